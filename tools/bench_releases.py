"""Two checkouts' benchmarks side by side, in one run: the release before and this one, alternating.

    python tools/bench_releases.py --before ../old decode --prompts 32,512,1536
    python tools/bench_releases.py --before ../old ttft --turns 30
    python tools/bench_releases.py --before ../old concurrency --concurrency 1,2,4 --max-new-tokens 128
    python tools/bench_releases.py --before ../old document
    python tools/bench_releases.py --before ../old peer --chats 4

A round runs `python -m llmweb bench ARGS --json` in the checkout before and then in this one (the
next round the other way round, so the machine's drift hits both alike), each in a process of its
own with this checkout's virtualenv and the same environment, and the end prints the headline
figures of every run in one Markdown table. `--before` is a checkout of the older release, e.g.
`git worktree add ../old REV`; the bench's own data dir is the checkout's, so neither run sees the
other's files. The full JSON of every run goes to `--out` (a folder) when it is given.

Must not: be imported by llmweb (it runs llmweb, as a user would, from outside).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def headline(result: dict) -> dict[str, str]:
    """The figures a bench's JSON is read for, by name; one row of the table each."""
    kind = result.get("bench")
    if kind == "decode":
        return _decode(result)
    if kind == "ttft":
        return _ttft(result)
    if kind == "concurrency":
        return _concurrency(result)
    if kind == "document":
        return _document(result)
    if kind == "peer":
        return _peer(result)
    raise SystemExit(f"bench_releases knows decode, ttft, concurrency, document and peer, not {kind!r}")


def _decode(r: dict) -> dict[str, str]:
    ours = {row["prompt"]: row for row in r["rows"] if row["step"] == r["default_step"]}
    out = {}
    for n, row in sorted(ours.items()):
        out[f"decode tok/s, prompt {n}"] = f"{row['decode_tok_s']:.1f}"
        out[f"prefill tok/s, prompt {n}"] = f"{row['prefill_tok_s']:.0f}"
    for ref in r.get("llama_bench") or []:
        n = ref["prompt"]
        out[f"llama-bench decode tok/s, depth {n}"] = f"{ref['decode_tok_s']:.1f}"
        out[f"decode / llama-bench, {n}"] = f"{ref['default_decode_ratio']:.2f}"
    first = r["first_turn"]
    out[f"first turn ({first['prompt']} + {first['new_tokens']} tokens) s"] = (
        f"{first['total_s'][r['default_step']]:.2f}"
    )
    return out


def _ttft(r: dict) -> dict[str, str]:
    out = {}
    for mode, m in r["modes"].items():
        out[f"{mode}: TTFT turns 2-6 s"] = f"{m['median_early_s']:.3f}"
        out[f"{mode}: TTFT last 10 s"] = f"{m['median_last10_s']:.3f}"
        out[f"{mode}: late / early"] = f"{m['late_early_ratio']:.2f}"
        if m.get("low_prefill_share") is not None:
            out[f"{mode}: turns prefilling < 30%"] = f"{m['low_prefill_share']:.0%}"
    return out


def _concurrency(r: dict) -> dict[str, str]:
    out = {}
    for row in r["rows"]:
        k, mode = row["concurrency"], row["engine"]
        out[f"{k} chats, {mode}: tok/s"] = f"{row['aggregate_tok_s']:.1f}"
        if mode == "batched":
            out[f"{k} chats: batched / serial"] = f"{row['aggregate_vs_serial']:.2f}"
            out[f"{k} chats, batched: TTFT p95 s"] = f"{row['ttft_p95_s']:.2f}"
    for ref in r.get("llama_batched_bench") or []:
        out[f"{ref['concurrency']} chats: llama-batched-bench k / 1"] = f"{ref['aggregate_vs_serial']:.2f}"
    return out


