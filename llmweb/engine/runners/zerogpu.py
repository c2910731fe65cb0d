"""ZeroGPU: each request is one `@spaces.GPU` call, a generator of token ids, whose GPU-side state
is rebuilt from host bytes and goes back as host bytes.

ZeroGPU lends a GPU only to a fork of the web process, for one call of a function decorated with
`spaces.GPU` before the app launched. The call's arguments are pickled into the fork, what it yields
is pickled back, and anything else it changes dies with it (spaces' zero/wrappers.py). So:

    the web process (host)                          the GPU call (`generate`, in a fork)
    Engine + ZeroRunner: the queue, fairness,       a LocalRunner over the model the fork inherited,
    cancel, time limits, stats; each chat's   --Job->  the chat's cache rebuilt from the bytes sent;
    KV cache as safetensors bytes in `kv`            prefill, then decode, yielding each sampled id;
    slot.record(id) for each id          <--Steps--  last, the new cache's bytes and the call's stats

Where the call is made: the engine's worker thread opens it (one scheduler and one policy for
every caller), inside a copy of the context of the thread that submitted the request
(`Handle.context`). For a visitor that is the Gradio handler's context, which carries the request
that `spaces` reads for the visitor's X-IP-Token (their quota, not the Space's), the event and its
progress. A background job (a summary) has no request, as on the CLI: spaces bills the Space.
The cost of one worker: it steps the open calls in turn, so a call still waiting for a GPU (ZeroGPU
queues them) delays the next ids of the others in the batch; their replies are not lost.

`duration(job)` asks for the time the request may take (spaces takes a callable of the call's
arguments): a start allowance plus the prompt and reply at rates well under an 8B model's on a
ZeroGPU slice, within the request's own time limit.

Owns: the job and step records, the GPU-side generator and the host runner that drives one call per
request. Must not: keep anything on the GPU between calls, pass the call anything that is not plain
data (no engine, lock, thread or bound method), or choose what runs when (the scheduler does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from llmweb.engine.constraint import Constraint, Vocab
from llmweb.engine.kvcache import Entry, KVStore, reusable
from llmweb.engine.request import EngineLimits, GenerationRequest, Handle, Slot, TokenLogprob, Unmetered
from llmweb.engine.runners.loopguard import Pieces
from llmweb.engine.telemetry import memory_snapshot
from llmweb.errors import LlmwebError
from llmweb.records import GenerationStats

SESSION = "call"  # the one session inside a call

# `duration`: seconds before the first token (the fork, the weights onto the GPU), then rates far below
# what an 8B 4-bit model does on a ZeroGPU slice (guesses, not measured there: a short request asks ~25 s)
START_S = 15.0
PREFILL_TOK_S = 1000.0
DECODE_TOK_S = 25.0


@dataclass(frozen=True)
class Job:
    """One request as the GPU call gets it: plain data only (it is pickled into the fork)."""

    model: str  # the key the model was registered under (`register`)
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    repetition_penalty: float
    loop_guard: bool
    seed: int | None
    stop_ids: tuple[int, ...]
    keep: bool  # return the new cache (the request has a session)
    cache: tuple[tuple[int, ...], bytes] | None  # the session's cache: the ids it holds, its bytes
    timeout_s: float
    logprobs: int | None = None  # the request's (engine/request.py `GenerationRequest.logprobs`)
    constraint: Constraint | None = None  # the reply's grammar (engine/constraint.py: plain text)

    def request(self) -> GenerationRequest:
        return GenerationRequest(
            list(self.prompt_ids),
            self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            loop_guard=self.loop_guard,
            seed=self.seed,
            stop_ids=frozenset(self.stop_ids),
            session_id=SESSION if self.keep else None,
            logprobs=self.logprobs,
            constraint=self.constraint,
        )


@dataclass(frozen=True)
class Step:
    """What the GPU call yields: an id it sampled, or the prompt's progress, or (last) its cache."""

    ids: tuple[int, ...] = ()  # sampled this step, a stop id included: the host's slot records them
    logprobs: tuple[TokenLogprob, ...] = ()  # beside `ids`, when the request asked
    prefilled: int = 0  # prompt tokens computed so far (a step per prefill chunk)
    oom: bool = False  # the GPU ran out of memory in this step; the call ends
    kept: tuple[tuple[int, ...], bytes] | None = None  # last: the session's new cache (its ids, its bytes)
    stats: GenerationStats | None = None  # last: the call's own figures (the GPU's memory, loop cuts)


