"""Every text function runs in time linear in its input, on pathological inputs too.

Property-style: each function of `llmweb.bench.hostile.targets()` (plus the API's wire parsing, a
layer bench may not import) is fed each of its `CASES` (long runs without punctuation, many
newlines, deep nesting, long digit runs, mixed scripts, combining marks, long dash runs...) at 1x
and 16x the size, and the ratio of the times is asserted, not the times: linear code shows ~16x,
quadratic ~256x. Best of 3 CPU-time runs per size (`hostile.measure`), measured once more when
over the limit, since this machine is shared. One case runs the old sentence regex of facts.py,
kept here as the reference of what the test catches, and asserts that its ratio is far over.
"""

from __future__ import annotations

import json
import re

import pytest

from llmweb.bench import hostile
from llmweb.bench.hostile import CASES, MAX_RATIO, Target, measure, measure_steady
from llmweb.chat import facts
from llmweb.chat.passages import Excerpt, Passage
from llmweb.records import Source
from llmweb.web import formatting
from llmweb.web.api import chat_wire, common

# facts.py's old sentence regex: a line without an end mark, cut by a newline, made it
# retry every suffix of the line (4,000 characters 0.32 s, 16,000 4.79 s, a 62,000-dash line ~80 s)
OLD_SENTENCE = re.compile(r"[^.!?。！？\n]+(?:[.!?。！？]+|$)")


def _api_messages(text: str) -> object:
    return chat_wire.parse_messages([{"role": "user", "content": [{"type": "text", "text": text}]}], 10**8)


def _passage_html(text: str) -> str:
    source = Source(1, text[:200], 1, text[:200], snippet=text[:240])
    return formatting.passage_html(Passage(source, Excerpt(text), Excerpt(text, 2), Excerpt(text)), source)


API_TARGETS = (  # and the page's: web/ is a layer above bench too
    Target("chat_wire.parse_messages", _api_messages),
    Target("common.parse_json", common.parse_json, lambda t: json.dumps({"messages": t}).encode()),
    Target("formatting.passage_html", _passage_html),
)
PAIRS = list(hostile.pairs(extra=API_TARGETS))


@pytest.mark.parametrize(("case", "target"), PAIRS, ids=[f"{t.name}-{c.name}" for c, t in PAIRS])
def test_time_grows_linearly(case, target):
    timing = measure_steady(case, target)
    assert timing.ratio <= MAX_RATIO, (
        f"{target.name} on {case.name!r}: {timing.seconds_16x * 1000:.1f} ms at {hostile.GROWTH}x "
        f"{timing.chars:,} characters vs {timing.seconds_1x * 1000:.2f} ms at 1x: {timing.ratio:.0f}x"
    )


def test_every_case_reaches_every_text_function():
    names = {t.name for _, t in PAIRS}
    for module, functions in [
        ("facts", ["sentences", "detail_terms", "ground", "extract_facts", "unkept_statements", "is_fact"]),
        ("summary", ["cap_text", "clean_summary"]),
        ("keywords", ["content_words"]),
    ]:
        assert {f"{module}.{f}" for f in functions} <= names
    assert {"documents.parse .html", "documents.parse .docx", "documents.parse .pdf", "documents.parse .md"} <= names
    assert {c.name for c, t in PAIRS if t.name == "facts.sentences"} == {c.name for c in CASES}


def test_the_ratio_catches_quadratic_code():
    """The old facts regex on a long line cut by a newline: the same measurement shows ~256x."""
    case = next(c for c in CASES if c.name == "long line, no end mark, then a newline")
    old = Target("old facts._SENTENCE", OLD_SENTENCE.findall)
    timing = measure(case, old, repeats=1)  # ~256x: one run of each size shows it
    assert timing.ratio > 4 * MAX_RATIO, f"{timing.ratio:.0f}x"
    # and the regex that replaced it finds the same sentences on ordinary text
    text = "Hi there. My name is Bob!\nA line without an end\nLast one? yes"
    assert facts._SENTENCE.findall(text) == OLD_SENTENCE.findall(text)
    assert facts.sentences(case.make(1000)) == [s.strip() for s in OLD_SENTENCE.findall(case.make(1000)) if s.strip()]


def test_api_refuses_json_nested_past_the_recursion_limit():
    with pytest.raises(common.ApiError) as err:
        common.parse_json(b'{"a": ' + b"[" * 100_000)
    assert err.value.status == 400 and "nests JSON arrays or objects too deeply" in err.value.message
