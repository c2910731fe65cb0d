"""`python -m llmweb bench ttft`: time-to-first-token over a growing chat, with and without KV reuse.

The same scripted conversation runs twice on one loaded model: once with session KV reuse, once
with full prefill. Each mode gets a Runtime of its own, built from `settings.replace(kv_reuse=...)`
(public configuration; a running engine is never changed). For each mode, the median TTFT over
the last 10 turns divided by the median over the first 5: flat (≈1) with reuse, growing with
history without it. Chats are stored in `settings.data_dir` and deleted afterwards; pass scratch
settings (`common.scratch_settings`) to keep them out of the user's database.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..store import LOCAL_OWNER as LOCAL
from .common import describe_setup, scripted_turns


@dataclass
class ModeResult:
    mode: str
    ttft_s: list[float]
    prompt_tokens: list[int]
    reused_tokens: list[int]
    replies: list[str]

    def ratio(self, early: int = 5, late: int = 10) -> float:
        return statistics.median(self.ttft_s[-late:]) / max(statistics.median(self.ttft_s[:early]), 1e-9)


def run_mode(settings, loaded, turns: list[str], reuse: bool) -> ModeResult:
    """One chat of `turns` on a Runtime of its own, with session KV reuse on or off."""
    from ..chat import Finished
    from ..runtime import Runtime

    runtime = Runtime(settings.replace(kv_reuse=reuse), loaded=loaded).start(background=False)
    res = ModeResult("reuse" if reuse else "full", [], [], [], [])
    try:
        chat = runtime.wait_ready()
        conv = runtime.store.create_conversation(LOCAL, f"bench ttft ({'reuse' if reuse else 'full prefill'})")
        try:
            for text in turns:
                for ev in chat.send(LOCAL, conv, text, use_docs=False, wait_summary=True):
                    if isinstance(ev, Finished):
                        g = ev.stats.gen
                        res.ttft_s.append(g.ttft_s)
                        res.prompt_tokens.append(g.prompt_tokens)
                        res.reused_tokens.append(g.reused_tokens)
                        res.replies.append(ev.reply)
        finally:
            chat.delete(LOCAL, conv)
    finally:
        runtime.close()
    return res


def run(settings, loaded, n_turns: int) -> dict:
    from ..context import Budget

    turns = scripted_turns(n_turns)
    results = [run_mode(settings, loaded, turns, reuse=True), run_mode(settings, loaded, turns, reuse=False)]
    same = sum(a == b for a, b in zip(results[0].replies, results[1].replies))
    budget = Budget.from_settings(settings, loaded.max_context, loaded.on_cpu)
    return {
        "bench": "ttft",
        "turns": n_turns,
        **describe_setup(settings, loaded, budget),
        "modes": {
            r.mode: {
                "late_early_ratio": round(r.ratio(), 3),
                "median_first5_s": round(statistics.median(r.ttft_s[:5]), 4),
                "median_last10_s": round(statistics.median(r.ttft_s[-10:]), 4),
                "ttft_s": [round(x, 4) for x in r.ttft_s],
                "prompt_tokens": r.prompt_tokens,
                "reused_tokens": r.reused_tokens,
            }
            for r in results
        },
        "identical_replies": f"{same}/{n_turns}",
    }


def markdown(r: dict) -> str:
    reuse, full = r["modes"]["reuse"], r["modes"]["full"]
    rows = ["| turn | prompt tokens | reused | TTFT reuse (s) | TTFT full prefill (s) |", "|---:|---:|---:|---:|---:|"]
    for i, (p, u, a, b) in enumerate(
        zip(reuse["prompt_tokens"], reuse["reused_tokens"], reuse["ttft_s"], full["ttft_s"]), 1
    ):
        rows.append(f"| {i} | {p} | {u} | {a:.3f} | {b:.3f} |")
    return "\n".join(
        [
            f"## TTFT over {r['turns']} turns ({r['model']}, {r['quant']}, {r['device']})",
            "",
            *rows,
            "",
            "| mode | median TTFT, first 5 (s) | median TTFT, last 10 (s) | late / early |",
            "|---|---:|---:|---:|",
            *(
                f"| {name} | {m['median_first5_s']:.3f} | {m['median_last10_s']:.3f} | {m['late_early_ratio']:.2f} |"
                for name, m in (("reuse", reuse), ("full prefill", full))
            ),
            "",
            f"Replies identical in both modes: {r['identical_replies']}",
            "",
        ]
    )
