"""`python -m llmweb bench continue`: "Continue in a new chat" from a long chat, against a fresh chat.

A chat of `history` turns is stored as an import of a long chat leaves it (none folded), with ten
of fidelity's fact sentences planted across it. It is continued in a new chat once (timed: the
fold of its window into the summary is what the button waits for), and that continued chat,
before its first message, is copied to `repeats` owners of their own. Each of those owners then
sends the same first message to its copy and to a new chat, side by side in alternating order;
the first TTFT of each is recorded, and the ratio of their medians (continued / fresh) says
whether a continued chat starts as a fresh one does. Each pair is one owner's own, so neither
takes a cached prefix from another repeat (kvcache.py shares prefixes only within an owner). Also
reported: the planted facts found in the continued chat's first prompt, and the first TTFT of the
long chat itself (its cache cold, as after an import or an engine restart), which is what staying
in it costs.

Must not: be imported by the product.
"""

from __future__ import annotations

import statistics
import time

from llmweb.records import LOCAL_OWNER as LOCAL

QUESTION = "Where were we? Remind me in one sentence."
FACT_EVERY = 11  # a planted fact every this many turns, from turn 4 on


REPLY = "An earlier answer, number {n}: " + "the tide comes in " * 16


def long_chat(store, turns: int, reply: str = REPLY) -> tuple[str, list[str]]:
    """A chat of the local user with `turns` turns stored, none folded, and fidelity's fact
    sentences planted every FACT_EVERY turns (as many as fit before its last few turns); its id
    and the facts planted. Each reply is `reply`, its {n} the turn's number."""
    from .fidelity import FACTS, FILLERS

    conv = store.create_conversation(LOCAL, "A long chat")
    planted: list[str] = []
    # fidelity's fillers, not scripted_turns: "Question 96: ..." reads as a fact sentence (it has a
    # number), and a hundred of those would crowd the planted facts out of the facts' budget
    for i in range(turns):
        text = f"Tell me one short fact about {FILLERS[i % len(FILLERS)]}."
        k = (i - 3) // FACT_EVERY
        if i >= 3 and (i - 3) % FACT_EVERY == 0 and k < len(FACTS) and i < turns - 4:
            text = FACTS[k][0]
            planted.append(text)
        store.add_turn(LOCAL, conv, text, reply.format(n=i + 1))
    return conv, planted


def _first(chat, owner: str, conv: str | None) -> dict:
    fin = chat.ask(owner, conv, QUESTION, use_docs=False)
    g = fin.stats.gen
    return {
        "ttft_s": round(g.ttft_s, 4),
        "prompt_tokens": g.prompt_tokens,
        "reused_tokens": g.reused_tokens,
        "prompt": fin.prompt_text(),
    }


def _warmed(chat, owner: str, conv: str) -> str:
    """`conv` with its first prompt prefilled, as the page leaves a chat it continues (or opens)
    before its owner has typed: the background warm-up of chat/memory.py, waited for."""
    request = chat.folds.warm_request(owner, conv)
    if request is not None:
        chat.folds.engine.submit(request).result()
    return conv


