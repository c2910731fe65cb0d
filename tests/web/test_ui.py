"""The UI without a model: the pure formatting of web/formatting.py, the handlers over a fake runtime,
and the wiring (endpoint names, element ids). The real app is driven in test_app.py / test_browser.py."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from llmweb.chat import context
from llmweb.chat.session import Chat, Delta, Finished, Queued, Started
from llmweb.errors import BusyError, InputError
from llmweb.records import GenerationStats, MemorySnapshot, Source, TurnStats
from llmweb.runtime.resident import Lease
from llmweb.store.db import Store
from llmweb.store.models import NotFound, new_id
from llmweb.web.formatting import (
    NO_PLOT,
    SECTION_COLOURS,
    SHOWN_TURNS,
    earlier_note,
    hidden_turns,
    history_messages,
    line_chart_html,
    plot_frames,
    sections_html,
    sources_message,
    stats_markdown,
)
from llmweb.web.identity import browser_owner, new_owner_token
from llmweb.web.panels import chat as chat_panel
from llmweb.web.panels.base import STREAMED, Panel, rest_shown, streamed, user_errors
from llmweb.web.ui import Handlers, build_app
from tests.conftest import make_settings
from tests.fakes import FakeFormat

MIB = 2**20


def turn_stats(turn=1, *, prompt=100, limit=1000, reason="eos", cuda=False, rss=50 * MIB, **kw) -> TurnStats:
    mem = MemorySnapshot(
        rss_bytes=rss,
        cuda_allocated_bytes=10 * MIB if cuda else None,
        cuda_reserved_bytes=12 * MIB if cuda else None,
        cuda_peak_bytes=11 * MIB if cuda else None,
    )
    gen = GenerationStats(
        prompt_tokens=prompt,
        generated_tokens=7,
        reused_tokens=40,
        prefilled_tokens=60,
        finish_reason=reason,
        kv_session_bytes=3 * MIB,
        kv_store_bytes=5 * MIB,
        mem=mem,
    )
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
    assert "tok/s, alone" in text
    batched = turn_stats()
    batched.gen.batch_size = 4
    assert "in a batch of up to 4 requests" in stats_markdown(batched)
    assert "peak 11 MiB" in stats_markdown(turn_stats(cuda=True)), "alone: the request's own peak"
    on_gpu_batched = turn_stats(cuda=True)
    on_gpu_batched.gen.batch_size = 4
    assert "batch peak 11 MiB" in stats_markdown(on_gpu_batched), "in a batch, the peak is the batch's"
    named = turn_stats(3, model="qwen3-8b")
    assert "**Turn 3** · eos · qwen3-8b" in stats_markdown(named), "the turn names the model that answered"
    assert TurnStats.from_dict(named.to_dict()).model == "qwen3-8b" and "model" not in turn_stats(3).to_dict()


def test_a_remote_engine_that_does_not_report_its_cache_shows_no_invented_reuse_or_kv_figures():
    remote = turn_stats()
    g = remote.gen
    g.reuse_reported, g.reused_tokens, g.kv_session_bytes, g.kv_store_bytes = False, 0, 0, 0
    text = stats_markdown(remote)
    assert "did not report" in text and "reused 0" not in text and "KV cache:" not in text
    from llmweb.web.api.common import Usage

    assert "prompt_tokens_details" not in Usage(100, 7, None).to_dict()
    assert Usage(100, 7, 40).to_dict()["prompt_tokens_details"] == {"cached_tokens": 40}


def test_near_limit_turns_warn_in_plain_words():
    text = stats_markdown(turn_stats(prompt=900, dropped_turns=2), mem_limit_bytes=52 * MIB)
    assert "used 950 of 1,000 context tokens" in text
    assert "2 older turns did not fit" in text
    assert "Memory is near its limit: 50 MiB of 52 MiB" in text
    assert "⚠️" not in stats_markdown(turn_stats(), mem_limit_bytes=500 * MIB)


def test_sources_are_labelled_by_source_label_and_snippets_are_not_headings():
    msg = sources_message(
        [
            Source(1, "guide.pdf", page=3, score=0.5, snippet="# Install <now>"),
            Source(2, "notes.md", heading="Setup", snippet="plain"),
        ]
    )
    assert msg["metadata"]["title"] == "Sources (2)"
    assert "**[1] guide.pdf, p. 3** · score 0.50\n> Install &lt;now&gt;" in msg["content"]
    assert "**[2] notes.md, Setup**" in msg["content"]
    assert sources_message([]) is None


def stored(*turns):
    """A Conversation-like object with StoredTurn-like turns (user, assistant, stats, sources, idx)."""
    return SimpleNamespace(
        turns=[
            SimpleNamespace(idx=i, user=f"q{i}", assistant=a, stats=s, sources=src)
            for i, (a, s, src) in enumerate(turns)
        ]
    )


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


def test_session_plots_draw_a_point_at_turn_1_and_label_the_axis_with_whole_turns():
    tokens, _ = plot_frames(stored(("a", turn_stats(1), [])))
    one = line_chart_html(tokens, "tokens", "section", "Prompt tokens", SECTION_COLOURS)
    ticks = re.findall(r'class="llmweb-x-tick">([^<]*)<', one)
    assert ticks == ["1"], "one turn: one tick, '1' (not '1.000000' or fractions)"
    assert one.count('class="llmweb-point"') == len(tokens) > 0, "every section's turn-1 value is a dot"
    assert "<polyline" not in one and SECTION_COLOURS["user"] in one
    turns = [(f"a{i}", turn_stats(i), []) for i in range(1, 31)]
    tokens, memory = plot_frames(stored(*turns))
    many = line_chart_html(tokens, "tokens", "section", "Prompt tokens")
    ticks = [int(t) for t in re.findall(r'class="llmweb-x-tick">([^<]*)<', many)]
    steps = {b - a for a, b in zip(ticks, ticks[1:])}
    assert ticks[0] == 1 and len(ticks) <= 8 and len(steps) == 1 and min(steps) >= 1, "evenly spaced whole turns"
    assert "<polyline" in many and many.count('class="llmweb-point"') == len(tokens)
    assert "turn 30:" in line_chart_html(memory, "MiB", "measure", "Memory")
    assert line_chart_html(tokens.iloc[:0], "tokens", "section", "x") == NO_PLOT
    assert "&lt;b&gt;" in line_chart_html(tokens.assign(section="<b>"), "tokens", "section", "x"), "names escaped"


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

    with pytest.raises(gr.Error, match=r"Something went wrong \(ref [0-9a-f]+\)") as e:
        bug()  # not a domain error: a ref to the log, never the exception's text
    assert "KeyError" not in e.value.message and "'x'" not in e.value.message


# ---- handlers over a fake runtime


class AddressBook:
    """The engine's `note_address`, recorded: owner -> the address group the page said it came from."""

    def __init__(self):
        self.addresses: dict[str, str] = {}

    def note_address(self, owner: str, group: str) -> None:
        self.addresses[owner] = group


