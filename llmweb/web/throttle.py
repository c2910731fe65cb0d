"""The login back-off: failed logins per user name and per client address, and how long each must wait.

A name's back-off cannot lock its owner out: an address a user has logged in from is known for that
name and waits only for its own failures, so a stranger guessing at "alice" from elsewhere holds up
new addresses for alice, never alice's own. In memory and bounded; it never sees a password, only
names, addresses and outcomes. web/accounts.py
asks it before running scrypt (so a flood of guesses costs the server nothing) and tells it how each
check went; it must not decide whether a password is good or whom a session belongs to.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from llmweb.config import MAX_USERNAME_CHARS
from llmweb.errors import InputError

# after FREE failures for a name or from an address, each further failure doubles the wait
# (1 s, 2 s, 4 s ...) up to CAP; a quiet CAP after the last wait forgets the failures
BACKOFF_FREE = 3
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 300.0
BACKOFF_KEYS = 10_000  # names and addresses remembered, least recently failed dropped first


class LoginBackoff(InputError):
    """A login refused without checking the password: too many failures lately for the name or address."""

    def __init__(self, wait_s: float):
        self.wait_s = max(1, round(wait_s + 0.49))
        super().__init__(f"Too many failed logins; try again in {self.wait_s} s.")


class LoginThrottle:
    """Failed logins per user name (as typed: known or not) and per client address, with an exponential,
    capped wait. In memory, bounded (BACKOFF_KEYS); `clock` is for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()  # key -> (failures, wait until)
        self._known: OrderedDict[tuple[str, str], None] = OrderedDict()  # (name, address) that logged in

    @staticmethod
    def _keys(name: str, address: str | None) -> list[str]:
        return [f"name:{name[:MAX_USERNAME_CHARS]}"] + ([f"address:{address}"] if address else [])

    def wait_s(self, name: str, address: str | None = None) -> float:
        """Seconds until `name` (and `address`) may try again; 0 when they may now."""
        now = self._clock()
        with self._lock:
            keys = self._keys(name, address)
            if address and (name[:MAX_USERNAME_CHARS], address) in self._known:
                keys = keys[1:]  # the user's own address: only its own failures count
            waits = [self._failures[k][1] - now for k in keys if k in self._failures]
        return max([0.0, *waits])

    def failed(self, name: str, address: str | None = None) -> None:
        now = self._clock()
        with self._lock:
            for key in self._keys(name, address):
                count, until = self._failures.pop(key, (0, now))
                if now > until + BACKOFF_CAP_S:  # quiet for long enough: start over
                    count = 0
                count += 1
                wait = (
                    0.0
                    if count <= BACKOFF_FREE
                    else min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (count - BACKOFF_FREE - 1))
                )
                self._failures[key] = (count, now + wait)
            while len(self._failures) > BACKOFF_KEYS:
                self._failures.popitem(last=False)

    def succeeded(self, name: str, address: str | None = None) -> None:
        """The name's failures are forgotten (not the address's: logging in to one's own account must not
        reset an address that guesses at others), and the address is known for the name from now on."""
        with self._lock:
            self._failures.pop(self._keys(name, None)[0], None)
            if address:
                self._known.pop((name[:MAX_USERNAME_CHARS], address), None)
                self._known[(name[:MAX_USERNAME_CHARS], address)] = None
                while len(self._known) > BACKOFF_KEYS:
                    self._known.popitem(last=False)
