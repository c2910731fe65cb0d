"""Full-text search over the owner's turns: `SearchQueries.search` and `fts_query`.

It reads the FTS5 index of every turn's text (migrations 3 and 8 in store/schema.py), kept in step
by triggers, so no write method has to remember it. The query matches the owner's tag AND the
words (`match_expression`), so FTS5 yields the owner's rows only: another owner's are never joined,
ranked or cut into snippets. A search runs on a read connection of its own (store/connection.py),
beside other visitors' calls, and is bounded in length, in terms, in time (a progress handler stops
it past SEARCH_TIME_S, with a clear message) and per owner (one at a time: another while it runs is
refused, so one visitor's flood of searches costs the others no more than one). It must not
write, and must not format the user's text into SQL: the query is a bound parameter.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from contextlib import contextmanager

from llmweb.errors import InputError
from llmweb.store.connection import Connection
from llmweb.store.models import HIT_END, HIT_START, SearchHit

MAX_QUERY_CHARS = 500  # a search query may be this long
MAX_QUERY_TERMS = 16  # words and "phrases" in one search
MAX_PREFIX_TERMS = 4  # of them word* prefixes (each reads every indexed word it starts)
SEARCH_TIME_S = 1.0  # a search running longer is stopped (it holds a reader and a core)
_PROGRESS_STEPS = 1_000  # SQLite VM steps between two looks at the clock (~0.1 ms each)
_clock = time.monotonic

SEARCH_SQL = """SELECT t.conversation_id, c.title, t.idx, snippet(turns_fts, -1, ?, ?, '…', 12)
    FROM turns_fts
    JOIN turns t ON t.rowid = turns_fts.rowid
    JOIN conversations c ON c.id = t.conversation_id
    WHERE turns_fts MATCH ? AND c.owner = ?
    ORDER BY bm25(turns_fts), c.updated DESC, t.idx
    LIMIT ?"""


class SearchQueries(Connection):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._searching: set[str] = set()  # owners with a search running
        self._searching_lock = threading.Lock()

    def search(self, owner: str, query: str, limit: int = 20) -> list[SearchHit]:
        """The owner's turns whose text matches `query` (SQLite FTS5 syntax: words, "phrases",
        AND/OR/NOT, (groups), prefix*; see `fts_query`), best first. A query FTS5 cannot read
        (an open quote, a dangling AND), one over the caps, one that runs past SEARCH_TIME_S, or
        one while the owner's previous search still runs is an `InputError`."""
        if not isinstance(query, str) or not query.strip():
            raise InputError("Type something to search for.")
        if len(query) > MAX_QUERY_CHARS:
            raise InputError(f"That search has {len(query):,} characters; the limit is {MAX_QUERY_CHARS}.")
        match = match_expression(owner, query)
        deadline = _clock() + SEARCH_TIME_S
        stopped = []

        def too_long() -> bool:
            if _clock() > deadline:
                stopped.append(True)
                return True
            return False

        with self._one_search(owner), self._read() as db:
            db.set_progress_handler(too_long, _PROGRESS_STEPS)
            try:
                rows = db.execute(SEARCH_SQL, (HIT_START, HIT_END, match, owner, max(1, int(limit)))).fetchall()
            except sqlite3.OperationalError as e:  # only the query text (or the clock) can fail this read
                if stopped:
                    raise InputError(
                        f"That search ran past {SEARCH_TIME_S:g} s and was stopped: use fewer words, "
                        "or longer ones before a *."
                    ) from None
                raise InputError(
                    f'Search could not read {query!r} ({e}). Use plain words, "a phrase in quotes", '
                    "AND, OR, NOT, or word* for a prefix."
                ) from None
            finally:
                db.set_progress_handler(None, 0)
        return [SearchHit(*row) for row in rows]

    @contextmanager
    def _one_search(self, owner: str):
        with self._searching_lock:
            if owner in self._searching:
                raise InputError("Your previous search is still running: wait a moment and search again.")
            self._searching.add(owner)
        try:
            yield
        finally:
            with self._searching_lock:
                self._searching.discard(owner)


def owner_tag(owner: str) -> str:
    """The owner's search tag, as store/schema.py's OWNER_TAG makes it in SQL."""
    return "o" + owner.encode().hex() + "x"


def match_expression(owner: str, query: str) -> str:
    """The FTS5 query of `owner`'s search: their tag in its column AND the words in the text
    columns. An InputError when the query has over MAX_QUERY_TERMS terms or MAX_PREFIX_TERMS
    prefixes."""
    words = fts_query(query)
    parts = [p for p in _FTS_PART.findall(words) if p not in ("(", ")", "AND", "OR", "NOT")]
    if len(parts) > MAX_QUERY_TERMS:
        raise InputError(f"That search has {len(parts)} words or phrases; the limit is {MAX_QUERY_TERMS}.")
    prefixes = sum(p.endswith("*") for p in parts)
    if prefixes > MAX_PREFIX_TERMS:
        raise InputError(f"That search has {prefixes} word* prefixes; the limit is {MAX_PREFIX_TERMS}.")
    return f'owner_tag : "{owner_tag(owner)}" AND {{user assistant}} : ({words})'


_FTS_PART = re.compile(r'"(?:[^"]|"")*"?|[()]|[^\s()"]+')  # a "phrase" (maybe unclosed), a bracket, a word
_FTS_BAREWORD = re.compile(r"[^\W]+\*?|AND|OR|NOT")


def fts_query(text: str) -> str:
    """The user's search as an FTS5 query. Phrases, brackets, AND/OR/NOT and word* pass as
    written; a word FTS5 would read as syntax (Zanzibar-7781, e-mail, foo:bar, C++) becomes a
    quoted phrase, so people can paste what they remember. What is left to fail is real syntax
    trouble (an open quote, a dangling operator), which `search` reports."""
    out = []
    for part in _FTS_PART.findall(text):
        if part.startswith('"') or part in "()" or _FTS_BAREWORD.fullmatch(part):
            out.append(part)
        else:
            star = "*" if part.endswith("*") and len(part) > 1 else ""
            out.append('"' + part.removesuffix(star).replace('"', '""') + '"' + star)
    return " ".join(out)