class FakeChat:
    """Like Chat: starts a conversation with its first turn, streams two deltas (or raises `error`),
    stores one turn per send, every store call scoped to the owner."""

    def __init__(self, store, settings=None):
        self.store, self.error = store, None
        # the per-chat settings are the real Chat's methods, over a small real budget
        self.settings = settings
        self.budget = context.Budget(
            context_limit=400, max_new_tokens=64, summary_tokens=30, retrieved_tokens=40, user_tokens=60
        )
        self.fmt, self.library = FakeFormat(), None
        self.warmed: list[tuple[str, str]] = []  # (owner, chat id) of each chat opened (`warm`)
        self.engine = AddressBook()

    def warm(self, owner, conv_id):
        self.store.get(owner, conv_id)  # the real one finds the chat as its owner's, or warms nothing
        self.warmed.append((owner, conv_id))
        return True

    def wait_background(self, conv_id=None, timeout=None):
        pass

    switch_version = Chat.switch_version
    turn_settings = Chat.turn_settings
    set_settings = Chat.set_settings
    import_json = Chat.import_json

    def regenerate(self, owner, conv_id, use_docs=True):
        return self.send(owner, conv_id, "", use_docs, redo=True)

    def continue_reply(self, owner, conv_id, use_docs=True):
        return self.send(owner, conv_id, "", use_docs, more=True)

    def edit(self, owner, conv_id, turn, text, use_docs=True):
        return self.send(owner, conv_id, text, use_docs, edit=turn)

    def send(self, owner, conv_id, text, use_docs=True, new=False, redo=False, more=False, edit=None):
        if edit is not None:  # edit: the new message at turn `edit`, answered "Rome"
            yield Started(conv_id)
            stats = turn_stats(edit + 1)
            self.store.edit_turn(owner, conv_id, edit, text, "Rome", stats)
            yield Finished("Rome", stats, [], [], conv_id=conv_id)
            return
        if redo or more:  # regenerate: the last reply replaced by "Lyon"; continue: "… and more"
            last = self.store.last_turn(owner, conv_id)
            reply = last.assistant + " and more" if more else "Lyon"
            yield Started(conv_id)
            yield Delta(reply[:2])
            stats = turn_stats(last.idx + 1)
            self.store.replace_last_reply(owner, conv_id, last.idx, reply, stats)
            yield Finished(reply, stats, [], [], conv_id=conv_id)
            return
        new = new or conv_id is None
        conv_id = conv_id or new_id()
        n = 0 if new else len(self.store.get(owner, conv_id).turns)
        yield Started(conv_id)
        yield Queued(1)
        if self.error:
            raise self.error
        try:
            yield Delta("Par")
            yield Delta("Paris")
        except GeneratorExit:  # Stop: the partial reply is stored, marked as stopped
            self.store.add_turn(owner, conv_id, text, "Par", turn_stats(reason="cancelled"), create=new)
            raise
        stats = turn_stats(n + 1)
        sources = [Source(1, "atlas.md", heading="France", snippet="Paris is the capital")]
        self.store.add_turn(owner, conv_id, text, "Paris", stats, sources, create=new)
        yield Finished("Paris", stats, sources, ["A note."], conv_id=conv_id)

    def delete(self, owner, conv_id):
        return self.store.delete(owner, conv_id)

    def undo(self, owner, conv_id):
        return self.store.pop_last_turn(owner, conv_id)

    def delete_owner(self, owner):
        return len(self.store.delete_owner(owner))


A_TOKEN, B_TOKEN = new_owner_token(), new_owner_token()
NOBODY = SimpleNamespace(username=None)  # a gr.Request without login


def fake_runtime(store, tmp_path) -> SimpleNamespace:
    """A Runtime's face for the handlers: the real store, FakeChat, a multi-user server."""
    rt = SimpleNamespace(
        store=store,
        settings=make_settings(tmp_path, single_user="0"),
        status="Ready",
        ready=True,
        engine=None,
        library=SimpleNamespace(documents=lambda *owner: []),
        secret="s" * 64,
    )
    rt.chat = FakeChat(store, rt.settings)
    rt.wait_ready = lambda timeout=None: rt.chat
    rt.hold = lambda model=None, timeout=None: Lease("fake", rt.chat)
    return rt


@pytest.fixture
def runtime(tmp_path):
    store = Store(tmp_path / "llmweb.sqlite3")
    yield fake_runtime(store, tmp_path)
    store.close()


def test_respond_streams_the_chat_then_fills_the_whole_panel(runtime, monkeypatch):
    monkeypatch.setattr(chat_panel, "SHOW_EVERY_S", 0.0)  # every token shown: the fake's tokens come at once
    h = Handlers(runtime)
    shown = []  # the chat list is reused between yields: read each as it comes
    outs = [
        shown.append(out[1][-1]["content"]) or out for out in h.chat.respond("Capital?", [], "", True, A_TOKEN, NOBODY)
    ]
    *streaming, final = outs
    assert shown[:-1] == ["*Waiting: number 1 in the queue, about 1 s…*", "Par", "Paris"]
    assert all(isinstance(v, dict) and v.get("__type__") == "update" for v in streaming[-1][2:-1]), "others skipped"
    panel = Panel(*final[:-1])
    assert final[-1] == "" and panel.conv_state == streaming[0][0]
    assert "**Turn 1**" in panel.stats_md and panel.stats_md.endswith("A note.")
    assert panel.chatbot[-1]["metadata"]["title"] == "Sources (1)"
    assert "atlas.md, France" in panel.chatbot[-1]["content"]
    assert 'class="llmweb-x-tick">1</text>' in panel.tokens_plot and "turn 1:" in panel.tokens_plot


