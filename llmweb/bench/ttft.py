"""`python -m llmweb bench ttft`: time-to-first-token over a growing chat, with and without KV reuse.

The same scripted conversation runs twice on one loaded model: once with session KV reuse, once
with full prefill. Each mode gets a Runtime of its own, built from `settings.replace(kv_reuse=...)`
(public configuration; a running engine is never changed), with the defaults on: summaries,
recall and the document library (the bundled guide). For each mode, the median TTFT over the
last 10 turns divided by the median over turns 2-6 (turn 1 pays one-off costs): flat (≈1) with
reuse, growing with history without it. Also per turn: how much of the prompt was prefilled (the
share of turns that prefill under 30% of their prompt), and which turns came right after a fold.
Chats are stored in `settings.data_dir` and deleted afterwards; pass scratch settings
(`common.scratch_settings`) to keep them out of the user's database.

With `settings.engine_url` (`bench ttft --engine-url URL`) the chat runs through a remote engine
(engine/remote.py) and `loaded` is None: one mode only (the server keeps its own prefix cache whatever we
do), TTFT as llmweb's user sees it (queue, HTTP, the server's prefill), and reused tokens as the
server reported them, or `None` per turn where it reports nothing (then no prefill share either).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from llmweb.records import LOCAL_OWNER as LOCAL

from .common import describe_setup, scripted_turns

EARLY = slice(1, 6)  # turns 2-6
LATE = 10  # the last 10 turns
LOW_PREFILL = 0.3  # a turn "reuses well" when it prefills under this share of its prompt
TYPING_S = 5.0  # --history: from opening the imported chat to its first message


@dataclass
class ModeResult:
    mode: str
    ttft_s: list[float]
    prompt_tokens: list[int]
    reused_tokens: list[int]
    replies: list[str]
    after_fold: list[bool]  # the summary changed since the previous turn
    per_turn_tokens: list[int]  # retrieved + recalled tokens in the prompt
    reuse_reported: list[bool] = field(default_factory=list)  # False: a remote engine did not say
    setup: dict = field(default_factory=dict)  # a remote engine's: url, model, context

    def ratio(self) -> float:
        return statistics.median(self.ttft_s[-LATE:]) / max(statistics.median(self.ttft_s[EARLY]), 1e-9)

    def low_prefill_share(self) -> float:
        """Share of turns (from turn 2) that prefilled under LOW_PREFILL of their prompt."""
        if not all(self.reuse_reported):
            return float("nan")
        pairs = list(zip(self.prompt_tokens, self.reused_tokens))[1:]
        return sum((p - r) < LOW_PREFILL * p for p, r in pairs) / max(len(pairs), 1)


def run_mode(settings, loaded, turns: list[str], reuse: bool, history: int = 0) -> ModeResult:
    """One chat of `turns` on a Runtime of its own, with session KV reuse on or off. `history`: the
    chat starts with that many turns stored and none folded (an imported chat), opened as the page
    opens one (its next prompt prefilled in the background: `Chat.warm`), its first message sent
    TYPING_S later, and each turn goes on without waiting for its fold, as a person's next message does."""
    from llmweb.runtime import Runtime

    # as the app runs: the model in an engine process of its own where the settings say so
    own = settings.in_engine_process and not settings.engine_url
    runtime = Runtime(settings.replace(kv_reuse=reuse), loaded=None if own else loaded).start(background=False)
    res = ModeResult("reuse" if reuse else "full", [], [], [], [], [], [])
    try:
        chat = runtime.wait_ready()
        if settings.engine_url:
            from llmweb.engine.remote import RemoteRunner

            assert runtime.engine is not None and isinstance(runtime.engine.runner, RemoteRunner)
            assert runtime.budget is not None
            res.setup = {
                "engine_url": settings.engine_url,
                "model": runtime.engine.runner.server.model,
                "context_limit": runtime.budget.context_limit,
                "max_new_tokens": runtime.budget.max_new_tokens,
                "engine_concurrency": settings.engine_concurrency,
            }
        conv, folded = (imported(chat.store, history) if history else None), 0
        if conv is not None:  # opened as the page opens an import, and the first message typed meanwhile
            chat.warm(LOCAL, conv)
            time.sleep(TYPING_S)
        try:
            for text in turns:
                ev = chat.ask(LOCAL, conv, text, wait_summary=not history)
                conv, g = ev.conv_id, ev.stats.gen
                res.ttft_s.append(g.ttft_s)
                res.prompt_tokens.append(g.prompt_tokens)
                res.reused_tokens.append(g.reused_tokens)
                res.reuse_reported.append(g.reuse_reported)
                res.replies.append(ev.reply)
                res.after_fold.append(ev.stats.summarized_turns != folded)
                res.per_turn_tokens.append(ev.stats.sections.get("retrieved", 0) + ev.stats.sections.get("recall", 0))
                folded = ev.stats.summarized_turns
        finally:
            if conv is not None:
                chat.delete(LOCAL, conv)
    finally:
        runtime.close()
    return res


