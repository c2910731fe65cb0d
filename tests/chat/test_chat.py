"""The chat path with the real model: budgets hold over long sessions, summaries happen,
KV reuse never changes the text, bad messages get clear errors."""

from __future__ import annotations

import pytest

from llmweb.chat.session import Delta, Finished, clean_message
from llmweb.errors import InputError
from llmweb.records import LOCAL_OWNER as LOCAL
from llmweb.records import Source
from llmweb.retrieval.library import LOCAL_OWNER
from llmweb.runtime import Runtime
from tests.conftest import make_settings


def run_turn(chat, conv, text, **kw):
    deltas, fin = [], None
    for ev in chat.send(LOCAL, conv, text, use_docs=False, wait_summary=True, **kw):
        if isinstance(ev, Delta):
            deltas.append(ev.text)
        elif isinstance(ev, Finished):
            fin = ev
    return deltas, fin


@pytest.fixture
def small_runtime(tmp_path, app_model):
    """The default model (int8-cpu here: twice the decode speed of fp32); exact comparisons use fp32."""
    rt = Runtime(
        make_settings(tmp_path, context_limit=512, max_new_tokens=40, summary_tokens=64),
        loaded=app_model,
    ).start(background=False)
    yield rt
    rt.close()


def test_clean_message_rejects_empty_and_huge_and_strips_controls():
    with pytest.raises(InputError, match="empty"):
        clean_message(" \n\t ", 100)
    with pytest.raises(InputError, match="1,000 characters; the limit is 100"):
        clean_message("x" * 1000, 100)
    assert clean_message("a\x00b\x1bc 🙂 שלום \ud800", 100) == "abc 🙂 שלום ?"


def test_sixty_turns_stay_inside_a_small_context(tmp_path, app_model):
    """Replies of at most 16 tokens: each turn still adds ~35 tokens against a 512-token context, so
    the window fills and folds several times in 60 turns; what is checked is every turn's plan."""
    rt = Runtime(
        make_settings(tmp_path, context_limit=512, max_new_tokens=16, summary_tokens=64), loaded=app_model
    ).start(background=False)
    try:
        chat = rt.chat
        conv = rt.store.create_conversation(LOCAL)
        topics = ["cats", "the moon", "rivers", "bread", "music", "trains", "snow", "maps", "tea", "bees"]
        folds = set()
        for i in range(60):
            user = f"Turn {i}: tell me one short fact about {topics[i % len(topics)]}."
            deltas, fin = run_turn(chat, conv, user)
            s = fin.stats
            assert s.gen.prompt_tokens + s.sections["reserve"] <= 512 == s.context_limit
            assert sum(v for k, v in s.sections.items() if k != "reserve") == s.gen.prompt_tokens
            assert deltas and deltas[-1].strip() == fin.reply
            # the newest turns are verbatim in the prompt
            prompt = fin.prompt_text()
            assert user in prompt
            stored = rt.store.get(LOCAL, conv)
            for t in stored.turns[-3:-1]:
                assert t.user in prompt and t.assistant in prompt
            folds.add(stored.summarized_upto)
        stored = rt.store.get(LOCAL, conv)
        assert len(folds - {0}) >= 2, f"the window folded more than once: {sorted(folds)}"
        assert stored.summary.strip()
        assert len(stored.turns) == 60
    finally:
        rt.close()


def test_a_long_window_only_chat_reuses_its_cache_between_the_windows_steps(tmp_path, app_model):
    """Window memory over a chat far past its room (an import of 30 turns, a 512-token context):
    the first turn prefills a window cut to the low-water mark, and the next turns start where it
    started, so the real engine serves all but their own message from the chat's KV cache (before,
    each turn moved the window by a turn and prefilled the whole prompt)."""
    rt = Runtime(
        make_settings(tmp_path, context_limit=512, max_new_tokens=24, summaries=False), loaded=app_model
    ).start(background=False)
    try:
        conv = rt.store.create_conversation(LOCAL)
        for i in range(30):
            rt.store.add_turn(LOCAL, conv, f"Old question {i} about the sea?", f"Old answer {i}: " + "waves " * 20)
        gens = [run_turn(rt.chat, conv, f"Name one fish, number {i}.")[1].stats for i in range(3)]
        assert gens[0].dropped_turns > 0 and gens[0].gen.reused_tokens == 0
        for prev, s in zip(gens, gens[1:]):
            assert s.dropped_turns == prev.dropped_turns, "the window holds its start"
            assert s.gen.reused_tokens >= prev.gen.prompt_tokens, (prev.gen, s.gen)
            assert s.gen.prefilled_tokens <= 40, s.gen
    finally:
        rt.close()


