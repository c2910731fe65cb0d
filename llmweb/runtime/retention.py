"""Retention: the data of anonymous owners (browsers, API conversations) idle longer than
LLMWEB_ANON_RETENTION_DAYS is deleted, once the model is up and then every PURGE_EVERY_S.

It must never purge a login account, an API key's owner or the single user: only the prefixes in
ANON_PREFIXES (web/identity.py mints them and keeps the same pair; tests/web/test_ui.py checks).
What a purge deletes is the chat's (`Chat.purge_idle`); serving is never affected by a failed round.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmweb.config import Settings

if TYPE_CHECKING:
    from llmweb.chat.session import Chat

log = logging.getLogger(__name__)

ANON_PREFIXES = ("anon:", "api:")  # owners the retention purge may delete (never "user:" or the local one)
PURGE_EVERY_S = 3600.0


class Retention:
    """Purges idle anonymous owners through the chat that `ready_chat` returns (None: not ready)."""

    def __init__(self, settings: Settings, ready_chat: Callable[[], Chat | None]):
        self.settings = settings
        self.ready_chat = ready_chat

    def purge_idle(self, now: float | None = None) -> tuple[int, int]:
        """Delete the data of anonymous owners idle longer than LLMWEB_ANON_RETENTION_DAYS. Returns
        (owners, conversations) deleted; logs the counts."""
        days = self.settings.anon_retention_days
        chat = self.ready_chat() if days > 0 else None
        if chat is None:
            return 0, 0
        owners, conversations = chat.purge_idle(ANON_PREFIXES, days * 86400, now)
        if owners:
            log.info(
                "retention: purged %d anonymous owners idle over %g days (%d conversations)",
                owners,
                days,
                conversations,
            )
        return owners, conversations

    def start(self, ready: threading.Event, closing: threading.Event) -> None:
        """Purge once `ready` is set, then every PURGE_EVERY_S until `closing` (a daemon thread)."""
        threading.Thread(target=self._loop, args=(ready, closing), name="llmweb-purge", daemon=True).start()

    def _loop(self, ready: threading.Event, closing: threading.Event) -> None:
        ready.wait()
        while not closing.is_set():
            try:
                self.purge_idle()
            except Exception:  # the next round tries again; serving is never affected
                log.exception("retention purge failed")
            closing.wait(PURGE_EVERY_S)
