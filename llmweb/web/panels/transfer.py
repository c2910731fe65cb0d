"""Export and import: a chat as a Markdown or JSON file to download, and a JSON export read back as
a new chat of the caller's. A file is refused whole (too large, not text, not an export) and
changes nothing. Files do not stay: an uploaded export is deleted once read, an export file after
EXPORT_TTL_S, and all of an owner's on "Delete all my data". Exports live in a private folder this
process makes (mkdtemp: an unpredictable name, mode 0700, removed at exit), one 0700 folder per owner,
files 0600: nobody else on the machine can read them or plant a link where one will be written.
The formats are the store's (export) and the chat's (import); this module only moves files between the page and them.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import gradio as gr
from gradio.processing_utils import hash_file
from gradio.utils import get_upload_folder

from llmweb.errors import InputError
from llmweb.web.panels.base import Panel, PanelHandlers, user_errors

log = logging.getLogger("llmweb.web")

EXPORT_TTL_S = 300.0  # an export file lives this long: the browser downloads it at once
EXPORTS: Path | None = None  # the process's private folder, made at the first export; one folder per owner
_exports_lock = threading.Lock()


def exports_root() -> Path:
    """The private exports folder (under the temp dir, where Gradio serves downloads from)."""
    global EXPORTS
    with _exports_lock:
        if EXPORTS is None:
            EXPORTS = Path(tempfile.mkdtemp(prefix="llmweb-exports-"))  # mode 0700, a random name
            atexit.register(shutil.rmtree, EXPORTS, True)
        return EXPORTS


def export_folder(owner: str, root: Path | None = None) -> Path:
    return (root or exports_root()) / hashlib.sha256(owner.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def sweep_exports(now: float | None = None, root: Path | None = None) -> int:
    """Delete every owner's export files older than EXPORT_TTL_S (Gradio's own copy of a download
    goes with its cache: gr.Blocks(delete_cache=...) in web/ui.py); how many were deleted."""
    now, n = time.time() if now is None else now, 0
    for path in (root or exports_root()).glob("*/*"):
        try:
            if now - path.stat().st_mtime > EXPORT_TTL_S:
                path.unlink()
                n += 1
        except OSError:
            continue  # gone meanwhile
    return n


def delete_exports(owner: str, root: Path | None = None) -> int:
    """ "Delete all my data": the owner's export files, and Gradio's cached copy of each download."""
    folder, n = export_folder(owner, root), 0
    for path in list(folder.glob("*")) if folder.is_dir() else []:
        copy = Path(get_upload_folder()) / hash_file(path) / path.name
        forget_upload(copy)
        path.unlink(missing_ok=True)
        n += 1
    if folder.is_dir():
        folder.rmdir()
    return n


def forget_upload(path: str | Path | None) -> None:
    """Delete a file Gradio keeps (an upload once read, a download's copy) and its folder if empty;
    only ever inside Gradio's upload folder (a path from elsewhere is left alone)."""
    if not path:
        return
    cache, path = Path(get_upload_folder()).resolve(), Path(path).resolve()
    if cache not in path.parents:
        return
    try:
        path.unlink(missing_ok=True)
        if path.parent != cache and not any(path.parent.iterdir()):
            path.parent.rmdir()
    except OSError as e:
        log.debug("could not delete %s: %s", path, e)


class TransferHandlers(PanelHandlers):
    """The sidebar's Export .md, Export .json and Import .json buttons."""

    @user_errors
    def export_md(self, conv_id, token, request: gr.Request) -> str:
        return self._export(self.owner(token, request), conv_id, "md")

    @user_errors
    def export_json(self, conv_id, token, request: gr.Request) -> str:
        return self._export(self.owner(token, request), conv_id, "json")

    @user_errors
    def export_memories(self, token, request: gr.Request) -> str:
        """The caller's memory across chats, as a JSON file to download."""
        owner = self.owner(token, request)
        return self._write(owner, "memories.json", self.store.export_memories(owner))

    @user_errors
    def import_memories(self, file, conv_id, token, request: gr.Request) -> Panel:
        """Add the memories of an exported memories file to the caller's (the chat shown stays open)."""
        owner = self.owner(token, request)
        added = self.store.import_memories(owner, self._read_upload(file, "memories"))
        panel = self._open(owner, conv_id or "")
        return panel._replace(stats_md=f"{panel.stats_md}\n\nAdded {added} memories across your chats.")

    def _export(self, owner: str, conv_id: str, kind: str) -> str:
        self._current(owner, conv_id)
        text = self.store.export_markdown(owner, conv_id) if kind == "md" else self.store.export_json(owner, conv_id)
        return self._write(owner, f"conversation-{conv_id[:8]}.{kind}", text)

    def _write(self, owner: str, name: str, text: str) -> str:
        """`text` as the owner's export file `name`, private to them, swept after EXPORT_TTL_S."""
        sweep_exports()
        folder = export_folder(owner)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / name
        path.unlink(missing_ok=True)  # a fresh file, created 0600 (never through a link)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return str(path)

    @user_errors
    def import_chat(self, file, token, request: gr.Request) -> Panel:
        """Import a JSON export as a new chat of the caller's and open it; a bad file is a toast and
        changes nothing."""
        owner = self.owner(token, request)
        text = self._read_upload(file, "conversation")
        with self.slots.take(owner, "import"):
            conv_id = self._chat().import_json(owner, text)
        conv = self.store.get(owner, conv_id)
        # not warmed: an import is a stranger's cheapest way to ask for a long prefill
        return self.panel(owner, conv, f"Imported “{conv.title}” ({len(conv.turns)} turns).")

    def _read_upload(self, file, what: str) -> str:
        """An uploaded export's text (Gradio's copy deleted once read); too large or not text: InputError."""
        if not file:
            raise InputError(f"Pick an llmweb .json export of a {what} to import.")
        path = Path(file if isinstance(file, str) else file.name)
        try:
            if path.stat().st_size > self.settings.max_file_mb * 2**20:
                raise InputError(f"That file is larger than {self.settings.max_file_mb} MB (LLMWEB_MAX_FILE_MB).")
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError("That file is not text (UTF-8): it is not an llmweb .json export.") from None
        finally:
            forget_upload(path)  # read (or refused): Gradio's upload copy is not kept
