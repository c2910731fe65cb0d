"""The health watch of a remote engine (LLMWEB_ENGINE_URL): whether the server answers, checked at
start and then on a background thread (every REMOTE_CHECK_S while it answers, every retry_s while
it does not), with the status line following it. Behind a router (LLMWEB_ENGINE_ROUTER) each check
also asks how many replicas answer, where the router reports it (`Server.replicas`).

It only watches and reports; it must not retry requests or change the engine (the remote runner
retries its own requests).
"""

from __future__ import annotations

import threading

from llmweb.runtime.status import StatusLine

REMOTE_RETRY_S = 5.0  # a remote engine that does not answer is checked again this often
REMOTE_CHECK_S = 30.0  # ... and one that answers, this often (the status line follows it)


class RemoteHealth:
    """Watches `runner` (a `RemoteRunner`) for the server at `url`; `started` ends the ready line."""

    def __init__(self, runner, url: str, status: StatusLine, started: str, retry_s: float = REMOTE_RETRY_S):
        self.runner, self.url, self.status, self.started, self.retry_s = runner, url, status, started, retry_s

    def check(self) -> bool:
        """Update the status line: which engine serves, and whether it answers now."""
        why = self.runner.server.reachable()
        if why is None:
            try:
                name, caps = self.runner.server.model, self.runner.probe()  # probed once, then remembered
            except Exception as e:  # it answered /v1/models but not usefully (a wrong key, no model): say so
                why = f"{type(e).__name__}: {e}"
        if why is None:
            server = self.runner.server
            replicas = (server.replicas() or "router") if server.config.router else None
            self.status.remote_up(self.url, name, caps.ids, self.started, replicas)
        else:
            self.status.remote_down(self.url, why, self.retry_s)
        return why is None

    def start(self, closing: threading.Event) -> None:
        """Check now, then keep checking on a daemon thread until `closing` is set."""
        self.check()
        threading.Thread(target=self._watch, args=(closing,), name="llmweb-remote-watch", daemon=True).start()

    def _watch(self, closing: threading.Event) -> None:
        while not closing.is_set():
            up = self.check()
            closing.wait(REMOTE_CHECK_S if up else self.retry_s)
