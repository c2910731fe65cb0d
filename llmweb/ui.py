"""The web UI: `build_app(runtime) -> gr.Blocks`. The only module that imports gradio.

Three parts, read top to bottom:
  - layout: `layout()` builds the components and returns them as a `Layout` dataclass;
  - handlers: `Handlers`, one short method per event over the runtime, returning values and
    updates; `@user_errors` on each turns a domain error (`LlmwebError`) into a `gr.Error`
    toast, the one place in llmweb where that happens;
  - wiring: `build_app` connects the two.
What is shown (Markdown, HTML, messages, plot tables) is made by the pure functions of
ui_format.py. Policy lives elsewhere (chat, store, retrieval): this file must not decide what
goes into a prompt or how anything is stored. The conversation id lives in the browser
(`gr.BrowserState`), so a reload or an app restart resumes the same chat from the SQLite store.
"""

from __future__ import annotations

import functools
import html
import inspect
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import gradio as gr

from .chat import Delta, Finished, Queued, clean_message
from .errors import InputError, LlmwebError
from .store import NotFound
from .ui_format import (SECTION_COLOURS, documents_markdown, fact_label, history_messages, ingest_markdown,
                        plot_frames, sections_html, stats_markdown, summary_markdown)

DOC_TYPES = [".txt", ".md", ".pdf", ".html", ".htm", ".docx"]
WAIT_READY_S = 600.0
STOP_WAIT_S = 5.0  # after Stop, how long to wait for the partial turn to be stored

CSS = """
.llmweb-bar {display:flex; height:18px; border-radius:4px; overflow:hidden; border:1px solid #d1d5db}
.llmweb-bar div {height:100%}
.llmweb-legend span {display:inline-block; margin-right:10px; font-size:12px}
.llmweb-legend i {display:inline-block; width:10px; height:10px; margin-right:3px; border-radius:2px}
"""


def launch_kwargs(settings) -> dict:
    auth = tuple(settings.auth.split(":", 1)) if settings.auth else None
    return dict(server_name=settings.host, server_port=settings.port, auth=auth,
                max_file_size=f"{settings.max_file_mb}mb", show_error=True, css=CSS,
                allowed_paths=[], footer_links=["api"])


# ---- layout: components only, no behaviour


@dataclass
class Layout:
    conv_state: gr.BrowserState
    status: gr.Markdown
    timer: gr.Timer
    # sidebar
    new_btn: gr.Button
    conv_list: gr.Radio
    delete_btn: gr.Button
    export_md: gr.DownloadButton
    export_json: gr.DownloadButton
    # chat column
    chatbot: gr.Chatbot
    msg: gr.Textbox
    send: gr.Button
    stop: gr.Button
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
    tokens_plot: gr.LinePlot
    memory_plot: gr.LinePlot

    def outputs(self, *names: str) -> list:
        return [getattr(self, n) for n in names]


def layout(status_text: Callable[[], str]) -> Layout:
    """Build every component inside the current `gr.Blocks`: a sidebar, the chat, the stats panel."""
    top = dict(conv_state=gr.BrowserState("", storage_key="llmweb_conversation"),
               status=gr.Markdown(status_text, elem_id="llmweb-status"),  # a callable: fresh on every page load
               timer=gr.Timer(1.0))
    with gr.Row():
        with gr.Column(scale=1, min_width=220):
            sidebar = _sidebar()
        with gr.Column(scale=3):
            chat = _chat_column()
        with gr.Column(scale=2, min_width=300):
            panel = _panel_column()
    return Layout(**top, **sidebar, **chat, **panel)


def _sidebar() -> dict:
    new_btn = gr.Button("New chat", variant="secondary")
    conv_list = gr.Radio(choices=[], label="Conversations", elem_id="llmweb-conversations")
    with gr.Row():
        delete_btn = gr.Button("Delete chat", size="sm", variant="stop")
    with gr.Row():
        export_md = gr.DownloadButton("Export .md", size="sm")
        export_json = gr.DownloadButton("Export .json", size="sm")
    return dict(new_btn=new_btn, conv_list=conv_list, delete_btn=delete_btn, export_md=export_md,
                export_json=export_json)


