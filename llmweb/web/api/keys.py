"""API keys for the OpenAI-compatible API (web/api/): whose a bearer key is.

Two sources: `LLMWEB_API_KEYS` ("alice:key1,bob:key2", or keys of no user), and keys a user holds in
the users file (`python -m llmweb user key NAME` prints a new one once and keeps only its SHA-256
digest; web/accounts.py reads the file). `ApiKeys.lookup(key)` says whose a key is; no key or digest
reaches a log line or a message. It must not turn a caller into an owner (web/identity.py does).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path

from llmweb.config import parse_api_keys
from llmweb.web.accounts import UsersFile

API_KEY_PREFIX = "llmweb-"  # keys made by `user key NAME`: the prefix, then 256 random bits


def key_digest(key: str) -> str:
    """The SHA-256 hex digest a key is known by. Keys are long random strings, so an unsalted hash
    is enough: what the users file holds cannot be turned back into a key."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class ApiCaller:
    """Who a valid key belongs to: a user's name, or None for a key of no user; `tag` names the key
    without revealing it (the first 12 hex digits of its digest)."""

    name: str | None
    tag: str


class ApiKeys:
    """Bearer keys for the OpenAI-compatible API: LLMWEB_API_KEYS, and the keys users hold in the
    users file (`python -m llmweb user key NAME`), re-read when the file changes."""

    def __init__(self, pairs: list[tuple[str | None, str]], users_file: Path | None = None):
        self._env = {key_digest(key): name for name, key in pairs}
        self._file = UsersFile(users_file) if users_file is not None else None

    @classmethod
    def from_settings(cls, settings) -> ApiKeys:
        return cls(parse_api_keys(settings.api_keys), settings.auth_file)

    def _file_keys(self) -> dict[str, str]:
        users = self._file.users() if self._file else {}
        return {digest: name for name, record in users.items() for digest in record.api_keys}

    @property
    def configured(self) -> bool:
        """Are there any keys? Then every API request needs one."""
        return bool(self._env) or bool(self._file_keys())

    def lookup(self, key: str) -> ApiCaller | None:
        """The caller a key belongs to, None for an unknown key (nothing is logged about the key)."""
        if not isinstance(key, str) or not key:
            return None
        digest = key_digest(key)
        if digest in self._env:
            return ApiCaller(self._env[digest], digest[:12])
        name = self._file_keys().get(digest)
        return ApiCaller(name, digest[:12]) if name is not None else None
