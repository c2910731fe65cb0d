"""The secret file: the key that encrypts what browsers keep (their owner token, their open chat),
created once in the data dir so visitors keep their chats over a restart.

This module only reads and creates the file; it must not log, show or derive anything from the
secret (web/ui.py hands it to `gr.BrowserState`).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def read_or_create_secret(path: Path) -> str:
    """A 256-bit hex secret kept in `path` (created once, atomically, mode 600)."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    try:
        os.link(tmp, path)  # never replaces a secret another process wrote first
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return path.read_text().strip()