def _chat_column() -> dict:
    chatbot = gr.Chatbot(label="Chat", height=560, elem_id="llmweb-chat", buttons=["copy"])
    with gr.Row():
        msg = gr.Textbox(placeholder="Ask anything (Enter to send)", show_label=False, scale=8,
                         lines=1, max_lines=8, autofocus=True)
        send = gr.Button("Send", variant="primary", scale=0, min_width=90, elem_id="llmweb-send")
        stop = gr.Button("Stop", variant="stop", scale=0, min_width=90, elem_id="llmweb-stop")
    use_docs = gr.Checkbox(value=True, label="Answer from my documents when relevant")
    with gr.Accordion("Documents", open=False, elem_id="llmweb-documents"):
        files = gr.File(label="Add documents", file_count="multiple", file_types=DOC_TYPES,
                        elem_id="llmweb-upload")
        ingest_md = gr.Markdown(elem_id="llmweb-ingest")
        docs_md = gr.Markdown(elem_id="llmweb-doclist")
        with gr.Row():
            remove_dd = gr.Dropdown(label="Remove a document", choices=[], scale=3)
            remove_btn = gr.Button("Remove", size="sm", scale=1)
    return dict(chatbot=chatbot, msg=msg, send=send, stop=stop, use_docs=use_docs, files=files,
                ingest_md=ingest_md, docs_md=docs_md, remove_dd=remove_dd, remove_btn=remove_btn)


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
    gr.Markdown("### This chat, turn by turn")
    # "~g": turn 1 reads "1", not "1.000000"; the sections keep the colours of the bar above
    tokens_plot = gr.LinePlot(x="turn", y="tokens", color="section", height=220, x_axis_format="~g",
                              color_map=SECTION_COLOURS, title="Prompt tokens by section",
                              elem_id="llmweb-tokens-plot")
    memory_plot = gr.LinePlot(x="turn", y="MiB", color="measure", height=220, x_axis_format="~g",
                              title="Memory", elem_id="llmweb-memory-plot")
    return dict(stats_md=stats_md, bar=bar, memory_md=memory_md, fact_dd=fact_dd, pin_btn=pin_btn,
                unpin_btn=unpin_btn, del_fact_btn=del_fact_btn, new_fact=new_fact, add_fact_btn=add_fact_btn,
                tokens_plot=tokens_plot, memory_plot=memory_plot)


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

    @classmethod
    def streaming(cls, conv_id: str, messages: list[dict]) -> "Panel":
        """While a reply streams, only the chat changes."""
        return cls(conv_id, messages, *[gr.skip()] * (len(cls._fields) - 2))