def test_each_message_tells_the_engine_its_senders_address_group_so_one_addresss_identities_share(runtime):
    """Two identities from one IPv6 /64 and one from another address: the engine hears each owner's
    group (engine/share.py counts an address's running requests and prompt tokens together)."""
    from tests.web.test_visitors import page

    h = Handlers(runtime)
    sent = [(A_TOKEN, "2001:db8:1:2::1"), (B_TOKEN, "2001:db8:1:2::99"), (new_owner_token(), "203.0.113.5")]
    for token, peer in sent:
        list(h.chat.respond("Capital?", [], "", True, token, page(session=peer, peer=peer)))
    groups = runtime.chat.engine.addresses
    assert len(groups) == 3
    assert groups[h.chat.owner(A_TOKEN, page())] == groups[h.chat.owner(B_TOKEN, page())] == "2001:db8:1:2::/64"
    assert sorted(set(groups.values())) == ["2001:db8:1:2::/64", "203.0.113.5"]


def test_on_the_page_a_turn_streams_the_chat_alone_and_the_next_event_shows_the_rest(runtime, monkeypatch):
    """The page's form of respond (panels/base.py's `streamed`): while the reply streams, each update
    is the chat's id, the chat, no rest and the box; the last carries the rest of the panel, which
    `rest_shown` puts out once and then forgets."""
    monkeypatch.setattr(chat_panel, "SHOW_EVERY_S", 0.0)
    h = Handlers(runtime)
    whole = list(h.chat.respond("Capital?", [], "", True, A_TOKEN, NOBODY))
    said = []  # the chat list is reused between yields: read each as it comes
    page_respond = streamed(h.chat.respond)
    outs = [said.append(o[1][-1]["content"]) or o for o in page_respond("Capital?", [], "", True, A_TOKEN, NOBODY)]
    assert [len(o) for o in outs] == [STREAMED + 2] * len(whole), "the chat's id, the chat, the rest, the box"
    *streaming, final = outs
    assert all(o[STREAMED] is None for o in streaming) and said[1:-1] == ["Par", "Paris"]
    assert final[-1] == "" and final[0] == streaming[0][0]
    rest = final[STREAMED]
    panel = Panel(*final[:STREAMED], *rest)
    assert "**Turn 1**" in panel.stats_md and 'class="llmweb-x-tick">1</text>' in panel.tokens_plot
    assert final[0] in [c[1] for c in panel.conv_list["choices"]] and panel.conv_list["value"] == final[0]
    *shown, emptied = rest_shown(rest)
    assert tuple(shown) == rest and emptied is None
    *shown, emptied = rest_shown(None)  # a turn that failed, or Stop: nothing shown, and none kept
    assert len(shown) == len(Panel._fields) - STREAMED and all(v == gr.skip() for v in shown) and emptied is None


def test_a_streamed_turns_errors_stay_the_users_sentence(runtime):
    h = Handlers(runtime)
    with pytest.raises(gr.Error, match="empty"):
        list(streamed(h.chat.respond)("   ", [], "", True, A_TOKEN, NOBODY))


def test_stop_closes_the_chat_stream_through_the_decorator_and_shows_the_stopped_turn(runtime, monkeypatch):
    monkeypatch.setattr(chat_panel, "SHOW_EVERY_S", 0.0)
    h = Handlers(runtime)
    stream = h.chat.respond("Capital?", [], "", True, A_TOKEN, NOBODY)
    next(stream), next(stream)  # queued, then "Par"
    conv_id = next(stream)[0]
    stream.close()  # what Gradio does when Stop cancels the event
    panel = h.chat.after_stop(conv_id, [{"role": "user", "content": "Capital?"}], A_TOKEN, NOBODY)
    assert panel.chatbot[-1]["content"] == "Par\n\n*(stopped)*"
    assert panel.stats_md.endswith("Stopped.")


def test_a_fast_stream_is_shown_at_most_every_show_every_s_and_whole_at_the_end(runtime, monkeypatch):
    """200 tokens over 2 s (a fake clock, 10 ms a token) are shown ~40 times, not 200; the text
    between two updates comes with the next, and the whole reply in the final panel."""
    clock = iter(i * 0.01 for i in range(10_000))
    monkeypatch.setattr(chat_panel.time, "monotonic", lambda: next(clock))
    h = Handlers(runtime)
    conv = _one_chat(h)
    reply = " ".join(f"w{i}" for i in range(200))
    words = reply.split(" ")
    events = [Delta(" ".join(words[: i + 1])) for i in range(len(words))]
    shown = [{}]
    texts = []  # the chat list is reused between yields: read each as it comes
    outs = [
        texts.append(p.chatbot[-1]["content"]) or p
        for p in h.chat._stream(f"anon:{A_TOKEN}", conv, shown, iter(events))
    ]
    *streaming, final = outs
    assert 2 / chat_panel.SHOW_EVERY_S - 5 <= len(streaming) <= 2 / chat_panel.SHOW_EVERY_S + 1, len(streaming)
    assert texts[0] == "w0", "the first token is shown at once"
    assert all(b.startswith(a) and b != a for a, b in zip(texts, texts[1:-1])), "each update extends the last"
    assert isinstance(final, Panel) and final.conv_state == conv


def test_refused_messages_are_toasts_and_leave_no_empty_chat(runtime):
    h = Handlers(runtime)
    with pytest.raises(gr.Error, match="empty"):
        list(h.chat.respond("   ", [], "", True, A_TOKEN, NOBODY))
    runtime.chat.error = BusyError("The queue is full.")
    with pytest.raises(gr.Error, match="The queue is full."):
        list(h.endpoints.api_chat("Hello", request=NOBODY))
    assert runtime.store.list_conversations(f"anon:{A_TOKEN}") == []
    with pytest.raises(gr.Error, match="no longer exists"):
        h.endpoints.api_stats("nope", request=NOBODY)
    runtime.chat.error = None
    conv = _one_chat(h)
    with pytest.raises(gr.Error, match="Pick a fact first."):
        h.memory.pin_fact(conv, None, A_TOKEN, NOBODY)


def _one_chat(h) -> str:
    *_, final = h.chat.respond("Capital?", [], "", True, A_TOKEN, NOBODY)
    return final[0]


def test_a_new_chat_is_not_stored_until_its_first_message_and_delete_moves_on(runtime):
    h = Handlers(runtime)
    blank = h.chats.new_chat(A_TOKEN, NOBODY)
    assert blank.conv_state == "" and "No turns yet" in blank.stats_md and blank.tokens_plot == NO_PLOT
    assert runtime.store.list_conversations(f"anon:{A_TOKEN}") == [], "no empty chats in the store"
    first, second = _one_chat(h), _one_chat(h)
    assert h.chats.switch("gone", A_TOKEN, NOBODY).conv_state == ""
    after = h.chats.delete_chat(second, A_TOKEN, NOBODY)
    assert after.conv_state == first


