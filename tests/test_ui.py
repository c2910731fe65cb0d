"""The UI without a model: the pure formatting of ui_format.py, the handlers over a fake runtime,
and the wiring (endpoint names, element ids). The real app is driven in test_app.py / test_browser.py."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import gradio as gr
import pytest

from llmweb import context
from llmweb.chat import Delta, Finished, Queued
from llmweb.errors import BusyError, InputError
from llmweb.records import GenerationStats, MemorySnapshot, Source, TurnStats
from llmweb.store import Store
from llmweb.ui import Handlers, Panel, build_app, user_errors
from llmweb.ui_format import (SECTION_COLOURS, history_messages, plot_frames, sections_html, sources_message,
                              stats_markdown)
from tests.conftest import make_settings

MIB = 2**20


def turn_stats(turn=1, *, prompt=100, limit=1000, reason="eos", cuda=False, rss=50 * MIB, **kw) -> TurnStats:
    mem = MemorySnapshot(rss_bytes=rss, cuda_allocated_bytes=10 * MIB if cuda else None,
                         cuda_reserved_bytes=12 * MIB if cuda else None, cuda_peak_bytes=11 * MIB if cuda else None)
    gen = GenerationStats(prompt_tokens=prompt, generated_tokens=7, reused_tokens=40, prefilled_tokens=60,
                          finish_reason=reason, kv_session_bytes=3 * MIB, kv_store_bytes=5 * MIB, mem=mem)
    sections = {"system": 20, "facts": 10, "user": prompt - 30, "reserve": 50}
    return TurnStats(turn, gen, sections=sections, context_limit=limit, **kw)


# ---- formatting


def test_every_prompt_section_has_a_colour_and_facts_is_drawn_in_the_bar():
    assert set(context.SECTIONS) <= set(SECTION_COLOURS)
    bar = sections_html(turn_stats())
    assert SECTION_COLOURS["facts"] in bar and "facts 10" in bar and "free 850 of 1,000" in bar
    assert sections_html(None) == ""


def test_stats_markdown_reads_the_typed_record():
    assert "No turns yet" in stats_markdown(None)
    text = stats_markdown(turn_stats(3))
    assert "**Turn 3** · eos" in text and "reused 40 of 100" in text and "RSS 50 MiB" in text
    assert "GPU" not in text, "no GPU line on CPU"
    assert "GPU: allocated 10 MiB, reserved 12 MiB" in stats_markdown(turn_stats(cuda=True))


def test_near_limit_turns_warn_in_plain_words():
    text = stats_markdown(turn_stats(prompt=900, dropped_turns=2), mem_limit_bytes=52 * MIB)
    assert "used 950 of 1,000 context tokens" in text
    assert "2 older turns did not fit" in text
    assert "Memory is near its limit: 50 MiB of 52 MiB" in text
    assert "⚠️" not in stats_markdown(turn_stats(), mem_limit_bytes=500 * MIB)


def test_sources_are_labelled_by_source_label_and_snippets_are_not_headings():
    msg = sources_message([Source(1, "guide.pdf", page=3, score=0.5, snippet="# Install <now>"),
                           Source(2, "notes.md", heading="Setup", snippet="plain")])
    assert msg["metadata"]["title"] == "Sources (2)"
    assert "**[1] guide.pdf, p. 3** · score 0.50\n> Install &lt;now&gt;" in msg["content"]
    assert "**[2] notes.md, Setup**" in msg["content"]
    assert sources_message([]) is None


def stored(*turns):
    """A Conversation-like object with StoredTurn-like turns (user, assistant, stats, sources, idx)."""
    return SimpleNamespace(turns=[SimpleNamespace(idx=i, user=f"q{i}", assistant=a, stats=s, sources=src)
                                  for i, (a, s, src) in enumerate(turns)])


def test_history_marks_stopped_replies_and_keeps_turns_without_stats():
    conv = stored(("half", turn_stats(reason="cancelled"), []), ("", None, [Source(1, "a.txt", snippet="x")]))
    roles = [m["role"] for m in history_messages(conv)]
    assert roles == ["user", "assistant", "user", "assistant", "assistant"]
    msgs = history_messages(conv)
    assert msgs[1]["content"] == "half\n\n*(stopped)*" and msgs[3]["content"] == "*(no reply)*"


def test_plot_frames_start_at_turn_1_skip_turns_without_stats_and_leave_out_reserve():
    tokens, memory = plot_frames(stored(("a", turn_stats(1), []), ("b", None, []), ("c", turn_stats(3), [])))
    assert set(tokens["turn"]) == {1, 3} and "reserve" not in set(tokens["section"])
    assert str(tokens["turn"].dtype) == "int64"
    assert {(1, "RSS"), (1, "KV this chat"), (1, "KV all chats")} <= set(zip(memory["turn"], memory["measure"]))
    assert "GPU peak" not in set(memory["measure"])
    empty_tokens, empty_memory = plot_frames(stored())
    assert str(empty_tokens["tokens"].dtype) == "float64" and len(empty_memory) == 0


# ---- the error decorator


def test_user_errors_turns_domain_errors_into_toasts_for_functions_and_generators():
    @user_errors
    def plain(x):
        raise InputError("Say something.")

    @user_errors
    def stream(x):
        yield 1
        raise BusyError("Too busy.")

    with pytest.raises(gr.Error, match="Say something."):
        plain(1)
    assert inspect.isgeneratorfunction(stream), "Gradio streams only generator functions"
    gen = stream(1)
    assert next(gen) == 1
    with pytest.raises(gr.Error, match="Too busy."):
        next(gen)

    @user_errors
    def bug():
        raise KeyError("x")

    with pytest.raises(KeyError):
        bug()  # not a domain error: not a toast


# ---- handlers over a fake runtime


class FakeChat:
    """Stores one turn per send, like Chat, after streaming two deltas (or raising `error`)."""

    def __init__(self, store):
        self.store, self.error = store, None

    def send(self, conv_id, text, use_docs=True):
        yield Queued(1)
        if self.error:
            raise self.error
        try:
            yield Delta("Par")
            yield Delta("Paris")
        except GeneratorExit:  # Stop: the partial reply is stored, marked as stopped
            self.store.add_turn(conv_id, text, "Par", turn_stats(reason="cancelled"))
            raise
        n = len(self.store.get(conv_id).turns)
        stats = turn_stats(n + 1)
        sources = [Source(1, "atlas.md", heading="France", snippet="Paris is the capital")]
        self.store.add_turn(conv_id, text, "Paris", stats, sources)
        yield Finished("Paris", stats, sources, ["A note."])

    def delete(self, conv_id):
        self.store.delete(conv_id)


@pytest.fixture
def runtime(tmp_path):
    store = Store(tmp_path / "llmweb.sqlite3")
    rt = SimpleNamespace(store=store, settings=make_settings(tmp_path), status="Ready", ready=True, engine=None,
                         library=SimpleNamespace(documents=lambda *owner: []))
    rt.chat = FakeChat(store)
    rt.wait_ready = lambda timeout=None: rt.chat
    yield rt
    store.close()


def test_respond_streams_the_chat_then_fills_the_whole_panel(runtime):
    h = Handlers(runtime)
    shown = []  # the chat list is reused between yields: read each as it comes
    *streaming, final = [shown.append(out[1][-1]["content"]) or out for out in h.respond("Capital?", [], "", True)]
    assert shown[:-1] == ["*Waiting: 1 ahead in the queue…*", "Par", "Paris"]
    assert all(isinstance(v, dict) and v.get("__type__") == "update" for v in streaming[-1][2:-1]), "others skipped"
    panel = Panel(*final[:-1])
    assert final[-1] == "" and panel.conv_state == streaming[0][0]
    assert "**Turn 1**" in panel.stats_md and panel.stats_md.endswith("A note.")
    assert panel.chatbot[-1]["metadata"]["title"] == "Sources (1)"
    assert "atlas.md, France" in panel.chatbot[-1]["content"]
    assert list(panel.tokens_plot["turn"].unique()) == [1]
    assert json.loads(h.api_stats(panel.conv_state))["turn"] == 1


def test_stop_closes_the_chat_stream_through_the_decorator_and_shows_the_stopped_turn(runtime):
    h = Handlers(runtime)
    stream = h.respond("Capital?", [], "", True)
    next(stream), next(stream)  # queued, then "Par"
    conv_id = next(stream)[0]
    stream.close()  # what Gradio does when Stop cancels the event
    panel = h.after_stop(conv_id, [{"role": "user", "content": "Capital?"}])
    assert panel.chatbot[-1]["content"] == "Par\n\n*(stopped)*"
    assert panel.stats_md.endswith("Stopped.")


def test_refused_messages_are_toasts_and_leave_no_empty_chat(runtime):
    h = Handlers(runtime)
    with pytest.raises(gr.Error, match="empty"):
        list(h.respond("   ", [], "", True))
    runtime.chat.error = BusyError("The queue is full.")
    with pytest.raises(gr.Error, match="The queue is full."):
        list(h.api_chat("Hello"))
    assert runtime.store.list_conversations() == []
    with pytest.raises(gr.Error, match="no longer exists"):
        h.api_stats("nope")
    with pytest.raises(gr.Error, match="Pick a fact first."):
        h.pin_fact("", None)


def test_a_stale_browser_id_opens_a_fresh_chat_and_delete_moves_on(runtime):
    h = Handlers(runtime)
    first = h.switch("gone")
    assert first.conv_state and "No turns yet" in first.stats_md and first.tokens_plot is None
    second = h.new_chat()
    after = h.delete_chat(second.conv_state)
    assert after.conv_state == first.conv_state


def test_build_app_keeps_the_endpoints_and_element_ids(runtime):
    config = build_app(runtime).config
    api = {d["api_name"]: d.get("api_visibility", "public") for d in config["dependencies"] if d.get("api_name")}
    assert {name for name, visibility in api.items() if visibility == "public"} == {
        "chat", "stats", "respond", "status_text"}, "the public API is unchanged"
    assert api["respond_enter"] == "private"
    ids = {c["props"].get("elem_id") for c in config["components"]}
    assert {"llmweb-chat", "llmweb-send", "llmweb-stop", "llmweb-stats", "llmweb-sections", "llmweb-memory",
            "llmweb-status", "llmweb-upload", "llmweb-doclist", "llmweb-tokens-plot"} <= ids
    keys = {c["props"].get("storage_key") for c in config["components"]}
    assert "llmweb_conversation" in keys