@dataclass
class Model:
    """What the GPU call needs of a loaded model; the fork inherits it from the web process."""

    model: object
    device: str
    kv_bytes_per_token: int
    pieces: Pieces | None = None  # the vocabulary's text, for the loop guard (decoded once, here)
    grammar_vocab: Vocab | None = None  # the tokenizer for constrained replies


MODELS: dict[str, Model] = {}  # filled in the web process before the first call forks it


def register(key: str, model: Model) -> None:
    MODELS[key] = model


def duration(job: Job) -> int:
    """Seconds to ask ZeroGPU for: see the module docstring."""
    new = len(job.prompt_ids) - (len(job.cache[0]) if job.cache else 0)
    want = START_S + max(new, 0) / PREFILL_TOK_S + job.max_new_tokens / DECODE_TOK_S
    return max(1, min(math.ceil(want), math.ceil(job.timeout_s)))


def generate(job: Job) -> Iterator[Step]:
    """The GPU call: the request on a LocalRunner of its own, from the job's bytes (runs in the fork)."""
    from llmweb.engine.runners.transformers import LocalRunner
    from llmweb.engine.scheduler import new_slot

    part = MODELS.get(job.model)
    if part is None:  # a worker forked before this model was loaded
        raise LlmwebError("The GPU worker does not have this model; try again.")
    kv = KVStore(1 << 62, 3600.0)
    runner = LocalRunner(part.model, part.device, kv, part.kv_bytes_per_token)
    runner.pieces = part.pieces
    runner.grammar_vocab = part.grammar_vocab
    request = job.request()
    if job.cache is not None:
        ids, data = job.cache
        kv.put(SESSION, list(ids), runner.import_cache(data))
    slot = new_slot(Handle(request, _Alone()), request, 0, EngineLimits(), retried=False, reason="oom")
    runner.start(slot)
    # 1) prefill, a chunk per step; the last samples the first id
    while not slot.ready:
        if not runner.prefill(slot):
            yield Step(oom=True)
            return
        yield Step(
            ids=(slot.state.last,) if slot.ready else (), prefilled=slot.stats.prefilled_tokens, logprobs=_last(slot)
        )
    # 2) decode until a stop id or the length cap (the host's slot ends at the same id)
    while slot.finish is None:
        if not runner.decode([slot]):
            yield Step(oom=True)
            return
        yield Step(ids=(slot.state.last,), logprobs=_last(slot))
    # 3) the session's cache back to the host, as bytes
    runner.release(slot, keep=True)
    entry = kv.take(SESSION)
    kept = (tuple(entry.ids), runner.export_cache(entry.cache)) if entry is not None else None
    yield Step(kept=kept, stats=slot.stats)  # its `mem`: the GPU's, as the runner took it on release


def _last(slot: Slot) -> tuple[TokenLogprob, ...]:
    """The log-probability of the id just sampled, when the request asked (a stop id's is not kept)."""
    if slot.request.logprobs is None or not slot.ready or slot.finish == "eos" or not slot.handle.logprobs:
        return ()
    return (slot.handle.logprobs[-1],)


class _Alone:
    """The queue a request inside a call is in: none."""

    def position(self, handle) -> int:
        return 0

    def wait(self, handle) -> tuple[int, float]:
        return 0, 0.0

    def prefilling(self, handle) -> tuple[int, int] | None:
        return None

    def withdraw(self, handle) -> None:
        return None


GpuCall = Callable[[Job], Generator[Step, None, None]]