def test_a_first_visit_gets_an_unguessable_token_and_a_reload_keeps_it(runtime):
    h = Handlers(runtime)
    token, *panel = h.account.visit("", "", NOBODY)
    assert len(token) == 32 and token != new_owner_token()
    again, *_ = h.account.visit(token, "", NOBODY)
    assert again == token
    forged, *_ = h.account.visit("not a token", "", NOBODY)
    assert forged != "not a token" and len(forged) == 32


def test_two_visitors_never_see_each_others_chats_through_any_handler(runtime):
    h = Handlers(runtime)
    a_conv = _one_chat(h)
    # B's own view
    b = h.account.visit(B_TOKEN, a_conv, NOBODY)  # even with A's id in B's browser state
    assert b[1] == "" and b[2] == [] and b[3]["choices"] == []
    assert h.chats.switch(a_conv, B_TOKEN, NOBODY).chatbot == []
    for call in (
        lambda: h.transfer.export_json(a_conv, B_TOKEN, NOBODY),
        lambda: h.transfer.export_md(a_conv, B_TOKEN, NOBODY),
        lambda: h.memory.add_fact(a_conv, "mine now", B_TOKEN, NOBODY),
        lambda: h.memory.delete_fact(a_conv, 1, B_TOKEN, NOBODY),
        lambda: h.endpoints.api_stats(a_conv, request=NOBODY),
    ):
        with pytest.raises(gr.Error, match="no longer exists"):
            call()
    with pytest.raises(gr.Error, match="no longer exists"):
        list(h.endpoints.api_chat("continue theirs", a_conv, request=NOBODY))
    h.chats.delete_chat(a_conv, B_TOKEN, NOBODY)
    assert [c.id for c in runtime.store.list_conversations(f"anon:{A_TOKEN}")] == [a_conv], "A's chat is intact"
    # a login is the owner, whatever the browser token says
    bob = SimpleNamespace(username="bob")
    assert browser_owner(runtime.settings, A_TOKEN, bob) == "user:bob"


def test_two_visitors_never_touch_each_others_memories_turn_views_or_continuations(runtime):
    """B holds A's chat id and A's memory id (in B's browser state or guessed): B can neither keep
    nor leave out A's turns, continue A's chat, remember its facts, nor see, edit, turn off,
    delete or export A's memories across chats. A's own stay as they were."""
    h = Handlers(runtime)
    a_conv, a = _one_chat(h), f"anon:{A_TOKEN}"
    h.memory.add_memory(a_conv, None, "My cat is called Quokka.", A_TOKEN, NOBODY)
    (mid,) = [m.id for m in runtime.store.memories(a)]
    b_panel = h.chats.new_chat(B_TOKEN, NOBODY)
    assert "Quokka" not in b_panel.memories_md and b_panel.memory_dd["choices"] == []
    n_chats = len(runtime.store.list_conversations(f"anon:{B_TOKEN}"))
    for call in (
        lambda: h.memory.keep_turn(a_conv, 0, B_TOKEN, NOBODY),
        lambda: h.memory.leave_out_turn(a_conv, 0, B_TOKEN, NOBODY),
        lambda: h.memory.plan_turn(a_conv, 0, B_TOKEN, NOBODY),
        lambda: h.memory.remember_fact(a_conv, 1, B_TOKEN, NOBODY),
        lambda: h.chats.continue_chat(a_conv, B_TOKEN, NOBODY),
    ):
        with pytest.raises(gr.Error, match="no longer exists"):
            call()
    assert h.memory.picked_memory(mid, A_TOKEN, NOBODY) == "My cat is called Quokka.", "picked: its text to edit"
    assert h.memory.picked_memory(mid, B_TOKEN, NOBODY) == "", "A's text is never B's to see"
    for call in (
        lambda: h.memory.save_memory("", mid, "My cat is called Mine.", B_TOKEN, NOBODY),
        lambda: h.memory.toggle_memory("", mid, "", B_TOKEN, NOBODY),
    ):
        with pytest.raises(gr.Error, match="That memory is gone"):
            call()
    after = h.memory.delete_memory("", mid, "", B_TOKEN, NOBODY)
    assert "Quokka" not in Panel(*after[:-1]).memories_md
    exported = Path(h.transfer.export_memories(B_TOKEN, NOBODY)).read_text(encoding="utf-8")
    assert "Quokka" not in exported
    assert [(m.text, m.enabled) for m in runtime.store.memories(a)] == [("My cat is called Quokka.", True)]
    assert [t.view for t in runtime.store.get(a, a_conv).turns] == [""], "A's turn as it was"
    assert len(runtime.store.list_conversations(f"anon:{B_TOKEN}")) == n_chats, "B continued nothing"
    assert [c.id for c in runtime.store.list_conversations(a)] == [a_conv], "nor made A a chat"


def test_a_chat_opened_by_its_owner_is_warmed_and_a_strangers_open_warms_nothing(runtime):
    """Picking a chat in the list and a search result prefill the chat's next prompt (Chat.warm) as
    its owner's; B naming A's chat opens a blank chat and warms nothing; an import warms nothing."""
    h = Handlers(runtime)
    a_conv, a = _one_chat(h), f"anon:{A_TOKEN}"
    runtime.chat.warmed.clear()
    h.chats.switch(a_conv, A_TOKEN, NOBODY)
    h.chats.switch(a_conv, B_TOKEN, NOBODY)
    h.chats.switch("", A_TOKEN, NOBODY)  # a new chat: nothing to warm
    idx = runtime.store.get(a, a_conv).turns[0].idx
    h.chats.open_hit(f"{a_conv}:{idx}", A_TOKEN, NOBODY)
    assert runtime.chat.warmed == [(a, a_conv), (a, a_conv)]
    exported = h.transfer.export_json(a_conv, A_TOKEN, NOBODY)
    imported = h.transfer.import_chat(exported, B_TOKEN, NOBODY)
    assert imported.conv_state != a_conv and runtime.chat.warmed == [(a, a_conv), (a, a_conv)]

    def broken(owner, conv_id):
        raise RuntimeError("a bug in the warm-up")

    runtime.chat.warm = broken  # a warm-up that fails never keeps the chat from opening
    assert h.chats.switch(a_conv, A_TOKEN, NOBODY).conv_state == a_conv


