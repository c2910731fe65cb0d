"""`bench peer`: its pure parts (the summary, the table, the questions), and one real run of both
servers, `python -m llmweb serve` and llama.cpp's `llama-server`, with 2 chats at once. The run's
figures are printed, not asserted (docs/benchmarks.md "Against llama-server"); what must hold is
that both answered every request in full through their APIs, on the same file and threads."""

from __future__ import annotations

import os

import pytest

from llmweb.bench import peer
from llmweb.bench.common import llama_tool
from llmweb.config import Settings
from llmweb.errors import ConfigError


def row(k: int, server: str, repeat: int, tok_s: float) -> dict:
    return {
        "concurrency": k,
        "server": server,
        "repeat": repeat,
        "generated_tokens": 128 * k,
        "shortest_reply": 128,
        "prompt_tokens": 50,
        "wall_s": 128 * k / tok_s,
        "aggregate_tok_s": tok_s,
    }


def test_the_summary_holds_ours_to_llama_servers_medians_per_k():
    rows = [row(4, "llmweb", r, t) for r, t in ((1, 90), (2, 100), (3, 140))]
    rows += [row(4, "llama-server", r, t) for r, t in ((1, 100), (2, 125), (3, 120))]
    rows += [row(1, "llmweb", 1, 60), row(1, "llama-server", 1, 80)]
    summary = {s["concurrency"]: s for s in peer.summarize(rows)}
    assert summary[4] == {"concurrency": 4, "llmweb_tok_s": 100, "llama_server_tok_s": 120, "ours_vs_peer": 0.83}
    assert summary[1]["ours_vs_peer"] == 0.75
    table = peer.markdown(
        {
            "model_file": "m.gguf",
            "threads": 2,
            "new_tokens": 128,
            "repeats": 3,
            "rows": rows,
            "summary": list(summary.values()),
        }
    )
    assert "| 4 | 100.0 | 120.0 | 0.83 |" in table and "| 4 | llama-server | 2 | 512 |" in table


def test_each_repeat_asks_new_questions_and_each_chat_its_own():
    first, second = peer.questions(4, 0), peer.questions(4, 1)
    assert len(set(first)) == 4 and not set(first) & set(second), "a round could be answered from the last one's cache"


def test_it_compares_only_the_embedded_file(monkeypatch):
    monkeypatch.setenv("LLMWEB_LLAMA_SERVER", "/bin/true")
    with pytest.raises(ConfigError, match="LLMWEB_MODEL"):
        peer.run(Settings(model="/elsewhere/model.gguf"))


@pytest.mark.slow
@pytest.mark.skipif(not llama_tool("llama-server"), reason="no llama-server (LLMWEB_LLAMA_SERVER or the PATH)")
def test_both_servers_answer_two_chats_at_once_in_full(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMWEB_GGUF_REQUANT", raising=False)
    result = peer.run(
        Settings(data_dir=tmp_path, threads=int(os.environ.get("LLMWEB_THREADS", "0"))),
        concurrencies=(2,),
        new_tokens=24,
        repeats=1,
    )
    by_server = {r["server"]: r for r in result["rows"]}
    assert set(by_server) == {"llmweb", "llama-server"}
    for server, r in by_server.items():
        assert r["generated_tokens"] == 2 * 24 and r["shortest_reply"] == 24, (server, r)
        assert r["prompt_tokens"] > 10 and r["aggregate_tok_s"] > 0, (server, r)
    print(peer.markdown(result))
