"""What every local runner does the same way, once: a slot's sequence (its prompt, how far it is,
its sampler), taking a session's saved cache and the `reusable` check, the end of a prefill (the
first token), a decode step's timing and recording, keeping the cache for the session's next turn,
and the release stats. The out-of-memory contract lives here too: a pass that runs out of memory
returns False (the back end's exception is caught and dropped, so the failed pass's frames and
their memory are freed before the engine retries), never raises, and leaves every cache as it was;
a device's other failures to get memory count as out of memory too (engine/faults.py).

A back end (llama_cpp.py, transformers.py) supplies only the native parts: how a sequence is
opened and closed, how a saved cache is restored and saved, one model pass, one row of logits.

Must not: import torch or llama_cpp (a back end does), or choose what runs or when (the scheduler).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmweb.engine import faults
from llmweb.engine.constraint import Matcher, Vocab
from llmweb.engine.kvcache import SHARED_MIN_TOKENS, KVStore, reusable
from llmweb.engine.request import GenerationRequest, Slot, TokenLogprob
from llmweb.engine.runners.logprobs import log_softmax, token_logprob
from llmweb.engine.runners.loopguard import Pieces
from llmweb.engine.runners.sampling import Sampler
from llmweb.engine.telemetry import RssPeak, StepTiming, memory_snapshot, rss_bytes
from llmweb.errors import InputError

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class Seq:
    """One slot's sequence: its prompt, how far it is, its sampler (a back end adds its own handle)."""

    prompt: list[int]
    sampler: Sampler
    reused: int = 0  # prompt tokens served from the session's cache
    filled: int = 0  # prompt tokens in the cache
    pos: int = 0  # the position of the next token fed
    last: int = -1  # the last sampled id, fed in the next decode step
    rss: RssPeak = field(default_factory=RssPeak)