def test_rename_shows_the_new_title_and_a_stranger_cannot_rename_it(runtime):
    h = Handlers(runtime)
    a_conv = _one_chat(h)
    assert runtime.store.get(f"anon:{A_TOKEN}", a_conv).title == "Capital?", "the default: the first message"
    *panel, box = h.chats.rename(a_conv, "  Geography\n quiz ", A_TOKEN, NOBODY)
    assert box == "" and Panel(*panel).conv_list["choices"][0] == ("Geography quiz (1)", a_conv)
    unknown = new_id()
    with pytest.raises(gr.Error) as stranger:
        h.chats.rename(a_conv, "Mine now", B_TOKEN, NOBODY)
    with pytest.raises(gr.Error) as missing:
        h.chats.rename(unknown, "Mine now", B_TOKEN, NOBODY)
    assert str(stranger.value).replace(a_conv[:8], "ID") == str(missing.value).replace(unknown[:8], "ID"), (
        "B learns nothing: A's chat answers as an unknown id does"
    )
    assert runtime.store.get(f"anon:{A_TOKEN}", a_conv).title == "Geography quiz"
    for bad, why in (("   ", "cannot be empty"), ("x" * 121, "the limit is 120")):
        with pytest.raises(gr.Error, match=why):
            h.chats.rename(a_conv, bad, A_TOKEN, NOBODY)
    with pytest.raises(gr.Error, match="not saved yet"):
        h.chats.rename("", "Title", A_TOKEN, NOBODY)
    assert runtime.store.get(f"anon:{A_TOKEN}", a_conv).title == "Geography quiz", "bad titles change nothing"


def test_search_lists_only_the_callers_turns_and_a_result_opens_its_chat_at_that_turn(runtime):
    h = Handlers(runtime)
    a_conv = _one_chat(h)
    *_, b_final = h.chat.respond("Capital?", [], "", True, B_TOKEN, NOBODY)
    found = h.chats.search("capital", A_TOKEN, NOBODY)
    assert found["visible"] and found["choices"] == [("Capital? · turn 1: «Capital»?", f"{a_conv}:0")], "A's only"
    assert h.chats.search("nothing-like-this", A_TOKEN, NOBODY)["choices"] == []
    opened = h.chats.open_hit(f"{a_conv}:0", A_TOKEN, NOBODY)
    assert opened.conv_state == a_conv and opened.stats_md.endswith("Search result: turn 1.")
    with pytest.raises(gr.Error, match="no longer exists"):
        h.chats.open_hit(f"{a_conv}:0", B_TOKEN, NOBODY)  # B with A's result: as an unknown id
    for bad in (None, "", "junk", f"{a_conv}:x"):
        with pytest.raises(gr.Error, match="Pick a search result"):
            h.chats.open_hit(bad, A_TOKEN, NOBODY)
    with pytest.raises(gr.Error, match="Search could not read"):
        h.chats.search('"unclosed', A_TOKEN, NOBODY)
    with pytest.raises(gr.Error, match="Type something"):
        h.chats.search("  ", A_TOKEN, NOBODY)
    assert b_final[0] != a_conv


def test_regenerate_streams_then_shows_one_reply_in_place_of_the_old_one(runtime):
    h = Handlers(runtime)
    conv = _one_chat(h)
    *streaming, final = list(h.chat.regenerate(conv, True, A_TOKEN, NOBODY))
    assert [m["content"] for m in streaming[-1].chatbot] == ["Capital?", "Ly"], "the old reply is not shown meanwhile"
    bots = [m["content"] for m in final.chatbot if m["role"] == "assistant" and not m.get("metadata")]
    assert bots == ["Lyon"] and [t.assistant for t in runtime.store.get(f"anon:{A_TOKEN}", conv).turns] == ["Lyon"]
    with pytest.raises(gr.Error, match="no longer exists"):
        list(h.chat.regenerate(conv, True, B_TOKEN, NOBODY))
    with pytest.raises(gr.Error, match="not saved yet"):
        list(h.chat.regenerate("", True, A_TOKEN, NOBODY))


def test_continue_shows_the_reply_so_far_then_the_grown_reply(runtime):
    h = Handlers(runtime)
    conv = _one_chat(h)
    first, *_, final = list(h.chat.continue_reply(conv, True, A_TOKEN, NOBODY))
    assert [m["content"] for m in final.chatbot if not m.get("metadata")] == ["Capital?", "Paris and more"]
    with pytest.raises(gr.Error, match="no longer exists"):
        list(h.chat.continue_reply(conv, True, B_TOKEN, NOBODY))


def test_undo_removes_the_last_turn_puts_its_message_back_and_refuses_strangers(runtime):
    h = Handlers(runtime)
    conv = _one_chat(h)
    *_, final = h.chat.respond("And Italy?", [], conv, True, A_TOKEN, NOBODY)
    with pytest.raises(gr.Error, match="no longer exists"):
        h.chat.undo(conv, B_TOKEN, NOBODY)
    *panel, box = h.chat.undo(conv, A_TOKEN, NOBODY)
    assert box == "And Italy?" and [m["content"] for m in Panel(*panel).chatbot][:2] == ["Capital?", "Paris"]
    assert [t.user for t in runtime.store.get(f"anon:{A_TOKEN}", conv).turns] == ["Capital?"]
    runtime.store.set_summary(f"anon:{A_TOKEN}", conv, "asked for a capital", 1)
    with pytest.raises(gr.Error, match="folded into this chat's summary"):
        h.chat.undo(conv, A_TOKEN, NOBODY)
    assert len(runtime.store.get(f"anon:{A_TOKEN}", conv).turns) == 1, "a refused undo changes nothing"


def test_api_conversations_continue_with_their_id_and_only_with_it(runtime):
    h = Handlers(runtime)
    *_, (reply, conv_id) = h.endpoints.api_chat("Capital?", request=NOBODY)
    assert reply == "Paris" and len(conv_id) == 32
    *_, (reply2, same) = h.endpoints.api_chat("Again?", conv_id, request=NOBODY)
    assert same == conv_id and json.loads(h.endpoints.api_stats(conv_id, request=NOBODY))["turn"] == 2
    assert runtime.store.list_conversations(f"anon:{A_TOKEN}") == [], "not in any browser's list"


