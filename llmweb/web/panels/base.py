"""What every panel's handlers share: who is asking, and how one conversation is shown.

`PanelHandlers` holds the runtime and fills a `Panel` (every component that shows a conversation)
from the store; `OwnerSlots` lets each owner run one long owner-only event at a time (an upload, an
import, "Delete all my data"), refusing a second at once, so no visitor holds more than one place of
a concurrency group nor makes another owner's action wait; `user_errors` turns a failure into a
`gr.Error` toast (the domain error's sentence, or a ref to the log), the one place in llmweb where
that happens. This module must not build
components (web/ui.py does), format text (web/formatting.py does) or work out an owner itself
(web/identity.py does).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import gradio as gr

from llmweb.chat.facts import suggestions
from llmweb.errors import InputError
from llmweb.records import OUT
from llmweb.store.models import DEFAULT_TITLE, ChatSettings, Conversation
from llmweb.web.failures import public_message
from llmweb.web.formatting import (
    SECTION_COLOURS,
    escape,
    fact_label,
    history_messages,
    line_chart_html,
    memories_markdown,
    memory_choices,
    plot_frames,
    scope_label,
    sections_html,
    stats_markdown,
    summary_markdown,
    turn_choices,
    version_choices,
)
from llmweb.web.identity import ANONYMOUS
from llmweb.web.trust import origin_of
from llmweb.web.visitors import visitors_for

log = logging.getLogger(__name__)

WAIT_READY_S = 600.0


def user_errors(fn):
    """Show a failure as a `gr.Error` toast: a domain error's sentence, anything else as "Something
    went wrong (ref N)" with the details in the log only (web/failures.py); the toast renders HTML,
    so the sentence is escaped. Works for plain and generator functions (a generator must stay one,
    or Gradio would not stream it)."""
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except gr.Error:
                raise
            except Exception as e:
                raise gr.Error(escape(public_message(e))) from None

        return stream

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except Exception as e:
            raise gr.Error(escape(public_message(e))) from None

    return call


class Panel(NamedTuple):
    """Everything that shows one conversation; the field names are `Layout` attributes, in output order."""

    conv_state: Any
    chatbot: Any
    conv_list: Any
    stats_md: Any
    bar: Any
    memory_md: Any
    fact_dd: Any
    tokens_plot: Any
    memory_plot: Any
    prompt_box: Any  # the last turn's prompt, as sent (known only right after a turn)
    use_docs: Any  # this chat's settings, each shown as its value in effect
    system_box: Any
    temperature: Any
    reply_cap: Any
    memory_mode: Any
    loop_guard: Any
    versions_row: Any  # the version switcher, shown when the chat has versions
    version_dd: Any
    doc_scope: Any  # the documents this chat reads (empty: all), among those the owner can read
    turn_dd: Any  # the turns, to keep in context or leave out (panels/memory.py)
    memories_md: Any  # what the owner asked all their chats to remember (panels/memory.py)
    memory_dd: Any
    suggest_dd: Any  # this chat's fact sentences, offered to remember in all the owner's chats
    source_box: Any  # the source panel (panels/sources.py): closed when another view of the chat is shown

    @classmethod
    def streaming(cls, conv_id: str, messages: list[dict]) -> Panel:
        """While a reply streams, only the chat changes."""
        return cls(conv_id, messages, *[gr.skip()] * (len(cls._fields) - 2))


STREAMED = 2  # a streaming turn's outputs on the page: the chat's id and the chat (the Panel's first two)
SKIP = gr.skip()


def streamed(handler):
    """A turn's handler as the page wires it. Each of its yields (a Panel, then the outputs after
    it) goes out as the chat's id, the chat, the rest of the panel and those after it; the rest is
    a `gr.State`: None while the reply streams, the Panel's other fields once it ends, which the
    next event shows (`rest_shown`).

    Why: per streamed update, Gradio rebuilds the component of every output it is told to skip
    (a new component and its config each, ~0.25 ms) and the page updates the status of every output
    of the event. With the whole panel as outputs, a 160-token reply shown 10 times a second cost
    the web process 0.51-0.64 CPU s, against 0.17-0.32 for the same reply through the API; with the
    chat alone, 0.27-0.28 (`bench busy`, docs/benchmarks.md)."""

    @functools.wraps(handler)
    def run(*args, **kwargs):
        width = len(Panel._fields)
        for out in handler(*args, **kwargs):
            rest, after = tuple(out[STREAMED:width]), tuple(out[width:])
            ended = not all(isinstance(x, dict) and x == SKIP for x in rest)
            yield (*out[:STREAMED], rest if ended else None, *after)

    return run


def rest_shown(rest) -> tuple:
    """The event after a streamed turn: the rest of the turn's last panel (nothing where it ended
    without one: an error, or Stop, whose own event fills the panel), and the state emptied, so a
    later turn that fails before its first update cannot show this one's panel again."""
    if rest is None:
        return (*[SKIP] * (len(Panel._fields) - STREAMED), None)
    return (*rest, None)


