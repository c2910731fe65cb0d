"""What the page serves besides its panels: the gradio_client endpoints `/chat` and `/stats`
(`gr.api` reads their type hints and docstrings), and the status line with its timer.

An endpoint caller's owner comes from web/identity.py (`gradio_api_owner`: without login, a
conversation's id is its key). This module must not decide what a turn does (chat/ does).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import gradio as gr

from llmweb.chat.session import Delta, Finished, Queued, Started, clean_message
from llmweb.store.models import new_id
from llmweb.web.formatting import escape
from llmweb.web.identity import gradio_api_owner
from llmweb.web.panels.base import PanelHandlers, user_errors
from llmweb.web.visitors import visitors_for

READY_TICK_S = 30.0  # the status line's refresh once the model is ready


class EndpointHandlers(PanelHandlers):
    """`/chat` and `/stats` for gradio_client callers."""

    def api_owner(self, conversation_id: str, request: gr.Request | None) -> str:
        return gradio_api_owner(self.settings, conversation_id, request)

    @user_errors
    def api_chat(
        self, message: str, conversation_id: str = "", request: gr.Request = None
    ) -> Iterator[tuple[str, str]]:
        """Send one message; streams (reply so far, conversation_id). Pass that conversation_id back to
        continue the chat. Without login, the id is the key to the conversation: keep it private."""
        chat = self._chat()
        clean_message(message, self.settings.max_message_chars)
        new = not conversation_id
        conv_id = new_id() if new else conversation_id
        owner = self.api_owner(conv_id, request)
        if new:
            visitors_for(self.settings).admit_api_conversation(owner, request)
        self._note_address(chat, owner, request)
        self._note_stored_address(owner, request)
        for event in chat.send(owner, conv_id, message, new=new):
            if isinstance(event, (Started, Queued)):
                yield "", conv_id  # lets Gradio notice a client that left while queued
            elif isinstance(event, Delta):
                yield event.text, conv_id
            elif isinstance(event, Finished):
                yield event.reply, conv_id

    @user_errors
    def api_stats(self, conversation_id: str, request: gr.Request = None) -> str:
        """The last turn's stats of a conversation, as JSON."""
        conv = self.store.get(self.api_owner(conversation_id, request), conversation_id)
        stats = conv.turns[-1].stats if conv.turns else None
        return json.dumps(stats.to_dict() if stats else {})


class StatusHandlers(PanelHandlers):
    """The status line at the top of the page: what the runtime is doing, until the model is ready."""

    def status_text(self) -> str:
        return f"**llmweb** · {escape(self.runtime.status, inline=True)}"  # it may quote a server's words

    def tick(self) -> tuple:
        """The timer: refresh the status line every second while the model loads, then every
        READY_TICK_S (a switch elsewhere, or the keep-alive's unload, shows within that)."""
        loading = not self.runtime.ready and not getattr(self.runtime, "unloaded", False)
        return self.status_text(), gr.update(value=1.0 if loading else READY_TICK_S, active=True)