def test_build_app_keeps_the_endpoints_and_element_ids(runtime):
    config = build_app(runtime).config
    api = {d["api_name"]: d.get("api_visibility", "public") for d in config["dependencies"] if d.get("api_name")}
    assert {name for name, visibility in api.items() if visibility == "public"} == {"chat", "stats", "status_text"}, (
        "the public API: chat and stats (the page's own events need its token)"
    )
    assert api["respond_enter"] == "private" and api["respond"] == "private"
    ids = {c["props"].get("elem_id") for c in config["components"]}
    assert {
        "llmweb-chat",
        "llmweb-send",
        "llmweb-stop",
        "llmweb-stats",
        "llmweb-sections",
        "llmweb-memory",
        "llmweb-status",
        "llmweb-upload",
        "llmweb-doclist",
        "llmweb-tokens-plot",
    } <= ids
    keys = {c["props"].get("storage_key") for c in config["components"]}
    assert {"llmweb_conversation", "llmweb_owner"} <= keys


def test_a_turn_streams_into_the_chat_alone_and_its_next_event_fills_the_rest_of_the_panel(runtime):
    """Gradio rebuilds every output it is told to skip, on every streamed update: a turn's events
    have the chat's id, the chat and the rest's state as outputs (and Send's, the box), and an
    event after each puts out every other part of the panel."""
    config = build_app(runtime).config
    elem = {c["id"]: c["props"].get("elem_id") for c in config["components"]}
    kinds = {c["id"]: c["type"] for c in config["components"]}
    panel_parts = {o for d in config["dependencies"] if d.get("api_name") == "after_stop" for o in d["outputs"]}
    ends = ("respond", "respond_enter", "regenerate", "continue_reply", "edit")
    turns = [d for d in config["dependencies"] if d.get("api_name") in ends]
    assert len(turns) == len(ends)
    for turn in turns:
        outs = [kinds[o] for o in turn["outputs"]]
        assert outs[:3] == ["browserstate", "chatbot", "state"] and len(outs) <= 4, turn["api_name"]
        then = [d for d in config["dependencies"] if d.get("trigger_after") == turn["id"]]
        rest = [d for d in then if turn["outputs"][2] in d["inputs"]]
        assert len(rest) == 1, f"{turn['api_name']}: no event shows the rest of its panel"
        shown = set(rest[0]["outputs"]) | set(turn["outputs"])
        assert panel_parts <= shown and "llmweb-stats" in {elem.get(o) for o in rest[0]["outputs"]}


def test_once_a_turn_ends_the_status_line_then_the_picker_show_the_model_served(runtime):
    """A turn may switch the model (a chat takes its own back: web/panels/models.py), so every event
    that ends one, Stop's included, is followed by the status line's refresh, then the picker's."""
    config = build_app(runtime).config
    elem = {c["id"]: c["props"].get("elem_id") for c in config["components"]}

    def after(dep) -> dict[frozenset, dict]:
        then = [d for d in config["dependencies"] if d.get("trigger_after") == dep["id"]]
        return {frozenset(elem.get(o) for o in d["outputs"]): d for d in then}

    ends = ("respond", "respond_enter", "regenerate", "continue_reply", "edit", "after_stop")
    turns = [d for d in config["dependencies"] if d.get("api_name") in ends]
    assert len(turns) == len(ends)
    for turn in turns:
        status = after(turn).get(frozenset({"llmweb-status", None}))  # the timer has no elem_id
        assert status is not None, f"{turn['api_name']}: no status line refresh after it"
        assert list(after(status)) == [frozenset({"llmweb-model"})], f"{turn['api_name']}: no picker refresh"


def test_delete_all_my_data_removes_only_the_callers_chats(runtime, monkeypatch):
    monkeypatch.setattr(gr, "Info", lambda message: None)  # the toast needs a running event
    h = Handlers(runtime)
    mine = [_one_chat(h) for _ in range(2)]
    theirs = h.chat.respond("Capital?", [], "", True, B_TOKEN, NOBODY)
    *_, final = theirs
    out = h.account.delete_everything(A_TOKEN, NOBODY)
    assert out[0] == "" and out[2]["choices"] == [], "A's page shows a blank chat and an empty list"
    assert runtime.store.list_conversations(f"anon:{A_TOKEN}") == [] and mine
    assert [c.id for c in runtime.store.list_conversations(f"anon:{B_TOKEN}")] == [final[0]], "B keeps theirs"


def _settings_inputs(panel: Panel, **changed) -> list:
    """The settings panel's values as the page would send them on Save (conv, system, temperature, cap,
    memory, loop guard, documents), with some changed."""
    values = dict(
        system=panel.system_box,
        temperature=panel.temperature,
        cap=panel.reply_cap,
        memory=panel.memory_mode,
        loop_guard=panel.loop_guard,
        use_docs=panel.use_docs,
    )
    values.update(changed)
    return [panel.conv_state, *values.values()]


def test_chat_settings_show_the_configuration_then_what_the_chat_saved_and_strangers_cannot(runtime):
    from llmweb.store.models import ChatSettings

    h = Handlers(runtime)
    blank = h.chats.new_chat(A_TOKEN, NOBODY)
    assert (blank.system_box, blank.reply_cap, blank.memory_mode, blank.use_docs) == (
        runtime.settings.system_prompt,
        64,
        "recall",
        True,
    ), "a new chat shows the configuration, capped by the server's budget"
    saved = h.settings.save_settings(*_settings_inputs(blank, system="You are a pirate.", cap=12), A_TOKEN, NOBODY)
    assert saved.conv_state and saved.system_box == "You are a pirate." and saved.reply_cap == 12
    conv = runtime.store.get(f"anon:{A_TOKEN}", saved.conv_state)
    assert conv.settings == ChatSettings(system_prompt="You are a pirate.", max_new_tokens=12), "only what changed"
    reopened = h.chats.switch(saved.conv_state, A_TOKEN, NOBODY)
    assert (reopened.system_box, reopened.reply_cap) == ("You are a pirate.", 12), "a reload shows them again"
    with pytest.raises(gr.Error, match="reply cap must be between 1 and 64"):
        h.settings.save_settings(*_settings_inputs(saved, cap=65), A_TOKEN, NOBODY)
    assert runtime.store.get(f"anon:{A_TOKEN}", saved.conv_state).settings == conv.settings, "nothing changed"
    h.settings.set_use_docs(saved.conv_state, False, A_TOKEN, NOBODY)
    assert h.chats.switch(saved.conv_state, A_TOKEN, NOBODY).use_docs is False
    # another visitor: the same id is an unknown chat, and saving creates B's own instead
    h.settings.set_use_docs(saved.conv_state, True, B_TOKEN, NOBODY)  # not B's chat: nothing to keep it with
    assert h.chats.switch(saved.conv_state, A_TOKEN, NOBODY).use_docs is False
    with pytest.raises(NotFound):
        runtime.chat.set_settings(f"anon:{B_TOKEN}", saved.conv_state, ChatSettings(temperature=1.0))
    theirs = h.settings.save_settings(*_settings_inputs(saved, system="Stolen"), B_TOKEN, NOBODY)
    assert theirs.conv_state != saved.conv_state
    assert runtime.store.get(f"anon:{A_TOKEN}", saved.conv_state).settings.system_prompt == "You are a pirate."


