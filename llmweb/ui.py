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
import re
import tempfile
import time
from pathlib import Path
from typing import Iterator

import gradio as gr

from .chat import Delta, Finished, Queued, clean_message
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


_MD_LEAD = re.compile(r"^\s*(#{1,6}\s+|[>*+-]\s+|\d+[.)]\s+)+")
NEAR = 0.9  # warn when a turn uses this share of the context or of the memory limit


def warnings(d: dict, limits: dict) -> list[str]:
    """Plain-words warnings for a turn that came near the token budget or the memory limit."""
    out = []
    limit = d.get("context_limit") or 0
    used = (d.get("prompt_tokens") or 0) + (d.get("sections", {}).get("reserve") or 0)
    if limit and used >= NEAR * limit:
        out.append(f"⚠️ This turn used {used:,} of {limit:,} context tokens; older turns will be summarised "
                   "or left out.")
    if d.get("dropped_turns"):
        out.append(f"⚠️ {d['dropped_turns']} older turns did not fit and were left out.")
    mem = d.get("mem", {})
    mem_limit = limits.get("mem_limit_bytes") or 0
    peak = mem.get("peak_rss_bytes") or mem.get("rss_bytes") or 0
    if mem_limit and peak >= NEAR * mem_limit:
        out.append(f"⚠️ Memory is near its limit: {_mib(peak)} of {_mib(mem_limit)}.")
    return out


def stats_markdown(d: dict, limits: dict | None = None) -> str:
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
    return "\n".join(lines + [""] + warnings(d, limits or {}))


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
        snippet = _MD_LEAD.sub("", s["snippet"])  # a chunk may start with "# Heading": not a heading here
        lines.append(f"**[{s['n']}] {html.escape(s['source'])}{html.escape(where)}** · score {s['score']:.2f}\n"
                     f"> {html.escape(snippet)}")
    return {"role": "assistant", "content": "\n\n".join(lines),
            "metadata": {"title": f"Sources ({len(sources)})", "status": "done"}}


def history_messages(conv) -> list[dict]:
    out: list[dict] = []
    for t in conv.turns:
        out.append({"role": "user", "content": t.user})
        stopped = (t.stats or {}).get("finish_reason") == "cancelled"
        out.append({"role": "assistant", "content": (t.assistant or "") + ("\n\n*(stopped)*" if stopped else "")
                    or "*(no reply)*"})
        src = sources_message(t.sources)
        if src:
            out.append(src)
    return out


def fact_label(f) -> str:
    return ("📌 " if f.pinned else "") + (f.text if len(f.text) <= 60 else f.text[:57] + "…")


def summary_markdown(conv) -> str:
    parts = [f"**Summary of the first {conv.summarized_upto} turns:** {html.escape(conv.summary)}" if conv.summary
             else "*No summary yet: the whole conversation still fits in the window.*"]
    if conv.facts:
        parts.append("**Facts you stated** (kept word for word; 📌 = pinned, never dropped):")
        parts += [f"- {'📌 ' if f.pinned else ''}{html.escape(f.text)}" for f in conv.facts]
    else:
        parts.append("*No facts kept yet. Facts you state are kept when their turn leaves the window; "
                     "add one below to keep it now.*")
    return "\n".join(parts)