class Handlers:
    """The UI's events over a `Runtime`. No component is built here; every store read goes
    through this class (the place a per-user owner will be passed from)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.store = runtime.store
        self.settings = runtime.settings

    # -- helpers
    def _chat(self):
        return self.runtime.wait_ready(WAIT_READY_S)

    def _exists(self, conv_id: str) -> bool:
        try:
            self.store.get(conv_id)
            return True
        except NotFound:
            return False

    def _mem_limit(self) -> int:
        engine = self.runtime.engine
        return engine.limits.mem_limit_bytes if engine is not None else 0

    def panel(self, conv, notes: str = "") -> Panel:
        """Every component that shows a conversation, filled from the store."""
        stats = conv.turns[-1].stats if conv.turns else None
        tokens_df, memory_df = plot_frames(conv)
        return Panel(
            conv_state=conv.id,
            chatbot=history_messages(conv),
            conv_list=gr.update(choices=[(f"{c.title} ({c.n_turns})", c.id) for c in self.store.list_conversations()],
                                value=conv.id),
            stats_md=stats_markdown(stats, self._mem_limit()) + (f"\n\n{notes}" if notes else ""),
            bar=sections_html(stats),
            memory_md=summary_markdown(conv),
            fact_dd=gr.update(choices=[(fact_label(f), f.id) for f in conv.facts], value=None),
            # None, not an empty frame, for a chat without turns: after an empty frame the plot
            # would stop drawing lines for later updates in this page (seen in Gradio 6.31)
            tokens_plot=tokens_df if len(tokens_df) else None,
            memory_plot=memory_df if len(memory_df) else None,
        )

    def _open(self, conv_id: str) -> Panel:
        """The conversation, or a new one when the id is empty or no longer exists."""
        try:
            conv = self.store.get(conv_id) if conv_id else None
        except NotFound:
            conv = None
        return self.panel(conv or self.store.get(self.store.create_conversation()))

    # -- chat
    @user_errors
    def respond(self, message, history, conv_id, use_docs) -> Iterator[tuple]:
        """Send from the chat box: streams the reply into the chat, then fills the panel and clears the box."""
        chat = self._chat()
        clean_message(message, self.settings.max_message_chars)  # refuse before creating a conversation
        if not conv_id or not self._exists(conv_id):
            conv_id = self.store.create_conversation()
        shown = list(history or []) + [{"role": "user", "content": message}, {"role": "assistant", "content": "…"}]
        notes = ""
        for event in chat.send(conv_id, message, use_docs=bool(use_docs)):
            if isinstance(event, Queued):
                shown[-1] = {"role": "assistant", "content": f"*Waiting: {event.position} ahead in the queue…*"}
                yield (*Panel.streaming(conv_id, shown), "")
            elif isinstance(event, Delta):
                shown[-1] = {"role": "assistant", "content": event.text}
                yield (*Panel.streaming(conv_id, shown), "")
            elif isinstance(event, Finished):
                notes = " ".join(event.notes)
        yield (*self.panel(self.store.get(conv_id), notes), "")

    @user_errors
    def after_stop(self, conv_id, history):
        """After Stop: wait (briefly) for the partial turn to be stored, then show it as stopped."""
        if not conv_id or not self._exists(conv_id):
            return gr.skip()
        asked = sum(1 for m in history or [] if m.get("role") == "user")
        deadline = time.monotonic() + STOP_WAIT_S
        conv = self.store.get(conv_id)
        while len(conv.turns) < asked and time.monotonic() < deadline:
            time.sleep(0.1)
            conv = self.store.get(conv_id)
        return self.panel(conv, "Stopped.")

    @user_errors
    def new_chat(self) -> Panel:
        return self._open("")

    @user_errors
    def switch(self, conv_id) -> Panel:
        return self._open(conv_id or "")

    @user_errors
    def delete_chat(self, conv_id) -> Panel:
        if conv_id:
            if self.runtime.chat is not None:
                self.runtime.chat.delete(conv_id)  # also drops its KV cache and background jobs
            else:
                self.store.delete(conv_id)
        remaining = self.store.list_conversations()
        return self._open(remaining[0].id if remaining else "")

    # -- facts: each returns the panel and clears the new-fact textbox
    @user_errors
    def add_fact(self, conv_id, text) -> tuple:
        self._chat().add_fact(conv_id, text)
        return (*self.panel(self.store.get(conv_id)), "")

    @user_errors
    def pin_fact(self, conv_id, fact_id) -> tuple:
        fact = _picked_fact(fact_id)
        self._chat().set_fact_pinned(fact, True)
        return (*self.panel(self.store.get(conv_id)), "")

    @user_errors
    def unpin_fact(self, conv_id, fact_id) -> tuple:
        fact = _picked_fact(fact_id)
        self._chat().set_fact_pinned(fact, False)
        return (*self.panel(self.store.get(conv_id)), "")

    @user_errors
    def delete_fact(self, conv_id, fact_id) -> tuple:
        fact = _picked_fact(fact_id)
        self._chat().delete_fact(fact)
        return (*self.panel(self.store.get(conv_id)), "")

    # -- export: a file to download
    @user_errors
    def export_md(self, conv_id) -> str:
        return self._export(conv_id, "md")

    @user_errors
    def export_json(self, conv_id) -> str:
        return self._export(conv_id, "json")

    def _export(self, conv_id: str, kind: str) -> str:
        if not conv_id:
            raise InputError("No conversation to export yet.")
        text = self.store.export_markdown(conv_id) if kind == "md" else self.store.export_json(conv_id)
        path = Path(tempfile.mkdtemp(prefix="llmweb-export-")) / f"conversation-{conv_id[:8]}.{kind}"
        path.write_text(text, encoding="utf-8")
        return str(path)

    # -- documents
    @user_errors
    def documents(self) -> tuple:
        """The library table and the remove dropdown's choices."""
        docs = self.runtime.library.documents()
        return documents_markdown(docs), gr.update(choices=[(d.source, d.doc_id) for d in docs], value=None)

    @user_errors
    def upload(self, files, progress=gr.Progress()) -> tuple:
        """Add files to the library; returns the table, the choices, a report, and clears the file box."""
        if not files:
            return gr.skip(), gr.skip(), gr.skip(), None
        paths = [f if isinstance(f, str) else f.name for f in files]

        def tell(done, total, what):
            progress((done, max(total, 1)), desc=what)

        reports = self.runtime.library.ingest_uploads([(p, Path(p).name) for p in paths], progress=tell)
        return *self.documents(), ingest_markdown(reports), None

    @user_errors
    def remove_document(self, doc_id) -> tuple:
        if not doc_id:
            raise InputError("Pick a document to remove first.")
        info = self.runtime.library.remove(doc_id)
        return *self.documents(), f"Removed {html.escape(info.source)} ({info.chunks} chunks)."

    # -- API endpoints (gr.api reads their type hints and docstrings)
    @user_errors
    def api_chat(self, message: str, conversation_id: str = "") -> Iterator[str]:
        """Send one message; streams the reply text. Pass the same conversation_id to continue a chat."""
        chat = self._chat()
        clean_message(message, self.settings.max_message_chars)  # refuse before creating a conversation
        created = ""
        conv_id = conversation_id if conversation_id and self._exists(conversation_id) else ""
        if not conv_id:
            conv_id = created = self.store.create_conversation()
        try:
            for event in chat.send(conv_id, message):
                if isinstance(event, Queued):
                    yield ""  # nothing to show yet; lets Gradio notice a client that left while queued
                elif isinstance(event, Delta):
                    yield event.text
                elif isinstance(event, Finished):
                    yield event.reply
        except LlmwebError:
            self._drop_if_empty(created)
            raise

    @user_errors
    def api_stats(self, conversation_id: str) -> str:
        """The last turn's stats of a conversation, as JSON."""
        conv = self.store.get(conversation_id)
        stats = conv.turns[-1].stats if conv.turns else None
        return json.dumps(stats.to_dict() if stats else {})

    def _drop_if_empty(self, conv_id: str) -> None:
        """Delete a conversation this call created if the message was refused (no turn was stored)."""
        if conv_id and self._exists(conv_id) and not self.store.get(conv_id).turns:
            self.store.delete(conv_id)

    # -- status line
    def status_text(self) -> str:
        return f"**llmweb** · {self.runtime.status}"

    def tick(self) -> tuple:
        """The timer: refresh the status line, and stop ticking once the model is ready."""
        return self.status_text(), gr.update(active=not self.runtime.ready)


