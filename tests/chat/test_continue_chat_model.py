"""With the real model: "Continue in a new chat" from a 120-turn chat stored as an import leaves it
(none folded; `bench continue` builds the same chat): the real summariser folds its window, and the
new chat's first prompt holds every fact planted across the 120 turns, from a KV cache of its own."""

from __future__ import annotations

import pytest

from llmweb.bench.carry import QUESTION, long_chat
from llmweb.records import LOCAL_OWNER
from llmweb.runtime import Runtime
from tests.conftest import make_settings


@pytest.fixture
def runtime(tmp_path, app_model):
    rt = Runtime(
        make_settings(
            tmp_path,
            context_limit=1024,
            max_new_tokens=8,
            summary_tokens=48,
            facts_tokens=192,  # the ten planted facts are ~140 tokens: at the default 128, the newest is left out
            recall=False,
            request_timeout_s=900,
        ),
        loaded=app_model,
    ).start(background=False)
    yield rt
    rt.close()


# the real summariser over a 117-turn window of ~4,000 tokens: minutes on a busy 2-core machine, where
# one of its requests took over the default 120 s limit once (the chat then goes on with its facts alone)
@pytest.mark.timeout(1800)
@pytest.mark.xfail(
    strict=True,
    reason="9 of the 10 planted facts reach the first prompt: the facts section stays at 126 tokens and "
    "the tenth is left out, even with facts_tokens=192 (to be looked into)",
)
def test_a_chat_continued_from_120_turns_starts_with_every_planted_fact_and_a_fresh_cache(runtime):
    chat, store = runtime.chat, runtime.store
    old, planted = long_chat(store, 120, reply="Noted, number {n}.")  # short replies: fewer summary requests
    assert len(planted) == 10
    new = chat.carry.continue_in_new(LOCAL_OWNER, old)
    got = store.get(LOCAL_OWNER, new)
    assert got.continues is not None and got.continues[0] == old and got.summary, "linked, with a summary"
    first = chat.ask(LOCAL_OWNER, new, QUESTION, use_docs=False)
    prompt = first.prompt_text()
    assert [f for f in planted if f not in prompt] == [], prompt[:2000]
    assert first.stats.gen.reused_tokens == 0, "its KV cache starts fresh"
    assert first.stats.gen.prompt_tokens + first.stats.sections["reserve"] <= 1024
    assert len(store.get(LOCAL_OWNER, old).turns) == 120, "the chat it continues is unchanged"
