"""A model's context and batch, sized to the machine: its own trained context and KV bytes per
token against the memory left once it is loaded.

`fit(...)` is pure: the context llmweb would otherwise use (the configured limit, or the model's
trained context, capped on the CPU for prefill speed: chat/context.py) and the batch slots, reduced
until every slot's full-context KV cache fits the room; `Fit.note` says what was reduced and why,
for the status line. The room is measured by `room_bytes` in the process that holds the model
(runtime/engines.py calls it after the load): on the CPU the memory limit (LLMWEB_MEM_LIMIT_MB, or
80% of RAM) minus the process's RSS (the weights are in it by then: llama.cpp reads them all at
load), minus LLMWEB_MEM_MARGIN_MB; on CUDA the free device memory minus that margin; and from either,
the activations' floor (engine/admission.py's ACTIVATION_FLOOR).

Must not: load anything or decide the budget's other parts (chat/context.py's `Budget` does).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmweb.errors import ConfigError

STEP = 256  # a reduced context is a multiple of this
MIN_CONTEXT = 512  # below this a chat is not useful: the model does not fit
USEFUL_CONTEXT = 2048  # fewer batch slots before a context below this


class DoesNotFit(ConfigError):
    """Not even MIN_CONTEXT tokens of KV cache fit the room (runtime/switching.py lets a parked model
    go, least recently used first, and loads again)."""


@dataclass(frozen=True, slots=True)
class Fit:
    context: int  # the most tokens one request holds
    slots: int  # requests decoded together
    note: str = ""  # what was reduced, and why ("" when nothing was)


def fit(wanted: int, slots: int, kv_bytes_per_token: int, room: int, *, name: str = "the model") -> Fit:
    """The largest context up to `wanted`, with up to `slots` slots, whose KV caches (slots x context
    x kv_bytes_per_token) fit in `room` bytes. Slots go first while the context would fall below
    USEFUL_CONTEXT (a long chat needs its context more than a fifth visitor needs a slot). A room
    that holds not even MIN_CONTEXT tokens for one request is a DoesNotFit that says so."""
    asked = slots = max(slots, 1)
    if kv_bytes_per_token <= 0 or wanted * slots * kv_bytes_per_token <= room:
        return Fit(wanted, slots)
    tokens = max(room, 0) // kv_bytes_per_token  # KV cells that fit
    floor = min(wanted, USEFUL_CONTEXT)
    while slots > 1 and tokens // slots < floor:
        slots -= 1
    context = min(wanted, tokens // slots // STEP * STEP)
    if context < min(wanted, MIN_CONTEXT):
        raise DoesNotFit(
            f"{name} does not fit in this machine's memory: its KV cache needs "
            f"{_mib(kv_bytes_per_token * MIN_CONTEXT)} for {MIN_CONTEXT} tokens and {_mib(max(room, 0))} is left "
            "after loading it. Choose a smaller model, or raise LLMWEB_MEM_LIMIT_MB."
        )
    cut = [f"context {context:,} tokens (not {wanted:,})"] if context < wanted else []
    cut += [f"{slots} requests at once (not {asked})"] if slots < asked else []
    why = f"the KV caches of {asked} x {wanted:,} tokens would not fit in the {_mib(max(room, 0))} left after loading"
    return Fit(context, slots, f"Sized to memory: {' and '.join(cut)}: {why}.")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"
