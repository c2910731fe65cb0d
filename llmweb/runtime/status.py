"""The status line: one sentence on what the runtime is doing ("Loading…", "Ready: …", "Model failed
to load: …", a remote engine's reachability), shown at the top of the page and logged as it changes.

It only words and holds the sentence; it must not decide when the model is ready (the runtime does)
or check a server (runtime/health.py does).
"""

from __future__ import annotations

import logging

log = logging.getLogger("llmweb.runtime")


class StatusLine:
    def __init__(self, text: str = "Starting…"):
        self.text = text

    def progress(self, message: str) -> None:
        """A start-up step: shown, and logged."""
        self.text = message
        log.info(message)

    def ready_local(self, loaded, budget, seconds: float) -> None:
        notes = (" " + " ".join(loaded.notes)) if loaded.notes else ""
        self.progress(
            f"Ready: {loaded.describe()} · context {budget.context_limit} tokens · started in {seconds:.0f} s.{notes}"
        )

    def failed(self, what: str, error: BaseException) -> None:
        """A start-up that failed: `what` names the step ("Model failed to load")."""
        self.text = f"{what}: {error}"

    def remote_up(self, url: str, model: str, token_ids: bool, started: str) -> None:
        prompts = "token-id prompts" if token_ids else "text prompts"
        self.text = f"Ready: remote engine {url} · model {model} · reachable · {prompts} · {started}."

    def remote_down(self, url: str, why: str, retry_s: float) -> None:
        self.text = (
            f"Ready, but the remote engine {url} is not reachable ({why}); retrying every "
            f"{retry_s:.0f} s. Messages fail until it answers."
        )
