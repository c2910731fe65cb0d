"""Accounts: who may log in, and the users file that holds them.

Two sources of users, both read from Settings:
  - `LLMWEB_AUTH` pairs ("user:password,user2:password2"), plain text in the environment. They are
    hashed once at start, so every login check takes the same scrypt path.
  - the users file (`LLMWEB_AUTH_FILE`): JSON with salted scrypt hashes, managed by
    `python -m llmweb user add | remove | list`. The server re-reads it when it changes on disk, so
    users can be added while it runs. A name in `LLMWEB_AUTH` wins over the same name in the file.

The contract:
  - No password, hash or salt ever reaches a log line or an exception message. Failed logins are
    logged with the name only when it is a known user (an unknown "name" is often a password typed
    into the wrong field).
  - `verify` hashes even for unknown names, so timing does not tell which names exist.
  - The file is JSON only, written atomically (temp file in the same folder, fsync, os.replace) with
    mode 0o600 from the moment it exists.

The login back-off is web/throttle.py's, API keys web/api/keys.py's (both read this file's users).
Stdlib only; this module knows nothing of Gradio. `gradio_auth` returns the plain callable that
web/ui.py hands to `launch(auth=...)`. It says whether a password is good; it must not turn that into
an owner (web/identity.py does) or keep anything but the users file.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from llmweb.config import MAX_USERNAME_CHARS, USERNAME_RE, check_username
from llmweb.errors import ConfigError, InputError
from llmweb.web.throttle import LoginBackoff, LoginThrottle

log = logging.getLogger(__name__)

FILE_FORMAT = "llmweb.users"
FILE_VERSION = 1
DEFAULT_FILE_NAME = "users.json"  # in Settings.data_dir when neither --file nor LLMWEB_AUTH_FILE is given
SALT_BYTES = 16
MIN_PASSWORD_CHARS = 8  # for the users file; LLMWEB_AUTH passwords are the operator's choice
MAX_PASSWORD_CHARS = 1024
MAX_FILE_BYTES = 16 * 1024 * 1024
SCRYPT_MAXMEM = 256 * 1024 * 1024  # refuse cost parameters (from a hand-edited file) that need more
_DIGEST = re.compile(r"[0-9a-f]{64}")  # an API key's SHA-256 (web/api/keys.py)


@dataclass(frozen=True, slots=True)
class Scrypt:
    """scrypt cost parameters. Memory is about 128 * r * (n + p + 2) bytes (16 MiB for the default)."""

    n: int = 2**14
    r: int = 8
    p: int = 1
    dklen: int = 32

    def __post_init__(self) -> None:
        ok = (
            all(type(v) is int for v in (self.n, self.r, self.p, self.dklen))
            and self.n >= 2
            and self.n & (self.n - 1) == 0
            and self.r >= 1
            and 1 <= self.p <= 16
            and 16 <= self.dklen <= 64
            and 128 * self.r * (self.n + self.p + 2) <= SCRYPT_MAXMEM
        )
        if not ok:
            raise ValueError("unusable scrypt parameters")

    def hash(self, password: str, salt: bytes) -> bytes:
        return hashlib.scrypt(
            password.encode("utf-8"),
            salt=salt,
            n=self.n,
            r=self.r,
            p=self.p,
            dklen=self.dklen,
            maxmem=SCRYPT_MAXMEM + 1024 * 1024,
        )


DEFAULT_SCRYPT = Scrypt()  # tests may lower this for speed; read at call time, never bound as a default


@dataclass(frozen=True, slots=True)
class UserRecord:
    """One user: the salted hash and its parameters, never the password."""

    name: str
    salt: bytes
    hash: bytes
    params: Scrypt
    created: float  # Unix time
    api_keys: tuple[str, ...] = ()  # SHA-256 hex digests of the user's API keys (`user key NAME`)

    def __repr__(self) -> str:  # keep hashes out of tracebacks and debug logs
        return f"UserRecord(name={self.name!r}, created={self.created!r})"

    def matches(self, password: str) -> bool:
        return hmac.compare_digest(self.params.hash(password, self.salt), self.hash)

    def to_json(self) -> dict:
        d = {
            "salt": self.salt.hex(),
            "hash": self.hash.hex(),
            "n": self.params.n,
            "r": self.params.r,
            "p": self.params.p,
            "created": self.created,
        }
        if self.api_keys:
            d["api_keys"] = list(self.api_keys)
        return d

    @classmethod
    def from_json(cls, name: str, d) -> UserRecord:
        """Raises ValueError (without echoing any value) if `d` is not a well-formed entry."""
        if not isinstance(d, dict):
            raise ValueError("not an object")
        salt, digest = bytes.fromhex(d["salt"]), bytes.fromhex(d["hash"])
        if not salt:
            raise ValueError("empty salt")
        created = d.get("created", 0.0)
        if type(created) not in (int, float):
            raise ValueError("bad created time")
        keys = d.get("api_keys", [])
        if not isinstance(keys, list) or not all(isinstance(k, str) and _DIGEST.fullmatch(k) for k in keys):
            raise ValueError("bad api_keys")
        params = Scrypt(n=d["n"], r=d["r"], p=d["p"], dklen=len(digest))
        return cls(name, salt, digest, params, float(created), tuple(keys))


def check_password(password: str) -> str:
    """For the users file. The message never shows the password."""
    if len(password) < MIN_PASSWORD_CHARS:
        raise InputError(f"the password is too short: use at least {MIN_PASSWORD_CHARS} characters")
    if len(password) > MAX_PASSWORD_CHARS:
        raise InputError(f"the password is too long: use at most {MAX_PASSWORD_CHARS} characters")
    return password


def new_record(name: str, password: str, *, params: Scrypt | None = None, now: float | None = None) -> UserRecord:
    """A fresh record with its own random salt (equal passwords give different hashes)."""
    params = params or DEFAULT_SCRYPT
    salt = secrets.token_bytes(SALT_BYTES)
    return UserRecord(name, salt, params.hash(password, salt), params, time.time() if now is None else now)


# -- the users file ---------------------------------------------------------------------------


def load_users(path: Path) -> dict[str, UserRecord]:
    """The users in `path` ({} when the file does not exist). A malformed file raises ConfigError."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(f"cannot read the users file {path}: {e.strerror}") from None
    bad = f"the users file {path} is not a valid llmweb users file"
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{bad}: larger than {MAX_FILE_BYTES // 2**20} MiB")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{bad}: not UTF-8 text") from None
    except json.JSONDecodeError as e:  # its message has a position, never the text
        raise ConfigError(f"{bad}: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT:
        raise ConfigError(f'{bad}: expected a JSON object with "format": "{FILE_FORMAT}"')
    if doc.get("version") != FILE_VERSION:
        raise ConfigError(f"{bad}: version {doc.get('version')!r} is not supported (expected {FILE_VERSION})")
    users = doc.get("users")
    if not isinstance(users, dict):
        raise ConfigError(f'{bad}: "users" must be an object of name: entry')
    records = {}
    for name, entry in users.items():
        if not USERNAME_RE.fullmatch(name):
            raise ConfigError(f"{bad}: user name {name[:MAX_USERNAME_CHARS]!r} is not valid")
        try:
            records[name] = UserRecord.from_json(name, entry)
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{bad}: the entry for user {name!r} is malformed") from None
    return records


def save_users(path: Path, users: dict[str, UserRecord]) -> None:
    """Write atomically: a 0o600 temp file in the same folder, fsync, os.replace, fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "users": {name: users[name].to_json() for name in sorted(users)},
    }
    data = (json.dumps(doc, indent=2) + "\n").encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0o600
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _stamp(path: Path) -> tuple | None:
    """Changes whenever the file is replaced (inode) or rewritten (mtime, size); None when absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class UsersFile:
    """The users file as the server sees it: re-read on the next lookup after it changes on disk.

    At start a malformed file raises ConfigError. Later, while serving, a file that turns malformed
    is logged once and treats its users as absent (fail closed) until it is fixed.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp = _stamp(self.path)
        self._users = load_users(self.path)

    def users(self) -> dict[str, UserRecord]:
        stamp = _stamp(self.path)
        with self._lock:
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._users = load_users(self.path)
                    log.info("users file %s re-read: %d users", self.path, len(self._users))
                except ConfigError as e:
                    self._users = {}
                    log.error("%s; its users cannot log in until it is fixed", e)
            return self._users


# -- logging in --------------------------------------------------------------------------------


def parse_auth_pairs(auth: str) -> dict[str, str]:
    """`LLMWEB_AUTH` ("user:password,user2:password2") as {name: password}. Messages show names only."""
    pairs: dict[str, str] = {}
    for item in auth.split(",") if auth else []:
        name, sep, password = item.partition(":")
        name = name.strip()
        if not sep:
            raise ConfigError("LLMWEB_AUTH must look like user:password (several: user1:pw1,user2:pw2)")
        try:
            check_username(name)
        except InputError as e:
            raise ConfigError(f"LLMWEB_AUTH: {e}") from None
        if not password:
            raise ConfigError(f"LLMWEB_AUTH: user {name!r} has an empty password")
        if name in pairs:
            raise ConfigError(f"LLMWEB_AUTH: user {name!r} appears twice")
        pairs[name] = password
    return pairs


def users_file_path(settings, file: Path | None = None) -> Path:
    """Where the CLI manages users: --file, else LLMWEB_AUTH_FILE, else <data dir>/users.json."""
    if file is not None:
        return Path(file)
    if settings.auth_file is not None:
        return Path(settings.auth_file)
    return Path(settings.data_dir) / DEFAULT_FILE_NAME


class Accounts:
    """Checks logins against the LLMWEB_AUTH users and the users file."""

    def __init__(self, env_users: dict[str, str] | None = None, users_file: Path | None = None):
        params = DEFAULT_SCRYPT
        self._env = {name: new_record(name, pw, params=params) for name, pw in (env_users or {}).items()}
        self._file = UsersFile(users_file) if users_file is not None else None
        # Unknown names are checked against this, so they cost the same scrypt as real ones.
        self._dummy = new_record("-", secrets.token_urlsafe(16), params=params)
        self.throttle = LoginThrottle()
        file_users = self._file.users() if self._file else {}
        where = self._file.path if self._file else "LLMWEB_AUTH"
        for name in sorted(self._env.keys() & file_users.keys()):
            log.warning("user %r is both in LLMWEB_AUTH and in %s; LLMWEB_AUTH wins", name, where)
        if not self._env and not file_users:
            log.warning("login is on but no users exist yet in %s; add one with: python -m llmweb user add NAME", where)

    @classmethod
    def from_settings(cls, settings) -> Accounts:
        return cls(parse_auth_pairs(settings.auth), settings.auth_file)

    def _lookup(self, name: str) -> UserRecord | None:
        if name in self._env:
            return self._env[name]
        return self._file.users().get(name) if self._file else None

    def names(self) -> list[str]:
        return sorted(self._env.keys() | (self._file.users().keys() if self._file else set()))

    def exists(self, name: str) -> bool:
        """Is `name` a user now (LLMWEB_AUTH, or the users file as it is on disk)? A removed user is not."""
        return isinstance(name, str) and self._lookup(name) is not None

    def verify(self, username: str, password: str, address: str | None = None) -> bool:
        """True for a known user with the right password. Never raises for bad input; False without
        hashing while the name or address is backing off (`check` says for how long)."""
        try:
            return self.check(username, password, address)
        except LoginBackoff:
            return False

    def check(self, username: str, password: str, address: str | None = None) -> bool:
        """As `verify`, but LoginBackoff (with the wait) while the name or address backs off after
        failed logins: then no scrypt runs at all (a flood of guesses costs the server nothing)."""
        if not isinstance(username, str) or not isinstance(password, str):
            return False
        record = self._lookup(username) if USERNAME_RE.fullmatch(username) else None
        shown = f"user {username!r}" if record is not None else "an unknown user name"  # maybe a misplaced password
        wait = self.throttle.wait_s(username, address)
        if wait > 0:
            log.warning("login refused for %s from %s: backing off %.0f s after failed logins", shown, address, wait)
            raise LoginBackoff(wait)
        ok = (record or self._dummy).matches(password) and record is not None
        if ok:
            self.throttle.succeeded(username, address)
            log.info("user %r logged in", username)
        else:
            self.throttle.failed(username, address)
            log.info("failed login for %s from %s", shown, address)
        return ok


@functools.lru_cache(maxsize=16)
def accounts_for(settings) -> Accounts:
    """The server's one `Accounts` for these settings: Gradio's auth callable, the login route
    (web/login.py) and the check that a session's user still exists (web/identity.py) share it, and
    with it the login back-off."""
    return Accounts.from_settings(settings)


def gradio_auth(settings) -> Callable[[str, str], Awaitable[bool]] | None:
    """What web/ui.py passes as `launch(auth=...)`: None without login, else a callable (user, password).

    It is a coroutine function (Gradio awaits those): scrypt takes tens of milliseconds on purpose,
    so it runs in a worker thread instead of stalling every stream on the event loop.
    """
    if not settings.login:
        return None
    accounts = accounts_for(settings)

    async def check_login(username: str, password: str) -> bool:
        return await asyncio.to_thread(accounts.verify, username, password)

    return check_login
