"""The user's facts kept verbatim, grounded summaries, recall of earlier turns."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmweb.chat import facts as facts_mod
from llmweb.chat.session import Finished
from llmweb.records import LOCAL_OWNER as LOCAL
from llmweb.runtime import Runtime
from llmweb.store.models import Fact
from tests.conftest import make_settings
from tests.fakes import FakeFormat

SOURCE = "User: my dog is called Pixel, a border collie. She was born on 3 May 2019.\nAssistant: Lovely!"


def test_summary_sentence_with_an_invented_name_is_removed():
    g = facts_mod.ground(
        "Dana Okafor, a Maltese Terrier, is a popular pet. The user has a border collie called Pixel. "
        "Pixel was born in 2019. Pixel is 11 years old.",
        SOURCE,
    )
    assert g.text == "The user has a border collie called Pixel. Pixel was born in 2019."
    assert g.dropped == ("Dana Okafor, a Maltese Terrier, is a popular pet.", "Pixel is 11 years old.")


def test_plain_sentences_without_names_are_kept():
    g = facts_mod.ground("Discussed dogs and their training. The assistant suggested short walks.", SOURCE)
    assert not g.dropped


def test_extract_facts_keeps_the_users_own_sentences_verbatim():
    facts = facts_mod.extract_facts(
        [
            "Hi! My dog is called Pixel, a border collie. What should I feed her?",
            "Tell me a joke.",
            "Remember that my flight leaves at 07:40 on Friday.",
            "I prefer short answers.",
            "My dog is called Pixel, a border collie.",  # a repeat
        ]
    )
    assert facts == [
        "My dog is called Pixel, a border collie.",
        "Remember that my flight leaves at 07:40 on Friday.",
        "I prefer short answers.",
    ]


def test_select_facts_keeps_pinned_then_newest_within_the_cap():
    fmt = FakeFormat()
    facts = [
        Fact(1, "old fact one two", False, 1),
        Fact(2, "pinned fact one two", True, 2),
        Fact(3, "new fact one two", False, 3),
    ]
    chosen, dropped = facts_mod.select_facts(facts, max_tokens=12, count=fmt.count)  # two facts of 4+2 tokens
    assert [f.id for f in chosen] == [2, 3], "the oldest unpinned goes first"
    assert [f.id for f in dropped] == [1]
    assert facts_mod.facts_block(chosen).splitlines()[1:] == ["- pinned fact one two", "- new fact one two"]


def test_select_facts_keeps_every_pinned_fact_even_past_the_cap():
    fmt = FakeFormat()
    facts = [
        Fact(1, "pinned one two three", True, 1),
        Fact(2, "pinned four five six", True, 2),
        Fact(3, "new fact", False, 3),
    ]
    chosen, dropped = facts_mod.select_facts(facts, max_tokens=6, count=fmt.count)
    assert [f.id for f in chosen] == [1, 2] and [f.id for f in dropped] == [3]


def run(chat, conv, text):
    return [e for e in chat.send(LOCAL, conv, text, use_docs=False, wait_summary=True) if isinstance(e, Finished)][0]


ASKED_EVERY = 12  # of a long chat's filler turns, every 12th is asked of the model; the others are stored


def grow(rt, conv, fillers: list[str], answer) -> list[int]:
    """The filler turns of a long chat: each 12th asked of the model, the ones between stored with
    `answer(filler)` as an import stores its turns. Twelve stored turns pass the window's
    high-water mark of a 512-token context, so every asked turn folds (summary, facts, recall
    index), and a fact is carried from fold to fold as in a chat typed turn by turn; what is
    under test is that memory and the prompt's plan, not the fillers' replies. Returns the chat's
    summary mark after each asked turn."""
    marks = []
    for i, text in enumerate(fillers, 1):
        if i % ASKED_EVERY:
            rt.store.add_turn(LOCAL, conv, text, answer(text))
        else:
            run(rt.chat, conv, text)
            marks.append(rt.store.get(LOCAL, conv).summarized_upto)
    return marks


def test_fact_from_turn_1_is_in_the_prompt_sixty_turns_later(tmp_path, app_model):
    rt = Runtime(
        make_settings(tmp_path, context_limit=512, max_new_tokens=16, summary_tokens=64),
        loaded=app_model,
    ).start(background=False)
    try:
        chat, conv = rt.chat, rt.store.create_conversation(LOCAL)
        run(chat, conv, "My dog is called Pixel, a border collie.")
        fillers = ["the weather", "trains", "bread", "rivers", "music", "chess", "tea", "maps", "snow", "bees"]
        texts = [f"Filler {i}: say one short thing about {fillers[i % len(fillers)]}." for i in range(58)]
        marks = grow(rt, conv, texts, lambda t: "One short thing: " + t.split("about ")[1])
        assert 1 < marks[0] < marks[-1], f"a fold at each asked turn, turn 1 in the first: {marks}"
        assert len(set(marks)) == len(marks), marks
        fin = run(chat, conv, "What is my dog called, and what breed is she?")
        prompt = fin.prompt_text()
        stored = rt.store.get(LOCAL, conv)
        assert len(stored.turns) == 60
        assert stored.summarized_upto > 1, "turn 1 left the window long ago"
        assert "- My dog is called Pixel, a border collie." in fin.prompt[0][1], "verbatim, as a kept fact"
        assert fin.stats.sections["facts"] > 0
        # the facts already carry turn 1's name: recalling that turn would only cost prefill
        # the model's summary may repeat the sentence: that copy is the summary's, not the turn recalled
        summary = prompt.split("Summary of the conversation so far:", 1)[-1].split("Facts the user stated", 1)[0]
        in_summary = summary.count("My dog is called Pixel") if "Summary of the conversation" in prompt else 0
        assert fin.stats.sections["recall"] == 0 and prompt.count("My dog is called Pixel") == 1 + in_summary
        assert any(f.text == "My dog is called Pixel, a border collie." for f in stored.facts)
        assert fin.stats.gen.prompt_tokens + fin.stats.sections["reserve"] <= 512
    finally:
        rt.close()


def test_pin_unpin_delete_persist_and_reach_the_prompt(tmp_path, fp32_model):
    settings = make_settings(tmp_path, max_new_tokens=8, quant="fp32")
    rt = Runtime(settings, loaded=fp32_model).start(background=False)
    conv = rt.store.create_conversation(LOCAL)
    rt.chat.pins.add(LOCAL, conv, "My sister Ana lives in Lisbon.")
    rt.chat.pins.add(LOCAL, conv, "I am allergic to peanuts.")
    a, b = rt.store.facts(LOCAL, conv)
    rt.chat.pins.set_pinned(LOCAL, conv, a.id, False)
    rt.chat.pins.delete(LOCAL, conv, b.id)
    fin = run(rt.chat, conv, "Hello")
    assert "My sister Ana lives in Lisbon." in fin.prompt_text()
    assert "peanuts" not in fin.prompt_text()
    rt.close()
    rt2 = Runtime(settings, loaded=fp32_model)  # a restart: the store on the same file
    try:
        facts = rt2.store.facts(LOCAL, conv)
        assert [(f.text, f.pinned) for f in facts] == [("My sister Ana lives in Lisbon.", False)]
    finally:
        rt2.close()


def test_pinning_past_the_facts_budget_is_refused_with_the_numbers(tmp_path, fp32_model):
    import pytest

    from llmweb.errors import InputError

    rt = Runtime(make_settings(tmp_path, facts_tokens=24, quant="fp32"), loaded=fp32_model).start(background=False)
    try:
        conv = rt.store.create_conversation(LOCAL)
        rt.chat.pins.add(LOCAL, conv, "My sister Ana lives in Lisbon.")
        with pytest.raises(InputError, match="budget is 24"):
            rt.chat.pins.add(LOCAL, conv, "My brother Tomás lives in Porto and works at the harbour as a crane driver.")
        assert [f.text for f in rt.store.facts(LOCAL, conv)] == ["My sister Ana lives in Lisbon."], "nothing was added"
    finally:
        rt.close()


def test_deleting_a_conversation_deletes_its_recall_index(tmp_path, fp32_model):
    from llmweb.retrieval.storage import list_namespaces

    rt = Runtime(
        make_settings(tmp_path, context_limit=384, max_new_tokens=16, summary_tokens=48, quant="fp32"),
        loaded=fp32_model,
    ).start(background=False)
    try:
        conv = rt.store.create_conversation(LOCAL)
        for i in range(14):
            run(rt.chat, conv, f"Message {i}: tell me one fact about the number {i}.")
        assert rt.store.get(LOCAL, conv).summarized_upto > 0
        assert f"recall-{conv}" in list_namespaces(rt.settings)
        rt.chat.delete(LOCAL, conv)
        assert f"recall-{conv}" not in list_namespaces(rt.settings)
    finally:
        rt.close()


def test_korean_facts_are_kept_by_their_numbers_or_a_request_to_remember():
    facts = facts_mod.extract_facts(
        [
            "안녕하세요! 제 사물함 번호는 4471이에요. 오늘 날씨가 좋네요.",
            "제 이름은 민준이고, 이 이름을 기억해 주세요.",
            "사물함 번호가 뭐였죠?",  # a question
            "3개 주세요.",  # a small count, not a detail
            "35번: 음악에 대해 짧게 말해 주세요.",  # a numbered request: the counter word makes "35번" no code
            "비행기는 금요일 07:40에 출발해요。그리고 좋아요！",
        ]
    )
    assert facts == [
        "제 사물함 번호는 4471이에요.",
        "제 이름은 민준이고, 이 이름을 기억해 주세요.",
        "비행기는 금요일 07:40에 출발해요。",
    ]


def test_german_facts_are_kept_by_their_codes_or_a_request_to_remember():
    facts = facts_mod.extract_facts(
        [
            "Hallo! Meine Schließfachnummer ist 4471. Wie geht es dir?",
            "Merk dir bitte: meine Tochter heißt Lena.",
            "Ich habe heute Hunger.",  # no detail, no request: the summary paraphrases it
            "Wie lautet meine Nummer?",
            "Der Zugangscode für das Büro lautet Zürich-0815.",
        ]
    )
    assert facts == [
        "Meine Schließfachnummer ist 4471.",
        "Merk dir bitte: meine Tochter heißt Lena.",
        "Der Zugangscode für das Büro lautet Zürich-0815.",
    ]


def test_grounding_reads_names_with_umlauts_and_numbers_in_any_script_whole():
    summary = "Code 4471 gehört Frau Müller. Frau Müller kommt aus Köln. Sie heißt Jürgen."
    g = facts_mod.ground(summary, "Frau Müller, Köln, Code 4471")
    assert "Frau Müller kommt aus Köln." in g.text and g.dropped == ("Sie heißt Jürgen.",)
    assert facts_mod.ground("사물함 번호는 4471이다. 번호는 9999이다.", "제 사물함 번호는 4471이에요.").dropped == (
        "번호는 9999이다.",
    )


FOREIGN_FACTS = {
    # language: (the fact of turn 1, a filler asking for something short about a topic, the question)
    "ko": ("제 사물함 번호는 4471이에요.", "{i}번: {topic}에 대해 짧게 말해 주세요.", "제 사물함 번호가 뭐였죠?"),
    "de": ("Meine Schließfachnummer ist 4471.", "Frage {i}: Sag etwas Kurzes über {topic}.", "Wie war meine Nummer?"),
}
FOREIGN_ANSWER = {"ko": "짧게 답할게요: ", "de": "Kurz gesagt: "}  # a stored filler turn's answer, before its question
FOREIGN_TOPICS = {
    "ko": ["날씨", "기차", "빵", "강", "음악", "체스", "차", "지도", "눈", "벌"],
    "de": ["das Wetter", "Züge", "Brot", "Flüsse", "Musik", "Schach", "Tee", "Karten", "Schnee", "Bienen"],
}


@pytest.mark.parametrize("lang", sorted(FOREIGN_FACTS))
def test_a_fact_stated_in_turn_1_in_korean_or_german_is_in_the_prompt_at_turn_40(tmp_path, app_model, lang):
    fact, filler, question = FOREIGN_FACTS[lang]
    rt = Runtime(
        make_settings(tmp_path, context_limit=512, max_new_tokens=16, summary_tokens=64),
        loaded=app_model,
    ).start(background=False)
    try:
        chat, conv = rt.chat, rt.store.create_conversation(LOCAL)
        run(chat, conv, fact)
        topics = FOREIGN_TOPICS[lang]
        texts = [filler.format(i=i + 1, topic=topics[i % len(topics)]) for i in range(38)]
        marks = grow(rt, conv, texts, lambda t: FOREIGN_ANSWER[lang] + t)
        assert 1 < marks[0] < marks[-1] and len(set(marks)) == len(marks), f"a fold at each asked turn: {marks}"
        fin = run(chat, conv, question)
        stored = rt.store.get(LOCAL, conv)
        assert len(stored.turns) == 40
        assert stored.summarized_upto > 1, "turn 1 left the window long ago"
        assert f"- {fact}" in fin.prompt[0][1], "verbatim, as a kept fact"
        assert fin.stats.sections["facts"] > 0 and any(f.text == fact for f in stored.facts)
        assert fin.stats.gen.prompt_tokens + fin.stats.sections["reserve"] <= 512
    finally:
        rt.close()


# --- linear rewrites: the same answers as the regexes they replaced ------------------

# the expressions they replaced, kept here as references of the answers
OLD_SENTENCE = r"[^.!?。！？\n]+(?:[.!?。！？]+|$)"
OLD_WORD = r"[^\W\d_](?:[^\W\d_]|['’\-])*|\d[\d,.:/\-]*"


@given(st.text(alphabet="ab .!?\n。！x7-'’é\u0301", max_size=40))
def test_sentence_and_word_regexes_answer_as_the_old_ones(text):
    import re

    assert facts_mod._SENTENCE.findall(text) == re.findall(OLD_SENTENCE, text)
    assert facts_mod._WORD.findall(text) == re.findall(OLD_WORD, text)


def test_a_line_of_62000_dashes_is_one_quick_pass():
    """The 62,000-dash line: under the 1,024-token limit, 70-100 s per pass of the old regex."""
    import time

    text = "-" * 62_000 + "\nMy name is Bo."
    t0 = time.thread_time()
    assert facts_mod.sentences(text) == ["My name is Bo."]
    assert facts_mod.extract_facts([text]) == ["My name is Bo."]
    assert time.thread_time() - t0 < 1.0
