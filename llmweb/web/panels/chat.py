"""The chat's handlers: send, regenerate, continue, edit, undo, the version switcher, and what the
page shows after Stop. A turn streams into the chat, then the whole panel is filled.

This module shows a turn's events; it must not decide what goes into the prompt or how a turn is
stored (chat/session.py does), and it builds no component (web/ui.py does).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator, Iterator

import gradio as gr

from llmweb.chat.session import Delta, Finished, Progress, Queued, Started, clean_message
from llmweb.errors import InputError, LlmwebError
from llmweb.runtime.resident import Lease
from llmweb.store.models import ChatSettings
from llmweb.web.formatting import escape, hidden_turns, history_messages, message_text
from llmweb.web.panels.base import WAIT_READY_S, Panel, PanelHandlers, user_errors
from llmweb.web.panels.models import chat_model

# the most often a streaming reply is shown again: each update re-sends and re-renders the whole
# message (markdown in the browser), so per token it costs O(n^2) in the reply's length, and a
# browser on the same cores takes them from the engine. Measured (headless Chromium on the 2-core
# machine, a 160-token reply): its renderer used 0.88-1.10 CPU s a turn at 20 updates a second,
# 0.69-0.77 at 10 and 0.51-0.73 at 5; 10 a second (a few words each) still reads as a stream
SHOW_EVERY_S = 0.1
# after Stop, the most to wait for the partial turn to be stored: the worker stops within a step,
# but a batch's step on a loaded CPU can take seconds (5 s was too short for the browser test there)
STOP_WAIT_S = 30.0
LOAD_POLL_S = 1.0  # while a model loads, the reply's place shows the status line this often


class ChatHandlers(PanelHandlers):
    """The chat column: its box, Send, the chat's retry/undo/edit controls, Continue, Stop, versions."""

    @user_errors
    def respond(
        self, message, history, conv_id, use_docs, token, request: gr.Request, whole_doc=False
    ) -> Iterator[tuple]:
        """Send from the chat box: streams the reply into the chat, then fills the panel and clears the box.
        `whole_doc` (the box beside the documents one): read the whole document (chat/document_task.py)."""
        owner = self.owner(token, request)
        clean_message(message, self.settings.max_message_chars)
        conv_id = conv_id if conv_id and self.store.exists(owner, conv_id) else None  # None: a new chat
        shown = list(history or []) + [
            {"role": "user", "content": escape(message, message=True)},
            {"role": "assistant", "content": "…"},
        ]
        with (yield from self._loaded(owner, conv_id, shown, (message,))) as chat:
            self._note_address(chat, owner, request)
            if conv_id is None and not use_docs:  # the box is this chat's setting: keep it from the first turn
                conv_id = self.store.create_conversation(owner)
                chat.set_settings(owner, conv_id, ChatSettings(use_docs=False))
            whole = {"whole_document": True} if whole_doc else {}
            events = chat.send(owner, conv_id, message, use_docs=bool(use_docs), **whole)
            for panel in self._stream(owner, conv_id, shown, events):
                yield (*panel, "")

    @user_errors
    def regenerate(self, conv_id, use_docs, token, request: gr.Request) -> Iterator[tuple]:
        """The chat's retry control: answer the last message again; the new reply replaces the old one."""
        yield from self._redo(conv_id, use_docs, token, request, more=False)

    @user_errors
    def continue_reply(self, conv_id, use_docs, token, request: gr.Request) -> Iterator[tuple]:
        """Continue: a reply cut by the length cap or stopped grows from where it ended."""
        yield from self._redo(conv_id, use_docs, token, request, more=True)

    def _redo(self, conv_id, use_docs, token, request, *, more: bool) -> Iterator[tuple]:
        owner = self.owner(token, request)
        conv = self._current(owner, conv_id)
        if not conv.turns:
            raise InputError("There is no reply to regenerate or continue yet.")
        with (yield from self._loaded(owner, conv_id, history_messages(conv))) as chat:
            last = conv.turns[-1]
            shown = history_messages(dataclasses.replace(conv, turns=conv.turns[:-1]))
            so_far = escape(last.assistant, message=True) if more else "…"
            shown += [
                {"role": "user", "content": escape(last.user, message=True)},
                {"role": "assistant", "content": so_far},
            ]
            events = (chat.continue_reply if more else chat.regenerate)(owner, conv_id, use_docs=bool(use_docs))
            yield from self._stream(owner, conv_id, shown, events)

    @user_errors
    def undo(self, conv_id, token, request: gr.Request) -> tuple:
        """The chat's undo control: remove the last turn and put its message back in the box."""
        owner = self.owner(token, request)
        self._current(owner, conv_id)
        gone = self._chat().undo(owner, conv_id)
        return (*self._reshown(owner, conv_id, "Removed the last turn."), gone.user)

    @user_errors
    def edit(self, conv_id, use_docs, token, shown, request: gr.Request, edited: gr.EditData) -> Iterator[tuple]:
        """The chat's edit control on a user message (`edited.index` of the chat as the page shows
        it, `shown`): send the new text in place of that turn. The chat forks there: the turns from
        it on stay, as another version (the switcher shows it)."""
        owner = self.owner(token, request)
        conv = self._current(owner, conv_id)
        first = hidden_turns(shown)
        messages = history_messages(conv, first)
        index = edited.index if isinstance(edited.index, int) else edited.index[0]
        turn = first + sum(1 for m in messages[:index] if m.get("role") == "user")
        value = edited.value
        text = value.get("content", "") if isinstance(value, dict) else value
        text = message_text(text if isinstance(text, str) else "")  # the shown text is escaped
        if (
            not (first <= turn < len(conv.turns) and 0 <= index < len(messages))
            or messages[index].get("role") != "user"
        ):
            raise InputError("Only your own messages can be edited.")
        clean_message(text, self.settings.max_message_chars)
        with (yield from self._loaded(owner, conv_id, messages)) as chat:
            shown = history_messages(dataclasses.replace(conv, turns=conv.turns[:turn]))
            shown += [{"role": "user", "content": escape(text, message=True)}, {"role": "assistant", "content": "…"}]
            events = chat.edit(owner, conv_id, turn, text, use_docs=bool(use_docs))
            yield from self._stream(owner, conv_id, shown, events)  # the switcher then shows this fork (the latest)

    @user_errors
    def prev_version(self, conv_id, fork, token, request: gr.Request) -> Panel:
        return self._step_version(conv_id, fork, -1, token, request)

    @user_errors
    def next_version(self, conv_id, fork, token, request: gr.Request) -> Panel:
        return self._step_version(conv_id, fork, +1, token, request)

    def _step_version(self, conv_id, fork, step: int, token, request) -> Panel:
        """‹ or ›: show the previous or next version of the chat from the picked fork on."""
        owner = self.owner(token, request)
        conv = self._current(owner, conv_id)
        if fork is None or int(fork) not in conv.versions:
            raise InputError("Pick a version switch first (the turn whose message was edited).")
        fork = int(fork)
        active, count = conv.versions[fork]
        self._chat().switch_version(owner, conv_id, fork, (active + step) % count)
        conv = self.store.get(owner, conv_id)
        return self.panel(owner, conv, f"Turn {fork + 1}: version {conv.versions[fork][0] + 1} of {count}.", fork=fork)

    def _loaded(self, owner: str, conv_id, shown: list[dict], tail: tuple = ()) -> Generator[tuple, None, Lease]:
        """The chat's model, held for the turn (`with lease as chat:` releases it when the turn ends):
        its own model where it is loaded or its owner may switch to it (web/panels/models.py), else
        the one served. While a model loads, the reply's place shows the load's progress (a switch,
        or a load again after the keep-alive unloaded it)."""
        wanted = chat_model(self, owner, conv_id)
        deadline = time.monotonic() + WAIT_READY_S
        while True:
            try:
                lease = self.runtime.hold(wanted, LOAD_POLL_S)
                if lease is not None:
                    return lease
                wanted = None  # its model was let go meanwhile: the one served answers
                continue
            except LlmwebError:
                if getattr(self.runtime, "_error", None) is not None or time.monotonic() > deadline:
                    raise  # a failed load says why; a load past WAIT_READY_S says it is still loading
            loading = [*shown[:-1], {"role": "assistant", "content": f"*{escape(self.runtime.status, inline=True)}*"}]
            yield (*Panel.streaming(conv_id or "", loading), *tail)

    def _stream(self, owner: str, conv_id, shown: list[dict], events) -> Iterator[Panel]:
        """Show a turn's events: the queue position, a whole-document task's progress (under the text
        so far), then the reply as it grows (at most every SHOW_EVERY_S: the text in between is
        shown with the next update, and all of it in the whole panel at the end)."""
        notes, prompt, so_far, shown_at = "", "", "", float("-inf")
        for event in events:
            if isinstance(event, Started):
                conv_id = event.conv_id
            elif isinstance(event, Queued):
                wait = f"number {event.position} in the queue, about {max(round(event.wait_s), 1)} s"
                shown[-1] = {"role": "assistant", "content": f"*Waiting: {wait}…*"}
                yield Panel.streaming(conv_id, shown)
            elif isinstance(event, Progress):
                line = f"*{escape(event.text, inline=True)}*"
                shown[-1] = {
                    "role": "assistant",
                    "content": f"{escape(so_far, message=True)}\n\n{line}" if so_far else line,
                }
                yield Panel.streaming(conv_id, shown)
            elif isinstance(event, Delta):
                so_far, now = event.text, time.monotonic()
                if now - shown_at < SHOW_EVERY_S:
                    continue
                shown_at = now
                shown[-1] = {"role": "assistant", "content": escape(event.text, message=True)}
                yield Panel.streaming(conv_id, shown)
            elif isinstance(event, Finished):
                notes, prompt = " ".join(event.notes), event.prompt_text()
        # the chat grew: a source opened meanwhile, of an earlier turn, stays open
        yield self.panel(owner, self.store.get(owner, conv_id), notes, prompt)._replace(source_box=gr.skip())

    @user_errors
    def show_earlier(self, conv_id, token, shown, request: gr.Request, clicked: gr.SelectData):
        """A click on the note that a long chat's earlier turns are not shown (`history_messages`):
        the whole chat. A click on any other message changes nothing."""
        owner = self.owner(token, request)
        if clicked.index != 0 or not hidden_turns(shown) or not conv_id or not self.store.exists(owner, conv_id):
            return gr.skip()
        return history_messages(self.store.get(owner, conv_id), 0)

    @user_errors
    def after_stop(self, conv_id, history, token, request: gr.Request):
        """After Stop: wait (briefly) for the partial turn to be stored, then show it as stopped."""
        owner = self.owner(token, request)
        if not conv_id or not self.store.exists(owner, conv_id):
            return gr.skip()
        asked = hidden_turns(history) + sum(1 for m in history or [] if m.get("role") == "user")
        deadline = time.monotonic() + STOP_WAIT_S
        conv = self.store.get(owner, conv_id)
        while len(conv.turns) < asked and time.monotonic() < deadline:
            time.sleep(0.1)
            conv = self.store.get(owner, conv_id)
        return self.panel(owner, conv, "Stopped.")
