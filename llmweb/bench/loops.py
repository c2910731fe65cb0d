"""`python -m llmweb bench loops`: does a reply repeat itself? Eight ordinary requests at the
defaults (the app's system prompt, greedy, the repetition penalty), then requests known to loop
(the same, with the penalty off), each answered with the loop guard off and on, side by side on
one loaded model (engine/runners/loopguard.py).

Per request: the most copies of one sentence in the reply (a sentence of 16 characters or more,
split at . ! ? and newlines), the guard's cuts, whether it ended the reply, tokens and decode tok/s.
The guard must leave a reply that does not loop exactly as it was: `same` says whether it did.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable

ORDINARY = [
    "Write a short summary of why sleep matters.",
    "List the benefits of drinking water.",
    "Tell me about the moon.",
    "Explain what a computer is to a child.",
    "Write a poem about the sea.",
    "Why is the sky blue?",
    "Write a Python function that prints hello three times, and show the output.",
    "Give me tips for learning a new language.",
]
LOOPING = ["Give me tips for learning a new language.", "Describe your ideal day."]  # with the penalty off
SENTENCE_RE = re.compile(r"(?<=[.!?])\s+|\n+")


def most_copies(text: str) -> int:
    """How often the reply says its most repeated sentence (16 characters or more); linear."""
    sentences = [s.strip() for s in SENTENCE_RE.split(text) if len(s.strip()) >= 16]
    return max(collections.Counter(sentences).values(), default=0)


def run(settings, new_tokens: int = 256, loaded=None, progress: Callable[[str], None] = print) -> dict:
    from llmweb.chat.tokens import TemplateFormat, render_prompt
    from llmweb.engine import models
    from llmweb.engine.backends import make_engine
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits, GenerationRequest

    loaded = loaded or models.load(settings, progress=progress)
    fmt = TemplateFormat(loaded.tokenizer, model_stops=loaded.stop_ids)
    limits = EngineLimits(max_new_tokens=new_tokens, kv_reuse=False, request_timeout_s=3600)  # a slow machine: no cut
    engine = make_engine(loaded, KVStore(64 * 2**20, ttl_s=60), limits)
    rows = []
    try:
        cases = [(p, settings.repetition_penalty) for p in ORDINARY] + [(p, 1.0) for p in LOOPING]
        for n, (text, penalty) in enumerate(cases, 1):
            progress(f"bench loops: request {n} of {len(cases)} (penalty {penalty})…")
            ids = render_prompt(fmt, settings.system_prompt, [("user", text)])
            row: dict = {"request": text, "penalty": penalty}
            for guard in (False, True):
                request = GenerationRequest(
                    prompt_ids=ids,
                    max_new_tokens=new_tokens,
                    repetition_penalty=penalty,
                    stop_ids=fmt.stop_ids,
                    loop_guard=guard,
                )
                h = engine.submit(request)
                h.result()
                stats = h.stats
                assert stats is not None, "a finished request has its stats"
                row["on" if guard else "off"] = {
                    "copies": most_copies(fmt.decode(h.generated)),
                    "tokens": stats.generated_tokens,
                    "tok_s": round(stats.decode_tok_s, 1),
                    "cuts": stats.loop_cuts,
                    "ended": stats.loop_stopped,
                    "ids": list(h.generated),
                }
            row["same"] = row["on"]["ids"] == row["off"]["ids"]
            for key in ("on", "off"):
                del row[key]["ids"]
            rows.append(row)
    finally:
        engine.close()
    ordinary = rows[: len(ORDINARY)]
    return {
        "bench": "loops",
        "backend": loaded.backend,
        "new_tokens": new_tokens,
        "rows": rows,
        "ordinary_most_copies": {k: max(r[k]["copies"] for r in ordinary) for k in ("off", "on")},
    }


def markdown(r: dict) -> str:
    lines = [
        f"## Loops: the most copies of one sentence in a reply ({r['backend']}, greedy, "
        f"up to {r['new_tokens']} tokens)",
        "",
        "| request | penalty | guard off: copies | tokens | guard on: copies | cuts | ended | tokens | tok/s off / on"
        " | same reply |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for row in r["rows"]:
        off, on = row["off"], row["on"]
        lines.append(
            f"| {row['request'][:48]} | {row['penalty']} | {off['copies']} | {off['tokens']} | **{on['copies']}** "
            f"| {on['cuts']} | {'yes' if on['ended'] else 'no'} | {on['tokens']} | {off['tok_s']} / {on['tok_s']} "
            f"| {'yes' if row['same'] else 'no'} |"
        )
    most = r["ordinary_most_copies"]
    lines += ["", f"The {len(ORDINARY)} ordinary requests: at most {most['off']} copies without the guard, "]
    lines[-1] += f"{most['on']} with it."
    return "\n".join(lines)
