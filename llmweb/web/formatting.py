"""What the web UI shows, as plain values: Markdown, HTML, chat messages and plot tables.

Pure functions from typed records (`TurnStats`, `Source`, the store's `Conversation`) to text
and tables, so they are tested without a browser or a model. This module must not import
gradio, touch the store or the engine, or decide anything: the handlers of web/panels/ (and
web/ui.py for the empty panel) call it and place the results.
"""

from __future__ import annotations

import html
import inspect
import re
from collections.abc import Sequence

from llmweb.chat.passages import Passage
from llmweb.engine.telemetry import mib
from llmweb.records import ENGINE_STOPPED, Source, TurnStats
from llmweb.store.models import HIT_END, HIT_START

SECTION_COLOURS = {
    "system": "#6b7280",
    "memory": "#d946ef",
    "summary": "#8b5cf6",
    "facts": "#ec4899",
    "history": "#3b82f6",
    "recall": "#06b6d4",
    "retrieved": "#f59e0b",
    "user": "#10b981",
    "reserve": "#e5e7eb",
}
NEAR = 0.9  # warn when a turn uses this share of the context or of the memory limit
NO_TURNS = "*No turns yet. Ask something.*"
STOPPED = "\n\n*(stopped)*"
CUT_OFF = "\n\n*(cut off: the model process stopped; press retry)*"
SOURCES_HINT = "*Click a source to read it in its document.*"  # atop a Sources message

_MD_LEAD = re.compile(r"^\s*(#{1,6}\s+|[>*+-]\s+|\d+[.)]\s+)+")
_SCHEME = re.compile(r"(?i)\b(javascript|vbscript|data|file)(\s*):")
_LINKS = re.compile(r"\](?=[(:])")


def escape(value: object, *, inline: bool = False, message: bool = False) -> str:
    """The one escape of everything the page shows that it did not write itself: user and model
    text, imported fields, file names, error sentences.

    By default `& < > "` become entities (safe as element text and inside attributes, which llmweb
    always writes in double quotes, in gr.HTML, SVG and Markdown alike; an apostrophe stays one);
    `[` becomes `&#91;`, so Markdown makes no link or image of it (a reply cannot make the browser
    fetch a URL, nor show a disguised link); a `javascript:`-like scheme gets a zero-width space
    before its colon. `inline=True` is for one line inside Markdown (a table cell, a list item, a
    sentence): whitespace runs become one space and `|` an entity, so the value cannot start a
    block (a fence, a heading) or a table cell.

    `message=True` is for a chat message, Markdown the Chatbot renders (see `_message`): prose gets
    a zero-width space after every `<` (no tag, comment or autolink starts with it) and between `]`
    and `(` or `:` (no link, image or link definition, so no `javascript:` link either); a fenced
    code block the renderer certainly shows as code is left as written (a copied sample has no
    hidden characters). `message_text` takes the spaces out again."""
    text = str(value)
    if message:
        return _message(text)
    if inline:
        text = " ".join(text.split())
    text = html.escape(text, quote=False).replace('"', "&quot;").replace("[", "&#91;")
    if inline:
        text = text.replace("|", "&#124;")
    return _SCHEME.sub("\\1\\2\u200b:", text)


def _guard(prose: str) -> str:
    """Message prose: a zero-width space after every `<` and between `]` and `(` or `:`."""
    return _LINKS.sub("]\u200b", prose.replace("<", "<\u200b"))


