"""This chat's settings: the system prompt, temperature, reply cap, memory mode, the loop guard and
the documents checkbox, kept with the chat. A value equal to the configuration's is not kept, so it follows the
configuration. What each setting does to a turn is chat/session.py's; this module must not decide it.
"""

from __future__ import annotations

import dataclasses

import gradio as gr

from llmweb.chat import scope
from llmweb.store.models import ChatSettings
from llmweb.web.panels.base import Panel, PanelHandlers, user_errors


class SettingsHandlers(PanelHandlers):
    """The "This chat's settings" accordion and the documents checkbox under the chat."""

    @user_errors
    def save_settings(
        self, conv_id, system, temperature, cap, memory, loop_guard, use_docs, token, request: gr.Request
    ) -> Panel:
        """Keep the panel's settings with this chat (a value equal to the configuration's follows it).
        A chat not stored yet is created now, so its first message already has them."""
        chat, owner = self._chat(), self.owner(token, request)
        default = chat.turn_settings(ChatSettings())
        chosen = ChatSettings(
            system_prompt=None if system is None or system == default.system_prompt else str(system),
            temperature=None if temperature is None or temperature == default.temperature else float(temperature),
            max_new_tokens=None if cap in (None, default.budget.max_new_tokens) else int(cap),
            use_docs=None if bool(use_docs) == default.use_docs else bool(use_docs),
            memory=None if not memory or memory == default.memory else str(memory),
            loop_guard=None if loop_guard is None or bool(loop_guard) == default.loop_guard else bool(loop_guard),
        )
        if not conv_id or not self.store.exists(owner, conv_id):
            conv_id = self.store.create_conversation(owner)
        chat.set_settings(owner, conv_id, chosen)
        return self._reshown(owner, conv_id, "Saved this chat's settings.")

    @user_errors
    def set_documents(self, conv_id, doc_ids, token, request: gr.Request) -> Panel:
        """The documents picker: the open chat reads these from now on (none picked: all). A chat not
        stored yet is created now. A document the visitor cannot read is refused by name
        (`Library.resolve`), whatever the page sent."""
        owner = self.owner(token, request)
        if not conv_id or not self.store.exists(owner, conv_id):
            conv_id = self.store.create_conversation(owner)
        picked = [str(d) for d in doc_ids or []]
        chosen = scope.choose(self.store, self.runtime.library, owner, conv_id, picked or None)
        names = ", ".join(name for _, name in chosen.documents or ())
        return self._reshown(
            owner, conv_id, f"This chat reads {names}." if names else "This chat reads every document."
        )

    @user_errors
    def set_use_docs(self, conv_id, use_docs, token, request: gr.Request):
        """The documents checkbox is a setting of the open chat: kept with it once it is stored."""
        owner = self.owner(token, request)
        if conv_id and self.store.exists(owner, conv_id):
            conv = self.store.get(owner, conv_id)
            self._chat().set_settings(owner, conv_id, dataclasses.replace(conv.settings, use_docs=bool(use_docs)))
