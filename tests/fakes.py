"""Deterministic fakes for fast unit tests of pure logic (next to real-model tests, never instead)."""

from __future__ import annotations

from collections.abc import Sequence


class FakeFormat:
    """A ChatFormat whose tokens are whitespace-separated words, with fixed per-message overhead.

    system_ids(text) = [BOS, SYS] + words + [END]; message_ids(role, text) = [START, ROLE] + words + [END];
    the generation prompt is [START, ASSISTANT]. Word ids are stable (assigned on first sight).
    """

    BOS, SYS, START, USER, ASSISTANT, END = 1, 2, 3, 4, 5, 6

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def _words(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = 100 + len(self.vocab)
                self.words[self.vocab[w]] = w
            ids.append(self.vocab[w])
        return ids

    def system_ids(self, text: str) -> list[int]:
        return [self.BOS, self.SYS] + self._words(text) + [self.END]

    def message_ids(self, role: str, text: str) -> list[int]:
        return [self.START, self.USER if role == "user" else self.ASSISTANT] + self._words(text) + [self.END]

    def generation_prompt_ids(self) -> list[int]:
        return [self.START, self.ASSISTANT]

    def count(self, text: str) -> int:
        return len(text.split())

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[i] for i in ids if i in self.words)

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.END})


class FakeRunner:
    """A scripted `Runner` for the real `Engine` (queue, admission, cancel, OOM retry), without a model.

    Like simonw/llm's `MockModel.enqueue`: `enqueue([ids...])` queues the token ids of the next
    replies (default: the prompt's last `default_len` ids echoed back). Each token takes
    `token_delay_s`. `fail_next(exc)` makes the next generation raise `exc` (a domain error) or,
    with `oom=True`, run out of memory (generate returns None, as the real runner does).
    `predict_bytes` / `available_bytes` feed admission control. `background` (request -> ids), when
    set, answers the low-priority jobs (summaries) instead of the queue of scripted replies. Session
    reuse follows the real contract: the longest common prefix with the session's last prompt +
    reply, at least one token prefilled. Every request it ran is kept in `requests`.
    """

    def __init__(self, token_delay_s: float = 0.0, default_len: int = 3, stop_id: int | None = None):
        import threading

        self.device = "cpu"
        self.token_delay_s = token_delay_s
        self.default_len = default_len
        self.stop_id = stop_id
        self.predict_bytes = 1
        self.available_bytes = 1 << 40
        self.requests: list = []
        self._replies: list[list[int]] = []
        self._failures: list = []  # (exception or None for an OOM)
        self._sessions: dict[str, list[int]] = {}
        self.background = None  # optional: request -> ids, the reply to background (summary) jobs
        self.running = threading.Event()  # set while a generation is in progress
        self.empties = 0

    # scripting
    def enqueue(self, *replies: Sequence[int]) -> FakeRunner:
        self._replies.extend(list(r) for r in replies)
        return self

    def fail_next(self, exc: Exception | None = None, *, oom: bool = False) -> FakeRunner:
        assert oom or exc is not None, "give an exception, or oom=True"
        self._failures.append(None if oom else exc)
        return self

    # the Runner protocol
    def predict(self, request) -> int:
        return self.predict_bytes

    def available(self) -> int:
        return self.available_bytes

    def empty_cache(self) -> None:
        self.empties += 1

    def snapshot(self):
        from llmweb.records import MemorySnapshot

        return MemorySnapshot(rss_bytes=1)

    def generate(self, handle, request, predicted, timeout):
        import time

        from llmweb.engine import stop_reason
        from llmweb.kvcache import reusable
        from llmweb.records import GenerationStats, MemorySnapshot

        self.requests.append(request)
        if self._failures:
            failure = self._failures.pop(0)
            if failure is None:
                return None
            raise failure
        prompt = list(request.prompt_ids)
        if request.background and self.background is not None:
            reply = list(self.background(request))
        else:
            reply = self._replies.pop(0) if self._replies else prompt[-self.default_len :]
        held = self._sessions.get(request.session_id or "", [])
        reused = reusable(held, prompt) if request.session_id else 0
        stats = GenerationStats(
            prompt_tokens=len(prompt),
            reused_tokens=reused,
            prefilled_tokens=len(prompt) - reused,
            predicted_bytes=predicted,
            mem=MemorySnapshot(rss_bytes=1),
        )
        t0 = time.perf_counter()
        self.running.set()
        try:
            finish, out = "length", []
            for i, tok in enumerate(reply[: request.max_new_tokens]):
                if self.token_delay_s:
                    time.sleep(self.token_delay_s)
                if i == 0:
                    stats.ttft_s = time.perf_counter() - t0
                if tok == self.stop_id or tok in request.stop_ids:
                    finish = "eos"
                    break
                out.append(tok)
                handle._emit([tok])
                if stop := stop_reason(handle, t0, timeout):
                    finish = stop
                    break
            else:
                finish = "eos" if len(reply) <= request.max_new_tokens and reply else "length"
        finally:
            self.running.clear()
        if request.session_id:
            self._sessions[request.session_id] = prompt + out
        stats.generated_tokens, stats.finish_reason = len(out), finish
        stats.total_s = time.perf_counter() - t0
        return stats


def fake_engine(runner: FakeRunner | None = None, **limits):
    """The real Engine (scheduler) over a FakeRunner: (engine, runner)."""
    from llmweb.engine import Engine, EngineLimits
    from llmweb.kvcache import KVStore

    runner = runner or FakeRunner()
    return Engine(runner, KVStore(1 << 30, 600), EngineLimits(**limits)), runner