def test_reuse_gives_the_same_replies_over_15_turns_with_a_compression(tmp_path, fp32_model):
    """Replies of at most 16 tokens: the turns still pass the 512-token context and fold, and every
    reply after the first is decoded over a prompt served mostly from the cache."""
    replies = {}
    summaries = {}
    for mode in (True, False):
        rt = Runtime(
            make_settings(
                tmp_path / str(mode),
                context_limit=512,
                max_new_tokens=16,
                summary_tokens=64,
                kv_reuse=mode,
                quant="fp32",
            ),
            loaded=fp32_model,
        ).start(background=False)
        try:
            conv = rt.store.create_conversation(LOCAL)
            out, reused = [], []
            for i in range(15):
                _, fin = run_turn(rt.chat, conv, f"Question {i}: name a colour and a fruit of that colour.")
                out.append(fin.reply)
                reused.append(fin.stats.gen.reused_tokens)
            replies[mode] = out
            summaries[mode] = rt.store.get(LOCAL, conv).summarized_upto
            if mode:
                assert sum(r > 0 for r in reused) >= 10, reused
            else:
                assert not any(reused)
        finally:
            rt.close()
    assert summaries[True] == summaries[False] > 0, "one compression (at least) in both modes"
    assert replies[True] == replies[False]


def test_oversized_message_is_refused_with_both_numbers(small_runtime):
    conv = small_runtime.store.create_conversation(LOCAL)
    with pytest.raises(InputError, match=r"Your message is [\d,]+ tokens; the limit is"):
        run_turn(small_runtime.chat, conv, "word " * 3000)
    assert small_runtime.store.get(LOCAL, conv).turns == []


def test_closing_the_stream_cancels_and_keeps_the_partial_reply(small_runtime):
    chat = small_runtime.chat
    conv = small_runtime.store.create_conversation(LOCAL)
    gen = chat.send(LOCAL, conv, "Write a long story about a dragon and a knight.", use_docs=False)
    n = 0
    for ev in gen:
        if isinstance(ev, Delta):
            n += 1
            if n == 3:
                break
    gen.close()
    stored = small_runtime.store.get(LOCAL, conv)
    assert len(stored.turns) == 1 and stored.turns[0].stats.gen.finish_reason == "cancelled"
    assert stored.turns[0].stats.stopped and stored.turns[0].stats.turn == 1
    assert stored.turns[0].assistant
    _, fin = run_turn(chat, conv, "What is 2 + 2?")  # the worker is free
    assert fin.stats.gen.finish_reason in ("eos", "length")


def test_question_about_the_sample_guide_cites_it(tmp_path, fp32_model):
    rt = Runtime(make_settings(tmp_path, sample_docs=True, max_new_tokens=32, quant="fp32"), loaded=fp32_model).start(
        background=False
    )
    try:
        # data/sample is ingested as a folder: its files are named "<folder>/<relative path>"
        assert [d.source for d in rt.library.documents(LOCAL_OWNER)] == ["sample/llmweb-guide.md"]
        conv = rt.store.create_conversation(LOCAL)
        fin = rt.chat.ask(LOCAL, conv, "How do I change the model?")
        assert fin.sources, "the answer cites sources"
        top = fin.sources[0]
        assert all(isinstance(s, Source) for s in fin.sources)
        assert [s.n for s in fin.sources] == list(range(1, len(fin.sources) + 1))
        assert (top.source, top.heading, top.kind) == (
            "sample/llmweb-guide.md",
            "How do I change the model?",
            "document",
        )
        assert top.label() == "sample/llmweb-guide.md, How do I change the model?"
        assert fin.stats.sections["retrieved"] > 0
        assert "LLMWEB_MODEL" in fin.prompt_text()
        # the sources are stored with the turn, for the UI after a reload
        assert rt.store.get(LOCAL, conv).turns[0].sources == fin.sources
    finally:
        rt.close()
