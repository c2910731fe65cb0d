"""The web UI: `build_app(runtime) -> gr.Blocks`. The only module that imports gradio.

It turns `Chat.send` events into chat messages and a stats panel, and domain errors into
`gr.Error` toasts. Policy lives elsewhere: this file only lays out components and maps events.
The conversation id lives in the browser (`gr.BrowserState`), so a reload or an app restart
resumes the same chat from the SQLite store.
"""

from __future__ import annotations

import html
import json
import logging
import tempfile
from pathlib import Path
from typing import Iterator

import gradio as gr

from .chat import Delta, Finished, Queued
from .errors import LlmwebError
from .store import NotFound

log = logging.getLogger(__name__)

SECTION_COLOURS = {"system": "#6b7280", "summary": "#8b5cf6", "history": "#3b82f6", "recall": "#06b6d4",
                   "retrieved": "#f59e0b", "user": "#10b981", "reserve": "#e5e7eb"}
DOC_TYPES = [".txt", ".md", ".pdf", ".html", ".htm", ".docx"]
WAIT_READY_S = 600.0

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


# ---- formatting (pure helpers, tested without a browser)
def _mib(n) -> str:
    return f"{(n or 0) / 2**20:,.0f} MiB"


def stats_markdown(d: dict) -> str:
    """The last turn's TurnStats (as a dict) in plain words."""
    if not d:
        return "*No turns yet. Ask something.*"
    mem = d.get("mem", {})
    lines = [
        f"**Turn {d.get('turn', '?')}** · {d.get('finish_reason', '')}",
        f"- prompt **{d.get('prompt_tokens', 0):,}** tokens: reused {d.get('reused_tokens', 0):,} of "
        f"{d.get('prompt_tokens', 0):,} from this chat's cache, prefilled {d.get('prefilled_tokens', 0):,}",
        f"- generated **{d.get('generated_tokens', 0):,}** tokens at {d.get('decode_tok_s', 0):.1f} tok/s",
        f"- first token after {d.get('ttft_s', 0):.2f} s (queued {d.get('queue_wait_s', 0):.2f} s); "
        f"total {d.get('total_s', 0):.1f} s",
    ]
    if "cuda_allocated_bytes" in mem:
        lines.append(f"- GPU: allocated {_mib(mem['cuda_allocated_bytes'])}, reserved {_mib(mem['cuda_reserved_bytes'])}, "
                     f"peak {_mib(mem['cuda_peak_bytes'])}")
    lines.append(f"- RSS {_mib(mem.get('rss_bytes'))} (peak this turn {_mib(mem.get('peak_rss_bytes'))})")
    lines.append(f"- KV cache: this chat {_mib(d.get('kv_session_bytes'))}, all chats {_mib(d.get('kv_store_bytes'))}")
    if d.get("dropped_turns") or d.get("summarized_turns"):
        lines.append(f"- history: {d.get('summarized_turns', 0)} turns summarised, "
                     f"{d.get('dropped_turns', 0)} left out")
    if d.get("oom_retry"):
        lines.append("- ran out of memory once; answered with a smaller prompt")
    return "\n".join(lines)


def sections_html(d: dict) -> str:
    """A stacked bar of prompt tokens per section against the context limit."""
    sections, limit = d.get("sections") or {}, d.get("context_limit") or 0
    if not sections or not limit:
        return ""
    used = sum(sections.values())
    bars, legend = [], []
    for name, n in sections.items():
        if n <= 0:
            continue
        pct = 100 * n / limit
        colour = SECTION_COLOURS.get(name, "#9ca3af")
        bars.append(f'<div title="{name}: {n} tokens" style="width:{pct:.2f}%;background:{colour}"></div>')
        legend.append(f'<span><i style="background:{colour}"></i>{name} {n:,} ({pct:.0f}%)</span>')
    free = max(limit - used, 0)
    legend.append(f"<span>free {free:,} of {limit:,}</span>")
    return (f'<div class="llmweb-bar">{"".join(bars)}</div>'
            f'<div class="llmweb-legend">{"".join(legend)}</div>')


def sources_message(sources: list[dict]) -> dict | None:
    if not sources:
        return None
    lines = []
    for s in sources:
        where = f", p. {s['page']}" if s.get("page") else (f", {s['heading']}" if s.get("heading") else "")
        lines.append(f"**[{s['n']}] {html.escape(s['source'])}{html.escape(where)}** · score {s['score']:.2f}\n"
                     f"> {html.escape(s['snippet'])}")
    return {"role": "assistant", "content": "\n\n".join(lines),
            "metadata": {"title": f"Sources ({len(sources)})", "status": "done"}}


