"""Which documents a chat reads: every one its owner can read (the default), none, or a chosen set.

A chat's choice is kept in its settings (`ChatSettings.documents`: (doc id, name) pairs, so that a
file replaced by a new version, or a chat imported from another install, still finds its document
by name); a request (the API's `x_llmweb.documents`, a `replay` line) may name documents of its own
for one turn. Both are resolved here against the owner's library (retrieval/library.py: `resolve`
for names, `scope` for a kept choice) into the doc ids retrieval and whole-document tasks read.
It must not search, store, or know who the owner is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from llmweb.errors import InputError
from llmweb.store.models import ChatSettings, Conversation


def turn_scope(library, conv: Conversation, names: Sequence[str] | None) -> frozenset[str] | None:
    """The doc ids a turn of `conv` reads: `names` (InputError for one the owner has not), else the
    chat's choice, else None: every document."""
    if library is None:
        return None
    if names is not None:
        return frozenset(doc_id for doc_id, _ in library.resolve(conv.owner, list(names)))
    chosen = conv.settings.documents
    return None if chosen is None else library.scope(conv.owner, chosen)


def chosen(library, owner: str, settings: ChatSettings, names: Sequence[str] | None) -> ChatSettings:
    """`settings` reading the documents `names` from now on (InputError for one `owner` has not):
    None: every document; []: none (the documents switch off); else those, with the switch on."""
    if names is None:
        return replace(settings, documents=None, use_docs=None)
    if not names:
        return replace(settings, documents=None, use_docs=False)
    if library is None:
        raise InputError("This server has no documents to choose from.")
    return replace(settings, documents=library.resolve(owner, list(names)), use_docs=None)


def choose(store, library, owner: str, conv_id: str, names: Sequence[str] | None) -> ChatSettings:
    """Keep with `owner`'s chat `conv_id` the documents it reads from now on (`chosen`; an InputError,
    nothing changed, for a name the owner has not). Returns what was stored. The chat's other
    settings were checked when they were kept, and a choice of documents has nothing else to check
    (no model is needed: this works while one loads)."""
    settings = chosen(library, owner, store.get(owner, conv_id).settings, names)
    store.set_settings(owner, conv_id, settings)
    return settings


def add(store, library, owner: str, conv_id: str, doc_ids: Sequence[str]) -> bool:
    """Files attached in a chat that reads chosen documents join them; True if the chat changed. A
    chat that reads every document (or none) is left as it is."""
    settings = store.get(owner, conv_id).settings
    if settings.documents is None or not doc_ids or library is None:
        return False
    kept = sorted(library.scope(owner, settings.documents))
    choose(store, library, owner, conv_id, kept + [d for d in doc_ids if d not in kept])
    return True
