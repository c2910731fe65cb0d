"""Full-text search over the owner's turns: `SearchQueries.search` and `fts_query`.

It reads the FTS5 index of every turn's text (migration 3 in store/schema.py), kept in step by
triggers, so no write method has to remember it. Hits are scoped to the owner in the same query.
It must not write, and must not format the user's text into SQL: the query is a bound parameter.
"""

from __future__ import annotations

import re
import sqlite3

from llmweb.errors import InputError
from llmweb.store.connection import Connection
from llmweb.store.models import HIT_END, HIT_START, SearchHit

MAX_QUERY_CHARS = 500  # a search query may be this long


class SearchQueries(Connection):
    def search(self, owner: str, query: str, limit: int = 20) -> list[SearchHit]:
        """The owner's turns whose text matches `query` (SQLite FTS5 syntax: words, "phrases",
        AND/OR/NOT, (groups), prefix*; see `fts_query`), best first. A query FTS5 cannot read
        (an open quote, a dangling AND) is an `InputError`."""
        if not isinstance(query, str) or not query.strip():
            raise InputError("Type something to search for.")
        if len(query) > MAX_QUERY_CHARS:
            raise InputError(f"That search has {len(query):,} characters; the limit is {MAX_QUERY_CHARS}.")
        with self._read() as db:
            try:
                rows = db.execute(
                    """SELECT t.conversation_id, c.title, t.idx,
                              snippet(turns_fts, -1, ?, ?, '…', 12)
                       FROM turns_fts
                       JOIN turns t ON t.rowid = turns_fts.rowid
                       JOIN conversations c ON c.id = t.conversation_id
                       WHERE turns_fts MATCH ? AND c.owner = ?
                       ORDER BY bm25(turns_fts), c.updated DESC, t.idx
                       LIMIT ?""",
                    (HIT_START, HIT_END, fts_query(query), owner, max(1, int(limit))),
                ).fetchall()
            except sqlite3.OperationalError as e:  # only the query text can fail this read
                raise InputError(
                    f'Search could not read {query!r} ({e}). Use plain words, "a phrase in quotes", '
                    "AND, OR, NOT, or word* for a prefix."
                ) from None
        return [SearchHit(*row) for row in rows]


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