class OwnerSlots:
    """One long event per owner at a time (an upload, an import, deleting their data): a second is
    refused at once with a sentence, never queued, so it holds no thread and no group place."""

    def __init__(self) -> None:
        self._busy: dict[str, str] = {}  # owner -> what is running
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self, owner: str, what: str) -> Iterator[None]:
        with self._lock:
            running = self._busy.get(owner)
            if running is None:
                self._busy[owner] = what
        if running is not None:
            raise InputError(f"Your {running} is still running: try again when it has finished.")
        try:
            yield
        finally:
            with self._lock:
                del self._busy[owner]


class PanelHandlers:
    """The base of every panel's handlers, over a `Runtime`. Every handler takes the browser's owner
    token and the request last, and every store and library call gets the caller's owner."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.store = runtime.store
        self.settings = runtime.settings
        self.visitors = visitors_for(runtime.settings)  # one per server: the page tokens and per-address counts
        self.slots = OwnerSlots()  # web/ui.py's Handlers gives every panel one, shared

    def owner(self, token: str, request: gr.Request | None) -> str:
        """The caller's owner (web/identity.py): the single user, the login account, or the browser's
        token; an event sent before its page had a token gets the page's, minted now (web/visitors.py)."""
        owner = self.visitors.resolve(token, request)[0]
        self._note_stored_address(owner, request)
        return owner

    def _note_stored_address(self, owner: str, request: gr.Request | None) -> None:
        """Tell the store which client address an anonymous owner came from: what all the anonymous
        owners of one address store is bounded together (store/owners.py). Login accounts, keys and
        the single user are counted per account only, like the count of new visitors (web/visitors.py)."""
        if request is not None and owner.startswith(ANONYMOUS):
            self.store.note_address(owner, origin_of(self.settings, request).group)

    def _chat(self):
        return self.runtime.wait_ready(WAIT_READY_S)

    def _note_address(self, chat, owner: str, request: gr.Request | None) -> None:
        """Tell `chat`'s engine which client address `owner` came from: the identities of one
        address share its limits (engine/share.py)."""
        if request is not None:
            chat.engine.note_address(owner, origin_of(self.settings, request).group)

    def _mem_limit(self) -> int:
        engine = self.runtime.engine
        return engine.limits.mem_limit_bytes if engine is not None else 0

    @staticmethod
    def _fork_shown(conv, fork: int | None) -> int | None:
        """The fork the switcher shows: the one just used, else the latest."""
        if fork in conv.versions:
            return fork
        return max(conv.versions) if conv.versions else None

    def panel(
        self, owner: str, conv, notes: str = "", prompt: str = "", fork: int | None = None, first: int | None = None
    ) -> Panel:
        """Every component that shows a conversation, filled from the store; the chat from turn
        `first` on (None: its last turns, `history_messages`)."""
        stats = conv.turns[-1].stats if conv.turns else None
        tokens_df, memory_df = plot_frames(conv)
        chats = [(f"{c.title} ({c.n_turns})", c.id) for c in self.store.list_conversations(owner)]
        return Panel(
            conv_state=conv.id,
            chatbot=history_messages(conv, first),
            versions_row=gr.update(visible=bool(conv.versions)),
            version_dd=gr.update(choices=version_choices(conv.versions), value=self._fork_shown(conv, fork)),
            conv_list=gr.update(choices=chats, value=conv.id or None),
            stats_md=stats_markdown(stats, self._mem_limit()) + (f"\n\n{escape(notes, inline=True)}" if notes else ""),
            bar=sections_html(stats),
            memory_md=summary_markdown(conv),
            fact_dd=gr.update(choices=[(fact_label(f), f.id) for f in conv.facts], value=None),
            tokens_plot=line_chart_html(tokens_df, "tokens", "section", "Prompt tokens by section", SECTION_COLOURS),
            memory_plot=line_chart_html(memory_df, "MiB", "measure", "Memory"),
            prompt_box=prompt,
            doc_scope=self.scope_shown(owner, conv.settings),
            **self._settings_shown(conv.settings),
            source_box=gr.update(visible=False),
            turn_dd=gr.update(choices=turn_choices(conv), value=None),
            **self._memories_shown(owner, conv),
        )

    def _memories_shown(self, owner: str, conv) -> dict:
        memories = self.store.memories(owner)
        said = [t.user for t in conv.turns if t.view != OUT]
        offered = suggestions(said, [m.text for m in memories])
        return dict(
            memories_md=memories_markdown(memories),
            memory_dd=gr.update(choices=memory_choices(memories), value=None),
            suggest_dd=gr.update(choices=offered, value=None),
        )

    def scope_shown(self, owner: str, chosen: ChatSettings):
        """The documents picker: every document `owner` can read, and the ones this chat reads
        (none picked: all of them)."""
        library = self.runtime.library
        docs = library.documents(owner)
        picked = library.scope(owner, chosen.documents) if chosen.documents is not None else frozenset()
        choices = [(scope_label(d), d.doc_id) for d in docs]
        return gr.update(choices=choices, value=[d.doc_id for d in docs if d.doc_id in picked])

    def _settings_shown(self, chosen: ChatSettings) -> dict:
        """The chat's settings in effect, as the panel shows them; before the model is loaded (no
        budget yet), what the chat sets over the configuration."""
        chat, s = self.runtime.chat, self.settings
        if chat is not None:
            mine = chat.turn_settings(chosen)
            prompt, temperature, cap, memory, guard = (
                mine.system_prompt,
                mine.temperature,
                mine.budget.max_new_tokens,
                mine.memory,
                mine.loop_guard,
            )
        else:
            prompt = s.system_prompt if chosen.system_prompt is None else chosen.system_prompt
            temperature = s.temperature if chosen.temperature is None else chosen.temperature
            cap, memory = chosen.max_new_tokens or s.max_new_tokens, chosen.memory
            guard = s.loop_guard if chosen.loop_guard is None else chosen.loop_guard
        return dict(
            use_docs=True if chosen.use_docs is None else chosen.use_docs,
            system_box=prompt,
            temperature=temperature,
            reply_cap=cap,
            memory_mode=memory,
            loop_guard=guard,
        )

    def _open(self, owner: str, conv_id: str) -> Panel:
        """The owner's conversation, or a blank new chat (stored with its first message) when the id
        is empty, gone, or not theirs."""
        conv = self.store.get(owner, conv_id) if conv_id and self.store.exists(owner, conv_id) else None
        return self.panel(owner, conv or _blank(owner))

    def _warmed(self, owner: str, panel: Panel) -> Panel:
        """`panel`, a chat its owner just opened, with the chat's next prompt prefilled meanwhile
        in the background (chat/session.py's `warm`), once the model is ready."""
        chat = self.runtime.chat
        if chat is not None and panel.conv_state:
            try:
                chat.warm(owner, panel.conv_state)
            except Exception:  # a warm-up is a saving, never a reason the chat does not open
                log.exception("warming a chat as it opened")
        return panel

    def _current(self, owner: str, conv_id: str):
        if not conv_id:
            raise InputError("Send a message first: this chat is not saved yet.")
        return self.store.get(owner, conv_id)

    def _reshown(self, owner: str, conv_id: str, notes: str = "", first: int | None = None) -> Panel:
        """The panel of a stored conversation, read again after a change."""
        return self.panel(owner, self.store.get(owner, conv_id), notes, first=first)


def _blank(owner: str) -> Conversation:
    """A new chat before its first message: shown, not stored."""
    return Conversation("", DEFAULT_TITLE, "", 0, [], owner=owner)
