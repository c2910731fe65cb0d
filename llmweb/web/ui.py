"""The web UI: `build_app(runtime) -> gr.Blocks`. The only module that imports gradio.

Three parts, read top to bottom:
  - layout: `layout()` builds the components and returns them as a `Layout` dataclass;
  - handlers: `Handlers`, one short method per event over the runtime, returning values and
    updates; `@user_errors` on each turns a domain error (`LlmwebError`) into a `gr.Error`
    toast, the one place in llmweb where that happens;
  - wiring: `build_app` connects the two.
What is shown (Markdown, HTML, messages, plot tables) is made by the pure functions of
web/formatting.py. Policy lives elsewhere (chat, store, retrieval): this file must not decide what
goes into a prompt or how anything is stored. The conversation id lives in the browser
(`gr.BrowserState`), so a reload or an app restart resumes the same chat from the SQLite store.

Owners (many visitors, one server): every handler acts for the caller's OWNER and passes it to
every store and library call. With login, the owner is the account ("user:<name>"); without, each
browser gets an unguessable token on its first visit ("anon:<token>", 192 bits, kept in an
encrypted `gr.BrowserState`, never shown, never in a URL); a single-user install
(`Settings.is_single_user`) has one owner, LOCAL_OWNER. API callers without login own each
conversation they start through its id ("api:<id>": the id is the capability), so a browser's
conversation is never reachable through the API, whoever knows its id.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import inspect
import json
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import gradio as gr

from llmweb.chat.session import Delta, Finished, Queued, Started, clean_message
from llmweb.errors import InputError, LlmwebError
from llmweb.store.db import DEFAULT_TITLE, LOCAL_OWNER, ChatSettings, Conversation, new_id
from llmweb.web.accounts import gradio_auth
from llmweb.web.formatting import (
    NO_PLOT,
    SECTION_COLOURS,
    VERSION_MARKER,
    documents_markdown,
    fact_label,
    history_messages,
    ingest_markdown,
    line_chart_html,
    plot_frames,
    search_choices,
    sections_html,
    stats_markdown,
    summary_markdown,
    version_choices,
)

DOC_TYPES = [".txt", ".md", ".pdf", ".html", ".htm", ".docx"]
WAIT_READY_S = 600.0
# after Stop, the most to wait for the partial turn to be stored: the worker stops within a step,
# but a batch's step on a loaded CPU can take seconds (5 s was too short for the browser test there)
STOP_WAIT_S = 30.0

CSS = """
.llmweb-bar {display:flex; height:18px; border-radius:4px; overflow:hidden; border:1px solid #d1d5db}
.llmweb-bar div {height:100%}
.llmweb-legend span {display:inline-block; margin-right:10px; font-size:12px}
.llmweb-legend i {display:inline-block; width:10px; height:10px; margin-right:3px; border-radius:2px}
.llmweb-plot svg text {fill: currentColor}
/* a phone (390 px): the chat first, its box and Stop on one line, the sidebar and panels after it */
@media (max-width: 640px) {
  #llmweb-chat-column {order: -1}
  #llmweb-chat {height: 60vh !important}
  #llmweb-input-row {flex-wrap: nowrap}
  #llmweb-input-row > * {min-width: 0 !important}
  #llmweb-send, #llmweb-stop {min-width: 64px !important; padding-left: 8px; padding-right: 8px}
}
"""


# after a search result opens its chat: scroll to that turn's user message and flash it
SCROLL_TO_TURN = """(hit) => {
  const idx = parseInt(String(hit || "").split(":").pop(), 10);
  setTimeout(() => {
    const msg = document.querySelectorAll('#llmweb-chat [data-testid="user"]')[idx];
    if (!msg) return;
    msg.scrollIntoView({block: "center"});
    msg.animate([{outline: "3px solid #f59e0b"}, {outline: "none"}], 2000);
  }, 300);
  return [];
}"""

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{32}$")  # secrets.token_urlsafe(24): 192 bits


def new_owner_token() -> str:
    return secrets.token_urlsafe(24)


def launch_kwargs(settings) -> dict:
    return dict(
        server_name=settings.host,
        server_port=settings.port,
        auth=gradio_auth(settings),
        max_file_size=f"{settings.max_file_mb}mb",
        show_error=True,
        css=CSS,
        allowed_paths=[],
        footer_links=["api"],
    )


# ---- layout: components only, no behaviour


@dataclass
class Layout:
    owner_state: gr.BrowserState
    conv_state: gr.BrowserState
    status: gr.Markdown
    timer: gr.Timer
    # sidebar
    new_btn: gr.Button
    search_box: gr.Textbox
    search_hits: gr.Radio
    conv_list: gr.Radio
    delete_btn: gr.Button
    title_box: gr.Textbox
    rename_btn: gr.Button
    export_md: gr.DownloadButton
    export_json: gr.DownloadButton
    import_btn: gr.UploadButton
    delete_all_btn: gr.Button
    confirm_row: gr.Row
    confirm_all_btn: gr.Button
    cancel_all_btn: gr.Button
    # chat column
    chatbot: gr.Chatbot
    versions_row: gr.Row
    version_dd: gr.Dropdown
    prev_version_btn: gr.Button
    next_version_btn: gr.Button
    msg: gr.Textbox
    send: gr.Button
    stop: gr.Button
    more_btn: gr.Button
    use_docs: gr.Checkbox
    files: gr.File
    ingest_md: gr.Markdown
    docs_md: gr.Markdown
    remove_dd: gr.Dropdown
    remove_btn: gr.Button
    # panel column
    stats_md: gr.Markdown
    bar: gr.HTML
    memory_md: gr.Markdown
    fact_dd: gr.Dropdown
    pin_btn: gr.Button
    unpin_btn: gr.Button
    del_fact_btn: gr.Button
    new_fact: gr.Textbox
    add_fact_btn: gr.Button
    tokens_plot: gr.HTML
    memory_plot: gr.HTML
    prompt_box: gr.Textbox
    # this chat's settings
    system_box: gr.Textbox
    temperature: gr.Slider
    reply_cap: gr.Number
    memory_mode: gr.Radio
    save_settings_btn: gr.Button

    def outputs(self, *names: str) -> list:
        return [getattr(self, n) for n in names]


def layout(status_text: Callable[[], str], secret: str) -> Layout:
    """Build every component inside the current `gr.Blocks`: a sidebar, the chat, the stats panel.
    `secret` encrypts what the browser keeps, with the same key after a restart."""
    top = dict(
        owner_state=gr.BrowserState("", storage_key="llmweb_owner", secret=secret),
        conv_state=gr.BrowserState("", storage_key="llmweb_conversation", secret=secret),
        status=gr.Markdown(status_text, elem_id="llmweb-status"),  # a callable: fresh on every page load
        timer=gr.Timer(1.0),
    )
    with gr.Row():
        with gr.Column(scale=1, min_width=220, elem_id="llmweb-sidebar"):
            sidebar = _sidebar()
        with gr.Column(scale=3, elem_id="llmweb-chat-column"):
            chat = _chat_column()
        with gr.Column(scale=2, min_width=300, elem_id="llmweb-panel"):
            panel = _panel_column()
    return Layout(**top, **sidebar, **chat, **panel)


def _sidebar() -> dict:
    new_btn = gr.Button("New chat", variant="secondary")
    search_box = gr.Textbox(
        placeholder="Search my chats (Enter)", show_label=False, max_lines=1, elem_id="llmweb-search"
    )
    search_hits = gr.Radio(choices=[], label="Found", visible=False, elem_id="llmweb-search-hits")
    conv_list = gr.Radio(choices=[], label="Conversations", elem_id="llmweb-conversations")
    with gr.Row():
        delete_btn = gr.Button("Delete chat", size="sm", variant="stop")
    with gr.Row():
        title_box = gr.Textbox(
            placeholder="New title for this chat", show_label=False, scale=3, max_lines=1, elem_id="llmweb-title"
        )
        rename_btn = gr.Button("Rename", size="sm", scale=1, elem_id="llmweb-rename")
    with gr.Row():
        export_md = gr.DownloadButton("Export .md", size="sm")
        export_json = gr.DownloadButton("Export .json", size="sm")
        import_btn = gr.UploadButton("Import .json", file_types=[".json"], size="sm", elem_id="llmweb-import")
    delete_all_btn = gr.Button("Delete all my data", size="sm", variant="stop", elem_id="llmweb-delete-all")
    with gr.Row(visible=False) as confirm_row:
        gr.Markdown("Delete every chat, fact and uploaded document of yours? This cannot be undone.")
        confirm_all_btn = gr.Button(
            "Yes, delete everything", size="sm", variant="stop", elem_id="llmweb-delete-all-confirm"
        )
        cancel_all_btn = gr.Button("Cancel", size="sm")
    return dict(
        new_btn=new_btn,
        search_box=search_box,
        search_hits=search_hits,
        conv_list=conv_list,
        delete_btn=delete_btn,
        title_box=title_box,
        rename_btn=rename_btn,
        export_md=export_md,
        export_json=export_json,
        import_btn=import_btn,
        delete_all_btn=delete_all_btn,
        confirm_row=confirm_row,
        confirm_all_btn=confirm_all_btn,
        cancel_all_btn=cancel_all_btn,
    )


def _chat_column() -> dict:
    chatbot = gr.Chatbot(label="Chat", height=560, elem_id="llmweb-chat", buttons=["copy"], editable="user")
    with gr.Row(visible=False, elem_id="llmweb-versions") as versions_row:
        version_dd = gr.Dropdown(label="Versions of this chat", choices=[], scale=4, elem_id="llmweb-version")
        prev_version_btn = gr.Button("‹", size="sm", scale=0, min_width=40, elem_id="llmweb-version-prev")
        next_version_btn = gr.Button("›", size="sm", scale=0, min_width=40, elem_id="llmweb-version-next")
    with gr.Row(elem_id="llmweb-input-row"):
        msg = gr.Textbox(
            placeholder="Ask anything (Enter to send)", show_label=False, scale=8, lines=1, max_lines=8, autofocus=True
        )
        send = gr.Button("Send", variant="primary", scale=0, min_width=90, elem_id="llmweb-send")
        stop = gr.Button("Stop", variant="stop", scale=0, min_width=90, elem_id="llmweb-stop")
    with gr.Row():
        use_docs = gr.Checkbox(value=True, label="Answer from my documents when relevant", scale=3)
        more_btn = gr.Button("Continue the reply", size="sm", scale=1, elem_id="llmweb-continue")
    with gr.Accordion("Documents", open=False, elem_id="llmweb-documents"):
        files = gr.File(label="Add documents", file_count="multiple", file_types=DOC_TYPES, elem_id="llmweb-upload")
        ingest_md = gr.Markdown(elem_id="llmweb-ingest")
        docs_md = gr.Markdown(elem_id="llmweb-doclist")
        with gr.Row():
            remove_dd = gr.Dropdown(label="Remove a document", choices=[], scale=3)
            remove_btn = gr.Button("Remove", size="sm", scale=1)
    return dict(
        chatbot=chatbot,
        versions_row=versions_row,
        version_dd=version_dd,
        prev_version_btn=prev_version_btn,
        next_version_btn=next_version_btn,
        msg=msg,
        send=send,
        stop=stop,
        more_btn=more_btn,
        use_docs=use_docs,
        files=files,
        ingest_md=ingest_md,
        docs_md=docs_md,
        remove_dd=remove_dd,
        remove_btn=remove_btn,
    )


def _panel_column() -> dict:
    gr.Markdown("### Last turn")
    stats_md = gr.Markdown(stats_markdown(None), elem_id="llmweb-stats")
    bar = gr.HTML("", elem_id="llmweb-sections")
    with gr.Accordion("Memory", open=False, elem_id="llmweb-memory-panel"):
        memory_md = gr.Markdown(elem_id="llmweb-memory")
        fact_dd = gr.Dropdown(label="Fact", choices=[], elem_id="llmweb-fact")
        with gr.Row():
            pin_btn = gr.Button("Pin", size="sm")
            unpin_btn = gr.Button("Unpin", size="sm")
            del_fact_btn = gr.Button("Delete", size="sm", variant="stop")
        with gr.Row():
            new_fact = gr.Textbox(placeholder="Something to remember, word for word", show_label=False, scale=3)
            add_fact_btn = gr.Button("Remember", size="sm", scale=1)
    with gr.Accordion("This chat's settings", open=False, elem_id="llmweb-chat-settings"):
        system_box = gr.Textbox(label="System prompt (persona)", lines=3, max_lines=10, elem_id="llmweb-system-prompt")
        temperature = gr.Slider(0.0, 2.0, step=0.05, label="Temperature (0: the likeliest word)")
        reply_cap = gr.Number(label="Reply length cap (tokens)", precision=0, minimum=1, elem_id="llmweb-reply-cap")
        memory_mode = gr.Radio(
            choices=[("Window only", "window"), ("+ summary", "summary"), ("+ summary + recall", "recall")],
            label="Memory",
            elem_id="llmweb-memory-mode",
        )
        save_settings_btn = gr.Button("Save for this chat", size="sm", elem_id="llmweb-save-settings")
    with gr.Accordion("Prompt of the last turn", open=False, elem_id="llmweb-prompt-panel"):
        prompt_box = gr.Textbox(show_label=False, lines=8, max_lines=30, interactive=False, elem_id="llmweb-prompt")
    gr.Markdown("### This chat, turn by turn")
    tokens_plot = gr.HTML(NO_PLOT, elem_id="llmweb-tokens-plot")
    memory_plot = gr.HTML(NO_PLOT, elem_id="llmweb-memory-plot")
    return dict(
        prompt_box=prompt_box,
        system_box=system_box,
        temperature=temperature,
        reply_cap=reply_cap,
        memory_mode=memory_mode,
        save_settings_btn=save_settings_btn,
        stats_md=stats_md,
        bar=bar,
        memory_md=memory_md,
        fact_dd=fact_dd,
        pin_btn=pin_btn,
        unpin_btn=unpin_btn,
        del_fact_btn=del_fact_btn,
        new_fact=new_fact,
        add_fact_btn=add_fact_btn,
        tokens_plot=tokens_plot,
        memory_plot=memory_plot,
    )


# ---- handlers: one method per event, values and updates out, domain errors to toasts


def user_errors(fn):
    """Show a domain error's sentence as a `gr.Error` toast. Works for plain and generator functions
    (a generator must stay one, or Gradio would not stream it)."""
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except LlmwebError as e:
                raise gr.Error(str(e)) from None

        return stream

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LlmwebError as e:
            raise gr.Error(str(e)) from None

    return call


class Panel(NamedTuple):
    """Everything that shows one conversation; the field names are `Layout` attributes, in output order."""

    conv_state: Any
    chatbot: Any
    conv_list: Any
    stats_md: Any
    bar: Any
    memory_md: Any
    fact_dd: Any
    tokens_plot: Any
    memory_plot: Any
    prompt_box: Any  # the last turn's prompt, as sent (known only right after a turn)
    use_docs: Any  # this chat's settings, each shown as its value in effect
    system_box: Any
    temperature: Any
    reply_cap: Any
    memory_mode: Any
    versions_row: Any  # the version switcher, shown when the chat has versions
    version_dd: Any

    @classmethod
    def streaming(cls, conv_id: str, messages: list[dict]) -> Panel:
        """While a reply streams, only the chat changes."""
        return cls(conv_id, messages, *[gr.skip()] * (len(cls._fields) - 2))


class Handlers:
    """The UI's events over a `Runtime`. No component is built here. Every handler takes the browser's
    owner token and the request last, and every store and library call gets the caller's owner."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.store = runtime.store
        self.settings = runtime.settings

    # -- who is asking
    def owner(self, token: str, request: gr.Request | None) -> str:
        """The caller's owner: the single user, the login account, or the browser's token."""
        if self.settings.is_single_user:
            return LOCAL_OWNER
        name = getattr(request, "username", None)
        if name:
            return f"user:{name}"
        if not isinstance(token, str) or not _TOKEN.match(token):
            raise InputError("This page has no session yet. Reload it, and allow this site to keep local storage.")
        return f"anon:{token}"

    def api_owner(self, conversation_id: str, request: gr.Request | None) -> str:
        """API callers: the single user, the login account, or (anonymous) the conversation's own id."""
        if self.settings.is_single_user:
            return LOCAL_OWNER
        name = getattr(request, "username", None)
        return f"user:{name}" if name else f"api:{conversation_id}"

    # -- helpers
    def _chat(self):
        return self.runtime.wait_ready(WAIT_READY_S)

    def _mem_limit(self) -> int:
        engine = self.runtime.engine
        return engine.limits.mem_limit_bytes if engine is not None else 0

    @staticmethod
    def _fork_shown(conv, fork: int | None) -> int | None:
        """The fork the switcher shows: the one just used, else the latest."""
        if fork in conv.versions:
            return fork
        return max(conv.versions) if conv.versions else None

    def panel(self, owner: str, conv, notes: str = "", prompt: str = "", fork: int | None = None) -> Panel:
        """Every component that shows a conversation, filled from the store."""
        stats = conv.turns[-1].stats if conv.turns else None
        tokens_df, memory_df = plot_frames(conv)
        chats = [(f"{c.title} ({c.n_turns})", c.id) for c in self.store.list_conversations(owner)]
        return Panel(
            conv_state=conv.id,
            chatbot=history_messages(conv),
            versions_row=gr.update(visible=bool(conv.versions)),
            version_dd=gr.update(choices=version_choices(conv.versions), value=self._fork_shown(conv, fork)),
            conv_list=gr.update(choices=chats, value=conv.id or None),
            stats_md=stats_markdown(stats, self._mem_limit()) + (f"\n\n{notes}" if notes else ""),
            bar=sections_html(stats),
            memory_md=summary_markdown(conv),
            fact_dd=gr.update(choices=[(fact_label(f), f.id) for f in conv.facts], value=None),
            tokens_plot=line_chart_html(tokens_df, "tokens", "section", "Prompt tokens by section", SECTION_COLOURS),
            memory_plot=line_chart_html(memory_df, "MiB", "measure", "Memory"),
            prompt_box=prompt,
            **self._settings_shown(conv.settings),
        )

    def _settings_shown(self, chosen: ChatSettings) -> dict:
        """The chat's settings in effect, as the panel shows them; before the model is loaded (no
        budget yet), what the chat sets over the configuration."""
        chat, s = self.runtime.chat, self.settings
        if chat is not None:
            mine = chat.turn_settings(chosen)
            prompt, temperature, cap, memory = (
                mine.system_prompt,
                mine.temperature,
                mine.budget.max_new_tokens,
                mine.memory,
            )
        else:
            prompt = s.system_prompt if chosen.system_prompt is None else chosen.system_prompt
            temperature = s.temperature if chosen.temperature is None else chosen.temperature
            cap, memory = chosen.max_new_tokens or s.max_new_tokens, chosen.memory
        return dict(
            use_docs=True if chosen.use_docs is None else chosen.use_docs,
            system_box=prompt,
            temperature=temperature,
            reply_cap=cap,
            memory_mode=memory,
        )

    def _open(self, owner: str, conv_id: str) -> Panel:
        """The owner's conversation, or a blank new chat (stored with its first message) when the id
        is empty, gone, or not theirs."""
        conv = self.store.get(owner, conv_id) if conv_id and self.store.exists(owner, conv_id) else None
        return self.panel(owner, conv or _blank(owner))

    def _current(self, owner: str, conv_id: str):
        if not conv_id:
            raise InputError("Send a message first: this chat is not saved yet.")
        return self.store.get(owner, conv_id)

    # -- page load
    @user_errors
    def visit(self, token, conv_id, request: gr.Request) -> tuple:
        """First event of every page load: give a new browser its owner token, then show its chat."""
        token = token if isinstance(token, str) and _TOKEN.match(token) else new_owner_token()
        owner = self.owner(token, request)
        self.store.touch_owner(owner)
        return (token, *self._open(owner, conv_id or ""))

    # -- chat
    @user_errors
    def respond(self, message, history, conv_id, use_docs, token, request: gr.Request) -> Iterator[tuple]:
        """Send from the chat box: streams the reply into the chat, then fills the panel and clears the box."""
        chat, owner = self._chat(), self.owner(token, request)
        clean_message(message, self.settings.max_message_chars)
        conv_id = conv_id if conv_id and self.store.exists(owner, conv_id) else None  # None: a new chat
        if conv_id is None and not use_docs:  # the box is this chat's setting: keep it from the first turn
            conv_id = self.store.create_conversation(owner)
            chat.set_settings(owner, conv_id, ChatSettings(use_docs=False))
        shown = list(history or []) + [{"role": "user", "content": message}, {"role": "assistant", "content": "…"}]
        for panel in self._stream(owner, conv_id, shown, chat.send(owner, conv_id, message, use_docs=bool(use_docs))):
            yield (*panel, "")

    @user_errors
    def regenerate(self, conv_id, use_docs, token, request: gr.Request) -> Iterator[Panel]:
        """The chat's retry control: answer the last message again; the new reply replaces the old one."""
        yield from self._redo(conv_id, use_docs, token, request, more=False)

    @user_errors
    def continue_reply(self, conv_id, use_docs, token, request: gr.Request) -> Iterator[Panel]:
        """Continue: a reply cut by the length cap or stopped grows from where it ended."""
        yield from self._redo(conv_id, use_docs, token, request, more=True)

    def _redo(self, conv_id, use_docs, token, request, *, more: bool) -> Iterator[Panel]:
        chat, owner = self._chat(), self.owner(token, request)
        conv = self._current(owner, conv_id)
        if not conv.turns:
            raise InputError("There is no reply to regenerate or continue yet.")
        last = conv.turns[-1]
        shown = history_messages(dataclasses.replace(conv, turns=conv.turns[:-1]))
        so_far = last.assistant if more else "…"
        shown += [{"role": "user", "content": last.user}, {"role": "assistant", "content": so_far}]
        events = chat.send(owner, conv_id, "", use_docs=bool(use_docs), redo=not more, more=more)
        yield from self._stream(owner, conv_id, shown, events)

    @user_errors
    def undo(self, conv_id, token, request: gr.Request) -> tuple:
        """The chat's undo control: remove the last turn and put its message back in the box."""
        owner = self.owner(token, request)
        self._current(owner, conv_id)
        gone = self._chat().undo(owner, conv_id)
        return (*self.panel(owner, self.store.get(owner, conv_id), "Removed the last turn."), gone.user)

    @user_errors
    def edit(self, conv_id, use_docs, token, request: gr.Request, edited: gr.EditData) -> Iterator[Panel]:
        """The chat's edit control on a user message: send the new text in place of that turn. The
        chat forks there: the turns from it on stay, as another version (the switcher shows it)."""
        chat, owner = self._chat(), self.owner(token, request)
        conv = self._current(owner, conv_id)
        messages = history_messages(conv)
        index = edited.index if isinstance(edited.index, int) else edited.index[0]
        turn = sum(1 for m in messages[:index] if m.get("role") == "user")
        value = edited.value
        text = value.get("content", "") if isinstance(value, dict) else value
        text = VERSION_MARKER.sub("", text if isinstance(text, str) else "")
        if not 0 <= turn < len(conv.turns) or messages[index].get("role") != "user":
            raise InputError("Only your own messages can be edited.")
        clean_message(text, self.settings.max_message_chars)
        shown = history_messages(dataclasses.replace(conv, turns=conv.turns[:turn]))
        shown += [{"role": "user", "content": text}, {"role": "assistant", "content": "…"}]
        events = chat.send(owner, conv_id, text, use_docs=bool(use_docs), edit=turn)
        yield from self._stream(owner, conv_id, shown, events)  # the switcher then shows this fork (the latest)

    @user_errors
    def prev_version(self, conv_id, fork, token, request: gr.Request) -> Panel:
        return self._step_version(conv_id, fork, -1, token, request)

    @user_errors
    def next_version(self, conv_id, fork, token, request: gr.Request) -> Panel:
        return self._step_version(conv_id, fork, +1, token, request)

    def _step_version(self, conv_id, fork, step: int, token, request) -> Panel:
        """‹ or ›: show the previous or next version of the chat from the picked fork on."""
        owner = self.owner(token, request)
        conv = self._current(owner, conv_id)
        if fork is None or int(fork) not in conv.versions:
            raise InputError("Pick a version switch first (the turn whose message was edited).")
        fork = int(fork)
        active, count = conv.versions[fork]
        self._chat().switch_version(owner, conv_id, fork, (active + step) % count)
        conv = self.store.get(owner, conv_id)
        return self.panel(owner, conv, f"Turn {fork + 1}: version {conv.versions[fork][0] + 1} of {count}.", fork=fork)

    def _stream(self, owner: str, conv_id, shown: list[dict], events) -> Iterator[Panel]:
        """Show a turn's events: the queue position, then the reply as it grows, then the whole panel."""
        notes, prompt = "", ""
        for event in events:
            if isinstance(event, Started):
                conv_id = event.conv_id
            elif isinstance(event, Queued):
                shown[-1] = {"role": "assistant", "content": f"*Waiting: {event.position} ahead in the queue…*"}
                yield Panel.streaming(conv_id, shown)
            elif isinstance(event, Delta):
                shown[-1] = {"role": "assistant", "content": event.text}
                yield Panel.streaming(conv_id, shown)
            elif isinstance(event, Finished):
                notes, prompt = " ".join(event.notes), event.prompt_text()
        yield self.panel(owner, self.store.get(owner, conv_id), notes, prompt)

    @user_errors
    def after_stop(self, conv_id, history, token, request: gr.Request):
        """After Stop: wait (briefly) for the partial turn to be stored, then show it as stopped."""
        owner = self.owner(token, request)
        if not conv_id or not self.store.exists(owner, conv_id):
            return gr.skip()
        asked = sum(1 for m in history or [] if m.get("role") == "user")
        deadline = time.monotonic() + STOP_WAIT_S
        conv = self.store.get(owner, conv_id)
        while len(conv.turns) < asked and time.monotonic() < deadline:
            time.sleep(0.1)
            conv = self.store.get(owner, conv_id)
        return self.panel(owner, conv, "Stopped.")

    @user_errors
    def new_chat(self, token, request: gr.Request) -> Panel:
        return self._open(self.owner(token, request), "")

    @user_errors
    def switch(self, conv_id, token, request: gr.Request) -> Panel:
        return self._open(self.owner(token, request), conv_id or "")

    @user_errors
    def search(self, query, token, request: gr.Request):
        """Search the caller's own chats; the results become choices that open their turn."""
        hits = self.store.search(self.owner(token, request), query)
        label = f"Found in {len(hits)} turns" if hits else "No chat of yours matches that search."
        return gr.update(choices=search_choices(hits), value=None, label=label, visible=True)

    @user_errors
    def open_hit(self, hit, token, request: gr.Request) -> Panel:
        """A search result picked: open its chat, say which turn (the page then scrolls to it)."""
        conv_id, _, idx = (hit or "").rpartition(":")
        if not conv_id or not idx.isdigit():
            raise InputError("Pick a search result first.")
        owner = self.owner(token, request)
        conv = self.store.get(owner, conv_id)
        return self.panel(owner, conv, f"Search result: turn {int(idx) + 1}.")

    @user_errors
    def rename(self, conv_id, title, token, request: gr.Request) -> tuple:
        """Rename the open chat; returns the panel (the list shows the new title) and clears the box."""
        owner = self.owner(token, request)
        self._current(owner, conv_id)
        self.store.rename(owner, conv_id, title)
        return (*self.panel(owner, self.store.get(owner, conv_id)), "")

    @user_errors
    def save_settings(self, conv_id, system, temperature, cap, memory, use_docs, token, request: gr.Request) -> Panel:
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
        )
        if not conv_id or not self.store.exists(owner, conv_id):
            conv_id = self.store.create_conversation(owner)
        chat.set_settings(owner, conv_id, chosen)
        return self.panel(owner, self.store.get(owner, conv_id), "Saved this chat's settings.")

    @user_errors
    def set_use_docs(self, conv_id, use_docs, token, request: gr.Request):
        """The documents checkbox is a setting of the open chat: kept with it once it is stored."""
        owner = self.owner(token, request)
        if conv_id and self.store.exists(owner, conv_id):
            conv = self.store.get(owner, conv_id)
            self._chat().set_settings(owner, conv_id, dataclasses.replace(conv.settings, use_docs=bool(use_docs)))

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

    @user_errors
    def delete_everything(self, token, request: gr.Request) -> tuple:
        """ "Delete all my data", confirmed: every chat, fact, recall index and private document."""
        owner = self.owner(token, request)
        n = self._chat().delete_owner(owner)
        gr.Info(f"Deleted {n} chats and your uploaded documents.")
        return (*self._open(owner, ""), *self.documents(token, request), gr.update(visible=False))

    # -- facts: each returns the panel and clears the new-fact textbox
    @user_errors
    def add_fact(self, conv_id, text, token, request: gr.Request) -> tuple:
        owner = self.owner(token, request)
        self._current(owner, conv_id)
        self._chat().add_fact(owner, conv_id, text)
        return (*self.panel(owner, self.store.get(owner, conv_id)), "")

    @user_errors
    def pin_fact(self, conv_id, fact_id, token, request: gr.Request) -> tuple:
        return self._fact(
            conv_id, fact_id, token, request, lambda chat, o, f: chat.set_fact_pinned(o, conv_id, f, True)
        )

    @user_errors
    def unpin_fact(self, conv_id, fact_id, token, request: gr.Request) -> tuple:
        return self._fact(
            conv_id, fact_id, token, request, lambda chat, o, f: chat.set_fact_pinned(o, conv_id, f, False)
        )

    @user_errors
    def delete_fact(self, conv_id, fact_id, token, request: gr.Request) -> tuple:
        return self._fact(conv_id, fact_id, token, request, lambda chat, o, f: chat.delete_fact(o, conv_id, f))

    def _fact(self, conv_id, fact_id, token, request, action) -> tuple:
        owner = self.owner(token, request)
        self._current(owner, conv_id)
        action(self._chat(), owner, _picked_fact(fact_id))
        return (*self.panel(owner, self.store.get(owner, conv_id)), "")

    # -- export: a file to download
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

    # -- documents
    @user_errors
    def documents(self, token, request: gr.Request) -> tuple:
        """The documents this visitor's questions search (shared and theirs), and the ones they may remove."""
        docs = self.runtime.library.documents(self.owner(token, request))
        removable = [(d.source, d.doc_id) for d in docs if d.removable]
        return documents_markdown(docs), gr.update(choices=removable, value=None)

    @user_errors
    def upload(self, files, token, request: gr.Request, progress=gr.Progress()) -> tuple:
        """Add files to the visitor's library; returns the table, the choices, a report, and clears the file box."""
        if not files:
            return gr.skip(), gr.skip(), gr.skip(), None
        owner = self.owner(token, request)
        paths = [f if isinstance(f, str) else f.name for f in files]

        def tell(done, total, what):
            progress((done, max(total, 1)), desc=what)

        reports = self.runtime.library.ingest_uploads(owner, [(p, Path(p).name) for p in paths], progress=tell)
        return *self.documents(token, request), ingest_markdown(reports), None

    @user_errors
    def remove_document(self, doc_id, token, request: gr.Request) -> tuple:
        if not doc_id:
            raise InputError("Pick a document to remove first.")
        info = self.runtime.library.remove(self.owner(token, request), doc_id)
        return *self.documents(token, request), f"Removed {html.escape(info.source)} ({info.chunks} chunks)."

    # -- API endpoints (gr.api reads their type hints and docstrings)
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

    # -- status line
    def status_text(self) -> str:
        return f"**llmweb** · {self.runtime.status}"

    def tick(self) -> tuple:
        """The timer: refresh the status line, and stop ticking once the model is ready."""
        return self.status_text(), gr.update(active=not self.runtime.ready)


