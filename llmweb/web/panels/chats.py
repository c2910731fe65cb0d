"""The list of chats in the sidebar: a new chat, opening one, searching them, renaming, deleting.

Every call is scoped to the caller's owner: another visitor's chat id opens a blank chat here and
is `NotFound` in the store. This module must not store anything itself beyond what the store and
the chat's delete offer.
"""

from __future__ import annotations

import gradio as gr

from llmweb.errors import InputError
from llmweb.web.formatting import search_choices
from llmweb.web.panels.base import Panel, PanelHandlers, user_errors


class ChatListHandlers(PanelHandlers):
    """The sidebar's chat list, its search box, and the rename and delete controls."""

    @user_errors
    def new_chat(self, token, request: gr.Request) -> Panel:
        return self._open(self.owner(token, request), "")

    @user_errors
    def continue_chat(self, conv_id, token, request: gr.Request) -> Panel:
        """Continue the open chat in a new one (chat/carry.py), one at a time per owner, and open it."""
        owner = self.owner(token, request)
        old = self._current(owner, conv_id)
        with self.slots.take(owner, "continuation in a new chat"):
            new = self._chat().carry.continue_in_new(owner, conv_id)
        notes = f"This chat continues “{old.title}”: its summary, facts and last turns."
        return self._warmed(owner, self._reshown(owner, new, notes))  # its first prompt prefilled meanwhile

    @user_errors
    def switch(self, conv_id, token, request: gr.Request) -> Panel:
        owner = self.owner(token, request)
        return self._warmed(owner, self._open(owner, conv_id or ""))

    @user_errors
    def search(self, query, token, request: gr.Request):
        """Search the caller's own chats; the results become choices that open their turn."""
        hits = self.store.search(self.owner(token, request), query)
        label = f"Found in {len(hits)} turns" if hits else "No chat of yours matches that search."
        return gr.update(choices=search_choices(hits), value=None, label=label, visible=True)

    @user_errors
    def open_hit(self, hit, token, request: gr.Request) -> Panel:
        """A search result picked: open its chat, whole, and say which turn (the page then scrolls to it)."""
        conv_id, _, idx = (hit or "").rpartition(":")
        if not conv_id or not idx.isdigit():
            raise InputError("Pick a search result first.")
        owner = self.owner(token, request)
        return self._warmed(owner, self._reshown(owner, conv_id, f"Search result: turn {int(idx) + 1}.", first=0))

    @user_errors
    def rename(self, conv_id, title, token, request: gr.Request) -> tuple:
        """Rename the open chat; returns the panel (the list shows the new title) and clears the box."""
        owner = self.owner(token, request)
        self._current(owner, conv_id)
        self.store.rename(owner, conv_id, title)
        return (*self._reshown(owner, conv_id), "")

    @user_errors
    def delete_chat(self, conv_id, token, request: gr.Request) -> Panel:
        owner = self.owner(token, request)
        if conv_id:
            if self.runtime.chat is not None:
                self.runtime.chat.delete(owner, conv_id)  # also its recall index and KV cache
            else:
                self.store.delete(owner, conv_id)
        remaining = self.store.list_conversations(owner)
        return self._open(owner, remaining[0].id if remaining else "")
