"""GET /v1/x_llmweb/passage (web/api/passages.py): a cited source's passage, for its owner's key only."""

from __future__ import annotations

from tests.conftest import make_settings
from tests.web.api.conftest import body, rig, say


def test_a_cited_passage_opens_for_its_key_only(tmp_path):
    """GET /v1/x_llmweb/passage: alice's upload opens for alice's key by the place a citation gives;
    bob's key gets the same 404 as for a place that does not exist; a recalled turn opens within its
    conversation only."""
    from llmweb.retrieval.library import Library
    from tests.chat.test_passages import LETTER, WordEmbedder

    keys = "alice:key-of-alice,bob:key-of-bob"
    s = make_settings(tmp_path, host="0.0.0.0", api_keys=keys, chunk_tokens=30, chunk_overlap=4)
    r = rig(tmp_path, library=Library(s, WordEmbedder()), host="0.0.0.0", api_keys=keys)
    alice, bob = ({"Authorization": f"Bearer key-of-{who}"} for who in ("alice", "bob"))
    try:
        path = tmp_path / "letter.md"
        path.write_text(LETTER)
        [report] = r.chat.library.ingest_uploads("user:alice", [(path, "rover.md")])
        chunk = r.chat.library.chunks("user:alice", report.doc_id)[2]
        place = {"doc_id": chunk.doc_id, "start": chunk.start, "end": chunk.end}
        got = r.client.get("/v1/x_llmweb/passage", params=place, headers=alice)
        assert got.status_code == 200 and got.json()["text"] == chunk.text and got.json()["before"]["text"]
        theirs = r.client.get("/v1/x_llmweb/passage", params=place, headers=bob)
        nowhere = r.client.get("/v1/x_llmweb/passage", params={**place, "doc_id": "f" * 32}, headers=alice)
        assert theirs.status_code == nowhere.status_code == 404 and theirs.json() == nowhere.json()
        assert "rock samples" not in theirs.text
        for bad_query in ({**place, "start": "-1"}, {"start": 1}, {**place, "kind": "x"}, {**place, "x": 1}):
            assert r.client.get("/v1/x_llmweb/passage", params=bad_query, headers=alice).status_code == 400

        say(r, "Noted")
        conv = r.client.post("/v1/chat/completions", json=body(conversation_id="new"), headers=alice).json()
        recall = {"kind": "recall", "doc_id": "turn-0", "conversation_id": conv["x_llmweb"]["conversation_id"]}
        turn = r.client.get("/v1/x_llmweb/passage", params=recall, headers=alice).json()
        assert turn["text"] == "User: hi\nAssistant: Noted"
        assert r.client.get("/v1/x_llmweb/passage", params=recall, headers=bob).status_code == 404
    finally:
        r.engine.close()
        r.store.close()
