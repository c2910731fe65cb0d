"""A chat's chosen documents, the pure parts: the stored shape and its checks, the API's
`x_llmweb.documents`, the keyword index's rowid filter, and a chat's choice kept, exported and
imported. The real-embedder tests are tests/retrieval/test_scope.py, the real-model ones
tests/chat/test_scope_model.py."""

from __future__ import annotations

import json

import pytest

from llmweb.chat import scope
from llmweb.errors import InputError
from llmweb.records import MAX_CHAT_DOCUMENTS
from llmweb.retrieval.keywords import KeywordIndex
from llmweb.store.db import Store
from llmweb.store.models import ChatSettings
from llmweb.web.api.chat_wire import parse_request
from llmweb.web.api.errors import ApiError

PAIR = ("d" * 16, "hours-2024.txt")


def test_chosen_documents_are_stored_as_id_name_pairs_and_checked():
    s = ChatSettings.from_dict({"documents": [list(PAIR)]})
    assert s.documents == (PAIR,) and json.loads(json.dumps(s.to_dict())) == {"documents": [list(PAIR)]}
    for bad in ([], "hours.txt", [["only-an-id"]], [[1, "x"]], [["", "x"]], [["x" * 200, "n"]], [list(PAIR)] * 101):
        with pytest.raises(ValueError, match="documents|chosen document"):
            ChatSettings.from_dict({"documents": bad})


def test_x_llmweb_documents_is_a_list_of_names():
    def parse(**ours):
        body = {"model": "llmweb", "messages": [{"role": "user", "content": "hi"}], "x_llmweb": ours}
        return parse_request(body, ["llmweb"], 1000)

    assert parse().documents is None
    assert parse(documents=["a.txt", "b"]).documents == ("a.txt", "b")
    assert parse(documents=[]).documents == ()
    for bad in ("a.txt", [""], [3], ["x" * 2000], ["a"] * (MAX_CHAT_DOCUMENTS + 1)):
        with pytest.raises(ApiError) as e:
            parse(documents=bad)
        assert e.value.status == 400 and e.value.param == "x_llmweb.documents"


def test_the_keyword_index_ranks_only_the_chosen_rows():
    index = KeywordIndex.build([(1, "harbor office opens at eight"), (2, "harbor office"), (3, "a ferry")], 1)
    assert [h.chunk_id for h in index.search("harbor office opens", 5)] == [1, 2]
    assert [h.chunk_id for h in index.search("harbor office opens", 5, only=[2, 3])] == [2]
    assert index.search("harbor office", 5, only=[]) == []
    with pytest.raises(ValueError):
        index.search("harbor", 5, only=["1); DROP TABLE chunks; --"])


class Names:
    """`Library.resolve` and `scope` over a fixed listing (the real library: tests/retrieval/test_scope.py)."""

    def __init__(self, docs: dict[str, str]):
        self.docs = docs  # id -> name

    def resolve(self, owner, wanted):
        out = []
        for w in wanted:
            found = [(i, n) for i, n in self.docs.items() if w in (i, n)]
            if not found:
                raise InputError(f"There is no document {w!r} in your library.")
            out += found
        return tuple(out)

    def scope(self, owner, chosen):
        return frozenset(i for i, n in chosen if i in self.docs)


def test_a_choice_is_kept_with_the_chat_and_files_added_join_it(tmp_path):
    store, library = Store(tmp_path / "s.sqlite3"), Names({"id-a": "a.txt", "id-b": "b.txt", "id-c": "c.txt"})
    conv = store.create_conversation("me")
    assert scope.add(store, library, "me", conv, ["id-c"]) is False, "a chat that reads everything stays so"
    scope.choose(store, library, "me", conv, ["a.txt"])
    assert store.get("me", conv).settings == ChatSettings(documents=(("id-a", "a.txt"),))
    assert scope.add(store, library, "me", conv, ["id-c"]) is True
    assert store.get("me", conv).settings.documents == (("id-a", "a.txt"), ("id-c", "c.txt"))
    with pytest.raises(InputError):
        scope.choose(store, library, "me", conv, ["nope.txt"])
    assert store.get("me", conv).settings.documents == (("id-a", "a.txt"), ("id-c", "c.txt")), "nothing changed"
    scope.choose(store, library, "me", conv, [])
    assert store.get("me", conv).settings == ChatSettings(use_docs=False), "[]: none at all"
    scope.choose(store, library, "me", conv, None)
    assert store.get("me", conv).settings == ChatSettings(), "None: every document again"

    scope.choose(store, library, "me", conv, ["b.txt"])
    copy = store.import_json("you", store.export_json("me", conv))
    assert store.get("you", copy).settings.documents == (("id-b", "b.txt"),), "the export carries the choice"
    assert "'b.txt'" in store.export_markdown("me", conv)
    store.close()