class BaseRunner:
    """The shared half of a local runner (engine/request.py `Runner`); see the module docstring."""

    name = "runner"  # for the log
    device = "cpu"
    out_of_memory: tuple[type[BaseException], ...] = (MemoryError,)
    # `_restore` copies a saved cache and leaves it as it was, so one of the owner's other sessions
    # may seed a new one's common prefix (kvcache.py `donor`)
    shares_prefixes = False
    # a visitor's chunk when the scheduler asks for small ones (`Slot.small_chunks`: another owner
    # may arrive and wait for it); 0 = the runner's own size always
    small_chunk = 0

    def __init__(self, kv: KVStore, kv_bytes_per_token: int, mem_limit_bytes: int = 0):
        self.kv = kv
        self.kv_bytes_per_token = kv_bytes_per_token
        self.mem_limit_bytes = mem_limit_bytes  # the RSS limit on the CPU; 0 = no limit
        self.timing = StepTiming()
        self.tap: Callable[[Slot, Any], None] | None = None  # test hook: each slot's logits before sampling
        self.pieces: Pieces | None = None  # the vocabulary's text, for the loop guard (engine/backends.py sets it)
        self.grammar_vocab: Vocab | None = None  # the tokenizer for constrained replies (engine/backends.py sets it)

    def matcher(self, request: GenerationRequest, n_logits: int) -> Matcher | None:
        """The request's grammar state, where it has a constraint (engine/constraint.py)."""
        if request.constraint is None:
            return None
        if self.grammar_vocab is None:
            raise InputError("This model's tokenizer cannot constrain a reply (it has no fast tokenizer).")
        return self.grammar_vocab.matcher(request.constraint, request.stop_ids, n_logits)

    # ---- memory
    def held(self, slot: Slot) -> int:
        seq: Seq | None = slot.state
        return 0 if seq is None else self.kv_bytes_per_token * (seq.filled + len(slot.generated))

    def padding(self, request: GenerationRequest, running: list[GenerationRequest]) -> tuple[int, int]:
        """(bytes, transient bytes) `request` adds beyond its `predict` when it joins `running`: a
        padded batch's (runners/transformers.py); none here, each sequence holds its own tokens."""
        return 0, 0

    def empty_cache(self) -> None:
        return None

    def snapshot(self):
        return memory_snapshot(self.device)

    def busy(self, work: Callable[[], None]) -> None:
        work()

    # ---- a session's cache as bytes, for the next engine process (engine/process.py's recycle)
    def export_cache(self, cache: Any) -> bytes | None:
        """A kept cache as bytes another process of this runner can `import_cache`; None: it cannot."""
        return None

    def import_cache(self, data: bytes) -> Any:
        raise NotImplementedError

    # ---- the batch, step by step
    def start(self, slot: Slot) -> None:
        request = slot.request
        prompt = list(request.prompt_ids)
        seq = self._open(request, prompt)
        entry = self.kv.take(request.session_id) if request.session_id else None
        reused = reusable(entry.ids, prompt) if entry is not None else 0
        if reused < SHARED_MIN_TOKENS and self.shares_prefixes and (shared := self.kv.donor(request.owner, prompt)):
            entry, reused = shared  # a new chat of this owner: start from another's common prefix (kvcache.py)
        if entry is not None and reused > 0:  # >= 1 token is left to prefill
            seq.reused = seq.filled = seq.pos = self._restore(seq, entry, reused)
        slot.stats.reused_tokens = seq.reused
        slot.state = seq

    def prefill(self, slot: Slot) -> bool:
        seq: Seq = slot.state
        size = self._chunk(slot.request)
        if slot.small_chunks and self.small_chunk:
            size = min(size, self.small_chunk)
        end = min(seq.filled + size, len(seq.prompt))
        last = end == len(seq.prompt)
        try:
            with self._mode():
                row = self._prefill(seq, seq.prompt[seq.filled : end], last)
                if row is None:
                    return False
                seq.filled = seq.pos = end
                slot.stats.prefilled_tokens = end - seq.reused  # so far: a cancel between chunks reports it
                if last:
                    seq.last, logprob = self._pick(slot, *row)
                    slot.ready = True
                    slot.record(seq.last, logprob)
        except Exception as e:
            if not faults.out_of_memory(e, self.out_of_memory):
                raise
            log.warning("%s: request %s ran out of memory in prefill: %s", self.name, slot.handle.id, _first_line(e))
            return False
        return True

    def decode(self, slots: list[Slot]) -> bool:
        t0 = self._clock()
        undo = None
        try:
            with self._mode():
                undo = self._feed(slots)
                t1 = self._clock()
                ran = self._step(slots)
                if ran is None:
                    return False
                rows, logits = ran
                rss = rss_bytes()
                t2 = self._clock()
                for i, slot in enumerate(rows):
                    seq: Seq = slot.state
                    seq.pos += 1
                    seq.last, logprob = self._pick(slot, logits, i)
                    seq.rss.peak = max(seq.rss.peak, rss)
                    slot.record(seq.last, logprob)
        except Exception as e:
            if not faults.out_of_memory(e, self.out_of_memory):
                raise
            log.warning("%s: a batch of %d ran out of memory in decode: %s", self.name, len(slots), _first_line(e))
            if undo is not None:
                undo()
            return False
        self.timing.add(t0, t1, t2, self._clock())
        return True

    def _clock(self) -> float:
        """Now, for the step's timing; after the device's queued work where the timing is `exact`."""
        if self.timing.exact:
            self._sync()
        return time.perf_counter()

    def release(self, slot: Slot, keep: bool) -> None:
        seq: Seq | None = slot.state
        if seq is None:
            return  # it never started
        slot.state = None
        try:
            cache = self._detach(slot, seq)
            if keep and slot.request.session_id:
                self._keep(slot, seq, cache)
        except Exception as e:  # out of memory while it leaves: its cache goes, its reply stands
            if not faults.out_of_memory(e, self.out_of_memory):
                raise
            log.warning("%s: request %s ran out of memory leaving; its cache is dropped", self.name, slot.handle.id)
            self._drop(slot, seq)
        finally:
            self._close_seq(seq)
        slot.stats.kv_store_bytes = self.kv.total_bytes
        slot.stats.mem = memory_snapshot(self.device, peak_rss=seq.rss.peak)

    # ---- session caches
    def _keep(self, slot: Slot, seq: Seq, cache: Any) -> None:
        """Keep the cache for the session's next turn; `Slot.fed_ids` says which ids it holds."""
        held_ids = slot.fed_ids(seq.prompt, seq.filled)
        held = self._held_tokens(seq, cache)
        assert held == len(held_ids), f"the cache holds {held} tokens but records {len(held_ids)} ids ({slot.finish})"
        if not held_ids:
            return
        saved = self._save(seq, cache)
        if saved is None:
            return
        data, size = saved
        slot.stats.kv_session_bytes = size
        request = slot.request
        self.kv.put(request.session_id or "", held_ids, data, size, owner=request.owner, background=request.background)

    def _pick(self, slot: Slot, logits: Any, i: int) -> tuple[int, TokenLogprob | None]:
        """The next id of `slot` from row `i` of the pass's logits, and its log-probability when the
        request asks (runners/logprobs.py: from the raw row, before the sampler's changes)."""
        row = self._row(logits, i)
        if self.tap is not None:
            self.tap(slot, row)
        top = slot.request.logprobs
        logp = None if top is None else log_softmax(row)
        sampler = slot.state.sampler
        nxt = sampler(row)
        if sampler.guard is not None and sampler.guard.cuts:
            slot.stats.loop_cuts, slot.stats.loop_stopped = sampler.guard.cuts, sampler.guard.gave_up
        return nxt, (None if top is None else token_logprob(logp, nxt, top))

    # ---- what a back end supplies
    def _mode(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _chunk(self, request: GenerationRequest) -> int:
        raise NotImplementedError

    def _open(self, request: GenerationRequest, prompt: list[int]) -> Seq:
        """A new sequence with its sampler and an empty cache."""
        raise NotImplementedError

    def _restore(self, seq: Seq, entry, reused: int) -> int:
        """The session's cache (`entry`) into `seq`, cut to `reused` tokens; the tokens it serves (0: none)."""
        raise NotImplementedError

    def _prefill(self, seq: Seq, chunk: list[int], last: bool) -> tuple[Any, int] | None:
        """One pass over the chunk; (logits, row) of its last token, None when out of memory."""
        raise NotImplementedError

    def _feed(self, slots: list[Slot]) -> Callable[[], None] | None:
        """The decode step's input, one token per slot; what undoes it if the pass fails."""
        raise NotImplementedError

    def _step(self, slots: list[Slot]) -> tuple[list[Slot], Any] | None:
        """The decode pass; (slots in row order, logits), None when out of memory (nothing changed)."""
        raise NotImplementedError

    def _row(self, logits: Any, i: int) -> Any:
        raise NotImplementedError

    def _detach(self, slot: Slot, seq: Seq) -> Any:
        """The sequence's cache, out of the batch (None where it stays in the context until saved)."""
        return None

    def _sync(self) -> None:
        """Wait for the device's queued work (an asynchronous device's runner supplies it)."""
        return None

    def _drop(self, slot: Slot, seq: Seq) -> None:
        """The sequence's cache, discarded without allocating (after `_detach` or `_save` ran out of memory)."""
        return None

    def _held_tokens(self, seq: Seq, cache: Any) -> int:
        raise NotImplementedError

    def _save(self, seq: Seq, cache: Any) -> tuple[Any, int] | None:
        """(what `kv` keeps, its bytes), None when it cannot be kept."""
        raise NotImplementedError

    def _close_seq(self, seq: Seq) -> None:
        return None


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