def _document(r: dict) -> dict[str, str]:
    """Cold and cached times, the read rate and its ratio to llama-bench (a release without them
    leaves those rows blank), and the visitor's turn beside the task."""
    runs = {x["run"]: x for x in r["runs"]}
    out = {}
    if served := r.get("served"):
        out["served"] = f"{served}, {r['weights_mib']:.0f} MiB"
    for name in ("cold", "cached"):
        if name in runs:
            out[f"{name} summary s"] = f"{runs[name].get('outside_total_s', runs[name]['seconds']):.2f}"
    if "cold" in runs:
        cold = runs["cold"]
        out["cold: tokens read"] = f"{cold['tokens_read']:,}"
        out["cold: coverage"] = f"{cold['coverage']:.0%}"
        total = cold.get("outside_total_s") or cold["seconds"]
        out["cold: read tok/s"] = f"{cold['tokens_read'] / total:.1f}"
        if cold.get("rss_mib"):
            out["cold: engine RSS MiB"] = f"{cold['rss_mib']:.0f}"
    p = r.get("prefill") or {}
    if p.get("llama_bench_tok_s"):
        out[f"llama-bench -p {p['llama_bench_prompt']} tok/s (shipped file)"] = f"{p['llama_bench_tok_s']:.1f}"
        out["cold read / llama-bench prefill"] = f"{p['ratio']:.2f}"
    for label, key in (("idle", "visitor_idle"), ("beside the task", "visitor_during_task")):
        v = r[key]
        out[f"visitor {label}: first token s"] = f"{v['ttft_s']:.2f}"
        out[f"visitor {label}: turn s"] = f"{v['seconds']:.2f}"
    return out


def _peer(r: dict) -> dict[str, str]:
    out = {"file": r["model_file"]}
    for s in r["summary"]:
        k = s["concurrency"]
        out[f"{k} chats: llmweb tok/s"] = f"{s['llmweb_tok_s']:.1f}"
        out[f"{k} chats: llama-server tok/s"] = f"{s['llama_server_tok_s']:.1f}"
        out[f"{k} chats: llmweb / llama-server"] = f"{s['ours_vs_peer']:.2f}"
    return out


def table(runs: list[tuple[str, dict[str, str]]]) -> str:
    """Markdown: a row per figure, a column per run, in the order they ran."""
    names = list(dict.fromkeys(name for _label, figures in runs for name in figures))
    lines = ["| figure | " + " | ".join(label for label, _ in runs) + " |", "|---|" + "---:|" * len(runs)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(figures.get(name, "") for _, figures in runs) + " |")
    return "\n".join(lines)


def run_one(checkout: Path, bench_args: list[str]) -> dict:
    """`python -m llmweb bench ARGS --json` in `checkout` (its llmweb, this virtualenv); its JSON."""
    cmd = [sys.executable, "-m", "llmweb", "bench", *bench_args, "--json"]
    done = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout[done.stdout.index("{") :])


def _commit(checkout: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return done.stdout.strip() or checkout.name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, type=Path, help="a checkout of the release before")
    p.add_argument("--rounds", type=int, default=1, help="rounds of (before, now); each later one reversed")
    p.add_argument("--out", type=Path, help="a folder for every run's JSON")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="the bench and its arguments, e.g. ttft --turns 30")
    args = p.parse_args(argv)
    if not args.bench:
        p.error("name the bench, e.g. ttft --turns 30")
    sides = [("before", args.before.resolve()), ("now", HERE)]
    runs: list[tuple[str, dict[str, str]]] = []
    for r in range(args.rounds):
        for side, checkout in sides if r % 2 == 0 else sides[::-1]:
            label = f"{side} {_commit(checkout)} #{r + 1}"
            print(f"bench_releases: {label}: bench {' '.join(args.bench)}…", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            result = run_one(checkout, args.bench)
            print(f"bench_releases: {label} took {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{args.bench[0]}-{side}-{r + 1}.json").write_text(json.dumps(result, indent=2))
            runs.append((label, headline(result)))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
