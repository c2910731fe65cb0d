"""The memory-fidelity benchmark: its script, its arithmetic, and a tiny real run with known answers."""

from __future__ import annotations

from llmweb.bench import fidelity as bf
from tests.conftest import make_settings


def test_script_plants_facts_then_asks_at_each_checkpoint():
    n = len(bf.FACTS)
    turns = bf.script(fillers_between=3, checkpoints=2)
    assert [t for t, _ in turns[:n]] == [f[0] for f in bf.FACTS]
    asked = [i for _, i in turns if i is not None]
    assert asked == list(range(n)) * 2
    assert len(turns) == n + 2 * (3 + n)
    two = bf.FACTS[:2]
    assert bf.script(fillers_between=1, checkpoints=1, facts=two) == [
        (two[0][0], None),
        (two[1][0], None),
        (f"Tell me one short fact about {bf.FILLERS[0]}.", None),
        (two[0][1], 0),
        (two[1][1], 1),
    ]


def test_summarise_gives_exact_rates_per_mode_and_checkpoint(tmp_path):
    facts = bf.FACTS[:2]
    checks = [
        bf.Check("window", 8, 0, in_prompt=False, answered=False),
        bf.Check("window", 9, 1, in_prompt=True, answered=False),
        bf.Check("window+summary", 8, 0, in_prompt=True, answered=True),
        bf.Check("window+summary", 9, 1, in_prompt=True, answered=False),
    ]
    r = bf.summarise(checks, make_settings(tmp_path, context_limit=320), None, 9, facts)
    w, s, rc = (r["modes"][m] for m in bf.MODES)
    assert (w["fact_in_prompt_rate"], w["answer_accuracy"]) == (0.5, 0.0)
    assert (s["fact_in_prompt_rate"], s["answer_accuracy"]) == (1.0, 0.5)
    assert (rc["fact_in_prompt_rate"], rc["checkpoints"]) == (0.0, []), "a mode without checks reports none"
    (cp,) = w["checkpoints"]  # the two questions of one checkpoint started at turn 8
    assert cp["turn"] == 8 and cp["facts"] == [
        {"fact": "Pixel", "in_prompt": False, "answered": False},
        {"fact": "Tromsø", "in_prompt": True, "answered": False},
    ]


def test_a_fact_that_left_the_window_is_kept_by_the_summary_modes(tmp_path, fp32_model):
    # one fact, 6 fillers, the question: at turn 8 the fact's turn is out of a 256-token window.
    # Short replies and summaries keep it light; the summaries themselves are not checked.
    settings = make_settings(tmp_path, context_limit=256, max_new_tokens=16, summary_tokens=16, quant="fp32")
    r = bf.run(
        settings, loaded=fp32_model, fillers_between=6, checkpoints=1, facts=bf.FACTS[:1], progress=lambda *_: None
    )
    assert r["turns_per_mode"] == 8 and set(r["modes"]) == set(bf.MODES)
    window, summary, recall = (r["modes"][m] for m in bf.MODES)
    assert window["fact_in_prompt_rate"] == 0.0, "the window alone has lost the fact"
    assert window["answer_accuracy"] == 0.0, "the model cannot answer with a name it was not shown"
    assert summary["fact_in_prompt_rate"] == 1.0, "the user's fact sentence is kept verbatim next to the summary"
    assert recall["fact_in_prompt_rate"] == 1.0
    for m in r["modes"].values():
        (cp,) = m["checkpoints"]
        assert cp["turn"] == 8 and [f["fact"] for f in cp["facts"]] == ["Pixel"]
    text = bf.markdown(r)
    assert "| window | 8 | 0% |" in text and "| window+summary | 8 | 100% |" in text
    assert not any(tmp_path.glob("llmweb-fidelity-*")), "the modes' data dirs are temporary"


def test_a_statement_without_details_comes_back_by_recall(tmp_path, fp32_model):
    # "I play the cello in a quartet." has no name, number or code: it is not kept as a fact, and
    # the 16-token summary cannot carry it. Only recall (the user's own statement, which the
    # summary does not hold) brings it back when the question is about it.
    settings = make_settings(tmp_path, context_limit=256, max_new_tokens=16, summary_tokens=16, quant="fp32")
    cello = [f for f in bf.FACTS if f[2] == "cello"]
    r = bf.run(settings, loaded=fp32_model, fillers_between=6, checkpoints=1, facts=cello, progress=lambda *_: None)
    window, summary, recall = (r["modes"][m] for m in bf.MODES)
    assert window["fact_in_prompt_rate"] == 0.0, "the window alone has lost the statement"
    assert summary["fact_in_prompt_rate"] == 0.0, "not a fact, and the short summary dropped it"
    assert recall["fact_in_prompt_rate"] == 1.0, "recall brings the turn back"
