"""`bench router`: its pure parts (the summary: reuse counted on turns 2+ only, p95 TTFT, failed
turns; the table; the refusals), and one tiny real run through the command line: one replica
behind vLLM's router and one llama-server, 2 chats x 2 turns. Its figures are printed, not
asserted (timings are for the full run on a quiet machine, docs/scaling.md)."""

from __future__ import annotations

import json
import os

import pytest

from llmweb.bench import router
from llmweb.bench.common import llama_tool
from llmweb.errors import ConfigError
from tests.conftest import make_settings


def row(chat: int, turn: int, prompt: int, reused: int, ttft: float, error: str = "") -> dict:
    return {"chat": chat, "turn": turn, "prompt": prompt, "reused": reused, "generated": 10, "ttft_s": ttft} | {
        "error": error
    }


def test_reuse_counts_turns_two_on_and_p95_ttft_and_failed_turns_show():
    rows = [row(0, 1, 100, 0, 0.5), row(0, 2, 200, 150, 0.2), row(1, 1, 100, 0, 0.6), row(1, 2, 200, 50, 0.3)]
    rows += [row(1, 3, 300, 300, 9.0, error="RemoteError: lost")]
    s = router.summarize(rows, wall_s=2.0)
    assert s["reuse_later"] == 0.5, "turn 1 (nothing to reuse) and the failed turn are left out"
    assert (s["answered"], s["turns"], s["errors"]) == (4, 5, ["RemoteError: lost"])
    assert s["tok_s"] == 25.0 and s["ttft_p95_s"] == 0.6 and s["ttft_p50_s"] == 0.4
    table = router.markdown(
        {
            "chats": 2,
            "turns": 3,
            "new_tokens": 10,
            "slots_per_replica": 2,
            "threads_per_replica": 1,
            "load_average": [1.0, 0.5, 0.25],
            "cases": [{"replicas": 2, "policy": "consistent_hash", **s}],
        }
    )
    assert "| 2 | consistent_hash | 4/5 | 0.50 | 25.0 | 0.4 | 0.6 |" in table and "1.00, 0.50, 0.25" in table


def test_each_chat_has_its_own_messages():
    a, b = router.chat_turns(0, 3), router.chat_turns(1, 3)
    assert len(a) == 3 and not set(a) & set(b)


def test_bench_router_refuses_what_it_cannot_measure(tmp_path):
    with pytest.raises(ConfigError, match="unset LLMWEB_MODEL and LLMWEB_ENGINE_URL"):
        router.run(make_settings(tmp_path, engine_url="http://127.0.0.1:9"))
    with pytest.raises(ConfigError, match="--policies from"):
        router.run(make_settings(tmp_path), policies=["sticky"])


@pytest.mark.slow
@pytest.mark.skipif(
    not (llama_tool("llama-server") and router.router_exe()) and not os.environ.get("LLMWEB_LLAMA_SERVER"),
    reason="no llama-server or no vllm-router",
)
def test_a_tiny_bench_router_answers_every_turn(monkeypatch, capsys):
    from llmweb.bench import bench_command
    from llmweb.cli.main import build_parser

    monkeypatch.delenv("LLMWEB_MODEL", raising=False)
    monkeypatch.delenv("LLMWEB_ENGINE_URL", raising=False)
    args = ["bench", "router", "--replicas", "1", "--policies", "consistent_hash", "--chats", "2", "--turns", "2"]
    code = bench_command(build_parser().parse_args([*args, "--slots", "1", "--max-new-tokens", "8", "--json"]))
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    cases = {c["policy"]: c for c in result["cases"]}
    assert set(cases) == {"one llama-server", "consistent_hash"}
    assert all(c["answered"] == c["turns"] == 4 for c in cases.values())
    assert all(c["reuse_later"] is not None for c in cases.values()), "turn 2 reports what the engine reused"
    print(router.markdown(result))
