"""Whole-document tasks' cache: one result per (owner, document, task, piece, model), so a task run
again (or after a cancel) reads only the pieces it has not read yet.

It owns the `document_pieces` table's queries (`PieceQueries`). The document id is the content hash
of the document's file (retrieval/parsers.py `hash_bytes`), so a changed document is another key
and never reads an old result. Every query takes the owner and scopes by it in SQL; a write passes
the owner's generation read before its task began (`Deleted` after a "Delete all my data" since:
nothing stored). Rows go with the document (`delete_document_pieces`, when it is removed from the
owner's library; `delete_document_pieces_everywhere`, every owner's, when a shared document is
removed) and with the owner (`OwnerQueries.delete_owner`).
"""

from __future__ import annotations

import time

from llmweb.store.connection import Connection
from llmweb.store.owners import check_generation

MAX_PIECE_CHARS = 20_000  # a stored result is cut here (a step's reply is far smaller)


class PieceQueries(Connection):
    def piece_results(self, owner: str, doc_id: str, task: str, model: str) -> dict[int, str]:
        """The owner's cached results of `task` over the document's pieces: piece index -> text."""
        with self._read() as db:
            rows = db.execute(
                "SELECT piece, text FROM document_pieces WHERE owner = ? AND doc_id = ? AND task = ? AND model = ?",
                (owner, doc_id, task, model),
            ).fetchall()
        return {int(p): t for p, t in rows}

    def put_piece(
        self, owner: str, doc_id: str, task: str, piece: int, model: str, text: str, *, generation: int | None = None
    ) -> None:
        """Keep one piece's result (replacing an earlier one). With `generation`: `Deleted`, storing
        nothing, when the owner deleted all their data since it was read."""
        with self._write() as db:
            check_generation(db, owner, generation)
            db.execute(
                "INSERT INTO document_pieces (owner, doc_id, task, piece, model, text, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(owner, doc_id, task, piece, model) "
                "DO UPDATE SET text = excluded.text, created = excluded.created",
                (owner, doc_id, task, int(piece), model, text[:MAX_PIECE_CHARS], time.time()),
            )

    def delete_document_pieces(self, owner: str, doc_id: str) -> int:
        """Forget the owner's cached results for a document (it left their library); how many."""
        with self._write() as db:
            return db.execute("DELETE FROM document_pieces WHERE owner = ? AND doc_id = ?", (owner, doc_id)).rowcount

    def delete_document_pieces_everywhere(self, doc_id: str) -> int:
        """Forget every owner's cached results for a shared document that was removed; how many."""
        with self._write() as db:
            return db.execute("DELETE FROM document_pieces WHERE doc_id = ?", (doc_id,)).rowcount
