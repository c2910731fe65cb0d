"""The keyword half of hybrid retrieval: an SQLite FTS5 index of one published state's chunk texts.

Contract:
- A `KeywordIndex` is an in-memory SQLite database with one contentless FTS5 table
  (`tokenize="porter unicode61"`), whose rowids are the chunk ids of exactly one published
  `retrieval.storage.State`, plus the generation it describes. It is immutable once built: `derive(...)`
  returns a new one (a copy with rows added and removed) and leaves the original untouched, the
  way `retrieval._apply` treats the FAISS index. Readers in several threads share one; a lock
  serialises their queries (a search takes ~7 ms at 10k chunks of README text, p50).
- `to_bytes()` / `from_bytes()` are SQLite's own serialize/deserialize: `retrieval.Index` writes
  the bytes as `fts-<generation>.sqlite3` with the vectors and the metadata, and the manifest
  names all three, so the keyword index is published, and replaced, with the same atomic rename.
- `search(query, k)` ranks by FTS5's `bm25()` (lower is better there; `KeywordHit.bm25` is the
  negated value, higher is better). `terms(query)` gives each content word of the query with the
  number of chunks that contain it: the IDFs behind the relevance gate's coverage (hybrid.Evidence).

Why a file per generation and not an index rebuilt in memory on load: a rebuild at ~10k chunks
costs 0.4-0.8 s of CPU per process per published change (a chat turn would pay it after every
upload in another process), while deserialising the stored bytes and checking that their rowids
are the state's chunk ids costs 25-50 ms (measured on this 2-core machine, shared: 10k synthetic
chunks and 9.9k chunks of package READMEs; 1.6-3 MB). A change copies the previous generation's
database in memory (~17 ms at 10k) and applies only its own rows. The table is contentless
(`content=''`): the texts already live in meta-<gen>.json, and deleting a row passes the stored
text back to FTS5, which `derive` takes from the published state it copies.

Nothing here knows about FAISS, embeddings or the files' names; only the standard library.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass

MAX_QUERY_TERMS = 64  # distinct content words of a query that are looked up (a long message is cut here)
_TOKEN = re.compile(r"\w+", re.UNICODE)  # unicode61 splits on everything that is not a letter or digit
_SCHEMA = (
    "CREATE VIRTUAL TABLE chunks USING fts5(text, content='', tokenize='porter unicode61');"
    "CREATE TABLE info(key TEXT PRIMARY KEY, value INTEGER NOT NULL);"
)

# English function words: they say nothing about what a message is about. Without them "how do I"
# would look like evidence in a guide whose headings all start that way. (NLTK's list, shortened.)
STOPWORDS = frozenset(
    """
    a about above after again against all am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have
    having he her here hers herself him himself his how i if in into is it its itself just me more most
    my myself no nor not now of off on once only or other our ours ourselves out over own same she
    should so some such than that the their theirs them themselves then there these they this those
    through to too under until up very was we were what when where which while who whom why will with
    would you your yours yourself yourselves s t don doesn didn isn aren wasn weren won wouldn shouldn
    can't i'm it's let us get got also may might must shall yes ok okay please
    """.split()
)


@dataclass(frozen=True, slots=True)
class KeywordHit:
    chunk_id: int
    bm25: float  # FTS5's bm25() negated: higher is better, > 0 for any match


@dataclass(frozen=True, slots=True)
class Term:
    """One content word of a query and how many chunks contain it (after stemming)."""

    word: str
    chunks: int  # 0 = no chunk has it

    def idf(self, total: int) -> float:
        """BM25's inverse document frequency, as FTS5 computes it (never below a small positive floor)."""
        return max(math.log((total - self.chunks + 0.5) / (self.chunks + 0.5)), 1e-6)


def content_words(query: str) -> list[str]:
    """The query's distinct words that are not function words, lower-cased, in order, at most MAX_QUERY_TERMS."""
    out: list[str] = []
    seen: set[str] = set()
    # word by word: a long message stops at the last term it needs (lower-cased first: lowering can
    # change where words split, "İ" becomes "i" and a combining dot)
    for m in _TOKEN.finditer(query.lower()):
        word = m.group()
        if word in STOPWORDS or word in seen or (len(word) < 2 and not word.isdigit()):
            continue
        out.append(word)
        seen.add(word)
        if len(out) == MAX_QUERY_TERMS:
            break
    return out


