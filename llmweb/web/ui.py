"""The web UI: `build_app(runtime) -> gr.Blocks`, the page's layout and its wiring.

Three parts, read top to bottom:
  - layout: `layout()` builds the components and returns them as a `Layout` dataclass;
  - handlers: `Handlers`, the panels' handlers over one runtime (web/panels/, one module per
    panel: chat, chats, memory, settings, transfer, documents, sources, account, endpoints);
  - wiring: `build_app` connects the two, one `_wire_*` function per part of the page.
What is shown (Markdown, HTML, messages, plot tables) is made by the pure functions of
web/formatting.py. Policy lives elsewhere (chat, store, retrieval): this file must not decide what
goes into a prompt or how anything is stored, nor handle an event itself. The conversation id
lives in the browser (`gr.BrowserState`), so a reload or an app restart resumes the same chat from
the SQLite store.

Owners (many visitors, one server): every handler acts for the caller's OWNER, as web/identity.py
works it out, and passes it to every store and library call. The browser keeps its owner token in
an encrypted `gr.BrowserState` (`owner_state`), the last input of every event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr

from llmweb.retrieval.parsers import SUPPORTED_SUFFIXES
from llmweb.web.accounts import gradio_auth
from llmweb.web.body_cap import BodyCap
from llmweb.web.formatting import LATEX_DELIMITERS, NO_PLOT, stats_markdown
from llmweb.web.panels.account import AccountHandlers
from llmweb.web.panels.base import STREAMED, OwnerSlots, Panel, rest_shown, streamed
from llmweb.web.panels.chat import ChatHandlers
from llmweb.web.panels.chats import ChatListHandlers
from llmweb.web.panels.documents import DocumentHandlers
from llmweb.web.panels.endpoints import EndpointHandlers, StatusHandlers
from llmweb.web.panels.memory import MemoryHandlers
from llmweb.web.panels.models import ModelHandlers
from llmweb.web.panels.settings import SettingsHandlers
from llmweb.web.panels.sources import SourceHandlers
from llmweb.web.panels.transfer import TransferHandlers

DOC_TYPES = list(SUPPORTED_SUFFIXES)  # the upload box offers what the parsers read

CSS = """
.llmweb-bar {display:flex; height:18px; border-radius:4px; overflow:hidden; border:1px solid #d1d5db}
.llmweb-bar div {height:100%}
.llmweb-legend span {display:inline-block; margin-right:10px; font-size:12px}
.llmweb-legend i {display:inline-block; width:10px; height:10px; margin-right:3px; border-radius:2px}
.llmweb-plot svg text {fill: currentColor}
/* a cited source: its lines in a Sources message open it; the source panel shows its passage */
#llmweb-chat .selectable {cursor: auto !important}
#llmweb-chat .thought strong {cursor: pointer; text-decoration: underline dotted}
#llmweb-source {max-height: 60vh; overflow-y: auto}
.llmweb-passage .llmweb-text {white-space: pre-wrap; overflow-wrap: anywhere; margin: 6px 0}
.llmweb-passage .llmweb-before, .llmweb-passage .llmweb-after {opacity: .6}
.llmweb-passage .llmweb-cited {border-left: 3px solid #f59e0b; background: rgba(245, 158, 11, .12); padding: 2px 8px}
.llmweb-passage .llmweb-where {opacity: .8}
/* while an event runs, gradio pulses the border of each of its outputs at the screen's frame rate:
   a browser on the server's cores repaints all the time the reply streams (bench busy: Chromium's
   renderer 1.86-2.06 CPU s in a 3.5 s turn with it, 1.33-1.50 without); the border stays, still */
.wrap.generating {animation: none !important}
.eta-bar {transition: none !important}
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


# Which cited source a click in a Sources message is on: the chat's select event says only which
# message. Recorded as the click starts (capture phase, before the Chatbot's own handler), for the
# event's `js` (OPEN_SOURCE) to send: the "[n]" of the last source line at or above the click, 0 for
# none (the hint above them: the first source).
SOURCE_CLICKS = """() => {
  document.addEventListener("click", (e) => {
    const block = e.target.closest ? e.target.closest("#llmweb-chat .thought") : null;
    let n = 0;
    for (const line of block ? block.querySelectorAll("strong") : []) {
      const m = /^\\[(\\d+)\\]/.exec(line.textContent.trim());
      const after = line.compareDocumentPosition(e.target) & Node.DOCUMENT_POSITION_FOLLOWING;
      const above = line.contains(e.target) || after;
      if (m && above) n = parseInt(m[1], 10);
    }
    window.llmwebSource = n;
    window.llmwebSourceClicked = Boolean(block);
  }, true);
}"""
OPEN_SOURCE = "(conv, n, token, chat) => [conv, window.llmwebSource || 0, token, chat]"
# once a source opened: bring the panel into view (on a phone it is below the chat; elsewhere a no-op)
SHOW_SOURCE = """() => {
  if (!window.llmwebSourceClicked) return [];
  setTimeout(() => {
    const panel = document.getElementById("llmweb-source");
    if (panel) panel.scrollIntoView({block: "nearest"});
  }, 300);
  return [];
}"""


def body_cap(settings):
    """The middleware that caps request bodies before Gradio's routes read them (web/body_cap.py)."""
    from starlette.middleware import Middleware

    return Middleware(BodyCap, **BodyCap.options(settings, upload_window_s=sum(GRADIO_CACHE_TTL)))


def launch_kwargs(settings) -> dict:
    return dict(
        server_name=settings.host,
        server_port=settings.port,
        auth=gradio_auth(settings),
        max_file_size=f"{settings.max_file_mb}mb",
        show_error=True,
        css=CSS,
        js=SOURCE_CLICKS,
        allowed_paths=[],
        footer_links=["api"],
    )


# ---- layout: components only, no behaviour


@dataclass
class Layout:
    owner_state: gr.BrowserState
    conv_state: gr.BrowserState
    turn_rest: gr.State  # a streamed turn's panel but its chat, for the event after it (panels/base.py)
    status: gr.Markdown
    timer: gr.Timer
    # sidebar
    model_dd: gr.Dropdown  # the model served (web/panels/models.py)
    fetch_box: gr.Accordion  # "Get a model" from the Hugging Face Hub (operators only)
    fetch_repo: gr.Textbox
    fetch_file: gr.Textbox
    fetch_check: gr.Button
    fetch_go: gr.Button
    fetch_md: gr.Markdown
    new_btn: gr.Button
    continue_btn: gr.Button  # "Continue in a new chat" (chat/carry.py)
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
    whole_doc: gr.Checkbox  # read the whole document for this message (chat/document_task.py)
    files: gr.File
    ingest_md: gr.Markdown
    docs_md: gr.Markdown
    remove_dd: gr.Dropdown
    remove_btn: gr.Button
    doc_scope: gr.Dropdown  # the documents this chat reads (none picked: all)
    # panel column
    source_box: gr.Group  # the source panel: a cited source opened (panels/sources.py)
    source_pick: gr.Radio
    source_html: gr.HTML
    source_close: gr.Button
    source_n: gr.Number  # which source was clicked, as the page's script says (SOURCE_CLICKS)
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
    turn_dd: gr.Dropdown  # what the model sees: a turn kept in context, left out, or as planned
    keep_btn: gr.Button
    leave_out_btn: gr.Button
    as_planned_btn: gr.Button
    remember_btn: gr.Button  # a fact of this chat, remembered in all the owner's chats
    memories_md: gr.Markdown  # memory across chats: listed, added, edited, turned off, deleted
    memory_dd: gr.Dropdown
    memory_text: gr.Textbox
    memory_add_btn: gr.Button
    memory_save_btn: gr.Button
    memory_toggle_btn: gr.Button
    memory_del_btn: gr.Button
    memory_export: gr.DownloadButton
    suggest_dd: gr.Dropdown
    suggest_btn: gr.Button
    memory_import: gr.UploadButton
    # this chat's settings
    system_box: gr.Textbox
    temperature: gr.Slider
    reply_cap: gr.Number
    loop_guard: gr.Checkbox
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
        turn_rest=gr.State(None),
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
    model_dd = gr.Dropdown(label="Model", choices=[], interactive=False, elem_id="llmweb-model")
    with gr.Accordion("Get a model", open=False, visible=False, elem_id="llmweb-fetch") as fetch_box:
        fetch_repo = gr.Textbox(placeholder="Hub id: owner/name", show_label=False, max_lines=1)
        fetch_file = gr.Textbox(placeholder="file (.gguf repos): name.gguf", show_label=False, max_lines=1)
        with gr.Row():
            fetch_check = gr.Button("Check size", size="sm")
            fetch_go = gr.Button("Download", size="sm", variant="primary")
        fetch_md = gr.Markdown(elem_id="llmweb-fetch-report")
    new_btn = gr.Button("New chat", variant="secondary")
    continue_btn = gr.Button("Continue in a new chat", size="sm", elem_id="llmweb-continue-chat")
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
        model_dd=model_dd,
        fetch_box=fetch_box,
        fetch_repo=fetch_repo,
        fetch_file=fetch_file,
        fetch_check=fetch_check,
        fetch_go=fetch_go,
        fetch_md=fetch_md,
        new_btn=new_btn,
        continue_btn=continue_btn,
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


def chat_view(**kw) -> gr.Chatbot:
    """The chat's Chatbot. Its rendering settings are the ones formatting.py's message guard is built
    for (Markdown, sanitised HTML, LaTeX between $$): tests/web/test_renderer.py renders hostile
    messages in this very component."""
    return gr.Chatbot(
        label="Chat",
        height=560,
        elem_id="llmweb-chat",
        buttons=["copy"],
        editable="user",
        render_markdown=True,
        sanitize_html=True,
        latex_delimiters=[dict(d) for d in LATEX_DELIMITERS],
        **kw,
    )


def _chat_column() -> dict:
    chatbot = chat_view()
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
        whole_doc = gr.Checkbox(value=False, label="Whole document (this message)", scale=2, elem_id="llmweb-whole-doc")
        more_btn = gr.Button("Continue the reply", size="sm", scale=1, elem_id="llmweb-continue")
    with gr.Accordion("Documents", open=False, elem_id="llmweb-documents"):
        doc_scope = gr.Dropdown(
            label="This chat reads",
            info="None picked: all of them. A file you add while some are picked joins them.",
            choices=[],
            multiselect=True,
            elem_id="llmweb-doc-scope",
        )
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
        whole_doc=whole_doc,
        files=files,
        ingest_md=ingest_md,
        docs_md=docs_md,
        remove_dd=remove_dd,
        remove_btn=remove_btn,
        doc_scope=doc_scope,
    )


def _panel_column() -> dict:
    with gr.Group(visible=False, elem_id="llmweb-source-panel") as source_box:
        source_pick = gr.Radio(choices=[], label="Source", elem_id="llmweb-source-pick")
        source_html = gr.HTML("", elem_id="llmweb-source", padding=True)
        source_close = gr.Button("Close", size="sm", elem_id="llmweb-source-close")
    source_n = gr.Number(0, precision=0, visible=False)
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
        remember_btn = gr.Button("Remember in all my chats", size="sm", elem_id="llmweb-remember-all")
        with gr.Row():
            new_fact = gr.Textbox(
                placeholder="Something to remember, word for word", show_label=False, scale=3, elem_id="llmweb-new-fact"
            )
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
        loop_guard = gr.Checkbox(label="Loop guard: never say a sentence a third time", elem_id="llmweb-loop-guard")
        save_settings_btn = gr.Button("Save for this chat", size="sm", elem_id="llmweb-save-settings")
    say = _say_panels()
    with gr.Accordion("Prompt of the last turn", open=False, elem_id="llmweb-prompt-panel"):
        prompt_box = gr.Textbox(show_label=False, lines=8, max_lines=30, interactive=False, elem_id="llmweb-prompt")
    gr.Markdown("### This chat, turn by turn")
    tokens_plot = gr.HTML(NO_PLOT, elem_id="llmweb-tokens-plot")
    memory_plot = gr.HTML(NO_PLOT, elem_id="llmweb-memory-plot")
    return dict(
        source_box=source_box,
        source_pick=source_pick,
        source_html=source_html,
        source_close=source_close,
        source_n=source_n,
        prompt_box=prompt_box,
        remember_btn=remember_btn,
        system_box=system_box,
        temperature=temperature,
        reply_cap=reply_cap,
        memory_mode=memory_mode,
        loop_guard=loop_guard,
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
        **say,
    )


def _say_panels() -> dict:
    """Memory across chats (listed, added, edited, turned off, deleted) and what the model sees of each turn."""
    with gr.Accordion("Memory across chats", open=False, elem_id="llmweb-all-memory"):
        memories_md = gr.Markdown(elem_id="llmweb-memories")
        memory_dd = gr.Dropdown(label="Remembered", choices=[], elem_id="llmweb-memory-pick")
        memory_text = gr.Textbox(
            placeholder="Something all your chats should know, word for word",
            show_label=False,
            elem_id="llmweb-memory-text",
        )
        with gr.Row():
            memory_add_btn = gr.Button("Add", size="sm", elem_id="llmweb-memory-add")
            memory_save_btn = gr.Button("Save text", size="sm", elem_id="llmweb-memory-save")
            memory_toggle_btn = gr.Button("Turn on/off", size="sm", elem_id="llmweb-memory-toggle")
            memory_del_btn = gr.Button("Delete", size="sm", variant="stop", elem_id="llmweb-memory-delete")
        with gr.Row():
            suggest_dd = gr.Dropdown(label="Offered from this chat", choices=[], scale=3, elem_id="llmweb-suggest")
            suggest_btn = gr.Button("Remember", size="sm", scale=1, elem_id="llmweb-suggest-remember")
        with gr.Row():
            memory_export = gr.DownloadButton("Export memories", size="sm", elem_id="llmweb-memory-export")
            memory_import = gr.UploadButton(
                "Import memories", file_types=[".json"], size="sm", elem_id="llmweb-memory-import"
            )
    with gr.Accordion("What the model sees", open=False, elem_id="llmweb-turns-panel"):
        gr.Markdown(
            "Keep a turn in context (📌: never summarised or dropped while it fits), or leave it out (⊘: "
            "in no later prompt or summary)."
        )
        turn_dd = gr.Dropdown(label="Turn", choices=[], elem_id="llmweb-turn")
        with gr.Row():
            keep_btn = gr.Button("Keep in context", size="sm", elem_id="llmweb-keep-turn")
            leave_out_btn = gr.Button("Leave out", size="sm", elem_id="llmweb-leave-out-turn")
            as_planned_btn = gr.Button("As planned", size="sm", elem_id="llmweb-plan-turn")
    return dict(
        turn_dd=turn_dd,
        keep_btn=keep_btn,
        leave_out_btn=leave_out_btn,
        as_planned_btn=as_planned_btn,
        memories_md=memories_md,
        memory_dd=memory_dd,
        memory_text=memory_text,
        memory_add_btn=memory_add_btn,
        memory_save_btn=memory_save_btn,
        memory_toggle_btn=memory_toggle_btn,
        memory_del_btn=memory_del_btn,
        memory_export=memory_export,
        suggest_dd=suggest_dd,
        suggest_btn=suggest_btn,
        memory_import=memory_import,
    )


# ---- handlers, by panel


class Handlers:
    """Every panel's handlers over one runtime (web/panels/); `build_app` wires their methods."""

    def __init__(self, runtime):
        self.chat = ChatHandlers(runtime)
        self.chats = ChatListHandlers(runtime)
        self.memory = MemoryHandlers(runtime)
        self.settings = SettingsHandlers(runtime)
        self.transfer = TransferHandlers(runtime)
        self.docs = DocumentHandlers(runtime)
        self.sources = SourceHandlers(runtime)
        self.account = AccountHandlers(runtime, self.docs)
        self.endpoints = EndpointHandlers(runtime)
        self.status = StatusHandlers(runtime)
        self.models = ModelHandlers(runtime)
        slots = OwnerSlots()  # one long event per owner across the panels: an upload, an import, a deletion
        for panel in vars(self).values():
            panel.slots = slots


# ---- wiring

# Gradio runs each (sync) handler on its thread pool (launch's max_threads, 40). Every event belongs
# to a concurrency group whose limit caps the threads it may hold, and the limits add up to less than
# the pool: handlers that wait (a streaming turn, Stop waiting for the partial turn, a file being
# indexed) cannot hold every thread, and the page's quick events always find one. Past its limit, an
# event waits in Gradio's queue. "files" (uploads, imports: long) and "account" (deleting one's data,
# exports, the operator's fetch) are separate groups, and an owner runs one upload, import or deletion
# at a time (panels/base.py's OwnerSlots refuses a second at once): one visitor holds one place at most.
CONCURRENCY = {"generate": 20, "stop": 4, "files": 3, "account": 2, "page": 8, "status": 2}
GRADIO_THREADS = 40  # gradio's launch(max_threads=...) default, which llmweb keeps
# every 2 minutes, Gradio deletes the uploads and download copies it made over 10 minutes ago (the
# handlers delete an upload as soon as it is read; this catches any left, e.g. an abandoned upload):
# a file stays at most 12 minutes, the window of each address's upload budget (web/body_cap.py)
GRADIO_CACHE_TTL = (120, 600)


def group(name: str, **kw) -> dict:
    """An event's concurrency settings (a UI event is not a gradio_client endpoint, unless `kw` says)."""
    return dict(api_visibility="private", concurrency_id=name, concurrency_limit=CONCURRENCY[name]) | kw


PRIVATE, GENERATE, STOP, FILES, ACCOUNT, STATUS = (
    group(n) for n in ("page", "generate", "stop", "files", "account", "status")
)


def build_app(runtime) -> gr.Blocks:
    h = Handlers(runtime)
    with gr.Blocks(title="llmweb", delete_cache=GRADIO_CACHE_TTL) as demo:
        ui = layout(h.status.status_text, runtime.secret)
        shown = ui.outputs(*Panel._fields)
        me = [ui.owner_state]  # every handler's last input: who is asking (with the request)
        turns = _wire_chat(ui, h.chat, shown, me)
        _wire_sidebar(ui, h, shown, me)
        _wire_panel(ui, h, shown, me)
        _wire_sources(ui, h.sources, me)
        _wire_models(ui, h, me, turns)
        library = [ui.docs_md, ui.remove_dd, ui.doc_scope]
        chat_id = [ui.conv_state]
        demo.load(h.account.visit, [ui.owner_state, ui.conv_state], [ui.owner_state] + shown, **PRIVATE).then(
            h.docs.documents, chat_id + me, library, **PRIVATE
        ).then(h.models.picker, me, [ui.model_dd], **PRIVATE).then(h.models.fetch_box, me, [ui.fetch_box], **PRIVATE)
        ui.confirm_all_btn.click(h.account.delete_everything, me, shown + library + [ui.confirm_row], **ACCOUNT)
        ui.files.upload(h.docs.upload, [ui.files] + chat_id + me, library + [ui.ingest_md, ui.files], **FILES)
        ui.remove_btn.click(h.docs.remove_document, [ui.remove_dd] + chat_id + me, library + [ui.ingest_md], **PRIVATE)
        ui.timer.tick(h.status.tick, None, [ui.status, ui.timer], show_progress="hidden", **STATUS)

        gr.api(
            h.endpoints.api_chat, api_name="chat", concurrency_id="generate", concurrency_limit=CONCURRENCY["generate"]
        )
        gr.api(h.endpoints.api_stats, api_name="stats", concurrency_id="page", concurrency_limit=CONCURRENCY["page"])
    for fn in demo.fns.values():  # events Gradio adds itself (the status line's callable value): a group too
        if fn.fn is not None and fn.concurrency_id not in CONCURRENCY:
            fn.concurrency_id, fn.concurrency_limit = "status", CONCURRENCY["status"]
    return demo


def _wire_chat(ui: Layout, h: ChatHandlers, shown: list, me: list) -> tuple:
    """Send (box and button), retry, Continue, edit, undo, the version switcher, and Stop. Returns
    the events that end a turn (Stop's included). A turn streams into the chat alone; the rest of
    its panel follows as the next event (panels/base.py's `streamed`)."""
    lead = ui.outputs(*Panel._fields[:STREAMED], "turn_rest")

    def turn(trigger, handler, inputs, after: list, **kw):
        event = trigger(streamed(handler), inputs, lead + after, **kw)
        rest = shown[STREAMED:] + [ui.turn_rest]
        event.then(rest_shown, [ui.turn_rest], rest, show_progress="hidden", **PRIVATE)
        return event

    inputs = ui.outputs("msg", "chatbot", "conv_state", "use_docs") + me + [ui.whole_doc]  # respond's last argument
    ev_submit = turn(ui.msg.submit, h.respond, inputs, [ui.msg], **group("generate", api_name="respond_enter"))
    ev_send = turn(ui.send.click, h.respond, inputs, [ui.msg], **group("generate", api_name="respond"))
    for sent in (ev_submit, ev_send):  # the whole-document box is per message: it clears once sent
        sent.then(None, None, ui.whole_doc, js="() => false")
    redo = [ui.conv_state, ui.use_docs] + me
    ev_retry = turn(ui.chatbot.retry, h.regenerate, redo, [], **GENERATE)
    ev_more = turn(ui.more_btn.click, h.continue_reply, redo, [], **GENERATE)
    ev_edit = turn(ui.chatbot.edit, h.edit, redo + [ui.chatbot], [], **GENERATE)
    earlier = [ui.conv_state] + me + [ui.chatbot]  # a click on the note on a long chat's earlier turns
    ui.chatbot.select(h.show_earlier, earlier, [ui.chatbot], show_progress="hidden", **PRIVATE)
    for button, handler in ((ui.prev_version_btn, h.prev_version), (ui.next_version_btn, h.next_version)):
        button.click(handler, [ui.conv_state, ui.version_dd] + me, shown, **PRIVATE)
    ui.chatbot.undo(h.undo, [ui.conv_state] + me, shown + [ui.msg], **PRIVATE)
    turns = (ev_submit, ev_send, ev_retry, ev_more, ev_edit)
    stopped = ui.stop.click(None, None, None, cancels=list(turns)).then(
        h.after_stop, [ui.conv_state, ui.chatbot] + me, shown, **STOP
    )
    return (*turns, stopped)


def _wire_models(ui: Layout, h: Handlers, me: list, turns: tuple) -> None:
    """The model picker and "Get a model". A turn may switch the model (a chat takes its own model
    back: panels/models.py's `ensure_chat_model`), so once it ends the status line, its timer and the
    picker say what is served, not what was before the turn."""
    wanted = [ui.fetch_repo, ui.fetch_file]
    ui.fetch_check.click(h.models.check_fetch, wanted + me, [ui.fetch_md], **PRIVATE)
    ui.fetch_go.click(h.models.fetch, wanted + me, [ui.fetch_md, ui.model_dd], **ACCOUNT)
    switched = [ui.status, ui.timer, ui.model_dd]
    ui.model_dd.input(h.models.switch, [ui.model_dd, ui.conv_state] + me, switched, **PRIVATE)
    for turn in turns:
        turn.then(h.status.tick, None, [ui.status, ui.timer], show_progress="hidden", **STATUS).then(
            h.models.picker, me, [ui.model_dd], show_progress="hidden", **PRIVATE
        )


def _wire_sidebar(ui: Layout, h: Handlers, shown: list, me: list) -> None:
    """The chat list and its search, rename, delete, export and import, and "Delete all my data"."""
    ui.new_btn.click(h.chats.new_chat, me, shown, **PRIVATE)
    ui.continue_btn.click(h.chats.continue_chat, [ui.conv_state] + me, shown, **GENERATE)  # may write a summary
    ui.search_box.submit(h.chats.search, [ui.search_box] + me, ui.search_hits, **PRIVATE)
    ui.search_hits.input(h.chats.open_hit, [ui.search_hits] + me, shown, **PRIVATE).then(
        None, [ui.search_hits], None, js=SCROLL_TO_TURN
    )
    ui.conv_list.input(h.chats.switch, [ui.conv_list] + me, shown, **PRIVATE)
    renamed = dict(fn=h.chats.rename, inputs=[ui.conv_state, ui.title_box] + me, outputs=shown + [ui.title_box])
    ui.rename_btn.click(**renamed, **PRIVATE)
    ui.title_box.submit(**renamed, **PRIVATE)
    ui.delete_btn.click(h.chats.delete_chat, [ui.conv_state] + me, shown, **PRIVATE)
    ui.export_md.click(h.transfer.export_md, [ui.conv_state] + me, ui.export_md, **ACCOUNT)
    ui.export_json.click(h.transfer.export_json, [ui.conv_state] + me, ui.export_json, **ACCOUNT)
    ui.import_btn.upload(h.transfer.import_chat, [ui.import_btn] + me, shown, **FILES)
    ui.memory_export.click(h.transfer.export_memories, me, ui.memory_export, **ACCOUNT)
    ui.memory_import.upload(h.transfer.import_memories, [ui.memory_import, ui.conv_state] + me, shown, **FILES)
    ui.delete_all_btn.click(lambda: gr.update(visible=True), None, ui.confirm_row, **PRIVATE)
    ui.cancel_all_btn.click(lambda: gr.update(visible=False), None, ui.confirm_row, **PRIVATE)


def _wire_panel(ui: Layout, h: Handlers, shown: list, me: list) -> None:
    """This chat's settings, the documents checkbox, and the memory panel's facts."""
    chosen = ui.outputs("conv_state", "system_box", "temperature", "reply_cap", "memory_mode", "loop_guard", "use_docs")
    ui.save_settings_btn.click(h.settings.save_settings, chosen + me, shown, **PRIVATE)
    ui.use_docs.input(h.settings.set_use_docs, [ui.conv_state, ui.use_docs] + me, None, **PRIVATE)
    ui.doc_scope.input(h.settings.set_documents, [ui.conv_state, ui.doc_scope] + me, shown, **PRIVATE)
    facts = [ui.conv_state, ui.new_fact]
    ui.add_fact_btn.click(h.memory.add_fact, facts + me, shown + [ui.new_fact], **PRIVATE)
    for button, handler in (
        (ui.pin_btn, h.memory.pin_fact),
        (ui.unpin_btn, h.memory.unpin_fact),
        (ui.del_fact_btn, h.memory.delete_fact),
    ):
        button.click(handler, [ui.conv_state, ui.fact_dd] + me, shown + [ui.new_fact], **PRIVATE)
    for button, handler in (
        (ui.keep_btn, h.memory.keep_turn),
        (ui.leave_out_btn, h.memory.leave_out_turn),
        (ui.as_planned_btn, h.memory.plan_turn),
    ):
        button.click(handler, [ui.conv_state, ui.turn_dd] + me, shown, **PRIVATE)
    ui.remember_btn.click(h.memory.remember_fact, [ui.conv_state, ui.fact_dd] + me, shown, **PRIVATE)
    picked = [ui.conv_state, ui.memory_dd, ui.memory_text]
    for button, handler in (
        (ui.memory_add_btn, h.memory.add_memory),
        (ui.memory_save_btn, h.memory.save_memory),
        (ui.memory_toggle_btn, h.memory.toggle_memory),
        (ui.memory_del_btn, h.memory.delete_memory),
    ):
        button.click(handler, picked + me, shown + [ui.memory_text], **PRIVATE)
    ui.memory_dd.input(h.memory.picked_memory, [ui.memory_dd] + me, [ui.memory_text], **PRIVATE)  # to edit
    offered = [ui.conv_state, ui.suggest_dd, ui.memory_text]
    ui.suggest_btn.click(h.memory.remember_offered, offered + me, shown + [ui.memory_text], **PRIVATE)


def _wire_sources(ui: Layout, h: SourceHandlers, me: list) -> None:
    """A click on a Sources message opens the source panel; its picker and Close. Not the chat's
    output: a click while a reply streams changes nothing of it."""
    panel = ui.outputs("source_box", "source_pick", "source_html")
    shown_chat = [ui.chatbot]  # which turns the page shows (formatting.py's `hidden_turns`)
    opened = ui.chatbot.select(
        h.open_clicked, [ui.conv_state, ui.source_n] + me + shown_chat, panel, js=OPEN_SOURCE, **PRIVATE
    )
    opened.then(None, None, None, js=SHOW_SOURCE)
    ui.source_pick.input(h.pick, [ui.conv_state, ui.source_pick] + me, panel, **PRIVATE)
    ui.source_close.click(h.close, None, panel, **PRIVATE)