def history_messages(conv) -> list[dict]:
    out: list[dict] = []
    for t in conv.turns:
        out.append({"role": "user", "content": t.user})
        out.append({"role": "assistant", "content": t.assistant or "*(no reply)*"})
        src = sources_message(t.sources)
        if src:
            out.append(src)
    return out


def summary_markdown(conv) -> str:
    if not conv.summary:
        return "*No summary yet: the whole conversation still fits in the window.*"
    return f"Summary of the first {conv.summarized_upto} turns:\n\n{conv.summary}"


def build_app(runtime) -> gr.Blocks:
    store = runtime.store
    settings = runtime.settings

    def chat_or_error():
        try:
            return runtime.wait_ready(WAIT_READY_S)
        except LlmwebError as e:
            raise gr.Error(str(e)) from None

    def conversation_choices():
        return [(f"{c.title} ({c.n_turns})", c.id) for c in store.list_conversations()]

    def last_stats(conv) -> dict:
        return conv.turns[-1].stats if conv.turns else {}

    def open_conversation(conv_id: str):
        """(conv_id, chatbot, list, stats, bar, memory) for an existing id, or a new chat."""
        try:
            conv = store.get(conv_id) if conv_id else None
        except NotFound:
            conv = None
        if conv is None:
            conv = store.get(store.create_conversation())
        d = last_stats(conv)
        return (conv.id, history_messages(conv), gr.update(choices=conversation_choices(), value=conv.id),
                stats_markdown(d), sections_html(d), summary_markdown(conv))

    def status_text():
        return f"**llmweb** · {runtime.status}"

    def respond(message, history, conv_id, use_docs):
        chat = chat_or_error()
        if not conv_id:
            conv_id = store.create_conversation()
        history = list(history or [])
        shown = history + [{"role": "user", "content": message}, {"role": "assistant", "content": "…"}]
        stats_md, bar = gr.skip(), gr.skip()
        try:
            for event in chat.send(conv_id, message, use_docs=bool(use_docs)):
                if isinstance(event, Queued):
                    shown[-1] = {"role": "assistant", "content": f"*Waiting: {event.position} ahead in the queue…*"}
                    yield shown, "", gr.skip(), gr.skip(), gr.skip(), conv_id, gr.skip()
                elif isinstance(event, Delta):
                    shown[-1] = {"role": "assistant", "content": event.text}
                    yield shown, "", gr.skip(), gr.skip(), gr.skip(), conv_id, gr.skip()
                elif isinstance(event, Finished):
                    d = event.stats.to_dict()
                    stats_md = stats_markdown(d) + ("\n\n" + " ".join(event.notes) if event.notes else "")
                    bar = sections_html(d)
                    shown[-1] = {"role": "assistant", "content": event.reply or "*(no reply)*"}
                    src = sources_message(event.sources)
                    if src:
                        shown.append(src)
        except LlmwebError as e:
            raise gr.Error(str(e)) from None
        conv = store.get(conv_id)
        yield (shown, "", stats_md, bar, summary_markdown(conv), conv_id,
               gr.update(choices=conversation_choices(), value=conv_id))

    def new_chat():
        return open_conversation("")

    def switch(conv_id):
        return open_conversation(conv_id or "")

    def delete_chat(conv_id):
        if conv_id:
            if runtime.chat is not None:
                runtime.chat.delete(conv_id)
            else:
                store.delete(conv_id)
        remaining = store.list_conversations()
        return open_conversation(remaining[0].id if remaining else "")

    def export(conv_id, kind):
        if not conv_id:
            raise gr.Error("No conversation to export yet.")
        text = store.export_markdown(conv_id) if kind == "md" else store.export_json(conv_id)
        folder = Path(tempfile.mkdtemp(prefix="llmweb-export-"))
        path = folder / f"conversation-{conv_id[:8]}.{kind}"
        path.write_text(text, encoding="utf-8")
        return str(path)

    def documents_view():
        docs = runtime.library.documents()
        if not docs:
            table = "*No documents yet. Add .txt, .md, .pdf, .html or .docx files above.*"
        else:
            rows = ["| document | chunks |", "|---|---:|"] + [f"| {html.escape(d.source)} | {d.chunks} |" for d in docs]
            table = "\n".join(rows)
        return table, gr.update(choices=[(d.source, d.doc_id) for d in docs], value=None)

    def upload(files, progress=gr.Progress()):
        if not files:
            return gr.skip(), gr.skip(), gr.skip(), None
        paths = [f if isinstance(f, str) else f.name for f in files]

        def tell(done, total, what):
            progress((done, max(total, 1)), desc=what)

        reports = runtime.library.ingest_uploads([(p, Path(p).name) for p in paths], progress=tell)
        lines = [("✅ " if r.ok else "⚠️ ") + html.escape(r.describe()) for r in reports]
        table, choices = documents_view()
        return table, choices, "\n\n".join(lines), None

    def remove_document(doc_id):
        if not doc_id:
            raise gr.Error("Pick a document to remove first.")
        try:
            info = runtime.library.remove(doc_id)
        except LlmwebError as e:
            raise gr.Error(str(e)) from None
        table, choices = documents_view()
        return table, choices, f"Removed {html.escape(info.source)} ({info.chunks} chunks)."

    def api_chat(message: str, conversation_id: str = "") -> Iterator[str]:
        """Send one message; streams the reply text. Pass the same conversation_id to continue a chat."""
        chat = chat_or_error()
        try:
            conv_id = conversation_id if conversation_id and _exists(store, conversation_id) else \
                store.create_conversation()
            for event in chat.send(conv_id, message):
                if isinstance(event, Delta):
                    yield event.text
                elif isinstance(event, Finished):
                    yield event.reply
        except LlmwebError as e:
            raise gr.Error(str(e)) from None

    def api_stats(conversation_id: str) -> str:
        """The last turn's stats of a conversation, as JSON."""
        try:
            conv = store.get(conversation_id)
        except NotFound as e:
            raise gr.Error(str(e)) from None
        return json.dumps(last_stats(conv))

    with gr.Blocks(title="llmweb") as demo:
        conv_state = gr.BrowserState("", storage_key="llmweb_conversation")
        status = gr.Markdown(status_text(), elem_id="llmweb-status")
        timer = gr.Timer(1.0)
        with gr.Row():
            with gr.Column(scale=1, min_width=220):
                new_btn = gr.Button("New chat", variant="secondary")
                conv_list = gr.Radio(choices=[], label="Conversations", elem_id="llmweb-conversations")
                with gr.Row():
                    delete_btn = gr.Button("Delete chat", size="sm", variant="stop")
                with gr.Row():
                    export_md = gr.DownloadButton("Export .md", size="sm")
                    export_json = gr.DownloadButton("Export .json", size="sm")
            with gr.Column(scale=3):
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
            with gr.Column(scale=2, min_width=300):
                gr.Markdown("### Last turn")
                stats_md = gr.Markdown(stats_markdown({}), elem_id="llmweb-stats")
                bar = gr.HTML("", elem_id="llmweb-sections")
                with gr.Accordion("Memory", open=False):
                    memory_md = gr.Markdown(elem_id="llmweb-memory")

        outputs = [chatbot, msg, stats_md, bar, memory_md, conv_state, conv_list]
        opened = [conv_state, chatbot, conv_list, stats_md, bar, memory_md]
        ev_submit = msg.submit(respond, [msg, chatbot, conv_state, use_docs], outputs, api_visibility="private")
        ev_send = send.click(respond, [msg, chatbot, conv_state, use_docs], outputs, api_visibility="private")
        stop.click(None, None, None, cancels=[ev_submit, ev_send])
        new_btn.click(new_chat, None, opened, api_visibility="private")
        conv_list.input(switch, conv_list, opened, api_visibility="private")
        delete_btn.click(delete_chat, conv_state, opened, api_visibility="private")
        export_md.click(lambda c: export(c, "md"), conv_state, export_md, api_visibility="private")
        export_json.click(lambda c: export(c, "json"), conv_state, export_json, api_visibility="private")
        timer.tick(lambda: (status_text(), gr.Timer(active=not runtime.ready)), None, [status, timer],
                   api_visibility="private", show_progress="hidden")
        demo.load(switch, conv_state, opened, api_visibility="private")
        demo.load(documents_view, None, [docs_md, remove_dd], api_visibility="private")
        files.upload(upload, files, [docs_md, remove_dd, ingest_md, files], api_visibility="private")
        remove_btn.click(remove_document, remove_dd, [docs_md, remove_dd, ingest_md], api_visibility="private")
        gr.api(api_chat, api_name="chat")
        gr.api(api_stats, api_name="stats")
    return demo


def _exists(store, conv_id: str) -> bool:
    try:
        store.get(conv_id)
        return True
    except NotFound:
        return False
