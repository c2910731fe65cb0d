"""The model in a process of its own: `ProcessRunner` is the scheduler's `Runner` in the web
process, and drives the real runner in an engine process over engine/boundary.py's wire.

Why: a native fault in llama.cpp, bitsandbytes or CUDA (a segfault, an abort, the kernel's OOM
killer) would otherwise end the web server with it, and allocator fragmentation or a native leak
can only grow in a process that lives for weeks. vLLM's EngineCoreProc and SGLang's scheduler
are processes of their own for the same reasons. Here the scheduler stays in the web process
(the queue, fairness, cancel, time limits and the OOM retry's fallback survive a death), and a
step costs one round trip: ~0.5 ms against a ~10 ms decode step (`bench decode`'s boundary row).

The supervisor, in this class:
  watch       a thread per engine process waits on it; a death ends every request in flight on
              it at once with `EngineStopped` (the chat keeps the partial reply, marked), and a
              new process starts loading at once; new requests wait in the queue meanwhile
  give up     DEATHS_PER_MINUTE deaths within 60 s: no more restarts; requests fail with a
              message that says so
  recycle     after `recycle_after` requests, `recycle_s` seconds, or (CUDA) when a request's
              snapshot shows inactive split blocks (fragmentation `empty_cache` cannot give back;
              reserved − allocated is mostly the allocator's ordinary cache) past
              `recycle_frag_bytes`: the old one empties its allocator cache, and a new process
              loads, sized as the first one was (not to the memory the old one still holds),
              while the old one serves (up to half as many requests again, or half the time
              again: then new requests wait for the new one); then new requests go to the new
              one, the old one drains what it holds and stops. No request fails. The chats'
              kept KV caches are handed over (llama.cpp's state bytes, or the transformers
              cache's tensors as safetensors; at the switch, and again for those that ran on the
              old one meanwhile): a chat's next turn reuses its prefix instead of prefilling its
              whole history again. A hand-over answered with an error (an OOM in the new one,
              say) stops there: those chats prefill once, and the recycle goes on

Owns: the engine processes' lifecycle and the slots' placement on them. Must not: import torch,
build a runner (runtime/worker.py does, in the engine process), or schedule (engine/scheduler.py).
"""

from __future__ import annotations

import collections
import itertools
import logging
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from llmweb.engine.boundary import SlotDelta, strip
from llmweb.engine.request import GenerationRequest, Slot
from llmweb.errors import EngineStopped, LlmwebError
from llmweb.records import MemorySnapshot

log = logging.getLogger(__name__)

DEATHS_PER_MINUTE = 3  # this many deaths within 60 s: stop restarting
STOPPED = "The model process stopped; your message was not lost: press retry."


@dataclass(frozen=True)
class Recycle:
    after: int = 0  # requests per engine process (LLMWEB_RECYCLE_AFTER); 0 = never
    seconds: float = 0.0  # an engine process's age (LLMWEB_RECYCLE_S); 0 = never
    frag_bytes: int = 0  # CUDA: inactive split bytes after a request (LLMWEB_RECYCLE_FRAG_MB); 0 = never