# -- chat messages, as Gradio 6.31's Chatbot renders them ------------------------------------------
# The Chatbot's Python side passes a message through `inspect.cleandoc` (tabs become spaces, the common
# indent of lines 2+ goes, leading and trailing blank lines go); its renderer
# (gradio/templates/frontend/assets/markdown-code-*.js) then turns every `$$...$$` (latex_delimiters,
# LATEX_DELIMITERS here) into a placeholder, lexes the rest with marked (GFM, v12's block rules), puts
# the spans back HTML-escaped and sanitises the HTML with amuchina, which keeps <img src>, <form> and
# <a href>. So the guard does the same cleandoc, and finds the lines marked shows as fenced code on
# the text as marked lexes it (a span may hide fence lines), by marked's rules, not CommonMark's: a fence
# opens with 3+ backticks (no backtick after them on the line) or 3+ tildes, at most 3 spaces in; it
# closes at the first line of at most 3 spaces, the opening run, then only backticks, tildes and spaces
# ("```~" closes "```"), else at the end of the text; lines end at "\n" alone (after \r\n and \r
# became \n), never at U+2028 or a form feed. Gradio adds a block rule of its own: "```mermaid" at the
# start of a block is a diagram whose text goes into the page as HTML, up to the first "```" anywhere;
# the guard breaks every "```mermaid" (a zero-width space after it), so it shows as a code block.
# Anything whose reading depends on the blocks around it is guarded: fence lines themselves (an info
# string is prose when the line turns out a paragraph's), and, after a list or quote, an indented fence
# and everything after it (it may be a list item's, which marked reads by the item's indent).
# tests/web/test_renderer.py renders these cases in the real Chatbot.

LATEX_DELIMITERS = ({"left": "$$", "right": "$$", "display": True},)  # ui.py gives the Chatbot these
_LATEX = re.compile(r"\$\$[\s\S]+?\$\$")  # the renderer's own pattern for "$$" ... "$$"
_MERMAID = "```mermaid"
_FENCE = re.compile(r"( {0,3})(`{3,}(?=[^`]*$)|~{3,})(.*)")  # an opening fence line
_CONTAINER = re.compile(r"[ \t]*(?:>|(?:[*+-]|\d{1,9}[.)])(?:[ \t]|$))")  # a quote or a list item starts
_PROSE, _CODE, _FENCE_LINE = 0, 1, 2


def _message(text: str) -> str:
    """A chat message, guarded for the Chatbot's renderer (see above)."""
    text = inspect.cleandoc(text.replace("\r\n", "\n").replace("\r", "\n"))  # as Gradio's Chatbot does
    lines: list[list[tuple[str, bool]]] = [[]]  # the lines marked lexes, as (original text, is a $$ span)
    at = 0
    for m in _LATEX.finditer(text):
        _add_lines(lines, text[at : m.start()])
        lines[-1].append((m.group(), True))
        at = m.end()
    _add_lines(lines, text[at:])
    view = ["".join("%" if is_span else part for part, is_span in line) for line in lines]
    out = [
        "".join(part if kind == _CODE and not is_span else _guard(part) for part, is_span in line)
        for kind, line in zip(_line_kinds(view), lines, strict=True)
    ]
    return "\n".join(out).replace(_MERMAID, _MERMAID + "\u200b")


def _add_lines(lines: list[list[tuple[str, bool]]], text: str) -> None:
    first, *rest = text.split("\n")
    if first:
        lines[-1].append((first, False))
    lines += [[(piece, False)] if piece else [] for piece in rest]


def _line_kinds(lines: list[str]) -> list[int]:
    """Each line (as marked lexes it) is prose, code or a fence line, in one pass (see above)."""
    kinds, fence, all_guarded, container = [], "", False, False
    for line in lines:
        if fence:
            rest = line.lstrip(" ")
            closes = len(line) - len(rest) <= 3 and rest.startswith(fence)
            closes = closes and not rest[len(fence) :].rstrip(" ").strip("`~")
            kinds.append(_FENCE_LINE if closes else _CODE)
            fence = "" if closes else fence
            continue
        opening = _FENCE.fullmatch(line)
        if opening and not all_guarded:
            if opening[1] and container:  # may be a list item's fence: its extent is the item's
                all_guarded = True
            else:
                fence = opening[2]
            kinds.append(_FENCE_LINE)
            continue
        container = container or bool(_CONTAINER.match(line))
        kinds.append(_PROSE)
    return kinds


