"""The documents accordion: the documents a visitor's questions search (the shared library and
their own), uploading files into their private library, removing one of theirs. Parsing, chunking
and indexing are retrieval/'s; this module must not decide what is indexed or searched.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from llmweb.chat import scope
from llmweb.chat.document_task import remove_document
from llmweb.errors import InputError
from llmweb.store.models import ChatSettings
from llmweb.web.formatting import documents_markdown, escape, ingest_markdown
from llmweb.web.panels.base import PanelHandlers, user_errors
from llmweb.web.panels.transfer import forget_upload


class DocumentHandlers(PanelHandlers):
    """The document list, the upload box and the Remove control."""

    @user_errors
    def documents(self, conv_id, token, request: gr.Request) -> tuple:
        """The documents this visitor's questions search (shared and theirs), the ones they may
        remove, and the picker of the documents the open chat reads."""
        owner = self.owner(token, request)
        docs = self.runtime.library.documents(owner)
        removable = [(d.source, d.doc_id) for d in docs if d.removable]
        conv = self.store.get(owner, conv_id) if conv_id and self.store.exists(owner, conv_id) else None
        picker = self.scope_shown(owner, conv.settings if conv is not None else ChatSettings())
        return documents_markdown(docs), gr.update(choices=removable, value=None), picker

    @user_errors
    def upload(self, files, conv_id, token, request: gr.Request, progress=gr.Progress()) -> tuple:
        """Add files to the visitor's library; returns the table, the choices, the picker, a report,
        and clears the file box. Files added while the open chat reads chosen documents join them."""
        if not files:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), None
        owner = self.owner(token, request)
        paths = [f if isinstance(f, str) else f.name for f in files]

        def tell(done, total, what):
            progress((done, max(total, 1)), desc=what)

        try:
            with self.slots.take(owner, "upload"):
                named = [(p, Path(p).name) for p in paths]  # the store counts its address's documents
                reports = self.runtime.library.ingest_uploads(owner, named, progress=tell, room=self.store)
        finally:
            for p in paths:  # indexed (or refused): Gradio's upload copy is not kept
                forget_upload(p)
        if conv_id and self.store.exists(owner, conv_id):
            scope.add(
                self.store, self.runtime.library, owner, conv_id, [r.doc_id for r in reports if r.ok and r.doc_id]
            )
        return *self.documents(conv_id, token, request), ingest_markdown(reports), None

    @user_errors
    def remove_document(self, doc_id, conv_id, token, request: gr.Request) -> tuple:
        if not doc_id:
            raise InputError("Pick a document to remove first.")
        info = remove_document(self.runtime.library, self.store, self.owner(token, request), doc_id)
        return *self.documents(
            conv_id, token, request
        ), f"Removed {escape(info.source, inline=True)} ({info.chunks} chunks)."
