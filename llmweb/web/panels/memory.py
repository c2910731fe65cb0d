"""The memory panel: the facts kept with a chat, added word for word, pinned, unpinned, deleted;
and what the model sees of each turn (kept in context, left out, or as the planner sees fit).

Each handler returns the panel and clears the new-fact box. What a fact is and how it reaches the
prompt is chat/facts.py's; this module must not decide it.
"""

from __future__ import annotations

import gradio as gr

from llmweb.errors import InputError
from llmweb.records import OUT, PIN
from llmweb.web.panels.base import PanelHandlers, user_errors


class MemoryHandlers(PanelHandlers):
    """The facts of the open chat."""

    @user_errors
    def add_fact(self, conv_id, text, token, request: gr.Request) -> tuple:
        return self._fact(conv_id, text, token, request, lambda chat, o, t: chat.pins.add(o, conv_id, t))

    @user_errors
    def pin_fact(self, conv_id, fact_id, token, request: gr.Request) -> tuple:
        return self._picked(
            conv_id, fact_id, token, request, lambda chat, o, f: chat.pins.set_pinned(o, conv_id, f, True)
        )

    @user_errors
    def unpin_fact(self, conv_id, fact_id, token, request: gr.Request) -> tuple:
        return self._picked(
            conv_id, fact_id, token, request, lambda chat, o, f: chat.pins.set_pinned(o, conv_id, f, False)
        )

    @user_errors
    def delete_fact(self, conv_id, fact_id, token, request: gr.Request) -> tuple:
        return self._picked(conv_id, fact_id, token, request, lambda chat, o, f: chat.pins.delete(o, conv_id, f))

    @user_errors
    def keep_turn(self, conv_id, turn, token, request: gr.Request) -> tuple:
        return self._view(PIN, conv_id, turn, token, request)

    @user_errors
    def leave_out_turn(self, conv_id, turn, token, request: gr.Request) -> tuple:
        return self._view(OUT, conv_id, turn, token, request)

    @user_errors
    def plan_turn(self, conv_id, turn, token, request: gr.Request) -> tuple:
        return self._view("", conv_id, turn, token, request)

    def _view(self, view: str, conv_id, turn, token, request) -> tuple:
        """Keep the turn picked in context (PIN), leave it out (OUT), or neither ("")."""
        if turn is None:
            raise InputError("Pick a turn first.")
        owner = self.owner(token, request)
        self._current(owner, conv_id)
        self._chat().set_view(owner, conv_id, [(int(turn), view)])
        return tuple(self._reshown(owner, conv_id))

    @user_errors
    def remember_fact(self, conv_id, fact_id, token, request: gr.Request) -> tuple:
        """The fact picked, remembered in all the owner's chats (their confirmation: this click)."""
        owner = self.owner(token, request)
        self._current(owner, conv_id)
        self._chat().pins.remember(owner, conv_id, _picked_fact(fact_id))
        return tuple(self._reshown(owner, conv_id, "Remembered in all your chats."))

    # ---- memory across chats: each handler gets the chat shown, the memory picked and the text box
    @user_errors
    def add_memory(self, conv_id, memory_id, text, token, request: gr.Request) -> tuple:
        return self._memory(conv_id, token, request, lambda o: self.store.add_memory(o, text))

    @user_errors
    def remember_offered(self, conv_id, offered, text, token, request: gr.Request) -> tuple:
        """A fact sentence llmweb offered from this chat, remembered in all the owner's chats (this click)."""
        if not offered:
            raise InputError("Pick a sentence offered from this chat first.")
        return self._memory(conv_id, token, request, lambda o: self.store.add_memory(o, offered))

    @user_errors
    def picked_memory(self, memory_id, token, request: gr.Request) -> str:
        """The text of the memory just picked, into the box to edit ("" when it is not the caller's)."""
        if memory_id is None:
            return ""
        owner = self.owner(token, request)
        return next((m.text for m in self.store.memories(owner) if m.id == int(memory_id)), "")

    @user_errors
    def save_memory(self, conv_id, memory_id, text, token, request: gr.Request) -> tuple:
        return self._memory(conv_id, token, request, lambda o: self.store.edit_memory(o, _picked(memory_id), text=text))

    @user_errors
    def toggle_memory(self, conv_id, memory_id, text, token, request: gr.Request) -> tuple:
        def toggle(owner: str) -> None:
            mid = _picked(memory_id)
            now = next((m for m in self.store.memories(owner) if m.id == mid), None)
            if now is None:
                raise InputError("That memory is gone (deleted in another tab?).")
            self.store.edit_memory(owner, mid, enabled=not now.enabled)

        return self._memory(conv_id, token, request, toggle)

    @user_errors
    def delete_memory(self, conv_id, memory_id, text, token, request: gr.Request) -> tuple:
        return self._memory(conv_id, token, request, lambda o: self.store.delete_memory(o, _picked(memory_id)))

    def _memory(self, conv_id, token, request, action) -> tuple:
        owner = self.owner(token, request)
        action(owner)
        return (*self._open(owner, conv_id), "")

    def _picked(self, conv_id, fact_id, token, request, action) -> tuple:
        """An action on the fact picked in the dropdown (none picked: a toast)."""
        return self._fact(conv_id, fact_id, token, request, lambda chat, o, f: action(chat, o, _picked_fact(f)))

    def _fact(self, conv_id, value, token, request, action) -> tuple:
        owner = self.owner(token, request)
        self._current(owner, conv_id)
        action(self._chat(), owner, value)
        return (*self._reshown(owner, conv_id), "")


def _picked(memory_id) -> int:
    if memory_id is None:
        raise InputError("Pick a memory first.")
    return int(memory_id)


def _picked_fact(fact_id) -> int:
    if fact_id is None:
        raise InputError("Pick a fact first.")
    return int(fact_id)