def warnings(s: TurnStats, mem_limit_bytes: int = 0) -> list[str]:
    """Plain-words warnings for a turn that came near the token budget or the memory limit."""
    out = []
    used = s.gen.prompt_tokens + s.sections.get("reserve", 0)
    if s.context_limit and used >= NEAR * s.context_limit:
        out.append(
            f"⚠️ This turn used {used:,} of {s.context_limit:,} context tokens; older turns will be "
            "summarised or left out."
        )
    if s.dropped_turns:
        out.append(f"⚠️ {s.dropped_turns} older turns did not fit and were left out.")
    peak = s.mem.peak_rss_bytes or s.mem.rss_bytes
    if mem_limit_bytes and peak >= NEAR * mem_limit_bytes:
        out.append(f"⚠️ Memory is near its limit: {mib(peak)} of {mib(mem_limit_bytes)}.")
    return out


def stats_markdown(s: TurnStats | None, mem_limit_bytes: int = 0) -> str:
    """The last turn's figures in plain words."""
    if s is None:
        return NO_TURNS
    g, mem = s.gen, s.mem
    lines = [
        f"**Turn {s.turn}** · {escape(g.finish_reason, inline=True)}"
        + (f" · {escape(s.model, inline=True)}" if s.model else ""),
        f"- prompt **{g.prompt_tokens:,}** tokens: "
        + (
            f"reused {g.reused_tokens:,} of {g.prompt_tokens:,} from this chat's cache, "
            f"prefilled {g.prefilled_tokens:,}"
            if g.reuse_reported
            else "the engine server did not report how many it served from its prefix cache"
        ),
        f"- generated **{g.generated_tokens:,}** tokens at {g.decode_tok_s:.1f} tok/s, "
        + ("alone" if g.batch_size <= 1 else f"in a batch of up to {g.batch_size} requests"),
        f"- first token after {g.ttft_s:.2f} s (queued {g.queue_wait_s:.2f} s); total {g.total_s:.1f} s",
    ]
    if mem.on_cuda:
        lines.append(
            f"- GPU: allocated {mib(mem.cuda_allocated_bytes)}, reserved {mib(mem.cuda_reserved_bytes)}, "
            # the device's peak is reset when a request starts on an empty batch: in a batch it is the batch's
            f"{'peak' if g.batch_size <= 1 else 'batch peak'} {mib(mem.cuda_peak_bytes)}"
        )
    lines.append(f"- RSS {mib(mem.rss_bytes)} (peak this turn {mib(mem.peak_rss_bytes)})")
    if g.kv_session_bytes or g.kv_store_bytes or g.reuse_reported:  # a remote engine's KV is the server's
        lines.append(f"- KV cache: this chat {mib(g.kv_session_bytes)}, all chats {mib(g.kv_store_bytes)}")
    if s.dropped_turns or s.summarized_turns:
        lines.append(f"- history: {s.summarized_turns} turns summarised, {s.dropped_turns} left out")
    if g.oom_retry:
        lines.append("- ran out of memory once; answered with a smaller prompt")
    if g.loop_cuts:
        ended = "; then it ended the reply, which kept looping" if g.loop_stopped else ""
        lines.append(f"- loop guard: turned the reply away from a third copy of a sentence {g.loop_cuts}x{ended}")
    if s.document:
        lines.append(document_line(s.document))
    return "\n".join(lines + [""] + warnings(s, mem_limit_bytes))


def document_line(d: dict) -> str:
    """A whole-document task's work, in the stats panel (TurnStats.document)."""
    try:
        pct = round(float(d.get("coverage", 0)) * 100)
        return (
            f"- whole document: read {int(d.get('read', 0)):,} of {int(d.get('pieces', 0)):,} sections "
            f"({pct}% of the text, {int(d.get('tokens_read', 0)):,} tokens; {int(d.get('from_cache', 0)):,} from "
            f"the cache), fold depth {int(d.get('fold_depth', 0))}, {int(d.get('steps', 0))} model steps, "
            f"{float(d.get('seconds', 0)):.1f} s"
        )
    except (TypeError, ValueError):  # an imported chat's figures are data, not trusted numbers
        return "- whole document: its figures could not be read"


