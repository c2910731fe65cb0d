"""The visitor and their data as a whole: the page's first event (a new browser gets its owner
token, web/visitors.py mints it) and "Delete all my data". This module must not mint or check an
owner itself, nor delete anything but through the chat (every chat, fact, recall index and private
document of the one owner) and the owner's export files (panels/transfer.py).
"""

from __future__ import annotations

import gradio as gr

from llmweb.records import LOCAL_OWNER
from llmweb.web.panels.base import PanelHandlers, user_errors
from llmweb.web.panels.documents import DocumentHandlers
from llmweb.web.panels.transfer import delete_exports, sweep_exports
from llmweb.web.trust import origin_of

# a browser on this machine without the owner's cookie (web/owner.py): say how to become the owner
OWNER_NOTICE = (
    "This browser is a visitor here, with chats and documents of its own. To use this machine's own, "
    "open the link that `python -m llmweb serve` printed in its terminal (http://127.0.0.1:…/?token=…)."
)


class AccountHandlers(PanelHandlers):
    """The page load and the "Delete all my data" confirmation."""

    def __init__(self, runtime, documents: DocumentHandlers):
        super().__init__(runtime)
        self.documents = documents  # the library's list, shown again after a delete

    @user_errors
    def visit(self, token, conv_id, request: gr.Request) -> tuple:
        """First event of every page load: give a new browser its owner token (the one its page's
        earlier events already used, if any: web/visitors.py), then show its chat."""
        owner, kept = self.visitors.resolve(token, request, first=True)
        if owner != LOCAL_OWNER and self.settings.is_single_user and origin_of(self.settings, request).local:
            gr.Warning(OWNER_NOTICE, duration=None)
        self.store.touch_owner(owner)
        self._note_stored_address(owner, request)
        sweep_exports()  # every page load: no export file outlives EXPORT_TTL_S by long, even unrequested
        return (kept or token, *self._open(owner, conv_id or ""))

    @user_errors
    def delete_everything(self, token, request: gr.Request) -> tuple:
        """ "Delete all my data", confirmed: every chat, fact, recall index and private document."""
        owner = self.owner(token, request)
        with self.slots.take(owner, "deletion"):  # never waits behind the owner's own upload or import
            n = self._chat().delete_owner(owner)
            delete_exports(owner)
        gr.Info(f"Deleted {n} chats and your uploaded documents.")
        return (*self._open(owner, ""), *self.documents.documents("", token, request), gr.update(visible=False))
