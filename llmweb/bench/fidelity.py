"""`python -m llmweb bench fidelity`: does a long session keep what the user said early?

Facts are planted in the first turns, filler turns push them out of the window, then each fact
is asked about at later checkpoints. For every fact and checkpoint it records whether the
fact's words are in the prompt (what memory can control, whatever the model's size) and
whether the reply contains the answer (what a 135M model then makes of it). Three modes run in
one process on one loaded model: window only, window + summary (with the user's facts), and
window + summary + recall of earlier turns. Each mode is a Runtime of its own, built from
`settings.replace(summaries=..., recall=...)` in a temporary data dir that is removed afterwards.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from llmweb.records import LOCAL_OWNER as LOCAL

from .common import scratch_settings

FACTS = [
    ("My dog is called Pixel, a border collie.", "What is my dog called?", "Pixel"),
    ("I was born in Tromsø in 1987.", "In which town was I born?", "Tromsø"),
    ("My favourite colour is teal.", "What is my favourite colour?", "teal"),
    ("Remember that my locker code is 4711.", "What is my locker code?", "4711"),
    ("My sister Ana works as a pilot.", "What is my sister Ana's job?", "pilot"),
    ("My car is a green Volvo from 2009.", "What make is my car?", "Volvo"),
    ("I work at the Zeiss lab in Jena.", "Which company do I work for?", "Zeiss"),
    ("My flight to Lisbon leaves on Friday.", "Which city am I flying to?", "Lisbon"),
    ("My son Teo is allergic to peanuts.", "What is my son allergic to?", "peanuts"),
    ("I play the cello in a quartet.", "Which instrument do I play?", "cello"),
]  # 10 facts x 3 checkpoints: 30 questions per mode, enough to tell the modes apart
FILLERS = [
    "the weather in spring",
    "how trains work",
    "baking bread",
    "why rivers bend",
    "jazz music",
    "the rules of chess",
    "green tea",
    "old maps",
    "snowflakes",
    "honey bees",
    "lighthouses",
    "paper planes",
    "volcanoes",
    "the moon's phases",
    "bicycles",
]
MODES = {
    "window": dict(summaries=False, recall=False),
    "window+summary": dict(summaries=True, recall=False),
    "window+summary+recall": dict(summaries=True, recall=True),
}


@dataclass
class Check:
    mode: str
    checkpoint: int  # the turn number at which the question was asked
    fact: int  # index into the run's facts
    in_prompt: bool
    answered: bool


def script(
    fillers_between: int,
    checkpoints: int,
    facts: Sequence[tuple[str, str, str]] = FACTS,
) -> list[tuple[str, int | None]]:
    """(user message, index of the fact asked about or None): the facts, then per checkpoint fillers and questions."""
    turns: list[tuple[str, int | None]] = [(statement, None) for statement, _, _ in facts]
    k = 0
    for _ in range(checkpoints):
        for _ in range(fillers_between):
            turns.append((f"Tell me one short fact about {FILLERS[k % len(FILLERS)]}.", None))
            k += 1
        turns += [(question, i) for i, (_, question, _) in enumerate(facts)]
    return turns


def run(
    settings,
    loaded=None,
    fillers_between: int = 12,
    checkpoints: int = 3,
    progress=print,
    facts: Sequence[tuple[str, str, str]] = FACTS,
) -> dict:
    """Plant `facts` (statement, question, answer), then ask about each at every checkpoint, in every mode."""
    from llmweb.chat.session import Finished
    from llmweb.runtime import Runtime

    turns = script(fillers_between, checkpoints, facts)
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="llmweb-fidelity-") as root:
        for mode, switches in MODES.items():
            scratch = scratch_settings(settings, f"{root}/{mode.replace('+', '-')}")
            rt = Runtime(scratch.replace(**switches), loaded=loaded).start(background=False)
            # the next mode shares this model where it is in this process; an engine process's model
            # (the default on the CPU) is that process's, and each mode starts its own
            loaded = rt.loaded if rt.loaded is not None and rt.loaded.model is not None else None
            try:
                chat = rt.wait_ready()
                conv = rt.store.create_conversation(LOCAL, f"fidelity {mode}")
                for n, (text, fact) in enumerate(turns, 1):
                    fin = [
                        e
                        for e in chat.send(LOCAL, conv, text, use_docs=False, wait_summary=True, seed=0)
                        if isinstance(e, Finished)
                    ][0]
                    if fact is None:
                        continue
                    answer = facts[fact][2]
                    prompt = fin.prompt_text()
                    # the question itself cannot count (an answer word in it would); everything
                    # else can, recalled turns included (the planner places them after it)
                    at = prompt.rfind(text)
                    prompt_without_question = prompt[:at] + prompt[at + len(text) :] if at >= 0 else prompt
                    checks.append(
                        Check(
                            mode,
                            n,
                            fact,
                            answer.lower() in prompt_without_question.lower(),
                            answer.lower() in fin.reply.lower(),
                        )
                    )
                progress(f"fidelity: {mode} done ({len(turns)} turns)")
            finally:
                rt.close()
    return summarise(checks, settings, loaded, len(turns), facts)


def summarise(
    checks: list[Check], settings, loaded, n_turns: int, facts: Sequence[tuple[str, str, str]] = FACTS
) -> dict:
    """Per mode: the share of checks with the answer in the prompt and in the reply, overall and per checkpoint."""
    out = {
        "bench": "fidelity",
        "turns_per_mode": n_turns,
        "context_limit": settings.context_limit,
        "model": loaded.name if loaded else "",
        "quant": loaded.quant if loaded else "",
        "modes": {},
    }
    for mode in MODES:
        rows = [c for c in checks if c.mode == mode]
        by_cp: dict[int, list[Check]] = {}
        for c in rows:
            by_cp.setdefault(c.checkpoint - c.fact, []).append(c)  # the questions of one checkpoint share a start
        out["modes"][mode] = {
            "fact_in_prompt_rate": round(sum(c.in_prompt for c in rows) / max(len(rows), 1), 3),
            "answer_accuracy": round(sum(c.answered for c in rows) / max(len(rows), 1), 3),
            "checkpoints": [
                {
                    "turn": start,
                    "fact_in_prompt_rate": round(sum(c.in_prompt for c in cs) / len(cs), 3),
                    "answer_accuracy": round(sum(c.answered for c in cs) / len(cs), 3),
                    "facts": [{"fact": facts[c.fact][2], "in_prompt": c.in_prompt, "answered": c.answered} for c in cs],
                }
                for start, cs in sorted(by_cp.items())
            ],
        }
    return out


def markdown(r: dict) -> str:
    lines = [
        f"## Memory fidelity ({r['model']}, {r['quant']}, context {r['context_limit']}, "
        f"{r['turns_per_mode']} turns per mode)",
        "",
        "| mode | checkpoint (turn) | facts in prompt | answers correct |",
        "|---|---:|---:|---:|",
    ]
    for mode, m in r["modes"].items():
        for cp in m["checkpoints"]:
            lines.append(f"| {mode} | {cp['turn']} | {cp['fact_in_prompt_rate']:.0%} | {cp['answer_accuracy']:.0%} |")
    lines += ["", "| mode | facts in prompt (all checkpoints) | answers correct |", "|---|---:|---:|"]
    lines += [
        f"| {mode} | {m['fact_in_prompt_rate']:.0%} | {m['answer_accuracy']:.0%} |" for mode, m in r["modes"].items()
    ]
    lines += ["", "Per fact (in prompt / answered), last checkpoint:", ""]
    for mode, m in r["modes"].items():
        last = m["checkpoints"][-1]["facts"] if m["checkpoints"] else []
        lines.append(
            f"- {mode}: "
            + ", ".join(f"{f['fact']} {'✓' if f['in_prompt'] else '✗'}/{'✓' if f['answered'] else '✗'}" for f in last)
        )
    return "\n".join(lines) + "\n"
