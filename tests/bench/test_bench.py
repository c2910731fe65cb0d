"""The benchmark commands end to end at tiny sizes on CPU: `capacity`, `bench ttft`, the `bench` suite.

They check that each command runs, reports what it promises (columns, keys, files), and that
its verdicts (fits, meets target, leak suspected) follow from its own figures. No timing
assertions: these machines are noisy.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from llmweb import bench
from llmweb.bench import capacity, memory, suite
from llmweb.bench.common import write_reports
from llmweb.cli.main import build_parser
from llmweb.engine import gguf
from llmweb.engine.blockcache import KEEP_ROOM
from tests.conftest import MODEL_CACHE, REPO, make_settings


def run_cli(tmp_path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        LLMWEB_DATA_DIR=str(tmp_path / "data"),
        LLMWEB_CACHE_DIR=str(MODEL_CACHE),
        LLMWEB_SAMPLE_DOCS="0",
        LLMWEB_DEVICE="cpu",
    )
    done = subprocess.run(
        [sys.executable, "-m", "llmweb", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


# the CPU default: llama.cpp on the GGUF file (f16 KV) where llama-cpp-python loads, else int8-cpu (fp32 KV)
# the default on the CPU: the embedded Q4_1 file re-encoded as Q8_0 on llama.cpp (LLMWEB_GGUF_REQUANT=auto)
DEFAULT_QUANT, DEFAULT_KV_PER_TOKEN = (
    ("Q8_0 GGUF from Q4_1", 23_040) if gguf.available() is None else ("int8-cpu", 46_080)
)


def printed_paths(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        kind, _, path = line.partition(": ")
        if kind in ("csv", "png", "md", "json") and path:
            out[kind] = path
    return out


@pytest.mark.slow  # loads the real model in a subprocess
def test_capacity_command_writes_table_csv_and_plot(tmp_path):
    done = run_cli(tmp_path, "capacity", "--context", "256,512", "--concurrency", "1,2", "--max-new-tokens", "8")
    out = done.stdout
    assert "| context | sessions | prompt tokens | predicted MiB (weights + KV + act) | measured peak RSS MiB" in out
    assert "up to max_batch requests per decode step" in out and "| aggregate tok/s | TTFT p95 (s) |" in out
    paths = printed_paths(out)
    assert set(paths) == {"csv", "png", "md"}
    for p in paths.values():
        assert os.path.isfile(p) and p.startswith(str(tmp_path / "data" / "reports"))
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(paths["csv"], newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == capacity.COLUMNS
        rows = list(reader)
    assert [(int(r["context"]), int(r["concurrency"])) for r in rows] == [(256, 1), (256, 2), (512, 1), (512, 2)]
    for r in rows:
        context, k, prompt = int(r["context"]), int(r["concurrency"]), int(r["prompt_tokens"])
        assert context - 8 - 16 < prompt <= context - 8, "the prompt fills the context up to the reply"
        assert int(r["completed"]) == k and int(r["refused"]) == 0 and int(r["evicted"]) == 0
        baseline, peak, limit = (int(r[c]) for c in ("measured_baseline_bytes", "measured_peak_bytes", "limit_bytes"))
        fits = max(baseline + int(r["predicted_growth_bytes"]), peak) <= limit  # nothing was refused or evicted
        assert r["fits"] == str(fits), "fits: the larger of predicted and measured peak is under the limit"
        pred = {
            c: int(r[c])
            for c in ("predicted_weights_bytes", "predicted_kv_bytes", "predicted_activation_bytes", "predicted_bytes")
        }
        assert min(pred.values()) > 0
        assert pred["predicted_bytes"] == (
            pred["predicted_weights_bytes"] + pred["predicted_kv_bytes"] + pred["predicted_activation_bytes"]
        )
        assert int(r["measured_peak_bytes"]) >= int(r["measured_baseline_bytes"]) > 0
        # every session's cache stays resident: prompt + reply - 1 tokens each, with up to KEEP_ROOM tokens
        # of room for the next message (blockcache) or a state header (llama.cpp)
        assert 0 < int(r["resident_kv_bytes"]) <= k * (prompt + 8 + KEEP_ROOM) * DEFAULT_KV_PER_TOKEN
        assert int(r["resident_kv_bytes"]) >= k * (context - 8 - 16) * DEFAULT_KV_PER_TOKEN
    kv = {(int(r["context"]), int(r["concurrency"])): int(r["predicted_kv_bytes"]) for r in rows}
    assert kv[(512, 2)] > kv[(512, 1)] > kv[(256, 1)]


@pytest.mark.slow  # loads the real model in a subprocess
def test_bench_concurrency_runs_the_serial_and_the_batched_engine_side_by_side(tmp_path):
    done = run_cli(tmp_path, "bench", "concurrency", "--concurrency", "1,2", "--max-new-tokens", "4", "--json")
    r = json.loads(done.stdout)
    assert r["bench"] == "concurrency" and r["quant"] == DEFAULT_QUANT and r["max_batch"] == 4  # auto on the CPU
    rows = {(x["concurrency"], x["engine"]): x for x in r["rows"]}
    assert list(rows) == [(1, "serial"), (1, "batched"), (2, "serial"), (2, "batched")]
    for (k, _engine), x in rows.items():
        assert x["completed"] == k and x["generated_tokens"] == 4 * k, "no stop ids: every reply is full length"
        assert 0 < x["ttft_p50_s"] <= x["ttft_p95_s"] and x["peak_bytes"] > 0
        serial = rows[(k, "serial")]
        assert x["aggregate_vs_serial"] == pytest.approx(x["aggregate_tok_s"] / serial["aggregate_tok_s"], abs=0.01)
    assert rows[(2, "serial")]["largest_batch"] == 1 and rows[(2, "batched")]["largest_batch"] == 2
    if r["backend"] == "llama.cpp" and os.environ.get("LLMWEB_LLAMA_BATCHED_BENCH"):  # CI builds it
        ref = {x["concurrency"]: x for x in r["llama_batched_bench"]}
        assert list(ref) == [1, 2] and ref[1]["aggregate_vs_serial"] == 1.0 and ref[1]["decode_vs_one"] == 1.0
        assert all(
            x["tokens_per_s"] > 0 and x["ours_vs_serial"] == rows[(k, "batched")]["aggregate_vs_serial"]
            for k, x in ref.items()
        )


def test_batched_bench_runs_llama_cpp_as_our_runner_and_reads_its_ratios(tmp_path, monkeypatch):
    """The reference's arguments and arithmetic, on a stand-in program that prints llama-batched-bench's
    jsonl (the real one runs in the test above, in CI)."""
    from types import SimpleNamespace

    from llmweb.bench.concurrency import _mean_reference, batched_bench, markdown

    log = tmp_path / "args"
    exe = tmp_path / "llama-batched-bench"
    lines = [
        '{"pl": 1, "t": 2.0, "speed_tg": 100.0}',
        '{"pl": 2, "t": 2.5, "speed_tg": 150.0}',
        '{"pl": 4, "t": 4.0, "speed_tg": 240.0}',
    ]
    exe.write_text("#!/bin/sh\n" + f'echo "$@" > {log}\n' + "".join(f"echo '{x}'\n" for x in lines))
    exe.chmod(0o755)
    monkeypatch.setenv("LLMWEB_LLAMA_BATCHED_BENCH", str(exe))
    ref = batched_bench(SimpleNamespace(path=tmp_path / "m.gguf", threads=2), 48, 128, [2, 4], progress=str)
    args = log.read_text().split()
    assert args[args.index("-npl") + 1] == "1,2,4" and args[args.index("-t") + 1] == "2"  # 1 is the baseline
    assert args[args.index("-fa") + 1] == "off" and "-kvu" not in args and args[args.index("-npp") + 1] == "48"
    assert [x["concurrency"] for x in ref] == [2, 4]
    assert ref[0]["aggregate_vs_serial"] == pytest.approx(2 * 2.0 / 2.5) and ref[0]["tokens_per_s"] == 2 * 128 / 2.5
    assert ref[1]["aggregate_vs_serial"] == 2.0 and ref[1]["decode_vs_one"] == 2.4
    twice = _mean_reference([ref, None, [dict(x, aggregate_vs_serial=x["aggregate_vs_serial"] + 1) for x in ref]])
    assert [x["aggregate_vs_serial"] for x in twice] == [1.6 + 0.5, 2.5] and twice[0]["runs"] == 2
    assert _mean_reference([None]) is None
    ref = _mean_reference([ref])
    for x in ref:
        x["ours_vs_serial"] = 1.5
    md = markdown(
        {
            "model": "m",
            "quant": "Q4_1 GGUF",
            "backend": "llama.cpp",
            "device": "cpu",
            "max_new_tokens": 128,
            "max_batch": 4,
            "prompt_tokens": [48],
            "total_s": 1,
            "rows": [],
            "llama_batched_bench": ref,
        }
    )
    assert "| 4 | 128.0 | 2.00x | 1.50x | 2.40x |" in md
    exe.write_text("#!/bin/sh\necho 'main: n_kv_max = 8192'\n" + f"echo '{lines[1]}'\n")  # no run of one
    assert batched_bench(SimpleNamespace(path=tmp_path / "m.gguf", threads=2), 48, 128, [2], progress=str) is None
    monkeypatch.setenv("LLMWEB_LLAMA_BATCHED_BENCH", "")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert batched_bench(SimpleNamespace(path=tmp_path / "m.gguf", threads=2), 48, 128, [4], progress=str) is None


def test_percentile_interpolates_between_ranks():
    from llmweb.bench.concurrency import percentile

    assert percentile([], 95) == 0.0 and percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0], 95) == pytest.approx(1.95)


@pytest.mark.slow  # loads the real model in a subprocess
def test_bench_ttft_still_works(tmp_path):
    done = run_cli(tmp_path, "bench", "ttft", "--turns", "6", "--max-new-tokens", "8", "--json")
    r = json.loads(done.stdout)
    assert r["bench"] == "ttft" and r["turns"] == 6
    import statistics

    for mode in ("reuse", "full"):
        m = r["modes"][mode]
        assert len(m["ttft_s"]) == 6 and all(t > 0 for t in m["ttft_s"])
        ratio = statistics.median(m["ttft_s"][-10:]) / statistics.median(m["ttft_s"][1:6])
        assert m["late_early_ratio"] == pytest.approx(ratio, rel=0.01), "late = last 10 turns, early = turns 2-6"
        prefilled = [p - u for p, u in zip(m["prompt_tokens"], m["reused_tokens"])]
        low = sum(f < 0.3 * p for f, p in zip(prefilled[1:], m["prompt_tokens"][1:])) / 5
        assert m["low_prefill_share"] == pytest.approx(low, abs=1e-3)
    assert r["modes"]["reuse"]["reused_tokens"][0] == 0 and all(n > 0 for n in r["modes"]["reuse"]["reused_tokens"][1:])
    assert all(n == 0 for n in r["modes"]["full"]["reused_tokens"])


@pytest.mark.slow  # loads the real model in a subprocess
def test_bench_ttft_from_an_imported_chat_warms_it_and_holds_its_window(tmp_path):
    """`--history`: 40 turns imported unfolded (far past a 2,048-token room), opened as the page
    opens one: the first message finds the chat prefilled, and the next ones reuse the prompt."""
    done = run_cli(
        tmp_path, "bench", "ttft", "--history", "40", "--turns", "3", "--max-new-tokens", "8", "--reuse-only", "--json"
    )
    r = json.loads(done.stdout)
    assert r["history"] == 40 and r["memory"] in ("summary", "recall")
    m = r["modes"]["reuse"]
    prefilled = [p - u for p, u in zip(m["prompt_tokens"], m["reused_tokens"])]
    assert m["reused_tokens"][0] > 0, "the warm-up on opening prefilled the first prompt"
    assert all(f < 0.3 * p for f, p in zip(prefilled, m["prompt_tokens"])), (prefilled, m["prompt_tokens"])


def test_bench_ttft_scripts():
    from llmweb.bench import fidelity, ttft

    facts = ttft.script_turns("facts", 200)
    assert facts == [text for text, _ in fidelity.script(fillers_between=12, checkpoints=3)] and len(facts) == 76
    assert ttft.script_turns("facts", 12) == facts[:12]
    assert ttft.script_turns("topics", 3)[0].startswith("Question 1:")
    args = build_parser().parse_args(["bench", "ttft", "--script", "facts", "--turns", "76"])
    assert (args.script, args.turns) == ("facts", 76)
    assert build_parser().parse_args(["bench", "ttft"]).script == "topics"


def test_bench_without_a_subcommand_is_the_suite():
    args = build_parser().parse_args(["bench"])
    assert args.which == "all" and args.turns is None and args.chunks is None and args.replay_turns == 200
    # --turns and --chats: each bench's own default (the suite's and ttft's 40 turns, router's 10 x 8 chats)
    args = build_parser().parse_args(["bench", "router", "--turns", "3", "--chats", "2", "--replicas", "1,2"])
    assert (args.turns, args.chats, bench.parse_ints(args.replicas), args.slots) == (3, "2", [1, 2], 2)
    args = build_parser().parse_args(["bench", "concurrency"])
    assert args.which == "concurrency" and bench.parse_ints(args.concurrency) == [1, 2, 4, 8] and args.max_batch == 0
    args = build_parser().parse_args(["capacity", "--context", "512,1024", "--concurrency", "1,4"])
    assert bench.parse_ints(args.context) == [512, 1024] and bench.parse_ints(args.concurrency) == [1, 4]


@pytest.fixture(scope="module")
def suite_result(app_model, tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("suite"), device="cpu")
    return settings, suite.run(
        settings,
        turns=6,
        ttft_new_tokens=8,
        chunks=30,
        replay_turns=8,
        warmup_turns=2,
        replay_context=512,
        replay_new_tokens=8,
        overhead_tokens=6,
        overhead_repeats=1,
        loaded=app_model,
    )


def test_suite_reports_every_section(suite_result):
    settings, r = suite_result
    assert set(r) >= {"environment", "overhead", "ttft", "memory", "retrieval", "seconds", "total_s"}
    env = r["environment"]
    for key in ("model", "quant", "device", "cpu", "cpus", "torch", "transformers", "context_limit", "kv_budget_mib"):
        assert env[key] not in (None, ""), key
    o = r["overhead"]
    assert o["engine_tok_s"] > 0 and o["bare_tok_s"] > 0 and o["ratio"] > 0
    assert o["same_token_count"] and o["runs_per_side"] == 3
    assert o["target"] == 0.9 and o["meets_target"] == (o["ratio"] >= 0.9), "the verdict matches the printed ratio"
    assert len(r["ttft"]["modes"]["reuse"]["ttft_s"]) == 6
    m = r["memory"]
    assert m["turns"] == 8 and m["warmup_turns"] >= 2
    assert m["start"]["mem_bytes"] > 0 and m["end"]["mem_bytes"] > 0 and m["start"]["tensors"] > 0
    a, b = m["start"], m["end"]
    assert m["mem_growth_bytes"] == b["mem_bytes"] - a["mem_bytes"]
    assert m["kv_growth_bytes"] == b["kv_store_bytes"] - a["kv_store_bytes"]
    assert m["unexplained_growth_bytes"] == m["mem_growth_bytes"] - m["kv_growth_bytes"]
    assert m["tensor_growth"] == b["tensors_outside_kv"] - a["tensors_outside_kv"]
    assert m["leak_suspected"] == (
        m["unexplained_growth_bytes"] > m["leak_threshold_bytes"] or m["tensor_growth"] > memory.LEAK_TENSOR_SLACK
    )
    assert r["retrieval"]["chunks"] > 0 and r["retrieval"]["requested_chunks"] == 30
    assert not (settings.data_dir / "llmweb.sqlite3").exists(), "the suite's chats run in a scratch data dir"


def test_suite_writes_markdown_and_json(suite_result):
    settings, r = suite_result
    md = suite.markdown(r)
    for heading in (
        "## Environment",
        "## Engine overhead",
        "## TTFT over 6 turns",
        "## Memory over a 8-turn replay",
        "## Retrieval (30 chunks",
    ):
        assert heading in md
    assert "Ratio ours / bare:" in md and "growth the KV store does not explain" in md
    paths = write_reports(r, md, settings.data_dir)
    assert paths["md"].read_text() == md
    assert json.loads(paths["json"].read_text())["overhead"]["ratio"] == r["overhead"]["ratio"]
    assert paths["md"].parent == settings.data_dir / "reports"


def test_bench_loops_answers_each_request_with_the_guard_off_and_on(app_model, tmp_path):
    """At 24 tokens no reply loops: the guard cuts nothing and leaves every reply as it was; the
    table names each request (the figures at 256 tokens are docs/benchmarks.md's)."""
    from llmweb.bench import loops

    r = loops.run(make_settings(tmp_path), new_tokens=24, loaded=app_model, progress=lambda _m: None)
    assert [row["request"] for row in r["rows"]] == loops.ORDINARY + loops.LOOPING
    for row in r["rows"]:
        assert row["on"]["cuts"] == 0 and row["same"], row
        assert 0 < row["on"]["tokens"] <= 24 and row["on"]["copies"] <= 2
    md = loops.markdown(r)
    assert all(row["request"][:48] in md for row in r["rows"]) and "ordinary requests: at most" in md


def test_most_copies_counts_sentences_of_16_characters_or_more():
    from llmweb.bench.loops import most_copies

    assert most_copies("The cat sat on the mat. The cat sat on the mat. Yes. Yes. Yes.") == 2
    assert most_copies("- one\n- one\n- one") == 0 and most_copies("") == 0
    assert most_copies("A long enough line here\n" * 5) == 5


def test_bench_constrained_measures_both_rates_the_compile_and_an_agent_loop(app_model, tmp_path, monkeypatch):
    """Tiny parameters (a smoke run): two pairs of 24 tokens, and a 2-step agent loop through a real
    server; the figures are there and the loop's steps answered within the context."""
    from llmweb.bench import constrained

    r = constrained.run(make_settings(tmp_path), new_tokens=24, repeats=2, steps=0, loaded=app_model, progress=print)
    assert r["constrained_tok_s"] > 0 and r["free_tok_s"] > 0 and r["ratio"] > 0
    assert r["compile_ms"] > 0 and r["matcher_ms"] > 0 and len(r["lengths"]) == 2
    assert "| **" in constrained.markdown(r)
    agent = constrained._agent(make_settings(tmp_path), 2, print)
    assert agent["answered"] == 2 and agent["within_context"], agent
    assert "2 of 2 steps answered" in constrained.markdown({**r, "agent": agent})