def sections_html(s: TurnStats | None) -> str:
    """A stacked bar of prompt tokens per section against the context limit."""
    if s is None or not s.sections or not s.context_limit:
        return ""
    limit = s.context_limit
    bars, legend = [], []
    for name, n in s.sections.items():
        if n <= 0:
            continue
        pct = 100 * n / limit
        colour, label = SECTION_COLOURS.get(name, "#9ca3af"), escape(name)
        bars.append(f'<div title="{label}: {n} tokens" style="width:{pct:.2f}%;background:{colour}"></div>')
        legend.append(f'<span><i style="background:{colour}"></i>{label} {n:,} ({pct:.0f}%)</span>')
    free = max(limit - sum(s.sections.values()), 0)
    legend.append(f"<span>free {free:,} of {limit:,}</span>")
    return f'<div class="llmweb-bar">{"".join(bars)}</div><div class="llmweb-legend">{"".join(legend)}</div>'


def sources_message(sources: Sequence[Source]) -> dict | None:
    """The collapsible "Sources (n)" chat message under an answer, or None without sources."""
    if not sources:
        return None
    lines = []
    for s in sources:
        snippet = _MD_LEAD.sub("", s.snippet)  # a chunk may start with "# Heading": not a heading here
        lines.append(
            f"**[{escape(s.n)}] {escape(s.label(), inline=True)}** · score {float(s.score):.2f}\n"
            f"> {escape(snippet, inline=True)}"
        )
    return {
        "role": "assistant",
        "content": "\n\n".join([SOURCES_HINT] + lines),
        "metadata": {"title": f"Sources ({len(sources)})", "status": "done"},
    }


def source_choices(idx: int, sources: Sequence[Source]) -> list[tuple[str, str]]:
    """A turn's sources as (label, value) choices for the source panel: "[1] guide.pdf, p. 3"; the
    value "idx:n" (turn index, source number) says which one to open."""
    return [(f"[{s.n}] {s.label()}", f"{idx}:{s.n}") for s in sources]


def sources_turn(conv, index: int, first: int = 0) -> int | None:
    """The turn (its `idx`) whose Sources message is message `index` of `history_messages(conv,
    first)`, or None when that message is another kind (a question, an answer, the note on the
    turns not shown) or not there."""
    at = 1 if first else 0  # the note on the turns before `first`
    for t in conv.turns[first:]:
        at += 2  # the question and the answer
        if t.sources:
            if at == index:
                return t.idx
            at += 1
        if at > index:
            return None
    return None


def passage_html(passage: Passage | None, source: Source) -> str:
    """An opened source (chat/passages.py) for the source panel: its name, page and heading, the
    document's text just before it (subdued), the passage the model was given (marked), the text
    just after it; or, when it cannot be found, a sentence saying so. Every text is escaped."""
    where = "".join(f" · {escape(w)}" for w in _where(source.page, source.heading))
    head = f'<div class="llmweb-passage-head"><strong>[{int(source.n)}] {escape(source.source)}</strong>{where}</div>'
    if passage is None:
        why = (
            "This earlier turn is not in this chat any more (it was undone, or edited into another version)."
            if source.kind == "recall"
            else "This passage is not available: its document is not in your library any more, or has "
            "changed since this answer."
        )
        return f'<div class="llmweb-passage">{head}<p class="llmweb-missing"><em>{why}</em></p></div>'
    parts = [head]
    if passage.by_words:
        parts.append(
            '<p class="llmweb-note"><em>Found by its name and first words: this answer was stored before '
            "llmweb kept where each source is.</em></p>"
        )
    cited = passage.cited
    for excerpt, kind in ((passage.before, "before"), (cited, "cited"), (passage.after, "after")):
        if excerpt is None:
            continue
        elsewhere = (excerpt.page, excerpt.heading) != (cited.page, cited.heading)
        tag = " · ".join(escape(w) for w in _where(excerpt.page, excerpt.heading)) if elsewhere else ""
        label = f'<small class="llmweb-where">{tag}</small>' if tag else ""
        parts.append(f'<div class="llmweb-{kind}">{label}<div class="llmweb-text">{escape(excerpt.text)}</div></div>')
    return f'<div class="llmweb-passage">{"".join(parts)}</div>'


def _where(page: int | None, heading: str | None) -> list[str]:
    return ([f"p. {int(page)}"] if page else []) + ([heading] if heading else [])


