"""The waiting room: how long a waiting request will wait before it starts, from the work ahead
of it and the throughput the engine measures itself. The queue is bounded by that estimate
(`EngineLimits.max_wait_s`, LLMWEB_MAX_WAIT_S), not by a count.

  Pace     what the engine measured: a moving average of prefill tokens/s (weighted by tokens)
           and of the seconds of one decode step (each step gives every request of the batch
           one token), with priors before the first measurement; and of interactive replies'
           lengths (a request is expected to reply that much, at most its cap).
  Work     what a request still has to do: prompt tokens to prefill, reply tokens to decode.
  wait_s   list scheduling over the batch's `max_batch` slots: the running requests fill them
           until their own remaining work (prefill, then reply) is done; each request ahead, in
           the fair queue's real serving order, takes the first slot to free, and its prefill
           pauses the others (prompt chunks run between decode steps); the estimate is when the
           next slot frees. Optional jobs (warm-ups) are left out: a visitor's request pre-empts
           them. The prefill rate is measured on interactive prompts only (background chunks are
           smaller and slower per token).

Owns: the throughput figures and the estimate. Must not: lock (the engine holds its lock around
every estimate), order the queue (queue.py), or import torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from llmweb.engine.request import GenerationRequest, Slot

PRIOR_PREFILL_TOK_S = 500.0  # before the first measurement: a small model on a CPU
PRIOR_STEP_S = 0.05  # seconds per decode step, likewise
DECAY = 0.8  # the past's weight in each moving average, per sample


@dataclass(frozen=True)
class Work:
    prefill: int  # prompt tokens still to prefill
    reply: float  # reply tokens still to decode (expected)


class Pace:
    """The engine's measured throughput (moving averages, priors until the first sample)."""

    def __init__(self, prefill_tok_s: float = PRIOR_PREFILL_TOK_S, step_s: float = PRIOR_STEP_S):
        self._tokens = 0.0  # decayed sums of prefilled tokens and of the seconds they took
        self._seconds = 0.0
        self._prior_prefill = prefill_tok_s
        self.step_s = step_s
        self.steps = 0  # decode steps measured
        self.reply_tokens: float | None = None  # the moving average of interactive replies' lengths

    @property
    def prefill_tok_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else self._prior_prefill

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill pass took `seconds` for `tokens` new prompt tokens."""
        if tokens > 0 and seconds > 0:
            self._tokens = DECAY * self._tokens + tokens
            self._seconds = DECAY * self._seconds + seconds

    def stepped(self, seconds: float) -> None:
        """One decode step of the batch took `seconds`."""
        self.step_s = seconds if self.steps == 0 else DECAY * self.step_s + (1 - DECAY) * seconds
        self.steps += 1

    def replied(self, tokens: int) -> None:
        """An interactive reply ended (stop id or cap) after `tokens` tokens."""
        past = self.reply_tokens
        self.reply_tokens = float(tokens) if past is None else DECAY * past + (1 - DECAY) * tokens

    def expected_reply(self, cap: int) -> float:
        """Reply tokens a request of cap `cap` is expected to generate: the average, at most the cap."""
        return float(cap) if self.reply_tokens is None else min(float(cap), self.reply_tokens)

    def seconds(self, work: Work) -> float:
        """Engine time of `work` alone in a slot: its prefill, then its decode steps."""
        return work.prefill / self.prefill_tok_s + work.reply * self.step_s


def waiting_work(request: GenerationRequest, pace: Pace) -> Work:
    """A waiting request's work: its whole prompt (a session cache may spare some) and its reply."""
    return Work(len(request.prompt_ids), pace.expected_reply(request.max_new_tokens))


def running_work(slot: Slot, pace: Pace) -> Work:
    """What a running request still has to do: the rest of its prompt, the rest of its reply."""
    if slot.finish is not None:
        return Work(0, 0.0)
    stats, cap, done = slot.stats, slot.request.max_new_tokens, len(slot.generated)
    prefill = 0 if slot.ready else max(stats.prompt_tokens - stats.reused_tokens - stats.prefilled_tokens, 0)
    reply = min(max(pace.expected_reply(cap) - done, 1.0), float(cap - done))
    return Work(prefill, max(reply, 0.0))


def wait_s(running: Sequence[Work], ahead: Sequence[Work], width: int, pace: Pace) -> float:
    """Seconds until a request with `ahead` before it (in serving order) starts, next to the
    `running` batch of at most `width` requests (see the module docstring)."""
    free = sorted(pace.seconds(w) for w in running)  # when each running request leaves: its own work
    free = [0.0] * max(width - len(free), 0) + free  # a sorted list is a heap
    for work in ahead:
        start = heapq.heappop(free)
        prefill = work.prefill / pace.prefill_tok_s
        free = [t + prefill for t in free]  # its prompt chunks pause the others' decoding (order kept)
        heapq.heappush(free, start + prefill + work.reply * pace.step_s)
    return free[0] if free else 0.0


def busy_message(wait: float, limit: float) -> str:
    return (
        f"The model is busy: about {wait:.0f} s of work is waiting, over this server's limit of "
        f"{limit:.0f} s; try again in a minute."
    )