class EngineProcess:
    """One engine process: spawned with `argv` + the fd of its end of a socket pair, sent `spec`,
    loaded (`load`), called (`call`, one at a time), stopped (`stop`)."""

    def __init__(self, argv: Sequence[str], spec: Any, number: int, stall_s: float, env: dict | None = None):
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([*argv, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env)
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        self.number, self.stall_s = number, stall_s
        self.lock = threading.Lock()
        self.keys: set[int] = set()  # its running slots
        self.started = 0  # requests it has started
        self.born = time.monotonic()
        self.stopping = False  # we stop it: its exit is no death
        self.device = "cpu"
        self.conn.send(spec)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def load(self, progress: Callable[[str], None]) -> dict:
        """Wait until the engine process has loaded its model ("ready", its info), passing its
        progress lines on; raise its failure (or its death) as an LlmwebError."""
        while True:
            kind, value = self._receive("loading the model")
            if kind == "progress":
                progress(value)
            elif kind == "ready":
                self.device = value.get("device", "cpu")
                return value
            else:
                raise value if isinstance(value, LlmwebError) else LlmwebError(str(value))

    def call(self, msg: tuple) -> Any:
        """Send one message and return its answer; a runner's error is raised as it is, the
        process's death (or silence past `stall_s`, after which it is killed) as EngineStopped."""
        with self.lock:
            try:
                self.conn.send(msg)
            except OSError as e:
                raise EngineStopped(STOPPED) from e
            kind, value = self._receive(msg[0])
        if kind == "error":
            raise value
        return value

    def _receive(self, what: str) -> tuple[str, Any]:
        try:
            if not self.conn.poll(self.stall_s):
                log.error("engine process %d: no answer to %s in %.0f s; killing it", self.pid, what, self.stall_s)
                self.proc.kill()
                raise EngineStopped(STOPPED)
            return self.conn.recv()
        except (EOFError, OSError) as e:
            raise EngineStopped(STOPPED) from e

    def stop(self, timeout: float = 5.0) -> None:
        """Ask it to exit; kill it if it does not within `timeout`."""
        self.stopping = True
        try:
            with self.lock:
                self.conn.send(("exit",))
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass(eq=False)
class _Placed:
    """A slot's place: which engine process runs it, under which key, and the KV it holds there."""

    child: EngineProcess
    key: int
    held: int = 0


class Supervisor:
    """The engine processes' lifecycle: the first one's start, the watch, restarts, the crash-loop
    stop, recycling and the hand-over of kept caches (see the module docstring)."""

    def __init__(
        self,
        launch: Callable[[int], EngineProcess],
        *,
        recycle: Recycle = Recycle(),
        status: Callable[[str], None] = log.info,
        load_timeout_s: float = 600.0,
    ):
        self._launch = launch
        self.recycle = recycle
        self._status = status
        self.load_timeout_s = load_timeout_s
        self.ready_text = ""  # the status line while all is well (the runtime sets it)
        self.first_info: dict = {}  # the first engine process's info ("ready"): later ones are sized as it was
        self.kv = ProcessKV(self)
        self._cond = threading.Condition()
        self._current: EngineProcess | None = None
        self._draining: list[EngineProcess] = []
        self._loading = False
        self._deaths: collections.deque[float] = collections.deque()
        self._gave_up = ""
        self._closed = False
        self._recycle_after = 0.0  # after a recycle's replacement failed to load: not before this
        self._numbers = itertools.count(1)
        self._keys = itertools.count(1)
        self.launched = 0  # engine processes started, the first included
        self.restarts = 0  # after a death
        self.recycles = 0
        self.handed_over = 0  # kept session caches copied to a recycled process's successor
        self.hand_over_failures = 0  # hand-overs stopped by an error answer (the rest of those chats prefill)
        self.hand_over_caches = True  # False: a recycle drops them (bench recycle compares)

    # ---- the lifecycle
    def boot(self) -> dict:
        """Start the first engine process and wait until its model is loaded: its info."""
        child = self._launch(next(self._numbers))
        self.launched += 1
        try:
            info = child.load(self._status)
        except BaseException:
            child.stop(timeout=1.0)
            raise
        self.first_info = info
        self._current = child
        self._watch(child)
        return info

    @property
    def device(self) -> str:
        child = self._current
        return child.device if child is not None else "cpu"

    @property
    def pid(self) -> int | None:
        """The serving engine process's id (None while none serves)."""
        child = self._current
        return child.pid if child is not None else None

    @property
    def gave_up(self) -> str:
        return self._gave_up

    @property
    def loading(self) -> bool:
        """A new engine process is loading (a restart, or a recycle's replacement)."""
        return self._loading

    def _watch(self, child: EngineProcess) -> None:
        def wait() -> None:
            child.proc.wait()
            self._exited(child)

        threading.Thread(target=wait, name=f"llmweb-engine-watch-{child.number}", daemon=True).start()

    def _exited(self, child: EngineProcess) -> None:
        """An engine process ended: nothing to do when we stopped it; else a death (see the docstring)."""
        if child.stopping or self._closed:
            return
        log.error("engine process %d (pid %d) died with exit code %s", child.number, child.pid, child.proc.returncode)
        with self._cond:
            if self._current is child:
                self._current = None
            if child in self._draining:
                self._draining.remove(child)
            self._died_locked()
        self._status(self._gave_up or "The model process stopped; restarting the model…")

    def _died_locked(self) -> None:
        """Count a death (or a failed restart): give up at DEATHS_PER_MINUTE in 60 s, else load
        a new engine process if none serves or loads."""
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > 60.0:
            self._deaths.popleft()
        if len(self._deaths) >= DEATHS_PER_MINUTE:
            self._gave_up = (
                f"The model process stopped {len(self._deaths)} times within a minute, so llmweb stopped "
                "restarting it. The operator must restart llmweb (the server log says why it stopped)."
            )
        elif self._current is None and not self._loading:
            self._bring_up_locked("The model process stopped; restarting the model", restart=True)
        self._cond.notify_all()

    def _bring_up_locked(self, why: str, restart: bool) -> None:
        self._loading = True
        number = next(self._numbers)
        threading.Thread(
            target=self._bring_up, args=(number, why, restart), name=f"llmweb-engine-load-{number}", daemon=True
        ).start()

    def _bring_up(self, number: int, why: str, restart: bool) -> None:
        """Load a new engine process (after a death, or to recycle); then it serves new requests."""
        t0 = time.perf_counter()
        child, old = None, self._current
        try:
            if not restart and old is not None:
                _empty_cache(old)  # what its allocator holds unused, the new one may use
            child = self._launch(number)
            self.launched += 1
            info = child.load(lambda text: self._status(f"{why}: {text}"))
            self.first_info = self.first_info or info
        except BaseException:
            log.exception("engine process %d failed to start (%s)", number, why)
            if child is not None:
                child.stop(timeout=1.0)
            with self._cond:
                self._loading = False
                if restart or self._current is None:
                    self._died_locked()  # counts toward giving up; tries again while it may
                else:  # a recycle's replacement: the old one serves on; try again in a minute
                    self._recycle_after = time.monotonic() + 60.0
                    self._cond.notify_all()
            if self._gave_up or restart:
                self._status(self._gave_up or "The model process could not start; trying again…")
            return
        try:
            if not restart and self._current is not None and self.hand_over_caches:  # the kept chats' caches
                self._hand_over(self._current, child, only_missing=False)
        except BaseException:  # never a process left unwatched: it goes, the old one serves on
            log.exception("engine process %d: failed after its load (%s); stopping it", number, why)
            child.stop(timeout=1.0)
            with self._cond:
                self._loading = False
                self._recycle_after = time.monotonic() + 60.0
                self._cond.notify_all()
            return
        with self._cond:
            if self._closed:  # closed while it loaded: it serves nobody
                self._loading = False
                child.stopping = True
        if child.stopping:
            child.stop(timeout=1.0)
            return
        with self._cond:
            old, self._current, self._loading = self._current, child, False
            if restart:
                self.restarts += 1
            else:
                self.recycles += 1
            if old is not None:
                self._draining.append(old)
            self._cond.notify_all()
        self._watch(child)
        log.info(
            "engine process %d (pid %d) serves, %.1f s after: %s", number, child.pid, time.perf_counter() - t0, why
        )
        self._status(self.ready_text or f"Ready: engine process {number}.")
        if old is not None and not old.keys:
            self._retire(old)

    def _retire(self, child: EngineProcess) -> None:
        """A drained engine process: hand its last kept caches over, then stop it (it holds no request)."""
        with self._cond:
            if child not in self._draining:
                return  # retired already (its last release and the switch may both get here)
            self._draining.remove(child)
            current = self._current
        try:
            if current is not None and self.hand_over_caches:
                self._hand_over(child, current, only_missing=True)  # the chats whose turn ran on it meanwhile
        finally:  # whatever happened, it stops: no engine process is left unwatched
            log.info(
                "engine process %d (pid %d) drained after %d requests; stopping it",
                child.number,
                child.pid,
                child.started,
            )
            child.stop()

    def _hand_over(self, old: EngineProcess, new: EngineProcess, only_missing: bool) -> None:
        """Copy the kept sessions' caches from `old` to `new`, one at a time (so steps go on
        between them); with `only_missing`, those `new` has no newer one of. A cache the runner
        cannot export (`export_cache` None) stays behind: that chat prefills once."""
        t0, moved, nbytes = time.perf_counter(), 0, 0
        try:
            have = set(new.call(("call", "kv", ("sessions",)))) if only_missing else set()
            for session_id in old.call(("call", "kv", ("sessions",))):
                got = None if session_id in have else old.call(("call", "kv_export", (session_id,)))
                if got is not None and new.call(("call", "kv_import", (session_id, *got))):
                    moved, nbytes = moved + 1, nbytes + got[3]
        except EngineStopped:
            log.warning("engine process: a hand-over of kept caches stopped half way (a process died)")
        except LlmwebError as e:  # e.g. out of memory in kv_import while both processes share the GPU
            self.hand_over_failures += 1
            log.warning("engine process %d -> %d: the hand-over of kept caches stopped: %s", old.number, new.number, e)
        self.handed_over += moved
        if moved:
            log.info(
                "engine process %d -> %d: %d kept caches (%.1f MiB) handed over in %.3f s",
                old.number,
                new.number,
                moved,
                nbytes / 2**20,
                time.perf_counter() - t0,
            )

    def _child(self) -> EngineProcess | None:
        """The engine process that takes new work, waiting while one loads; None when llmweb gave
        up restarting (then the request fails in `start` with the reason)."""
        deadline = time.monotonic() + self.load_timeout_s
        with self._cond:
            while not self._gave_up and not self._closed:
                child = self._current
                if child is not None and not (self._loading and self._overdue(child)):
                    return child
                if time.monotonic() > deadline:
                    raise EngineStopped("The model is still restarting; try again in a minute.")
                if child is None and not self._loading:
                    self._bring_up_locked("Starting the model", restart=True)
                self._cond.wait(0.5)
            return None if self._closed else self._current

    def _overdue(self, child: EngineProcess) -> bool:
        """Past its recycle point by half as much again: new requests wait for its replacement
        (a recycle never waits for a load until then, and always ends)."""
        r = self.recycle
        return (r.after > 0 and child.started >= r.after + max(r.after // 2, 1)) or (
            r.seconds > 0 and time.monotonic() - child.born >= 1.5 * r.seconds
        )

    def live(self) -> list[EngineProcess]:
        """The engine processes that answer calls now (the serving one, and those draining)."""
        with self._cond:
            return [c for c in [self._current, *self._draining] if c is not None and not c.stopping]

    def _recycle_due(self, child: EngineProcess, snapshot: MemorySnapshot | None = None) -> None:
        r = self.recycle
        frag = snapshot.cuda_inactive_split_bytes if snapshot is not None else None
        due = (
            (r.after > 0 and child.started >= r.after)
            or (r.seconds > 0 and time.monotonic() - child.born >= r.seconds)
            or (r.frag_bytes > 0 and frag is not None and frag > r.frag_bytes)
        )
        if not due or time.monotonic() < self._recycle_after:
            return
        with self._cond:
            if self._current is child and not self._loading and not self._gave_up and not self._closed:
                log.info("engine process %d: recycling after %d requests", child.number, child.started)
                self._bring_up_locked(f"Recycling the model process ({child.started} requests)", restart=False)

    def recycle_now(self, timeout: float | None = None) -> bool:
        """Replace the serving engine process now, gracefully (as a due recycle does); with a
        `timeout`, wait until its successor serves. True once it does (or, without a timeout, once begun)."""
        with self._cond:
            before = self.launched
            if self._current is None or self._gave_up or self._closed:
                return False
            if not self._loading:
                self._bring_up_locked("Recycling the model process", restart=False)
            if timeout is None:
                return True
            deadline = time.monotonic() + timeout
            while (self._loading or self.launched == before) and time.monotonic() < deadline:
                self._cond.wait(0.1)
            return not self._loading and not self._gave_up and self.launched > before

    def close(self) -> None:
        with self._cond:
            self._closed = True
            children = [c for c in [self._current, *self._draining] if c is not None]
            self._current, self._draining = None, []
            self._cond.notify_all()
        for child in children:
            child.stop()


def _empty_cache(child: EngineProcess) -> None:
    try:
        child.call(("call", "empty_cache", ()))
    except LlmwebError as e:
        log.warning("engine process %d: empty_cache failed: %s", child.number, e)


class ProcessRunner(Supervisor):
    """The `Runner` of the scheduler over the supervised engine processes: each call is a message
    to the one that runs the slot (engine/boundary.py)."""

    name = "engine process"
    # `close` may run while the worker is inside a call (waiting for a process to load, say): that
    # call ends with EngineStopped, and nothing of this process's memory is freed under it
    closes_while_busy = True

    def start(self, slot: Slot) -> None:
        child = self._child()
        if child is None:
            raise EngineStopped(self._gave_up or "The engine is shutting down.")
        key = next(self._keys)
        delta: SlotDelta = child.call(("start", key, strip(slot.request)))
        slot.state = _Placed(child, key, delta.held)
        child.keys.add(key)
        child.started += 1
        delta.apply(slot)
        self._recycle_due(child)

    def prefill(self, slot: Slot) -> bool:
        placed: _Placed = slot.state
        ok, delta = placed.child.call(("prefill", placed.key, slot.small_chunks))
        placed.held = delta.held
        delta.apply(slot)
        return ok

    def decode(self, slots: list[Slot]) -> bool:
        groups: dict[EngineProcess, list[Slot]] = {}
        for s in slots:  # one step on each engine process that holds some (two while one drains)
            groups.setdefault(s.state.child, []).append(s)
        all_ok = True
        for child, group in groups.items():
            ok, deltas = child.call(("decode", [s.state.key for s in group]))
            for s, delta in zip(group, deltas, strict=True):
                s.state.held = delta.held
                delta.apply(s)
            all_ok = all_ok and ok
        return all_ok

    def release(self, slot: Slot, keep: bool) -> None:
        placed: _Placed | None = slot.state
        if placed is None:
            return
        slot.state = None
        child = placed.child
        child.keys.discard(placed.key)
        try:
            delta: SlotDelta = child.call(("release", placed.key, keep, slot.finish))
            delta.apply(slot)
        except EngineStopped:
            return  # it died: its caches went with it; the request ends as it was going to
        if child in self.live() and child is not self._current and not child.keys:
            try:
                self._retire(child)
            except Exception:  # the reply is done: retiring the old process is no part of it
                log.exception("engine process %d: retiring it failed", child.number)
        elif child is self._current:
            self._recycle_due(child, slot.stats.mem)

    def held(self, slot: Slot) -> int:
        placed: _Placed | None = slot.state
        return placed.held if placed is not None else 0

    def predict(self, request: GenerationRequest) -> int:
        child = self._child()
        return 0 if child is None else child.call(("call", "predict", (strip(request),)))

    def padding(self, request: GenerationRequest, running: list[GenerationRequest]) -> tuple[int, int]:
        child = self._child()
        if child is None:
            return 0, 0
        pad, copy = child.call(("call", "padding", (strip(request), [strip(r) for r in running])))
        return pad, copy

    def available(self) -> int:
        child = self._child()
        return 1 << 62 if child is None else child.call(("call", "available", ()))

    def snapshot(self) -> MemorySnapshot:
        """The serving engine process's memory (where the model is); empty while none serves."""
        child = self._current
        if child is None:
            return MemorySnapshot()
        try:
            return child.call(("call", "snapshot", ()))
        except EngineStopped:
            return MemorySnapshot()

    def empty_cache(self) -> None:
        for child in self.live():
            try:
                child.call(("call", "empty_cache", ()))
            except EngineStopped:
                pass

    @property
    def timing(self):
        """The serving engine process's decode timing (bench decode reads it)."""
        child = self._child()
        assert child is not None, "no engine process serves"
        return child.call(("call", "timing", ()))

    def busy(self, work: Callable[[], None]) -> None:
        work()


class ProcessKV:
    """The sessions' KV caches, as the scheduler sees them: they live in the engine processes;
    maintenance goes to each live one, and never waits for one that is loading."""

    def __init__(self, runner: Supervisor):
        self.runner = runner

    def _each(self, what: str, *args) -> list[Any]:
        out = []
        for child in self.runner.live():
            try:
                out.append(child.call(("call", "kv", (what, *args))))
            except EngineStopped:
                pass
        return out

    def drop(self, session_id: str) -> bool:
        return any(self._each("drop", session_id))

    def expire(self) -> int:
        return sum(self._each("expire"))

    def evict(self, need_bytes: int) -> int:
        return sum(self._each("evict", need_bytes))

    def clear(self) -> int:
        return sum(self._each("clear"))

    @property
    def total_bytes(self) -> int:
        return sum(self._each("total_bytes"))

    @property
    def budget_bytes(self) -> int:
        return max(self._each("budget_bytes"), default=0)

    def session_bytes(self, session_id: str) -> int:
        return sum(self._each("session_bytes", session_id))

    def sessions(self) -> list[str]:
        return [s for found in self._each("sessions") for s in found]
