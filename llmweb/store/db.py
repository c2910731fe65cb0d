"""`Store`: SQLite persistence of conversations, turns, rolling summaries, per-turn stats, versions
and facts, in one file, behind one facade. Every caller does `Store(path)` and calls its methods.

It is assembled from the query groups beside it in store/ (the bases of `Store` below); which
holds what is docs/architecture.md's "Where to look".

Ownership: every conversation belongs to an OWNER (the login account "user:<name>", an anonymous
browser "anon:<token>", or LOCAL_OWNER for a single-user install), and every public method takes
the caller's owner first and scopes its query by it, here in SQL, not in the UI. Another owner's
conversation behaves exactly like one that does not exist: the same `NotFound`. Ids are 128 random
bits (`new_id`): unguessable. Deleting something already gone is not an error.

Missing conversations raise `NotFound` (a `LookupError` and an `LlmwebError`, so the UI can show
its message as it is).

"Delete all my data" (`delete_owner`) bumps the owner's generation (store/owners.py; the row is
the delete's tombstone). A writer that works for a while before it writes (a reply, a background
fold) reads the generation with the chat (`Conversation.generation`, `generation`) and passes it
to its write; one begun before a delete commits nothing and raises `Deleted` ("This chat was
deleted.", a `NotFound`), so no reply or fold recreates what was deleted. `alive` answers the
same for writers outside the store (the recall folders).

This module only assembles the facade: it must hold no SQL of its own. The store knows nothing of
tokens, models or the UI; it imports only the standard library and llmweb's errors and records.
"""

from __future__ import annotations

from llmweb.store.exchange import ExchangeQueries
from llmweb.store.facts import FactQueries
from llmweb.store.memories import MemoryQueries
from llmweb.store.owners import OwnerQueries
from llmweb.store.pieces import PieceQueries
from llmweb.store.search import SearchQueries
from llmweb.store.versions import VersionQueries


class Store(ExchangeQueries, VersionQueries, FactQueries, MemoryQueries, SearchQueries, PieceQueries, OwnerQueries):
    """All conversations in one SQLite file. Safe to share between threads (store/connection.py).

    Open with `Store(path)`; close with `close()` or use it as a context manager."""
