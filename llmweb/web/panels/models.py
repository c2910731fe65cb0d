"""The model picker: which model the server serves, switched from the page by those who may (the
machine's owner of a single-user install, an operator: web/identity.py's `may_switch_models`);
everyone else sees the model served, and cannot change it. A switch also becomes the open chat's
own model (`ChatSettings.model`): the chat's next message is answered by it (`chat_model`), at
once where it is loaded (LLMWEB_MAX_LOADED keeps several), else switched back to. The load's
progress is the status line's.

This module must not load or close a model itself (runtime/switching.py does).
"""

from __future__ import annotations

import dataclasses

import gradio as gr

from llmweb.engine import hub
from llmweb.errors import InputError
from llmweb.web.formatting import escape, model_label
from llmweb.web.identity import may_switch_models
from llmweb.web.panels.base import PanelHandlers, user_errors

SWITCH_TICK_S = 1.0  # the status line's refresh while a model loads


class ModelHandlers(PanelHandlers):
    """The "Model" dropdown above the chat list."""

    @user_errors
    def picker(self, token, request: gr.Request):
        """The models, the one served chosen, the others loaded beside it marked; a visitor who may
        not switch sees it, greyed."""
        owner = self.owner(token, request)
        allowed = may_switch_models(self.settings, owner)
        entries, parked = self.runtime.models(), set(self.runtime.loaded_ids()) - {self.runtime.model_id}
        choices = [(model_label(e) + " · loaded" * (e.id in parked), e.id) for e in entries]
        choices = choices or [(self.runtime.model_id, self.runtime.model_id)]
        return gr.update(choices=choices, value=self.runtime.model_id, interactive=allowed and len(choices) > 1)

    @user_errors
    def fetch_box(self, token, request: gr.Request):
        """The "Get a model" box: shown to those who may switch models only."""
        return gr.update(visible=may_switch_models(self.settings, self.owner(token, request)))

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

    @user_errors
    def check_fetch(self, repo, filename, token, request: gr.Request) -> str:
        """What a fetch would download, and its size, before anything downloads (engine/hub.py)."""
        self._operator(token, request)
        plan = hub.plan(str(repo or "").strip(), str(filename or "").strip() or None)
        files = "\n".join(f"- {escape(f.name, inline=True)} · {hub.human_bytes(f.size)}" for f in plan.files)
        kept = hub.bytes_kept(plan, self.settings.models_folder)
        resume = f"\n\n{hub.human_bytes(kept)} of it is here already: Download resumes." if kept else ""
        return f"**{escape(plan.summary(), inline=True)}**\n\n{files}{resume}"

    @user_errors
    def fetch(self, repo, filename, token, request: gr.Request, progress=gr.Progress()):
        """Download the model into the models folder with a progress bar (resumable: a stopped
        download goes on from where it was); then it is in the picker."""
        self._operator(token, request)
        plan = hub.plan(str(repo or "").strip(), str(filename or "").strip() or None)

        def tell(done: int, total: int, what: str) -> None:
            progress((done, max(total, 1)), desc=f"{what}: {hub.human_bytes(done)} of {hub.human_bytes(total)}")

        path = hub.fetch(plan, self.settings.models_folder, tell, max_bytes=self.settings.max_download_bytes)
        said = f"Downloaded {escape(path.name, inline=True)} ({hub.human_bytes(plan.total_bytes)}): pick it above."
        return said, self.picker(token, request)

    def _operator(self, token, request) -> None:
        if not may_switch_models(self.settings, self.owner(token, request)):
            raise InputError("Only this server's operator adds models.")


def chat_model(handlers: PanelHandlers, owner: str, conv_id: str | None) -> str | None:
    """Before a turn: the model that answers the chat. Its own model (`ChatSettings.model`) where it
    is loaded (served, or kept loaded beside it: nothing switches, whoever asks) or served; where it
    is not, switched to if its owner may switch models; else None, the model served (a chat
    imported by a visitor who may not switch runs on it)."""
    allowed = may_switch_models(handlers.settings, owner)
    if not conv_id or not (allowed or handlers.settings.max_loaded > 1):
        return None  # first, with no I/O: where only the served model is loaded, a visitor pays no read per turn
    if not handlers.store.exists(owner, conv_id):
        return None
    wanted = handlers.store.get(owner, conv_id).settings.model
    runtime = handlers.runtime
    if not wanted or wanted == runtime.model_id or wanted in runtime.loaded_ids():
        return wanted or None
    if allowed and any(e.id == wanted for e in runtime.models()):
        runtime.switch(wanted)
        return wanted
    return None
