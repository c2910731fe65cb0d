"""With the real model: a turn kept in context is in the prompt 60 turns later, through real folds;
one left out is in no later prompt or summary, and the next reply is still written from the rest."""

from __future__ import annotations

import pytest

from llmweb.records import LOCAL_OWNER, OUT, PIN
from llmweb.runtime import Runtime
from tests.conftest import make_settings

PINNED = "My locker code is quokka seven."
LEFT_OUT = "The walrus password is narwhal."


@pytest.fixture
def runtime(tmp_path, app_model):
    rt = Runtime(
        make_settings(tmp_path, context_limit=384, max_new_tokens=8, summary_tokens=48, recall=False),
        loaded=app_model,
    ).start(background=False)
    yield rt
    rt.close()


@pytest.mark.timeout(1800)  # 62 real turns and their folds: minutes on a busy 2-core machine
def test_a_kept_turn_outlives_60_turns_and_a_left_out_one_reaches_no_prompt_or_summary(runtime):
    chat, store = runtime.chat, runtime.store
    conv = None
    topics = ["cats", "the moon", "rivers", "bread", "music", "trains", "snow", "maps", "tea", "bees"]
    for i in range(62):
        text = PINNED if i == 0 else LEFT_OUT if i == 1 else f"Tell me one short fact about {topics[i % 10]}."
        fin = chat.ask(LOCAL_OWNER, conv, text, use_docs=False, wait_summary=True)
        conv = fin.conv_id
        if i == 1:
            chat.set_view(LOCAL_OWNER, conv, [(0, PIN)])
            chat.set_view(LOCAL_OWNER, conv, [(1, OUT)])
        elif i > 1:
            prompt = fin.prompt_text()
            assert PINNED in prompt, f"turn {i + 1}: the kept turn is not in the prompt"
            assert "narwhal" not in prompt.lower(), f"turn {i + 1}: the left-out turn is in the prompt"
            assert fin.stats.gen.prompt_tokens + fin.stats.sections["reserve"] <= 384
    got = store.get(LOCAL_OWNER, conv)
    assert got.summarized_upto > 10, "real folds ran meanwhile"
    assert "narwhal" not in got.summary.lower() and "walrus" not in got.summary.lower()
    assert not any("narwhal" in f.text.lower() for f in got.facts)