def test_the_loop_guard_box_shows_the_default_and_what_one_chat_saved(runtime):
    from llmweb.store.models import ChatSettings

    h = Handlers(runtime)
    blank = h.chats.new_chat(A_TOKEN, NOBODY)
    assert blank.loop_guard is True, "on by default (LLMWEB_LOOP_GUARD)"
    saved = h.settings.save_settings(*_settings_inputs(blank, loop_guard=False), A_TOKEN, NOBODY)
    assert runtime.store.get(f"anon:{A_TOKEN}", saved.conv_state).settings == ChatSettings(loop_guard=False)
    assert h.chats.switch(saved.conv_state, A_TOKEN, NOBODY).loop_guard is False, "kept over a reload"
    assert h.chats.switch(saved.conv_state, B_TOKEN, NOBODY).loop_guard is True, "not another visitor's chat"


def test_import_of_an_export_reproduces_the_chat_for_its_importer_and_bad_files_change_nothing(runtime, tmp_path):
    from llmweb.store.models import ChatSettings

    h, a = Handlers(runtime), f"anon:{A_TOKEN}"
    conv = _one_chat(h)
    h.chat.respond("And Italy?", [], conv, True, A_TOKEN, NOBODY).close()
    *_, last = h.chat.respond("And Spain?", [], conv, True, A_TOKEN, NOBODY)
    runtime.store.set_summary(a, conv, "The user asks for capitals.", 1)
    runtime.store.add_fact(a, conv, "I live in Lyon.", pinned=True)
    runtime.chat.set_settings(a, conv, ChatSettings(system_prompt="Be brief.", temperature=0.3, memory="summary"))
    exported = Path(h.transfer.export_json(conv, A_TOKEN, NOBODY))
    opened = h.transfer.import_chat(str(exported), B_TOKEN, NOBODY)
    assert opened.conv_state != conv and opened.stats_md.endswith("(2 turns).")
    original, copy = runtime.store.get(a, conv), runtime.store.get(f"anon:{B_TOKEN}", opened.conv_state)
    assert [(t.user, t.assistant, t.stats, t.sources) for t in copy.turns] == [
        (t.user, t.assistant, t.stats, t.sources) for t in original.turns
    ]
    same = ("title", "summary", "summarized_upto", "settings")
    assert [getattr(copy, k) for k in same] == [getattr(original, k) for k in same]
    assert [(f.text, f.pinned) for f in copy.facts] == [("I live in Lyon.", True)]
    assert opened.chatbot == h.chats.switch(conv, A_TOKEN, NOBODY).chatbot and opened.system_box == "Be brief."
    assert h.chats.switch(opened.conv_state, A_TOKEN, NOBODY).conv_state == "", "B's copy is not A's"
    before = (runtime.store.list_conversations(a), runtime.store.list_conversations(f"anon:{B_TOKEN}"))
    for name, content in (
        ("notes.json", b'{"hello": 1}'),
        ("broken.json", exported.read_bytes()[:-20]),
        ("binary.json", b"\xff\xfe\x00junk"),
    ):
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(gr.Error, match="not an llmweb|not text"):
            h.transfer.import_chat(str(bad), A_TOKEN, NOBODY)
    assert (runtime.store.list_conversations(a), runtime.store.list_conversations(f"anon:{B_TOKEN}")) == before


def test_editing_turn_2_of_4_forks_the_chat_and_the_switcher_goes_back_to_all_4_turns(runtime):
    h, a = Handlers(runtime), f"anon:{A_TOKEN}"
    conv = _one_chat(h)
    for q in ("Italy?", "Spain?", "Peru?"):
        *_, last = h.chat.respond(q, [], conv, True, A_TOKEN, NOBODY)
    original = Panel(*last[:-1])
    users = [m["content"] for m in original.chatbot if m["role"] == "user"]
    assert users == ["Capital?", "Italy?", "Spain?", "Peru?"] and original.versions_row["visible"] is False
    index = next(i for i, m in enumerate(original.chatbot) if m["content"] == "Italy?")
    edited = SimpleNamespace(index=index, value="Italy, please?")
    *_, forked = h.chat.edit(conv, True, A_TOKEN, original.chatbot, NOBODY, edited)
    assert [m["content"] for m in forked.chatbot if m["role"] == "user"] == ["Capital?", "Italy, please?\n\n‹ 2/2 ›"]
    assert forked.chatbot[-1]["content"] == "Rome" and forked.versions_row["visible"] is True
    assert forked.version_dd["choices"] == [("Turn 2 ‹ 2/2 ›", 1)] and forked.version_dd["value"] == 1
    back = h.chat.prev_version(conv, 1, A_TOKEN, NOBODY)
    assert [m["content"] for m in back.chatbot if m["role"] == "user"] == [
        "Capital?",
        "Italy?\n\n‹ 1/2 ›",
        "Spain?",
        "Peru?",
    ]
    assert back.stats_md.endswith("Turn 2: version 1 of 2.")
    assert h.chats.switch(conv, A_TOKEN, NOBODY).chatbot == back.chatbot, "a reload keeps the active version"
    with pytest.raises(gr.Error, match="no longer exists"):
        h.chat.next_version(conv, 1, B_TOKEN, NOBODY)
    with pytest.raises(gr.Error, match="no longer exists"):
        list(h.chat.edit(conv, True, B_TOKEN, original.chatbot, NOBODY, edited))
    assert runtime.store.get(a, conv).versions == {1: (0, 2)}, "a stranger changed nothing"
    again = h.chat.edit(
        conv, True, A_TOKEN, back.chatbot, NOBODY, SimpleNamespace(index=index, value="Italy?\n\n‹ 1/2 › ")
    )
    *_, third = again
    assert third.version_dd["choices"] == [("Turn 2 ‹ 3/3 ›", 1)], "the marker is not part of the message"
    assert runtime.store.get(a, conv).turns[1].user == "Italy?"