def plot_frames(conv):
    """Two long-format tables for the session plots: tokens per section and memory, per turn."""
    import pandas as pd

    tokens, memory = [], []
    for t in conv.turns:
        d = t.stats or {}
        turn = t.idx + 1
        for name, n in (d.get("sections") or {}).items():
            if name != "reserve":
                tokens.append({"turn": turn, "section": name, "tokens": n})
        mem = d.get("mem") or {}
        for key, label in (("rss_bytes", "RSS"), ("cuda_allocated_bytes", "GPU allocated"),
                           ("cuda_reserved_bytes", "GPU reserved"), ("cuda_peak_bytes", "GPU peak")):
            if mem.get(key) is not None:
                memory.append({"turn": turn, "measure": label, "MiB": mem[key] / 2**20})
        for key, label in (("kv_session_bytes", "KV this chat"), ("kv_store_bytes", "KV all chats")):
            if d.get(key) is not None:
                memory.append({"turn": turn, "measure": label, "MiB": d[key] / 2**20})
    # numeric dtypes even when empty: an empty frame of objects would make the plot's axes categorical
    return (pd.DataFrame(tokens, columns=["turn", "section", "tokens"]).astype({"turn": "int64", "tokens": "float64"}),
            pd.DataFrame(memory, columns=["turn", "measure", "MiB"]).astype({"turn": "int64", "MiB": "float64"}))


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

    def panel(conv, notes: str = "") -> dict:
        """Every component that shows a conversation, filled from the store."""
        d = last_stats(conv)
        tokens_df, memory_df = plot_frames(conv)
        return {
            conv_state: conv.id,
            chatbot: history_messages(conv),
            conv_list: gr.update(choices=conversation_choices(), value=conv.id),
            stats_md: stats_markdown(d, limits()) + (f"\n\n{notes}" if notes else ""),
            bar: sections_html(d),
            memory_md: summary_markdown(conv),
            fact_dd: gr.update(choices=[(fact_label(f), f.id) for f in conv.facts], value=None),
            # None, not an empty frame, for a chat without turns: after an empty frame the plot
            # would stop drawing lines for later updates in this page (seen in Gradio 6.31)
            tokens_plot: tokens_df if len(tokens_df) else None,
            memory_plot: memory_df if len(memory_df) else None,
        }

    def limits() -> dict:
        engine = runtime.engine
        return {"mem_limit_bytes": engine.limits.mem_limit_bytes} if engine is not None else {}

    def open_conversation(conv_id: str) -> dict:
        try:
            conv = store.get(conv_id) if conv_id else None
        except NotFound:
            conv = None
        if conv is None:
            conv = store.get(store.create_conversation())
        return panel(conv)

    def status_text():
        return f"**llmweb** · {runtime.status}"

    def respond(message, history, conv_id, use_docs):
        chat = chat_or_error()
        try:
            clean_message(message, settings.max_message_chars)  # refuse before creating a conversation
        except LlmwebError as e:
            raise gr.Error(str(e)) from None
        if not conv_id or not _exists(store, conv_id):
            conv_id = store.create_conversation()
        shown = list(history or []) + [{"role": "user", "content": message}, {"role": "assistant", "content": "…"}]
        notes = ""
        try:
            for event in chat.send(conv_id, message, use_docs=bool(use_docs)):
                if isinstance(event, Queued):
                    shown[-1] = {"role": "assistant", "content": f"*Waiting: {event.position} ahead in the queue…*"}
                    yield {chatbot: shown, msg: "", conv_state: conv_id}
                elif isinstance(event, Delta):
                    shown[-1] = {"role": "assistant", "content": event.text}
                    yield {chatbot: shown, msg: "", conv_state: conv_id}
                elif isinstance(event, Finished):
                    notes = " ".join(event.notes)
        except LlmwebError as e:
            raise gr.Error(str(e)) from None
        yield {msg: "", **panel(store.get(conv_id), notes)}

    def after_stop(conv_id, history):
        """After Stop: wait (briefly) for the partial turn to be stored, then show it as stopped."""
        if not conv_id or not _exists(store, conv_id):
            return gr.skip()
        asked = sum(1 for m in history or [] if m.get("role") == "user")
        deadline = time.monotonic() + 5.0
        conv = store.get(conv_id)
        while len(conv.turns) < asked and time.monotonic() < deadline:
            time.sleep(0.1)
            conv = store.get(conv_id)
        return panel(conv, "Stopped.")

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

    def fact_action(conv_id, fact_id, action, text=""):
        chat = chat_or_error()
        try:
            if action == "add":
                chat.add_fact(conv_id, text)
            elif fact_id is None:
                raise gr.Error("Pick a fact first.")
            elif action == "delete":
                chat.delete_fact(int(fact_id))
            else:
                chat.set_fact_pinned(int(fact_id), action == "pin")
        except LlmwebError as e:
            raise gr.Error(str(e)) from None
        return {new_fact: "", **panel(store.get(conv_id))}

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
        created = ""
        try:
            clean_message(message, settings.max_message_chars)  # refuse before creating a conversation
            conv_id = conversation_id if conversation_id and _exists(store, conversation_id) else ""
            if not conv_id:
                conv_id = created = store.create_conversation()
            for event in chat.send(conv_id, message):
                if isinstance(event, Queued):
                    yield ""  # nothing to show yet; lets Gradio notice a client that left while queued
                elif isinstance(event, Delta):
                    yield event.text
                elif isinstance(event, Finished):
                    yield event.reply
        except LlmwebError as e:
            _drop_if_empty(store, created)
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
        status = gr.Markdown(status_text, elem_id="llmweb-status")  # a callable: fresh on every page load
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
                with gr.Accordion("Memory", open=False, elem_id="llmweb-memory-panel"):
                    memory_md = gr.Markdown(elem_id="llmweb-memory")
                    fact_dd = gr.Dropdown(label="Fact", choices=[], elem_id="llmweb-fact")
                    with gr.Row():
                        pin_btn = gr.Button("Pin", size="sm")
                        unpin_btn = gr.Button("Unpin", size="sm")
                        del_fact_btn = gr.Button("Delete", size="sm", variant="stop")
                    with gr.Row():
                        new_fact = gr.Textbox(placeholder="Something to remember, word for word", show_label=False,
                                              scale=3)
                        add_fact_btn = gr.Button("Remember", size="sm", scale=1)
                gr.Markdown("### This chat, turn by turn")
                tokens_plot = gr.LinePlot(x="turn", y="tokens", color="section", height=220,
                                          title="Prompt tokens by section", elem_id="llmweb-tokens-plot")
                memory_plot = gr.LinePlot(x="turn", y="MiB", color="measure", height=220,
                                          title="Memory", elem_id="llmweb-memory-plot")

        shown = [conv_state, chatbot, conv_list, stats_md, bar, memory_md, fact_dd, tokens_plot, memory_plot]
        inputs = [msg, chatbot, conv_state, use_docs]
        ev_submit = msg.submit(respond, inputs, shown + [msg], api_name="respond_enter", api_visibility="private")
        ev_send = send.click(respond, inputs, shown + [msg], api_name="respond")
        stop.click(None, None, None, cancels=[ev_submit, ev_send]).then(
            after_stop, [conv_state, chatbot], shown, api_visibility="private")
        new_btn.click(new_chat, None, shown, api_visibility="private")
        conv_list.input(switch, conv_list, shown, api_visibility="private")
        delete_btn.click(delete_chat, conv_state, shown, api_visibility="private")
        export_md.click(lambda c: export(c, "md"), conv_state, export_md, api_visibility="private")
        export_json.click(lambda c: export(c, "json"), conv_state, export_json, api_visibility="private")
        for button, action in ((pin_btn, "pin"), (unpin_btn, "unpin"), (del_fact_btn, "delete"), (add_fact_btn, "add")):
            button.click(lambda c, f, t, a=action: fact_action(c, f, a, t), [conv_state, fact_dd, new_fact],
                         shown + [new_fact], api_visibility="private")
        timer.tick(lambda: (status_text(), gr.Timer(active=not runtime.ready)), None, [status, timer],
                   api_visibility="private", show_progress="hidden")
        demo.load(switch, conv_state, shown, api_visibility="private")
        demo.load(documents_view, None, [docs_md, remove_dd], api_visibility="private")
        files.upload(upload, files, [docs_md, remove_dd, ingest_md, files], api_visibility="private")
        remove_btn.click(remove_document, remove_dd, [docs_md, remove_dd, ingest_md], api_visibility="private")
        gr.api(api_chat, api_name="chat")
        gr.api(api_stats, api_name="stats")
    return demo


def _drop_if_empty(store, conv_id: str) -> None:
    """Delete a conversation this call created if the message was refused (no turn was stored)."""
    if conv_id and _exists(store, conv_id) and not store.get(conv_id).turns:
        store.delete(conv_id)


def _exists(store, conv_id: str) -> bool:
    try:
        store.get(conv_id)
        return True
    except NotFound:
        return False
