"""Benchmarks that print figures: `python -m llmweb bench ttft | retrieval`.

Every comparison is measured side by side in one run on one loaded model (these machines are
noisy; a ratio from one run means more than two absolute numbers from two). Nothing here is
asserted in the test suite; tests only check that the commands run and report what they say.

ttft: the same scripted conversation twice, with session KV reuse and without. For each mode,
the median time-to-first-token over the last 10 turns divided by the median over the first 5:
flat (≈1) with reuse, growing with history without it.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass

TOPICS = ["the history of tea", "how bridges carry load", "why the sky is blue", "what a compiler does",
          "how bees find flowers", "the rules of chess", "how vaccines work", "what makes bread rise",
          "how tides happen", "what a database index is", "how a bicycle stays up", "why leaves change colour",
          "how rainbows form", "what an operating system does", "how glaciers move", "why we sleep",
          "how batteries store energy", "what a black hole is", "how coffee is roasted", "why cats purr"]


def scripted_turns(n: int) -> list[str]:
    """A deterministic conversation of n user messages of similar length."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        out.append(f"Question {i + 1}: in two or three sentences, explain {topic}. "
                   f"Keep it simple, and mention one surprising fact about {topic.split()[-1]}.")
    return out


@dataclass
class ModeResult:
    mode: str
    ttft_s: list[float]
    prompt_tokens: list[int]
    reused_tokens: list[int]
    replies: list[str]

    def ratio(self, early: int = 5, late: int = 10) -> float:
        return statistics.median(self.ttft_s[-late:]) / max(statistics.median(self.ttft_s[:early]), 1e-9)


def run_mode(runtime, turns: list[str], reuse: bool) -> ModeResult:
    from .chat import Finished

    chat = runtime.wait_ready()
    runtime.engine.kv.clear()
    runtime.engine.limits.kv_reuse = reuse
    conv = runtime.store.create_conversation(f"bench ttft ({'reuse' if reuse else 'full prefill'})")
    res = ModeResult("reuse" if reuse else "full", [], [], [], [])
    try:
        for text in turns:
            for ev in chat.send(conv, text, use_docs=False, wait_summary=True):
                if isinstance(ev, Finished):
                    g = ev.stats.gen
                    res.ttft_s.append(g.ttft_s)
                    res.prompt_tokens.append(g.prompt_tokens)
                    res.reused_tokens.append(g.reused_tokens)
                    res.replies.append(ev.reply)
    finally:
        runtime.engine.limits.kv_reuse = runtime.settings.kv_reuse
        chat.delete(conv)
    return res


def ttft(runtime, n_turns: int) -> dict:
    turns = scripted_turns(n_turns)
    results = [run_mode(runtime, turns, reuse=True), run_mode(runtime, turns, reuse=False)]
    same = sum(a == b for a, b in zip(results[0].replies, results[1].replies))
    return {
        "bench": "ttft", "turns": n_turns, **environment(runtime),
        "modes": {r.mode: {"late_early_ratio": round(r.ratio(), 3),
                           "median_first5_s": round(statistics.median(r.ttft_s[:5]), 4),
                           "median_last10_s": round(statistics.median(r.ttft_s[-10:]), 4),
                           "ttft_s": [round(x, 4) for x in r.ttft_s], "prompt_tokens": r.prompt_tokens,
                           "reused_tokens": r.reused_tokens} for r in results},
        "identical_replies": f"{same}/{n_turns}",
    }


def ttft_markdown(r: dict) -> str:
    reuse, full = r["modes"]["reuse"], r["modes"]["full"]
    rows = ["| turn | prompt tokens | reused | TTFT reuse (s) | TTFT full prefill (s) |", "|---:|---:|---:|---:|---:|"]
    for i, (p, u, a, b) in enumerate(zip(reuse["prompt_tokens"], reuse["reused_tokens"], reuse["ttft_s"], full["ttft_s"]), 1):
        rows.append(f"| {i} | {p} | {u} | {a:.3f} | {b:.3f} |")
    return "\n".join([
        f"## TTFT over {r['turns']} turns ({r['model']}, {r['quant']}, {r['device']})", "", *rows, "",
        "| mode | median TTFT, first 5 (s) | median TTFT, last 10 (s) | late / early |", "|---|---:|---:|---:|",
        f"| reuse | {reuse['median_first5_s']:.3f} | {reuse['median_last10_s']:.3f} | {reuse['late_early_ratio']:.2f} |",
        f"| full prefill | {full['median_first5_s']:.3f} | {full['median_last10_s']:.3f} | {full['late_early_ratio']:.2f} |",
        "", f"Replies identical in both modes: {r['identical_replies']}", ""])