def _picked_fact(fact_id) -> int:
    if fact_id is None:
        raise InputError("Pick a fact first.")
    return int(fact_id)


# ---- wiring


def build_app(runtime) -> gr.Blocks:
    h = Handlers(runtime)
    with gr.Blocks(title="llmweb") as demo:
        ui = layout(h.status_text)
        shown = ui.outputs(*Panel._fields)
        private = dict(api_visibility="private")

        inputs = ui.outputs("msg", "chatbot", "conv_state", "use_docs")
        ev_submit = ui.msg.submit(h.respond, inputs, shown + [ui.msg], api_name="respond_enter", **private)
        ev_send = ui.send.click(h.respond, inputs, shown + [ui.msg], api_name="respond")
        ui.stop.click(None, None, None, cancels=[ev_submit, ev_send]).then(
            h.after_stop, [ui.conv_state, ui.chatbot], shown, **private)
        ui.new_btn.click(h.new_chat, None, shown, **private)
        ui.conv_list.input(h.switch, ui.conv_list, shown, **private)
        ui.delete_btn.click(h.delete_chat, ui.conv_state, shown, **private)
        ui.export_md.click(h.export_md, ui.conv_state, ui.export_md, **private)
        ui.export_json.click(h.export_json, ui.conv_state, ui.export_json, **private)

        ui.add_fact_btn.click(h.add_fact, [ui.conv_state, ui.new_fact], shown + [ui.new_fact], **private)
        for button, handler in ((ui.pin_btn, h.pin_fact), (ui.unpin_btn, h.unpin_fact),
                                (ui.del_fact_btn, h.delete_fact)):
            button.click(handler, [ui.conv_state, ui.fact_dd], shown + [ui.new_fact], **private)

        ui.timer.tick(h.tick, None, [ui.status, ui.timer], show_progress="hidden", **private)
        demo.load(h.switch, ui.conv_state, shown, **private)
        demo.load(h.documents, None, [ui.docs_md, ui.remove_dd], **private)
        library = [ui.docs_md, ui.remove_dd, ui.ingest_md]
        ui.files.upload(h.upload, ui.files, library + [ui.files], **private)
        ui.remove_btn.click(h.remove_document, ui.remove_dd, library, **private)

        gr.api(h.api_chat, api_name="chat")
        gr.api(h.api_stats, api_name="stats")
    return demo
