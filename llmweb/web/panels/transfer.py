"""Export and import: a chat as a Markdown or JSON file to download, and a JSON export read back as
a new chat of the caller's. A file is refused whole (too large, not text, not an export) and
changes nothing. The formats are the store's (export) and the chat's (import); this module only
moves files between the page and them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gradio as gr

from llmweb.errors import InputError
from llmweb.web.panels.base import Panel, PanelHandlers, user_errors


class TransferHandlers(PanelHandlers):
    """The sidebar's Export .md, Export .json and Import .json buttons."""

    @user_errors
    def export_md(self, conv_id, token, request: gr.Request) -> str:
        return self._export(self.owner(token, request), conv_id, "md")

    @user_errors
    def export_json(self, conv_id, token, request: gr.Request) -> str:
        return self._export(self.owner(token, request), conv_id, "json")

    def _export(self, owner: str, conv_id: str, kind: str) -> str:
        self._current(owner, conv_id)
        text = self.store.export_markdown(owner, conv_id) if kind == "md" else self.store.export_json(owner, conv_id)
        path = Path(tempfile.mkdtemp(prefix="llmweb-export-")) / f"conversation-{conv_id[:8]}.{kind}"
        path.write_text(text, encoding="utf-8")
        return str(path)

    @user_errors
    def import_chat(self, file, token, request: gr.Request) -> Panel:
        """Import a JSON export as a new chat of the caller's and open it; a bad file is a toast and
        changes nothing."""
        owner = self.owner(token, request)
        if not file:
            raise InputError("Pick an llmweb .json export to import.")
        path = Path(file if isinstance(file, str) else file.name)
        if path.stat().st_size > self.settings.max_file_mb * 2**20:
            raise InputError(f"That file is larger than {self.settings.max_file_mb} MB (LLMWEB_MAX_FILE_MB).")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError("That file is not text (UTF-8): it is not an llmweb .json export.") from None
        conv_id = self._chat().import_json(owner, text)
        conv = self.store.get(owner, conv_id)
        return self.panel(owner, conv, f"Imported “{conv.title}” ({len(conv.turns)} turns).")