def history_messages(conv, first: int | None = None) -> list[dict]:
    """A stored conversation as Chatbot messages: user, assistant (marked when stopped), sources;
    from turn `first` on, after a note that says how many turns are not shown (`hidden_turns`
    reads it back). `first` None: the last SHOWN_TURNS turns; 0: the whole chat.

    Why a window: Gradio's Chatbot renders every message it holds again at each streamed update,
    so the browser's work per update grows with the chat (a 100-turn chat shown whole took the browser
    1.69-2.41 CPU s a reply, 0.94-1.09 with 30 turns: docs/benchmarks.md), and on a machine it shares with the
    engine that slows the reply itself. The note is a message: a click on it shows the whole chat."""
    turns = conv.turns
    first = max(len(turns) - SHOWN_TURNS, 0) if first is None else min(max(first, 0), len(turns))
    out: list[dict] = [earlier_note(first)] if first else []
    versions = getattr(conv, "versions", {})
    for t in turns[first:]:
        stopped = t.stats is not None and t.stats.stopped
        mark = CUT_OFF if stopped and t.stats.gen.finish_reason == ENGINE_STOPPED else STOPPED
        marker = f"\n\n{version_marker(*versions[t.idx])}" if t.idx in versions else ""
        out.append({"role": "user", "content": escape(t.user, message=True) + marker})
        reply = escape(t.assistant or "", message=True) + (mark if stopped else "")
        out.append({"role": "assistant", "content": reply or "*(no reply)*"})
        src = sources_message(t.sources)
        if src:
            out.append(src)
    return out


SHOWN_TURNS = 30  # the chat's last turns the page shows (`history_messages`)
_EARLIER = "earlier turns of this chat are not shown here"
_EARLIER_NOTE = re.compile(r"^\*(\d{1,9}) " + _EARLIER)  # a count a stranger sends back stays small


def earlier_note(n: int) -> dict:
    """The first message of a chat shown from its turn `n` on."""
    return {
        "role": "assistant",
        "content": f"*{n} {_EARLIER}, to keep the page quick while a reply streams. Click this note to show them.*",
    }