def gpu_call(spaces) -> GpuCall:
    """`generate` decorated by `spaces.GPU`, with its `duration` per request. Call it at start-up,
    before the app launches: ZeroGPU stops a Space that has no decorated function by then."""
    return spaces.GPU(duration=duration)(generate)


@dataclass(eq=False)
class _Call:
    steps: Generator[Step, None, None]  # the GPU call, open
    before: Entry | None  # the session's entry as it was taken (put back if the call ends without a cache)
    last: Step | None = None


class ZeroRunner(Unmetered):
    """The host's half (engine/request.py `Runner`): one GPU call per request, caches as host bytes.

    GPU memory is the call's: admission here only queues (the host holds bytes, counted by `kv`)."""

    name = "zerogpu"
    device = "cpu"  # where this process keeps what it holds: bytes

    def __init__(self, call: GpuCall, model: str, kv: KVStore):
        self.call = call
        self.model = model
        self.kv = kv

    # ---- memory: none of it is here (`Unmetered`), but the host's bytes
    def snapshot(self):
        return memory_snapshot("cpu")

    # ---- a request: one call
    def start(self, slot: Slot) -> None:
        r = slot.request
        entry = self.kv.take(r.session_id) if r.session_id else None
        reused = reusable(entry.ids, r.prompt_ids) if entry is not None else 0
        job = Job(
            model=self.model,
            prompt_ids=tuple(r.prompt_ids),
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            repetition_penalty=r.repetition_penalty,
            loop_guard=r.loop_guard,
            seed=r.seed,
            stop_ids=tuple(sorted(r.stop_ids)),
            keep=r.session_id is not None,
            cache=(tuple(entry.ids), entry.cache) if entry is not None and reused else None,
            timeout_s=slot.timeout,
            logprobs=r.logprobs,
            constraint=r.constraint,
        )
        slot.stats.reused_tokens = reused
        slot.state = _Call(slot.handle.context.run(self.call, job), before=entry)

    def prefill(self, slot: Slot) -> bool:
        step = self._next(slot)
        if step is None or step.oom:
            return False
        slot.stats.prefilled_tokens = step.prefilled
        slot.ready = bool(step.ids)
        self._record(slot, step)
        return True

    def decode(self, slots: list[Slot]) -> bool:
        for slot in slots:
            step = self._next(slot)
            if step is None or step.oom:
                slot.finish = "error"
                slot.error = LlmwebError("The GPU ran out of memory for this reply.")
                continue
            self._record(slot, step)
        return True

    def release(self, slot: Slot, keep: bool) -> None:
        call: _Call | None = slot.state
        if call is None:
            return
        slot.state = None
        last = self._next(slot, call) if slot.finish in ("eos", "length") else None
        call.steps.close()  # a call still running (cancel, time limit) stops at its next step
        r = slot.request
        if last is not None and last.stats is not None:
            stats = last.stats
            slot.stats.mem, slot.stats.loop_cuts, slot.stats.loop_stopped = (
                stats.mem,
                stats.loop_cuts,
                stats.loop_stopped,
            )
        if keep and r.session_id and last is not None and last.kept is not None:
            ids, data = last.kept
            self.kv.put(r.session_id, list(ids), data, len(data), owner=r.owner)
            slot.stats.kv_session_bytes = len(data)
        elif call.before is not None:  # the cache it started from still serves its own ids
            entry = call.before
            self.kv.put(r.session_id or "", entry.ids, entry.cache, entry.nbytes, owner=entry.owner)
        slot.stats.kv_store_bytes = self.kv.total_bytes
        slot.stats.mem = slot.stats.mem or self.snapshot()

    def _next(self, slot: Slot, call: _Call | None = None) -> Step | None:
        call = call or slot.state
        return slot.handle.context.run(next, call.steps, None)

    def _record(self, slot: Slot, step: Step) -> None:
        for n, i in enumerate(step.ids):
            if slot.finish is None:
                slot.record(i, step.logprobs[n] if n < len(step.logprobs) else None)
