"""The source panel: a cited source opened beside the chat, its passage in its document's text.

A click on a Sources message opens that turn's sources (the one clicked, as the page's script tells
it, else the first); the picker switches between them; Close hides the panel. The turn and its
sources are read from the store for the caller's owner, never taken from the page, and the passage
is found by chat/passages.py in what that owner may read. This module must not find passages or
decide who may read them.
"""

from __future__ import annotations

import gradio as gr

from llmweb.chat.passages import open_source
from llmweb.web.formatting import hidden_turns, passage_html, source_choices, sources_turn
from llmweb.web.panels.base import PanelHandlers, user_errors

NOTHING = (gr.skip(), gr.skip(), gr.skip())  # the panel as it was: a click on something else


class SourceHandlers(PanelHandlers):
    """The source panel: (shown?, the turn's sources to pick from, the passage)."""

    @user_errors
    def open_clicked(self, conv_id, n, token, shown, request: gr.Request, clicked: gr.SelectData) -> tuple:
        """A click on a chat message (`clicked.index` of the chat as the page shows it, `shown`): a
        Sources message opens its turn's source number `n` (0: the first); any other message
        changes nothing."""
        owner = self.owner(token, request)
        index = clicked.index if isinstance(clicked.index, int) else None
        if not conv_id or index is None or not self.store.exists(owner, conv_id):
            return NOTHING
        conv = self.store.get(owner, conv_id)
        idx = sources_turn(conv, index, hidden_turns(shown))
        return NOTHING if idx is None else self._shown(owner, conv, idx, n)

    @user_errors
    def pick(self, conv_id, value, token, request: gr.Request) -> tuple:
        """The picker's choice, "idx:n" (`source_choices`)."""
        owner = self.owner(token, request)
        idx, _, n = str(value or "").partition(":")
        if not (idx.isdigit() and n.isdigit()) or not conv_id or not self.store.exists(owner, conv_id):
            return NOTHING
        return self._shown(owner, self.store.get(owner, conv_id), int(idx), n)

    def close(self) -> tuple:
        return gr.update(visible=False), gr.skip(), gr.skip()

    def _shown(self, owner: str, conv, idx: int, n) -> tuple:
        turn = next((t for t in conv.turns if t.idx == idx), None)
        if turn is None or not turn.sources:
            return NOTHING
        source = next((s for s in turn.sources if s.n == _number(n)), turn.sources[0])
        passage = open_source(self.runtime.library, owner, conv, source)
        return (
            gr.update(visible=True),
            gr.update(choices=source_choices(idx, turn.sources), value=f"{idx}:{source.n}"),
            passage_html(passage, source),
        )


def _number(n) -> int:
    """The page's source number (the script's, or the picker's), 0 when it is not one."""
    try:
        return int(n)
    except (TypeError, ValueError, OverflowError):
        return 0