def imported(store, turns: int) -> str:
    """A new chat of the local user with `turns` turns stored and none in its summary, as an
    import of a long chat leaves it; its id."""
    conv = store.create_conversation(LOCAL)
    for i, text in enumerate(scripted_turns(turns)):
        store.add_turn(LOCAL, conv, text, f"An earlier answer, number {i + 1}: " + "the tide comes in " * 16)
    return conv


def script_turns(script: str, n_turns: int) -> list[str]:
    """The user messages of a scripted chat: "topics" (questions that come back to 20 topics; no
    statement about the user, so recall has nothing to bring back) or "facts" (fidelity's chat:
    ten statements about the user, filler questions, then questions about each statement, which
    recall answers once the statement has left the window), at most `n_turns` of them."""
    if script == "facts":
        from .fidelity import script as fidelity_script

        return [text for text, _ in fidelity_script(fillers_between=12, checkpoints=3)][:n_turns]
    assert script == "topics", f"unknown script {script!r}"
    return scripted_turns(n_turns)


def run(settings, loaded, n_turns: int, full: bool = True, script: str = "topics", history: int = 0) -> dict:
    """Both modes side by side (`full=False`: reuse only, for long runs); `history`: see `run_mode`."""
    from llmweb.chat.context import Budget

    turns = script_turns(script, n_turns)
    n_turns = len(turns)
    results = [run_mode(settings, loaded, turns, reuse=True, history=history)]
    if full and not settings.engine_url:
        results.append(run_mode(settings, loaded, turns, reuse=False, history=history))
    same = sum(a == b for a, b in zip(results[0].replies, results[-1].replies))
    if settings.engine_url:
        setup = {**results[0].setup, "quant": "remote", "device": settings.engine_url, "kv_reuse": settings.kv_reuse}
    else:
        setup = describe_setup(settings, loaded, Budget.from_settings(settings, loaded.max_context, loaded.on_cpu))
    return {
        "bench": "ttft",
        "turns": n_turns,
        "script": script,
        "history": history,
        "memory": "recall" if settings.summaries and settings.recall else "summary" if settings.summaries else "window",
        **setup,
        "modes": {
            r.mode: {
                "late_early_ratio": round(r.ratio(), 3),
                "median_early_s": round(statistics.median(r.ttft_s[EARLY]), 4),
                "median_last10_s": round(statistics.median(r.ttft_s[-LATE:]), 4),
                "low_prefill_share": _round(r.low_prefill_share()),
                "ttft_s": [round(x, 4) for x in r.ttft_s],
                "prompt_tokens": r.prompt_tokens,
                "reused_tokens": [u if ok else None for u, ok in zip(r.reused_tokens, r.reuse_reported)],
                "after_fold": r.after_fold,
                "retrieved_tokens": r.per_turn_tokens,
            }
            for r in results
        },
        "identical_replies": f"{same}/{n_turns}",
    }


def markdown(r: dict) -> str:
    modes = r["modes"]
    reuse, full = modes["reuse"], modes.get("full")
    head = "| turn | prompt tokens | reused | prefilled | retrieved + recalled | after a fold | TTFT reuse (s) |"
    rows = [
        head + (" TTFT full prefill (s) |" if full else ""),
        "|---:|---:|---:|---:|---:|:-:|---:|" + ("---:|" if full else ""),
    ]
    for i, (p, u, x, f, a) in enumerate(
        zip(
            reuse["prompt_tokens"],
            reuse["reused_tokens"],
            reuse["retrieved_tokens"],
            reuse["after_fold"],
            reuse["ttft_s"],
        )
    ):
        reused, prefilled = (u, p - u) if u is not None else ("not reported", "?")
        row = f"| {i + 1} | {p} | {reused} | {prefilled} | {x} | {'fold' if f else ''} | {a:.3f} |"
        rows.append(row + (f" {full['ttft_s'][i]:.3f} |" if full else ""))
    named = [("reuse", reuse)] + ([("full prefill", full)] if full else [])
    return "\n".join(
        [
            f"## TTFT over {r['turns']} turns of the {r.get('script', 'topics')!r} chat "
            f"({r['model']}, {r['quant']}, {r['device']}, memory: {r.get('memory', 'recall')})",
            (
                f"The chat starts with {r['history']} imported turns, none folded, opened {TYPING_S:.0f} s before "
                "its first message; turns do not wait for folds."
                if r.get("history")
                else ""
            ),
            "",
            *rows,
            "",
            "| mode | median TTFT, turns 2-6 (s) | median TTFT, last 10 (s) | late / early | turns prefilling < 30% |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {name} | {m['median_early_s']:.3f} | {m['median_last10_s']:.3f} | {m['late_early_ratio']:.2f} "
                f"| {_share(m['low_prefill_share'])} |"
                for name, m in named
            ),
            "",
            f"Turns with retrieved or recalled text: {sum(x > 0 for x in reuse['retrieved_tokens'])} "
            f"of {len(reuse['retrieved_tokens'])}",
            f"Replies identical in both modes: {r['identical_replies']}" if full else "",
            "",
        ]
    )


def _round(x: float) -> float | None:
    return None if x != x else round(x, 3)  # NaN (not reported) -> None in the JSON


def _share(x: float | None) -> str:
    return "not reported" if x is None else f"{x:.0%}"