def quant(settings, quants=("fp32", "4bit"), new_tokens: int = 64, repeats: int = 3) -> dict:
    """Weights size and decode speed of each quantisation, same prompt, one process."""
    from . import models
    from .engine import Engine, EngineLimits, GenerationRequest
    from .kvcache import KVStore
    from .tokens import TemplateFormat, render_prompt

    rows = []
    for q in quants:
        lm = models.load(settings.replace(quant=q))
        fmt = TemplateFormat(lm.tokenizer)
        engine = Engine(lm.model, lm.device, KVStore(0, 1), EngineLimits(max_new_tokens=new_tokens, kv_reuse=False),
                        lm.kv_bytes_per_token)
        ids = render_prompt(fmt, "You are a helpful assistant.", [("user", "Write a long story about a lighthouse.")])
        speeds, ttfts = [], []
        try:
            for _ in range(repeats):
                h = engine.submit(GenerationRequest(ids, new_tokens))  # no stop ids: always new_tokens
                h.result()
                speeds.append(h.stats.decode_tok_s)
                ttfts.append(h.stats.ttft_s)
        finally:
            engine.close()
        rows.append({"quant": lm.quant, "weights_mib": round(lm.weights_bytes / 2**20, 1),
                     "decode_tok_s": round(statistics.median(speeds), 1), "ttft_s": round(statistics.median(ttfts), 3),
                     "device": lm.device})
        del engine, lm
    return {"bench": "quant", "model": settings.model or models.EMBEDDED_NAME, "new_tokens": new_tokens, "rows": rows}


def quant_markdown(r: dict) -> str:
    lines = [f"## Quantisation ({r['model']}, {r['new_tokens']} new tokens, median of 3)", "",
             "| quant | weights (MiB) | decode tok/s | TTFT (s) | device |", "|---|---:|---:|---:|---|"]
    lines += [f"| {x['quant']} | {x['weights_mib']:.0f} | {x['decode_tok_s']:.1f} | {x['ttft_s']:.3f} | {x['device']} |"
              for x in r["rows"]]
    return "\n".join(lines) + "\n"


def environment(runtime) -> dict:
    lm, s = runtime.loaded, runtime.settings
    return {"model": lm.name, "quant": lm.quant, "device": lm.device, "weights_mib": round(lm.weights_bytes / 2**20, 1),
            "context_limit": runtime.budget.context_limit, "max_new_tokens": runtime.budget.max_new_tokens,
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks: ttft | retrieval | quant")
    b.add_argument("which", choices=["ttft", "retrieval", "quant"])
    b.add_argument("--turns", type=int, default=40)
    b.add_argument("--chunks", type=int, default=10_000)
    b.add_argument("--max-new-tokens", type=int, default=48, help="reply length per turn (ttft)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=main)


def main(args) -> int:
    from .config import Settings

    if args.which == "retrieval":
        from . import bench_retrieval

        result = bench_retrieval.run(Settings.from_env(), n_chunks=args.chunks)
        print(json.dumps(result, indent=2) if args.json else bench_retrieval.format_markdown(result))
        return 0
    if args.which == "quant":
        result = quant(Settings.from_env())
        print(json.dumps(result, indent=2) if args.json else quant_markdown(result))
        return 0
    from .runtime import Runtime

    settings = Settings.from_env(max_new_tokens=args.max_new_tokens)
    runtime = Runtime(settings).start(background=False)
    try:
        result = ttft(runtime, args.turns)
    finally:
        runtime.close()
    print(json.dumps(result, indent=2) if args.json else ttft_markdown(result))
    return 0
