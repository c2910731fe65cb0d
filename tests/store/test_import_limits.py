"""An import is a stranger's file: checked field by field against the export's format
and its caps before anything is written; a hostile or oversized one is refused whole."""

from __future__ import annotations

import json

import pytest

from llmweb.chat.context import SECTIONS
from llmweb.errors import InputError
from llmweb.store import exchange
from llmweb.store.db import Store
from tests.store.test_store import A, _sample

HOSTILE = '"><img src=x onerror=alert(1)>'


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "llmweb.sqlite3")
    yield s
    s.close()


@pytest.fixture
def doc(store):
    return json.loads(store.export_json(A, _sample(store)))


def refused(store, doc, *words: str) -> str:
    """Import `doc`; it must be refused naming `words`, and nothing of A's may change."""
    before = [(c.id, c.n_turns) for c in store.list_conversations(A)]
    with pytest.raises(InputError) as e:
        store.import_json(A, doc if isinstance(doc, str) else json.dumps(doc))
    assert [(c.id, c.n_turns) for c in store.list_conversations(A)] == before
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return str(e.value)


def test_the_section_names_are_the_planners():
    assert exchange.SECTION_NAMES == SECTIONS


def test_an_export_still_imports_whole(store, doc):
    back = store.get(A, store.import_json(A, json.dumps(doc)))
    assert len(back.turns) == 3 and back.turns[0].stats.sections == {"system": 4, "retrieved": 6}


def test_the_model_a_turn_names_imports_as_any_models_folder_name(store, doc):
    """A model's id is a file's stem (capitals, digits, dots, dashes), not a short word; the page
    escapes it (tests/web/test_escaping.py)."""
    doc["turns"][0]["stats"]["model"] = "SmolLM2-135M-Instruct.Q4_1"
    back = store.get(A, store.import_json(A, json.dumps(doc)))
    assert back.turns[0].stats.model == "SmolLM2-135M-Instruct.Q4_1"


def test_the_html_injection_through_a_section_name_is_refused(store, doc):
    """The attack's carrier: a section named with HTML rendered into the 'Last turn' bar."""
    doc["turns"][0]["stats"]["sections"] = {HOSTILE: 5, "system": 4}
    refused(store, doc, "unknown prompt section")


@pytest.mark.parametrize(
    "path,value,word",
    [
        (("turns", 0, "stats", "finish_reason"), HOSTILE, "finish_reason"),
        (("turns", 0, "stats", "turn"), HOSTILE, "turn"),
        (("turns", 0, "stats", "prompt_tokens"), 10**400, "prompt_tokens"),
        (("turns", 0, "stats", "decode_tok_s"), "NaN", "decode_tok_s"),
        (("turns", 0, "stats", "oom_retry"), "yes", "oom_retry"),
        (("turns", 0, "stats", "mem", "rss_bytes"), HOSTILE, "rss_bytes"),
        (("turns", 0, "stats", "mem", HOSTILE), 1, "unknown key"),
        (("turns", 0, "stats", "model"), ["SmolLM2"], "model"),
        (("turns", 0, "stats", "model"), "m" * 256, "model"),
        (("turns", 0, "sources", 0, "n"), HOSTILE, "n"),
        (("turns", 0, "sources", 0, "score"), HOSTILE, "score"),
        (("turns", 0, "sources", 0, "kind"), HOSTILE, "source kind"),
        (("turns", 0, "sources", 0, "page"), "3", "page"),
        (("turns", 0, "user"), 5, "message"),
        (("turns", 0, "created"), "yesterday", "number"),
        (("facts", 0, "pinned"), "yes", "pinned"),
        (("title",), ["a"], "title"),
        (("summarized_upto",), 99, "summarized_upto"),
        (("created",), float("inf"), "number"),
    ],
)
def test_each_field_is_checked_for_its_kind_and_range(store, doc, path, value, word):
    *where, last = path
    node = doc
    for key in where:
        node = node[key]
    node[last] = value
    refused(store, doc, word)


@pytest.mark.parametrize(
    "where",
    [(), ("turns", 0), ("turns", 0, "sources", 0), ("facts", 0), ("settings",)],
)
def test_unknown_keys_are_refused_by_name(store, doc, where):
    node = doc
    for key in where:
        node = node[key]
    node["onerror"] = "alert(1)"
    refused(store, doc, "onerror")


def test_the_caps_are_named_constants_and_refuse_whole(store, doc, monkeypatch):
    monkeypatch.setattr(exchange, "MAX_IMPORT_TURNS", 2)
    refused(store, doc, "turns")
    monkeypatch.undo()
    monkeypatch.setattr(exchange, "MAX_TURN_CHARS", 10)
    refused(store, doc, "over 10 characters")
    monkeypatch.undo()
    monkeypatch.setattr(exchange, "MAX_IMPORT_FACTS", 1)
    refused(store, doc, "facts")
    monkeypatch.undo()
    monkeypatch.setattr(exchange, "MAX_IMPORT_CHARS", 100)
    refused(store, doc, "MB")


def test_a_document_over_the_size_cap_is_refused_before_parsing(store, doc):
    text = json.dumps(doc) + " " * (exchange.MAX_IMPORT_CHARS + 1)
    refused(store, text, "cannot be imported")


def test_versions_are_capped_and_their_bodies_checked(store, doc):
    body = {"turns": [["u", "a", "{}", "[]", 1.0]], "summary": "", "summarized_upto": 0, "facts": [], "nested": []}
    doc["versions"] = [{"fork": 0, "version": 0, "body": body}, {"fork": 0, "version": 1, "body": None}]
    store.import_json(A, json.dumps(doc))  # well formed: imported
    hostile = dict(body, turns=[["u", "a", json.dumps({"sections": {HOSTILE: 1}}), "[]", 1.0]])
    doc["versions"][0]["body"] = hostile
    refused(store, doc, "unknown prompt section")
    doc["versions"][0]["body"] = dict(body, extra=1)
    refused(store, doc, "extra")
    many = [{"fork": 0, "version": i, "body": body} for i in range(exchange.MAX_IMPORT_VERSIONS + 1)]
    doc["versions"] = many + [{"fork": 0, "version": len(many), "body": None}]
    refused(store, doc, "versions")


def test_deep_nesting_is_refused_not_a_crash(store):
    refused(store, "[" * 100_000 + "]" * 100_000, "not an llmweb")
