"""`python -m llmweb bench fidelity`: does a long session keep what the user said early?

Facts are planted in the first turns, filler turns push them out of the window, then each fact
is asked about at later checkpoints. For every fact and checkpoint it records whether the
fact's words are in the prompt (what memory can control, whatever the model's size) and
whether the reply contains the answer (what a 135M model then makes of it). Three modes run in
one process on one loaded model: window only, window + summary (with the user's facts), and
window + summary + recall of earlier turns.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

FACTS = [
    ("My dog is called Pixel, a border collie.", "What is my dog called?", "Pixel"),
    ("I was born in Tromsø in 1987.", "In which town was I born?", "Tromsø"),
    ("My favourite colour is teal.", "What is my favourite colour?", "teal"),
    ("Remember that my locker code is 4711.", "What is my locker code?", "4711"),
    ("My sister Ana works as a pilot.", "What is my sister Ana's job?", "pilot"),
]
FILLERS = ["the weather in spring", "how trains work", "baking bread", "why rivers bend", "jazz music",
           "the rules of chess", "green tea", "old maps", "snowflakes", "honey bees", "lighthouses",
           "paper planes", "volcanoes", "the moon's phases", "bicycles"]
MODES = {"window": dict(summaries=False, recall=False),
         "window+summary": dict(summaries=True, recall=False),
         "window+summary+recall": dict(summaries=True, recall=True)}


@dataclass
class Check:
    mode: str
    checkpoint: int  # the turn number at which the question was asked
    fact: int
    in_prompt: bool
    answered: bool


def script(fillers_between: int, checkpoints: int) -> list[tuple[str, int | None]]:
    """(user message, index of the fact asked about or None)."""
    turns: list[tuple[str, int | None]] = [(statement, None) for statement, _, _ in FACTS]
    k = 0
    for _ in range(checkpoints):
        for _ in range(fillers_between):
            turns.append((f"Tell me one short fact about {FILLERS[k % len(FILLERS)]}.", None))
            k += 1
        turns += [(question, i) for i, (_, question, _) in enumerate(FACTS)]
    return turns


def run(settings, loaded=None, fillers_between: int = 12, checkpoints: int = 3, progress=print) -> dict:
    from ..chat import Finished
    from ..runtime import Runtime

    turns = script(fillers_between, checkpoints)
    checks: list[Check] = []
    root = Path(tempfile.mkdtemp(prefix="llmweb-fidelity-", dir=settings.data_dir if settings.data_dir.exists() else None))
    for mode, switches in MODES.items():
        rt = Runtime(settings.replace(data_dir=root / mode.replace("+", "-"), sample_docs=False, **switches),
                     loaded=loaded).start(background=False)
        loaded = rt.loaded
        try:
            conv = rt.store.create_conversation(f"fidelity {mode}")
            for n, (text, fact) in enumerate(turns, 1):
                fin = [e for e in rt.chat.send(conv, text, use_docs=False, wait_summary=True, seed=0)
                       if isinstance(e, Finished)][0]
                if fact is None:
                    continue
                statement, _, answer = FACTS[fact]
                prompt = fin.prompt_text()
                prompt_without_question = prompt[: prompt.rfind(text)] if text in prompt else prompt
                checks.append(Check(mode, n, fact, answer.lower() in prompt_without_question.lower(),
                                    answer.lower() in fin.reply.lower()))
            progress(f"fidelity: {mode} done ({len(turns)} turns)")
        finally:
            rt.close()
    return summarise(checks, settings, loaded, len(turns))


def summarise(checks: list[Check], settings, loaded, n_turns: int) -> dict:
    out = {"bench": "fidelity", "turns_per_mode": n_turns, "context_limit": settings.context_limit,
           "model": loaded.name if loaded else "", "quant": loaded.quant if loaded else "", "modes": {}}
    for mode in MODES:
        rows = [c for c in checks if c.mode == mode]
        by_cp: dict[int, list[Check]] = {}
        for c in rows:
            by_cp.setdefault(c.checkpoint - c.fact, []).append(c)  # the questions of one checkpoint share a start
        out["modes"][mode] = {
            "fact_in_prompt_rate": round(sum(c.in_prompt for c in rows) / max(len(rows), 1), 3),
            "answer_accuracy": round(sum(c.answered for c in rows) / max(len(rows), 1), 3),
            "checkpoints": [{"turn": start,
                             "fact_in_prompt_rate": round(sum(c.in_prompt for c in cs) / len(cs), 3),
                             "answer_accuracy": round(sum(c.answered for c in cs) / len(cs), 3),
                             "facts": [{"fact": FACTS[c.fact][2], "in_prompt": c.in_prompt, "answered": c.answered}
                                       for c in cs]}
                            for start, cs in sorted(by_cp.items())],
        }
    return out


def markdown(r: dict) -> str:
    lines = [f"## Memory fidelity ({r['model']}, {r['quant']}, context {r['context_limit']}, "
             f"{r['turns_per_mode']} turns per mode)", "",
             "| mode | checkpoint (turn) | facts in prompt | answers correct |", "|---|---:|---:|---:|"]
    for mode, m in r["modes"].items():
        for cp in m["checkpoints"]:
            lines.append(f"| {mode} | {cp['turn']} | {cp['fact_in_prompt_rate']:.0%} | {cp['answer_accuracy']:.0%} |")
    lines += ["", "| mode | facts in prompt (all checkpoints) | answers correct |", "|---|---:|---:|"]
    lines += [f"| {mode} | {m['fact_in_prompt_rate']:.0%} | {m['answer_accuracy']:.0%} |" for mode, m in r["modes"].items()]
    lines += ["", "Per fact (in prompt / answered), last checkpoint:", ""]
    for mode, m in r["modes"].items():
        last = m["checkpoints"][-1]["facts"] if m["checkpoints"] else []
        lines.append(f"- {mode}: " + ", ".join(f"{f['fact']} {'✓' if f['in_prompt'] else '✗'}/"
                                              f"{'✓' if f['answered'] else '✗'}" for f in last))
    return "\n".join(lines) + "\n"