def hidden_turns(messages) -> int:
    """How many turns the chat as a page shows it (`history_messages`) leaves out: the number in its
    note, 0 without one. Only the first message can be the note (a chat's first turn is a question)."""
    first = messages[0] if messages else None
    content = first.get("content") if isinstance(first, dict) and first.get("role") == "assistant" else None
    if isinstance(content, list):  # as the page sends it back: [{"type": "text", "text": ...}]
        content = next((p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"), None)
    match = _EARLIER_NOTE.match(content) if isinstance(content, str) else None
    return int(match.group(1)) if match else 0


def message_text(shown: str) -> str:
    """What the visitor wrote, back from a message the page shows (`history_messages` escaped it
    with `escape(..., message=True)`): the edit control hands the shown text back."""
    text = VERSION_MARKER.sub("", shown)
    return text.replace("<\u200b", "<").replace("]\u200b", "]").replace(_MERMAID + "\u200b", _MERMAID)


def version_marker(active: int, count: int) -> str:
    """The switcher's text on a message that has versions: "‹ 2/3 ›" (1-based)."""
    return f"‹ {active + 1}/{count} ›"


VERSION_MARKER = re.compile(r"\n\n‹ \d+/\d+ ›\s*$")  # what `history_messages` appends to a forked message


def version_choices(versions: dict[int, tuple[int, int]]) -> list[tuple[str, int]]:
    """The forks of a chat as (label, turn index) choices: "Turn 2 ‹ 2/3 ›"."""
    return [(f"Turn {fork + 1} {version_marker(*group)}", fork) for fork, group in sorted(versions.items())]


MAX_TURN_CHOICES = 500  # turns the "what the model sees" picker lists: the newest


def turn_choices(conv) -> list[tuple[str, int]]:
    """The picker of turns to keep in context or leave out: "12. 📌 first words", newest first."""
    marks = {"pin": "📌 ", "out": "⊘ "}
    return [
        (f"{t.idx + 1}. {marks.get(t.view, '')}{t.user if len(t.user) <= 50 else t.user[:47] + '…'}", t.idx)
        for t in reversed(conv.turns[-MAX_TURN_CHOICES:])
    ]


def fact_label(f) -> str:
    return ("📌 " if f.pinned else "") + (f.text if len(f.text) <= 60 else f.text[:57] + "…")


def summary_markdown(conv) -> str:
    parts = [
        f"**Summary of the first {conv.summarized_upto} turns:** {escape(conv.summary, inline=True)}"
        if conv.summary
        else "*No summary yet: the whole conversation still fits in the window.*"
    ]
    if conv.continues is not None:
        parts.insert(0, f"*This chat continues “{escape(conv.continues[1], inline=True)}” (in your chat list).*")
    if conv.facts:
        parts.append("**Facts you stated** (kept word for word; 📌 = pinned, never dropped):")
        parts += [f"- {'📌 ' if f.pinned else ''}{escape(f.text, inline=True)}" for f in conv.facts]
    else:
        parts.append(
            "*No facts kept yet. Facts you state are kept when their turn leaves the window; "
            "add one below to keep it now.*"
        )
    return "\n".join(parts)


def memories_markdown(memories) -> str:
    """What the owner asked all their chats to remember (store/memories.py), ⏸ for those turned off."""
    if not memories:
        return (
            "*Nothing yet. Add something below, or pick a fact of this chat under Memory and press "
            "“Remember in all my chats”.*"
        )
    return "\n".join(f"- {'⏸ ' if not m.enabled else ''}{escape(m.text, inline=True)}" for m in memories)


def memory_choices(memories) -> list[tuple[str, int]]:
    return [
        (("⏸ " if not m.enabled else "") + (m.text if len(m.text) <= 60 else m.text[:57] + "…"), m.id) for m in memories
    ]


def documents_markdown(docs) -> str:
    """The documents a visitor's questions search (`LibraryDocument`), saying which are theirs."""
    if not docs:
        return "*No documents yet. Add .txt, .md, .pdf, .html or .docx files above.*"
    rows = ["| document | chunks | whose |", "|---|---:|---|"] + [
        f"| {escape(d.source, inline=True)} | {d.chunks} | {'yours (private)' if d.scope == 'yours' else 'shared'} |"
        for d in docs
    ]
    return "\n".join(rows)


def model_label(entry) -> str:
    """A model in the picker (plain text): its id, size and trained context."""
    size = f"{entry.size_bytes / 2**30:.1f} GB" if entry.size_bytes >= 2**30 else f"{entry.size_bytes / 2**20:,.0f} MB"
    context = f" · {entry.context_train:,} ctx" if entry.context_train else ""
    return f"{entry.id} · {size}{context}"


def scope_label(doc) -> str:
    """A document in the picker of a chat's documents (a plain-text label: the dropdown shows it as text)."""
    return f"{doc.source} ({doc.scope})"


def ingest_markdown(reports) -> str:
    """One line per uploaded file (`IngestReport`): ✅ added, or ⚠️ and why not."""
    return "\n\n".join(("✅ " if r.ok else "⚠️ ") + escape(r.describe(), inline=True) for r in reports)


_MEMORY_MEASURES = (
    ("rss_bytes", "RSS"),
    ("cuda_allocated_bytes", "GPU allocated"),
    ("cuda_reserved_bytes", "GPU reserved"),
    ("cuda_peak_bytes", "GPU peak"),
)
_KV_MEASURES = (("kv_session_bytes", "KV this chat"), ("kv_store_bytes", "KV all chats"))


def plot_frames(conv):
    """Two long-format tables for the session plots: tokens per section and memory (MiB), per turn."""
    import pandas as pd

    tokens, memory = [], []
    for t in conv.turns:
        s, turn = t.stats, t.idx + 1
        if s is None:
            continue
        tokens += [{"turn": turn, "section": name, "tokens": n} for name, n in s.sections.items() if name != "reserve"]
        if s.gen.mem is not None:
            memory += [
                {"turn": turn, "measure": label, "MiB": getattr(s.mem, key) / 2**20}
                for key, label in _MEMORY_MEASURES
                if getattr(s.mem, key) is not None
            ]
        memory += [{"turn": turn, "measure": label, "MiB": getattr(s.gen, key) / 2**20} for key, label in _KV_MEASURES]
    # numeric dtypes even when empty: an empty frame of objects would make the plot's axes categorical
    return (
        pd.DataFrame(tokens, columns=["turn", "section", "tokens"]).astype({"turn": "int64", "tokens": "float64"}),
        pd.DataFrame(memory, columns=["turn", "measure", "MiB"]).astype({"turn": "int64", "MiB": "float64"}),
    )


_SERIES_COLOURS = ("#3b82f6", "#ef4444", "#10b981", "#f59e0b", "#8b5cf6", "#06b6d4", "#ec4899", "#6b7280")
NO_PLOT = '<div class="llmweb-plot"><em>No turns yet.</em></div>'


def line_chart_html(frame, y: str, series: str, title: str, colours: dict[str, str] | None = None) -> str:
    """A small SVG line chart of `frame` (long format: "turn", `series`, `y`) for the session panel.

    Drawn here rather than by Gradio's LinePlot, which labels a one-turn axis with fractions
    ("1.000000") and draws a line only from two points: here the x ticks are whole turns and every
    value is a dot (with a hover title), joined by a line once a series has two turns."""
    if frame is None or not len(frame):
        return NO_PLOT
    w, h, left, right, top, bottom = 360, 190, 46, 10, 8, 26
    turns = sorted({int(t) for t in frame["turn"]})
    lo, hi = turns[0], turns[-1]
    y_max = max(float(frame[y].max()), 1e-9) * 1.1

    def px(turn: int) -> float:
        return left + (w - left - right) * (0.5 if hi == lo else (turn - lo) / (hi - lo))

    def py(value: float) -> float:
        return top + (h - top - bottom) * (1 - float(value) / y_max)

    parts = [
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="#9ca3af"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#9ca3af"/>',
    ]
    step = max(1, -(-len(range(lo, hi + 1)) // 8))  # at most ~8 whole-turn ticks
    for turn in range(lo, hi + 1, step):
        x = px(turn)
        parts.append(
            f'<text x="{x:.1f}" y="{h - bottom + 15}" font-size="11" text-anchor="middle" '
            f'class="llmweb-x-tick">{turn}</text>'
        )
    y_format = ",.0f" if y_max >= 10 else ".1f"
    for i in range(5):
        value = y_max * i / 4
        parts.append(
            f'<text x="{left - 4}" y="{py(value) + 4:.1f}" font-size="10" text-anchor="end">{value:{y_format}}</text>'
        )
    legend = []
    for n, (name, rows) in enumerate(frame.sort_values("turn").groupby(series, sort=False)):
        colour = (colours or {}).get(name) or _SERIES_COLOURS[n % len(_SERIES_COLOURS)]
        label = escape(name)
        points = [(px(int(t)), py(v), int(t), float(v)) for t, v in zip(rows["turn"], rows[y])]
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{yy:.1f}" for x, yy, _, _ in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts += [
            f'<circle cx="{x:.1f}" cy="{yy:.1f}" r="3" fill="{colour}" class="llmweb-point">'
            f"<title>{label}, turn {t}: {v:,.1f}</title></circle>"
            for x, yy, t, v in points
        ]
        legend.append(f'<span><i style="background:{colour}"></i>{label}</span>')
    svg = (
        f'<svg viewBox="0 0 {w} {h}" width="100%" role="img" aria-label="{escape(title)} by turn">'
        + "".join(parts)
        + "</svg>"
    )
    return (
        f'<div class="llmweb-plot"><div><strong>{escape(title)}</strong> '
        f'<small>({escape(y)} by turn)</small></div>{svg}<div class="llmweb-legend">{"".join(legend)}</div></div>'
    )


def search_choices(hits) -> list[tuple[str, str]]:
    """Search results (`SearchHit`) as (label, value) choices: "title · turn N: …snippet…", with the
    matched words in «guillemets»; the value "conversation_id:idx" says where to jump."""
    out = []
    for h in hits:
        snippet = " ".join(h.snippet.split()).replace(HIT_START, "«").replace(HIT_END, "»")
        out.append((f"{h.title} · turn {h.idx + 1}: {snippet}", f"{h.conversation_id}:{h.idx}"))
    return out