class KeywordIndex:
    """An FTS5 table of (chunk id, text) rows; see the module docstring."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn
        self._lock = threading.Lock()
        row = conn.execute("SELECT value FROM info WHERE key = 'generation'").fetchone()
        self.generation = int(row[0]) if row else 0
        self.size = int(conn.execute("SELECT value FROM info WHERE key = 'chunks'").fetchone()[0])

    # -- building ---------------------------------------------------------------

    @classmethod
    def build(cls, rows: Iterable[tuple[int, str]], generation: int) -> KeywordIndex:
        """A new index of `rows` (chunk id, text) that describes `generation`."""
        conn = _connect()
        conn.executescript(_SCHEMA)
        conn.execute("INSERT INTO info VALUES ('generation', ?), ('chunks', 0)", (generation,))
        return cls._changed(conn, rows, (), generation)

    def derive(
        self, add: Iterable[tuple[int, str]], remove: Iterable[tuple[int, str]], generation: int
    ) -> KeywordIndex:
        """A copy with `remove` (chunk id, the text it was indexed with) deleted and `add` inserted."""
        with self._lock:
            blob = self._conn.serialize()
        conn = _connect()
        conn.deserialize(blob)
        return self._changed(conn, add, remove, generation)

    @classmethod
    def _changed(
        cls,
        conn: sqlite3.Connection,
        add: Iterable[tuple[int, str]],
        remove: Iterable[tuple[int, str]],
        generation: int,
    ) -> KeywordIndex:
        add, remove = list(add), list(remove)
        with conn:  # one transaction
            # contentless FTS5 deletes by giving back the indexed text (SQLite 3.40 has no contentless_delete)
            conn.executemany("INSERT INTO chunks(chunks, rowid, text) VALUES ('delete', ?, ?)", remove)
            conn.executemany("INSERT INTO chunks(rowid, text) VALUES (?, ?)", add)
            conn.execute("UPDATE info SET value = ? WHERE key = 'generation'", (generation,))
            conn.execute("UPDATE info SET value = value + ? WHERE key = 'chunks'", (len(add) - len(remove),))
        return cls(conn)

    # -- storing ----------------------------------------------------------------

    def to_bytes(self) -> bytes:
        with self._lock:
            return self._conn.serialize()

    @classmethod
    def from_bytes(cls, blob: bytes) -> KeywordIndex:
        """Raises sqlite3.DatabaseError (or KeyError/TypeError) for bytes that are not such an index."""
        conn = _connect()
        conn.deserialize(blob)
        return cls(conn)

    def ids(self) -> set[int]:
        """Every chunk id in the table (a full scan: ~6 ms at 10k chunks)."""
        with self._lock:
            return {int(r[0]) for r in self._conn.execute("SELECT rowid FROM chunks")}

    # -- reading ----------------------------------------------------------------

    def search(self, query: str, k: int, only: Collection[int] | None = None) -> list[KeywordHit]:
        """The `k` best chunks for any of the query's content words, by BM25, best first; with `only`,
        the best among those chunk ids (a chat's chosen documents). BM25's statistics stay the whole
        table's: a word is as rare as it is in the namespace, whichever documents a chat reads."""
        words = content_words(query)
        if not words or k < 1 or self.size == 0 or (only is not None and not only):
            return []
        match = " OR ".join(_quote(w) for w in words)
        sql, args = "SELECT rowid, bm25(chunks) AS r FROM chunks WHERE chunks MATCH ?", [match]
        if only is not None:  # one JSON array parameter: any number of ids, no SQL built from them
            sql += " AND rowid IN (SELECT value FROM json_each(?))"
            args.append(json.dumps(sorted(int(i) for i in only)))
        with self._lock:
            rows = self._conn.execute(sql + " ORDER BY r LIMIT ?", (*args, k)).fetchall()
        return [KeywordHit(int(i), -float(r)) for i, r in rows]

    def terms(self, query: str) -> list[Term]:
        """Each content word of the query with the number of chunks that contain it."""
        out = []
        with self._lock:
            for w in content_words(query):
                n = self._conn.execute("SELECT count(*) FROM chunks WHERE chunks MATCH ?", (_quote(w),)).fetchone()[0]
                out.append(Term(w, int(n)))
        return out


def _connect() -> sqlite3.Connection:
    # One connection per KeywordIndex, used from any thread under its lock.
    return sqlite3.connect(":memory:", check_same_thread=False)


def _quote(word: str) -> str:
    """An FTS5 string: a bare word could be read as an operator (AND, NEAR) or a column filter."""
    return '"' + word.replace('"', '""') + '"'