def run(settings, loaded, history: int = 120, repeats: int = 3, progress=lambda s: None) -> dict:
    """The continued chat's first TTFT beside a fresh chat's, `repeats` pairs, on one Runtime."""
    from llmweb.chat.context import Budget
    from llmweb.runtime import Runtime

    from .common import describe_setup

    own = settings.in_engine_process and not settings.engine_url
    runtime = Runtime(settings, loaded=None if own else loaded).start(background=False)
    try:
        chat, store = runtime.wait_ready(), runtime.store
        chat.ask(LOCAL, None, "Hello!", use_docs=False)  # one-off costs (first request) paid outside the figures
        old, planted = long_chat(store, history)
        progress(f"bench continue: continuing a {history}-turn chat in a new one")
        t0 = time.perf_counter()
        new = chat.carry.continue_in_new(LOCAL, old)
        continue_s = time.perf_counter() - t0
        summary = store.get(LOCAL, new).summary  # "" when the fold failed (a time limit): facts and turns only
        summary_tokens = chat.fmt.count(summary) if summary else 0
        copy = store.export_json(LOCAL, new)
        pairs = []
        for k in range(repeats):
            owner = f"user:bench-continue-{k}"
            # the not-warmed copy is another owner's: an owner's chats share their longest cached prefix
            stranger = f"user:bench-continue-cold-{k}"
            mine, cold = store.import_json(owner, copy), store.import_json(stranger, copy)
            order = ("continued", "fresh") if k % 2 == 0 else ("fresh", "continued")
            pair = {
                name: _first(chat, owner, _warmed(chat, owner, mine) if name == "continued" else None) for name in order
            }
            pair["cold"] = _first(chat, stranger, cold)  # the same chat had it not been prefilled as it opened
            pairs.append(pair)
            progress(
                f"bench continue: pair {k + 1}/{repeats}: continued {pair['continued']['ttft_s']:.3f} s, "
                f"fresh {pair['fresh']['ttft_s']:.3f} s"
            )
        stay = _first(chat, LOCAL, old)
    finally:
        runtime.close()
    first_prompt = pairs[0]["continued"]["prompt"] if pairs else ""
    continued = [p["continued"]["ttft_s"] for p in pairs]
    fresh = [p["fresh"]["ttft_s"] for p in pairs]
    med_c, med_f = statistics.median(continued), statistics.median(fresh)
    med_cold = statistics.median(p["cold"]["ttft_s"] for p in pairs) if pairs else 0.0
    budget = Budget.from_settings(settings, loaded.max_context, loaded.on_cpu) if loaded is not None else None
    return {
        "bench": "continue",
        "history": history,
        "repeats": repeats,
        **(describe_setup(settings, loaded, budget) if loaded is not None else {}),
        "continue_s": round(continue_s, 3),
        "summary_tokens": summary_tokens,
        "facts_planted": len(planted),
        "facts_in_first_prompt": sum(f in first_prompt for f in planted),
        "pairs": [{name: {k: v for k, v in d.items() if k != "prompt"} for name, d in p.items()} for p in pairs],
        "median_continued_ttft_s": round(med_c, 4),
        "median_fresh_ttft_s": round(med_f, 4),
        "continued_fresh_ratio": round(med_c / max(med_f, 1e-9), 3),
        "median_cold_ttft_s": round(med_cold, 4),
        "cold_fresh_ratio": round(med_cold / max(med_f, 1e-9), 3),
        "stay": {k: v for k, v in stay.items() if k != "prompt"},
    }


def markdown(r: dict) -> str:
    rows = [
        f"| {i + 1} | {p['continued']['ttft_s']:.3f} | {p['continued']['prompt_tokens']} "
        f"| {p['continued']['reused_tokens']} | {p['fresh']['ttft_s']:.3f} | {p['fresh']['prompt_tokens']} "
        f"| {p['fresh']['reused_tokens']} | {p['cold']['ttft_s']:.3f} |"
        for i, p in enumerate(r["pairs"])
    ]
    stay = r["stay"]
    return "\n".join(
        [
            f"## Continue in a new chat from a {r['history']}-turn chat "
            f"({r.get('model', '?')}, {r.get('quant', '?')}, {r.get('device', '?')})",
            "",
            f"Continuing took {r['continue_s']:.2f} s (the window folded into a summary of {r['summary_tokens']} "
            f"tokens; 0: the fold failed, see the log); the continued chat's first prompt holds "
            f"{r['facts_in_first_prompt']} of the {r['facts_planted']} planted facts.",
            "",
            "The continued chat is prefilled as the page leaves it when it opens (warmed); *not warmed* is the",
            "same chat's first message without that.",
            "",
            "| pair | continued TTFT (s) | prompt tokens | reused | fresh TTFT (s) | prompt tokens | reused "
            "| not warmed TTFT (s) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "| median continued TTFT (s) | median fresh TTFT (s) | continued / fresh | not warmed / fresh |",
            "|---:|---:|---:|---:|",
            f"| {r['median_continued_ttft_s']:.3f} | {r['median_fresh_ttft_s']:.3f} "
            f"| {r['continued_fresh_ratio']:.2f} | {r['cold_fresh_ratio']:.2f} |",
            "",
            f"Staying in the {r['history']}-turn chat instead (its cache cold): TTFT {stay['ttft_s']:.3f} s, "
            f"{stay['prompt_tokens']} prompt tokens, {stay['reused_tokens']} reused.",
            "",
        ]
    )
