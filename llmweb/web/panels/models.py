"""The model picker: which model the server serves, switched from the page by those who may (the
machine's owner of a single-user install, an operator: web/identity.py's `may_switch_models`);
everyone else sees the model served, and cannot change it. A switch also becomes the open chat's
own model (`ChatSettings.model`): the chat's next message switches back to it if another was
chosen meanwhile (`ensure_chat_model`). The load's progress is the status line's.

This module must not load or close a model itself (runtime/switching.py does).
"""

from __future__ import annotations

import dataclasses

import gradio as gr

from llmweb.errors import InputError
from llmweb.web.formatting import model_label
from llmweb.web.identity import may_switch_models
from llmweb.web.panels.base import PanelHandlers, user_errors

SWITCH_TICK_S = 1.0  # the status line's refresh while a model loads


class ModelHandlers(PanelHandlers):
    """The "Model" dropdown above the chat list."""

    @user_errors
    def picker(self, token, request: gr.Request):
        """The models, the one served chosen; a visitor who may not switch sees it, greyed."""
        owner = self.owner(token, request)
        allowed = may_switch_models(self.settings, owner)
        entries = self.runtime.models()
        choices = [(model_label(e), e.id) for e in entries] or [(self.runtime.model_id, self.runtime.model_id)]
        return gr.update(choices=choices, value=self.runtime.model_id, interactive=allowed and len(choices) > 1)

    @user_errors
    def switch(self, model_id, conv_id, token, request: gr.Request):
        """Serve `model_id` from now on, and keep it as the open chat's model. Returns the status
        line and its timer (ticking until the load is done) and the picker."""
        owner = self.owner(token, request)
        if not may_switch_models(self.settings, owner):
            raise InputError("Only this server's operator switches its model.")
        if not model_id:
            raise InputError("Pick a model first.")
        self.runtime.switch(str(model_id))
        if conv_id and self.store.exists(owner, conv_id):
            settings = self.store.get(owner, conv_id).settings
            self.store.set_settings(owner, conv_id, dataclasses.replace(settings, model=str(model_id)))
        status = f"**llmweb** · Switching to {model_id}…"
        return status, gr.update(value=SWITCH_TICK_S, active=True), self.picker(token, request)


def ensure_chat_model(handlers: PanelHandlers, owner: str, conv_id: str | None) -> None:
    """Before a turn: a chat with a model of its own gets it served, if its owner may switch models
    (a chat imported by a visitor who may not simply runs on the model served)."""
    if not conv_id or not handlers.store.exists(owner, conv_id):
        return
    wanted = handlers.store.get(owner, conv_id).settings.model
    runtime = handlers.runtime
    if wanted and wanted != runtime.model_id and may_switch_models(handlers.settings, owner):
        if any(e.id == wanted for e in runtime.models()):
            runtime.switch(wanted)
