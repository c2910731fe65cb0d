"""Anonymous visitors as the server counts them: their owner tokens, minted here, and how many new
ones a client address may start.

  - A page's owner token is minted on the server by the page's first event that needs one, whichever
    that is: the page load (`visit`), or a message sent before the load's answer came back (a cold
    start, the CPU busy loading the model). Events of one page load share Gradio's `session_hash`, so
    every event of the page gets the same token until the load's answer stores it in the browser
    (`PageTokens`, keyed by session and client address, bounded, an hour at most).
  - A token is 192 random bits the browser cannot predict; one it makes up itself (or drops, to start
    over) would be a fresh identity with fresh per-owner quotas (conversations, stored bytes, uploads,
    imports, queue places). So at most `LLMWEB_ANON_PER_ADDRESS` anonymous owners are admitted per
    client address per hour (`AddressQuota`, keyed by web/trust.py's address group: an IPv6 client's
    /64, LLMWEB_IPV6_PREFIX; bounded LRU):
    every per-owner cap then holds per address too, within that factor. A returning browser's token
    counts once; login accounts, the single user and API keys are not counted.
  - A gradio_client caller without login who starts a conversation (no id) starts a new owner
    (the conversation owns itself): it is counted the same way (`admit_api_conversation`).

In-process and in memory: a restart forgets the counts (tokens live in the browsers and the store).
This module must not decide an owner's kind (web/identity.py does) or store anything.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from llmweb.config import Settings
from llmweb.errors import InputError
from llmweb.web.identity import (
    API_CONVERSATION,
    BROWSER,
    browser_owner,
    is_owner_token,
    needs_owner_token,
    new_owner_token,
)
from llmweb.web.trust import origin_of

log = logging.getLogger(__name__)

WINDOW_S = 3600.0  # the per-address count's window, and how long a page's minted token is remembered
MAX_ADDRESSES = 10_000  # addresses counted at once (least recently seen dropped first)
MAX_PAGES = 10_000  # page loads whose token is remembered at once


class AddressQuota:
    """At most `limit` distinct owners per address within `window_s` (an owner seen again is free)."""

    def __init__(self, limit: int, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.limit, self.window_s, self._clock = limit, window_s, clock
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, dict[str, float]] = OrderedDict()  # address -> owner -> first seen

    def admit(self, address: str, owner: str) -> bool:
        now = self._clock()
        with self._lock:
            owners = self._seen.pop(address, {})
            for o in [o for o, t in owners.items() if now - t >= self.window_s]:
                del owners[o]
            ok = owner in owners or len(owners) < self.limit
            if ok and owner not in owners:
                owners[owner] = now
            self._seen[address] = owners  # most recent last
            while len(self._seen) > MAX_ADDRESSES:
                self._seen.popitem(last=False)
            return ok


class PageTokens:
    """The token minted for a page load (session hash and address), until the page keeps it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def token(self, session: str, address: str) -> str:
        now = self._clock()
        with self._lock:
            found = self._tokens.pop((session, address), None)
            token = found[0] if found and now - found[1] < WINDOW_S else new_owner_token()
            self._tokens[(session, address)] = (token, found[1] if found and token == found[0] else now)
            while len(self._tokens) > MAX_PAGES:
                self._tokens.popitem(last=False)
            return token


class Visitors:
    """The browser events' owners: web/identity.py's rules, with tokens minted here and counted per address."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.pages = PageTokens(clock)
        self.quota = AddressQuota(settings.anon_per_address, clock=clock)

    def resolve(self, token, request, *, first: bool = False) -> tuple[str, str]:
        """(owner, the token the browser should keep). An event without a token of its own gets its
        page's (minted now if it is the page's first); `first` (the page load) mints one even where
        Gradio gave no session. InputError past the address's quota of new anonymous visitors."""
        address = origin_of(self.settings, request).group
        if not is_owner_token(token) and needs_owner_token(self.settings, request):
            session = getattr(request, "session_hash", None)
            if isinstance(session, str) and session:
                token = self.pages.token(session, address)
            elif first:
                token = new_owner_token()
        owner = browser_owner(self.settings, token, request)
        if owner.startswith(BROWSER):
            self._admit(address, owner)
        return owner, token if is_owner_token(token) else ""

    def admit_api_conversation(self, owner: str, request) -> None:
        """A gradio_client caller without login who starts a conversation starts a new owner (the
        conversation owns itself): counted per address like a new browser, so leaving out the id
        does not buy a fresh quota. InputError past the address's quota."""
        if owner.startswith(API_CONVERSATION):
            self._admit(origin_of(self.settings, request).group, owner)

    def _admit(self, address: str, owner: str) -> None:
        if not self.quota.admit(address, owner):
            log.warning("refused a new anonymous owner from %s: %d this hour", address, self.quota.limit)
            raise InputError(
                f"Too many new visitors from your network in the last hour ({self.quota.limit}). Try again "
                "later, and let this site keep local storage so your browser is counted once."
            )


@functools.lru_cache(maxsize=16)
def visitors_for(settings: Settings) -> Visitors:
    """The server's one `Visitors` for these settings (every panel's handlers share it)."""
    return Visitors(settings)