def _blank(owner: str) -> Conversation:
    """A new chat before its first message: shown, not stored."""
    return Conversation("", DEFAULT_TITLE, "", 0, [], owner=owner)


def _picked_fact(fact_id) -> int:
    if fact_id is None:
        raise InputError("Pick a fact first.")
    return int(fact_id)


# ---- wiring


def build_app(runtime) -> gr.Blocks:
    h = Handlers(runtime)
    with gr.Blocks(title="llmweb") as demo:
        ui = layout(h.status_text, runtime.secret)
        shown = ui.outputs(*Panel._fields)
        private = dict(api_visibility="private")
        me = [ui.owner_state]  # every handler's last input: who is asking (with the request)

        inputs = ui.outputs("msg", "chatbot", "conv_state", "use_docs") + me
        ev_submit = ui.msg.submit(h.respond, inputs, shown + [ui.msg], api_name="respond_enter", **private)
        ev_send = ui.send.click(h.respond, inputs, shown + [ui.msg], api_name="respond", **private)
        ev_retry = ui.chatbot.retry(h.regenerate, [ui.conv_state, ui.use_docs] + me, shown, **private)
        ev_more = ui.more_btn.click(h.continue_reply, [ui.conv_state, ui.use_docs] + me, shown, **private)
        ev_edit = ui.chatbot.edit(h.edit, [ui.conv_state, ui.use_docs] + me, shown, **private)
        for button, handler in ((ui.prev_version_btn, h.prev_version), (ui.next_version_btn, h.next_version)):
            button.click(handler, [ui.conv_state, ui.version_dd] + me, shown, **private)
        ui.chatbot.undo(h.undo, [ui.conv_state] + me, shown + [ui.msg], **private)
        ui.stop.click(None, None, None, cancels=[ev_submit, ev_send, ev_retry, ev_more, ev_edit]).then(
            h.after_stop, [ui.conv_state, ui.chatbot] + me, shown, **private
        )
        ui.new_btn.click(h.new_chat, me, shown, **private)
        ui.search_box.submit(h.search, [ui.search_box] + me, ui.search_hits, **private)
        ui.search_hits.input(h.open_hit, [ui.search_hits] + me, shown, **private).then(
            None, [ui.search_hits], None, js=SCROLL_TO_TURN
        )
        ui.conv_list.input(h.switch, [ui.conv_list] + me, shown, **private)
        renamed = dict(fn=h.rename, inputs=[ui.conv_state, ui.title_box] + me, outputs=shown + [ui.title_box])
        ui.rename_btn.click(**renamed, **private)
        ui.title_box.submit(**renamed, **private)
        chosen = ui.outputs("conv_state", "system_box", "temperature", "reply_cap", "memory_mode", "use_docs")
        ui.save_settings_btn.click(h.save_settings, chosen + me, shown, **private)
        ui.use_docs.input(h.set_use_docs, [ui.conv_state, ui.use_docs] + me, None, **private)
        ui.delete_btn.click(h.delete_chat, [ui.conv_state] + me, shown, **private)
        ui.export_md.click(h.export_md, [ui.conv_state] + me, ui.export_md, **private)
        ui.export_json.click(h.export_json, [ui.conv_state] + me, ui.export_json, **private)
        ui.import_btn.upload(h.import_chat, [ui.import_btn] + me, shown, **private)
        ui.delete_all_btn.click(lambda: gr.update(visible=True), None, ui.confirm_row, **private)
        ui.cancel_all_btn.click(lambda: gr.update(visible=False), None, ui.confirm_row, **private)

        ui.add_fact_btn.click(h.add_fact, [ui.conv_state, ui.new_fact] + me, shown + [ui.new_fact], **private)
        for button, handler in (
            (ui.pin_btn, h.pin_fact),
            (ui.unpin_btn, h.unpin_fact),
            (ui.del_fact_btn, h.delete_fact),
        ):
            button.click(handler, [ui.conv_state, ui.fact_dd] + me, shown + [ui.new_fact], **private)

        ui.timer.tick(h.tick, None, [ui.status, ui.timer], show_progress="hidden", **private)
        library = [ui.docs_md, ui.remove_dd]
        demo.load(h.visit, [ui.owner_state, ui.conv_state], [ui.owner_state] + shown, **private).then(
            h.documents, me, library, **private
        )
        ui.confirm_all_btn.click(h.delete_everything, me, shown + library + [ui.confirm_row], **private)
        ui.files.upload(h.upload, [ui.files] + me, library + [ui.ingest_md, ui.files], **private)
        ui.remove_btn.click(h.remove_document, [ui.remove_dd] + me, library + [ui.ingest_md], **private)

        gr.api(h.api_chat, api_name="chat")
        gr.api(h.api_stats, api_name="stats")
    return demo
