"""`bench load`'s case of one hostile owner beside ordinary visitors (llmweb/bench/load.py
`beside_hostile`): its table follows from its figures, and a shortened run through the launched
app (the real model) reports both crowds and the hostile client's messages. No timing assertions:
these machines are noisy."""

from __future__ import annotations

import pytest

from llmweb.bench import load


def crowd_figures(p95: float, refusals: int = 0) -> dict:
    return {"turns": 24, "answered": 24, "refusals": refusals, "errors": [], "p50_s": 1.0, "p95_s": p95, "max_s": p95}


def test_the_hostile_owner_section_shows_both_crowds_and_the_ratio_of_their_p95():
    h = {
        "visitors": 8,
        "turns_each": 3,
        "message_chars": 4_621,
        "tabs": 2,
        "alone": crowd_figures(2.0),
        "beside": crowd_figures(3.5),
        "p95_ratio": 1.75,
        "hostile": {"sent": 9, "answered": 5, "refused": 4},
    }
    text = "\n".join(load.hostile_markdown(h))
    assert "| alone | 24/24 | 0 | 1.0 s | 2.0 s | 2.0 s |" in text
    assert "| beside the hostile owner | 24/24 | 0 | 1.0 s | 3.5 s | 3.5 s |" in text
    assert "**1.75x** (target <= 2x)" in text and "sent 9 messages (5 answered, 4 refused)" in text
    assert "2 tabs of 4,621-character messages" in text


@pytest.mark.slow  # the real model behind the launched app
def test_a_shortened_run_beside_a_hostile_owner_answers_every_ordinary_turn(tmp_path, app_model):
    from llmweb.runtime import Runtime
    from tests.conftest import make_settings
    from tests.test_hostile import serve

    settings = make_settings(tmp_path, max_new_tokens=4, single_user="0", anon_per_address=1000)
    runtime = Runtime(settings, loaded=app_model).start(background=False)
    try:
        with serve(runtime) as (_demo, url):
            h = load.beside_hostile(url, visitors=2, turns=1, message=load.LONG[:600], tabs=1)
    finally:
        runtime.close()
    for crowd in (h["alone"], h["beside"]):
        assert crowd["turns"] == crowd["answered"] == 2 and not crowd["errors"], crowd
    assert h["hostile"]["sent"] >= 1 and h["hostile"]["sent"] == h["hostile"]["answered"] + h["hostile"]["refused"]
    assert h["p95_ratio"] == round(h["beside"]["p95_s"] / h["alone"]["p95_s"], 2)