def test_a_new_chat_sent_without_documents_keeps_the_box_unticked(runtime):
    h = Handlers(runtime)
    *_, final = h.chat.respond("Capital?", [], "", False, A_TOKEN, NOBODY)
    panel = Panel(*final[:-1])
    assert panel.use_docs is False and [m["content"] for m in panel.chatbot][:2] == ["Capital?", "Paris"]
    assert runtime.store.get(f"anon:{A_TOKEN}", panel.conv_state).settings.use_docs is False
    (info,) = runtime.store.list_conversations(f"anon:{A_TOKEN}")
    assert info.title == "Capital?" and info.n_turns == 1, "one chat, titled by its first message"


def test_the_owners_retention_may_purge_are_the_anonymous_ones_identity_mints():
    """The runtime sits below the web layer, so it keeps its own copy of the anonymous prefixes."""
    from llmweb.runtime import retention
    from llmweb.web import identity

    assert retention.ANON_PREFIXES == identity.ANONYMOUS
    assert identity.OPEN_STATELESS_OWNER.startswith(identity.ANONYMOUS)
    assert not identity.login_owner("alice").startswith(identity.ANONYMOUS)


# ---- a long chat on the page: its last turns, and a note that brings back the rest
def _long_chat(runtime, token: str, extra: int) -> str:
    owner = f"anon:{token}"
    conv = runtime.store.create_conversation(owner)
    for i in range(SHOWN_TURNS + extra):
        runtime.store.add_turn(owner, conv, f"Question {i}?", f"Answer {i}.")
    return conv


def _users(messages) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def test_a_long_chat_shows_its_last_turns_after_a_note_that_counts_the_rest():
    turns = [
        SimpleNamespace(idx=i, user=f"q{i}", assistant="a", stats=None, sources=[]) for i in range(SHOWN_TURNS + 3)
    ]
    conv = SimpleNamespace(turns=turns, versions={})
    shown = history_messages(conv)
    assert shown[0]["role"] == "assistant" and shown[0]["content"].startswith("*3 earlier turns")
    assert _users(shown) == [f"q{i}" for i in range(3, SHOWN_TURNS + 3)]
    assert hidden_turns(shown) == 3
    as_sent_back = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in shown]  # the page's form
    assert hidden_turns(as_sent_back) == 3
    whole = history_messages(conv, 0)
    assert _users(whole) == [f"q{i}" for i in range(SHOWN_TURNS + 3)] and hidden_turns(whole) == 0
    assert hidden_turns(history_messages(SimpleNamespace(turns=turns[:SHOWN_TURNS], versions={}))) == 0, "no note"
    assert hidden_turns([{"role": "user", "content": shown[0]["content"]}]) == 0, "only the chat's note counts"
    forged = earlier_note(1)["content"].replace("*1 ", "*" + "9" * 5000 + " ")  # a client sends back what it likes
    assert hidden_turns([{"role": "assistant", "content": forged}]) == 0
    assert history_messages(conv, 10**6) == [earlier_note(len(turns))], "a first past the end: the note alone"


def test_a_click_on_the_note_shows_the_whole_chat_to_its_owner_alone(runtime):
    h = Handlers(runtime)
    conv = _long_chat(runtime, A_TOKEN, 4)
    page = h.chats.switch(conv, A_TOKEN, NOBODY).chatbot
    assert hidden_turns(page) == 4 and _users(page)[0] == "Question 4?"

    whole = h.chat.show_earlier(conv, A_TOKEN, page, NOBODY, SimpleNamespace(index=0))
    assert _users(whole) == [f"Question {i}?" for i in range(SHOWN_TURNS + 4)] and hidden_turns(whole) == 0
    assert h.chat.show_earlier(conv, A_TOKEN, page, NOBODY, SimpleNamespace(index=1)) == gr.skip(), "a question"
    assert h.chat.show_earlier(conv, A_TOKEN, whole, NOBODY, SimpleNamespace(index=0)) == gr.skip(), "no note"
    assert h.chat.show_earlier(conv, B_TOKEN, page, NOBODY, SimpleNamespace(index=0)) == gr.skip(), "A's chat, B"
    hit = f"{conv}:1"
    assert hidden_turns(h.chats.open_hit(hit, A_TOKEN, NOBODY).chatbot) == 0, "a search hit opens it whole"


def test_an_edit_and_a_sources_click_on_a_long_chat_find_their_turn_past_the_hidden_ones(runtime):
    h, a = Handlers(runtime), f"anon:{A_TOKEN}"
    conv = _long_chat(runtime, A_TOKEN, 2)
    page = h.chats.switch(conv, A_TOKEN, NOBODY).chatbot
    index = next(i for i, m in enumerate(page) if m["content"] == "Question 5?")
    *_, forked = h.chat.edit(conv, True, A_TOKEN, page, NOBODY, SimpleNamespace(index=index, value="Question five?"))
    stored = runtime.store.get(a, conv)
    assert stored.turns[5].user == "Question five?" and list(stored.versions) == [5], "turn 6 forked, not turn 4"
    assert forked.chatbot[-1]["content"] == "Rome"
    whole = history_messages(stored, 0)
    index = next(i for i, m in enumerate(whole) if m["content"] == "Question 3?")
    list(h.chat.edit(conv, True, A_TOKEN, whole, NOBODY, SimpleNamespace(index=index, value="Question three?")))
    assert runtime.store.get(a, conv).turns[3].user == "Question three?", "on the whole chat: no offset"
    with pytest.raises(gr.Error, match="Only your own messages"):
        list(h.chat.edit(conv, True, A_TOKEN, page, NOBODY, SimpleNamespace(index=0, value="the note")))


def test_a_chat_continued_in_a_new_one_is_warmed_as_it_opens(runtime):
    """ "Continue in a new chat" opens the new chat as picking one does: its first prompt (summary,
    facts, last turns) is prefilled in the background, so the first message prefills only itself."""
    h = Handlers(runtime)
    a_conv, a = _one_chat(h), f"anon:{A_TOKEN}"
    made = []

    def continue_in_new(owner, conv_id):
        made.append(runtime.store.create_conversation(owner))
        return made[-1]

    runtime.chat.carry = SimpleNamespace(continue_in_new=continue_in_new)
    runtime.chat.warmed.clear()
    panel = h.chats.continue_chat(a_conv, A_TOKEN, NOBODY)
    assert panel.conv_state == made[0] != a_conv
    assert runtime.chat.warmed == [(a, made[0])]
