"""Long-session memory: grounded summaries, the user's facts kept verbatim, recall of earlier turns."""

from __future__ import annotations

from llmweb import memory
from llmweb.chat import Finished
from llmweb.runtime import Runtime
from llmweb.store import Fact
from tests.conftest import make_settings
from tests.fakes import FakeFormat

SOURCE = "User: my dog is called Pixel, a border collie. She was born on 3 May 2019.\nAssistant: Lovely!"


def test_summary_sentence_with_an_invented_name_is_removed():
    g = memory.ground("Dana Okafor, a Maltese Terrier, is a popular pet. The user has a border collie called Pixel. "
                      "Pixel was born in 2019. Pixel is 11 years old.", SOURCE)
    assert g.text == "The user has a border collie called Pixel. Pixel was born in 2019."
    assert g.dropped == ("Dana Okafor, a Maltese Terrier, is a popular pet.", "Pixel is 11 years old.")


def test_plain_sentences_without_names_are_kept():
    g = memory.ground("Discussed dogs and their training. The assistant suggested short walks.", SOURCE)
    assert not g.dropped


def test_extract_facts_keeps_the_users_own_sentences_verbatim():
    facts = memory.extract_facts([
        "Hi! My dog is called Pixel, a border collie. What should I feed her?",
        "Tell me a joke.",
        "Remember that my flight leaves at 07:40 on Friday.",
        "I prefer short answers.",
        "My dog is called Pixel, a border collie.",  # a repeat
    ])
    assert facts == ["My dog is called Pixel, a border collie.", "Remember that my flight leaves at 07:40 on Friday.",
                     "I prefer short answers."]


def test_select_facts_keeps_pinned_then_newest_within_the_cap():
    fmt = FakeFormat()
    facts = [Fact(1, "old fact one two", False, 1), Fact(2, "pinned fact one two", True, 2),
             Fact(3, "new fact one two", False, 3)]
    chosen = memory.select_facts(facts, max_tokens=12, count=fmt.count)  # room for two facts of 4+2 tokens
    assert [f.id for f in chosen] == [2, 3], "the oldest unpinned goes first"
    assert memory.facts_block(chosen).splitlines()[1:] == ["- pinned fact one two", "- new fact one two"]


def run(chat, conv, text):
    return [e for e in chat.send(conv, text, use_docs=False, wait_summary=True) if isinstance(e, Finished)][0]


def test_fact_from_turn_1_is_in_the_prompt_sixty_turns_later(tmp_path, fp32_model):
    rt = Runtime(make_settings(tmp_path, context_limit=512, max_new_tokens=16, summary_tokens=64, quant="fp32"),
                 loaded=fp32_model).start(background=False)
    try:
        chat, conv = rt.chat, rt.store.create_conversation()
        run(chat, conv, "My dog is called Pixel, a border collie.")
        fillers = ["the weather", "trains", "bread", "rivers", "music", "chess", "tea", "maps", "snow", "bees"]
        for i in range(58):
            run(chat, conv, f"Filler {i}: say one short thing about {fillers[i % len(fillers)]}.")
        fin = run(chat, conv, "What is my dog called, and what breed is she?")
        prompt = fin.prompt_text()
        stored = rt.store.get(conv)
        assert stored.summarized_upto > 1, "turn 1 left the window long ago"
        assert "My dog is called Pixel, a border collie." in prompt  # verbatim: a kept fact and/or recall
        assert fin.stats.sections["recall"] > 0, "the earlier turn was recalled"
        assert any(f.text == "My dog is called Pixel, a border collie." for f in stored.facts)
        assert fin.stats.gen.prompt_tokens + fin.stats.sections["reserve"] <= 512
    finally:
        rt.close()


def test_pin_unpin_delete_persist_and_reach_the_prompt(tmp_path, fp32_model):
    settings = make_settings(tmp_path, max_new_tokens=8, quant="fp32")
    rt = Runtime(settings, loaded=fp32_model).start(background=False)
    conv = rt.store.create_conversation()
    rt.chat.add_fact(conv, "My sister Ana lives in Lisbon.")
    rt.chat.add_fact(conv, "I am allergic to peanuts.")
    a, b = rt.store.facts(conv)
    rt.chat.set_fact_pinned(a.id, False)
    rt.chat.delete_fact(b.id)
    fin = run(rt.chat, conv, "Hello")
    assert "My sister Ana lives in Lisbon." in fin.prompt_text()
    assert "peanuts" not in fin.prompt_text()
    rt.close()
    rt2 = Runtime(settings, loaded=fp32_model)  # a restart: the store on the same file
    try:
        facts = rt2.store.facts(conv)
        assert [(f.text, f.pinned) for f in facts] == [("My sister Ana lives in Lisbon.", False)]
    finally:
        rt2.close()


def test_deleting_a_conversation_deletes_its_recall_index(tmp_path, fp32_model):
    from llmweb.retrieval import list_namespaces

    rt = Runtime(make_settings(tmp_path, context_limit=384, max_new_tokens=16, summary_tokens=48, quant="fp32"),
                 loaded=fp32_model).start(background=False)
    try:
        conv = rt.store.create_conversation()
        for i in range(14):
            run(rt.chat, conv, f"Message {i}: tell me one fact about the number {i}.")
        assert rt.store.get(conv).summarized_upto > 0
        assert f"recall-{conv}" in list_namespaces(rt.settings)
        rt.chat.delete(conv)
        assert f"recall-{conv}" not in list_namespaces(rt.settings)
    finally:
        rt.close()
