"""The memory-fidelity benchmark runs end to end (tiny size) and reports per mode and checkpoint."""

from __future__ import annotations

from llmweb.bench import fidelity as bf
from tests.conftest import make_settings


def test_script_plants_facts_then_asks_at_each_checkpoint():
    turns = bf.script(fillers_between=3, checkpoints=2)
    assert [t for t, _ in turns[:5]] == [f[0] for f in bf.FACTS]
    asked = [i for _, i in turns if i is not None]
    assert asked == list(range(5)) * 2
    assert len(turns) == 5 + 2 * (3 + 5)


def test_fidelity_bench_tiny_run(tmp_path, fp32_model):
    settings = make_settings(tmp_path, context_limit=320, max_new_tokens=16, summary_tokens=48, quant="fp32")
    r = bf.run(settings, loaded=fp32_model, fillers_between=2, checkpoints=1, progress=lambda *_: None)
    assert set(r["modes"]) == set(bf.MODES)
    for m in r["modes"].values():
        assert 0 <= m["fact_in_prompt_rate"] <= 1 and 0 <= m["answer_accuracy"] <= 1
        assert len(m["checkpoints"]) == 1 and len(m["checkpoints"][0]["facts"]) == len(bf.FACTS)
    # memory can only add facts to the prompt: never fewer than the bare window
    rates = [r["modes"][m]["fact_in_prompt_rate"] for m in bf.MODES]
    assert rates[2] >= rates[0] and rates[1] >= rates[0]
    text = bf.markdown(r)
    assert "| window+summary+recall |" in text and "facts in prompt" in text
