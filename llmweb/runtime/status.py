"""The status line: one sentence on what the runtime is doing ("Loading…", "Ready: …", "Model failed
to load: …", a remote engine's reachability), shown at the top of the page and logged as it changes.

It only words and holds the sentence; it must not decide when the model is ready (the runtime does)
or check a server (runtime/health.py does).
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit

log = logging.getLogger("llmweb.runtime")


class StatusLine:
    def __init__(self, text: str = "Starting…"):
        self.text = text
        self._down = ""  # the last reason the remote engine was down, logged once
        self.ready_line = ""  # the last "Ready: …" of a local model, without `after_ready` (a parked one's, again)
        self.after_ready = ""  # what a switch did ("Kept X loaded."), said once after the next ready line

    def progress(self, message: str) -> None:
        """A start-up step: shown, and logged."""
        self.text = message
        log.info(message)

    def ready_local(self, loaded, budget, seconds: float) -> None:
        notes = (" " + " ".join(loaded.notes)) if loaded.notes else ""
        self.ready_line = (
            f"Ready: {loaded.describe()} · context {budget.context_limit} tokens · started in {seconds:.0f} s.{notes}"
        )
        self.ready_again(self.ready_line)

    def ready_again(self, line: str) -> None:
        """`line` (a ready line), followed once by what the switch did (`after_ready`)."""
        self.ready_line, said, self.after_ready = line, self.after_ready, ""
        self.progress(f"{line} {said}".rstrip())

    def failed(self, what: str, error: BaseException) -> None:
        """A start-up that failed: `what` names the step ("Model failed to load"). The page gets the
        error's words without file paths (the runtime logs the whole error)."""
        self.text = f"{what}: {_no_paths(str(error))}"

    def remote_up(
        self, url: str, model: str, token_ids: bool, started: str, replicas: tuple[int, int] | str | None = None
    ) -> None:
        """The remote engine answers. The page names it "remote engine" and its model, never its
        address (LLMWEB_ENGINE_URL may be a private host, or carry a key): that goes to the log.
        `replicas`: behind a router, (answering, total) where it reports them, else "router"."""
        prompts = "token-id prompts" if token_ids else "text prompts"
        if isinstance(replicas, tuple):
            prompts = f"{replicas[0]} of {replicas[1]} replicas answer · {prompts}"
        elif replicas:
            prompts = f"behind a router · {prompts}"
        text = f"Ready: remote engine · model {model} · reachable · {prompts} · {started}."
        if text != self.text:
            log.info("remote engine %s reachable, model %s", url, model)
        self.text = text

    def remote_down(self, url: str, why: str, retry_s: float) -> None:
        if why != self._down:
            log.warning("remote engine %s not reachable: %s", url, why)
            self._down = why
        self.text = (
            f"Ready, but the remote engine is not reachable ({_no_paths(_hidden(why, url))}); retrying every "
            f"{retry_s:.0f} s. Messages fail until it answers."
        )


def _hidden(text: str, url: str) -> str:
    """`text` without the engine's address: the URL, its credentials and host[:port] (connection
    errors name them)."""
    parts = urlsplit(url) if url else None
    found = {url}
    if parts is not None:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        found |= {parts.netloc, userinfo, hostport, parts.hostname or ""}
    for secret in sorted((f for f in found if len(f) >= 4), key=len, reverse=True):
        text = text.replace(secret, "…")
    return text


_PATH = re.compile(r"(?<![\w.:/])(?:/|~/|[A-Za-z]:\\)[^\s'\"]+")


def _no_paths(text: str) -> str:
    """`text` with every absolute file path shown as "…" (a server's folders are not a visitor's)."""
    return _PATH.sub("…", text)
