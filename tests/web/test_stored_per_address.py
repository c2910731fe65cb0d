"""What the anonymous visitors of one client address store is bounded together, through the real
handlers: the page tells the store each anonymous owner's address group (from the connection,
web/trust.py), visitors A1 and A2 of one IPv6 /64 reach its budget and the next message is refused
with a sentence naming it, a visitor of another address is not, and "Delete all my data" of A1
frees room for A2. A gradio_client caller's conversations count at their address too."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr
import pytest

from llmweb.store.db import Store
from llmweb.store.models import OwnerCaps
from llmweb.web.identity import new_owner_token
from llmweb.web.ui import Handlers
from tests.conftest import make_settings
from tests.web.test_ui import fake_runtime
from tests.web.test_visitors import page

KB = 1024
X1, X2, Y = "2001:db8:1:2::1", "2001:db8:1:2::99", "203.0.113.5"  # X1 and X2: one /64


@pytest.fixture
def runtime(tmp_path):
    store = Store(tmp_path / "llmweb.sqlite3", caps=OwnerCaps(stored_bytes=7 * KB, address_bytes=9 * KB))
    yield fake_runtime(store, tmp_path)
    store.close()


def say(h: Handlers, text: str, token: str, peer: str, conv: str = "") -> str:
    *_, final = h.chat.respond(text, [], conv, True, token, page(session=token[:8], peer=peer))
    return final[0]


def test_one_addresss_visitors_share_its_budget_and_another_address_stores_on(runtime):
    h = Handlers(runtime)
    a1, a2, b = new_owner_token(), new_owner_token(), new_owner_token()
    for token, peer in ((a1, X1), (a2, X2), (b, Y)):
        h.account.visit(token, "", page(session=token[:8], peer=peer))
    say(h, "x" * (3 * KB), a1, X1)
    # each turn keeps ~1 kB of figures beside its text: A1 holds ~4 kB, A2 ~3 kB of its own 7, X ~7 of its 9
    mine = say(h, "y" * (2 * KB), a2, X2)
    with pytest.raises(gr.Error) as refused:
        say(h, "z" * (2 * KB), a2, X2, mine)
    message = refused.value.message
    assert "your network" in message and "LLMWEB_STORED_PER_ADDRESS_MB" in message and "Delete some chats" in message
    assert len(runtime.store.get(f"anon:{a2}", mine).turns) == 1, "nothing stored past the budget"
    theirs = say(h, "w" * (3 * KB), b, Y)  # another address: its own budget
    say(h, "v" * KB, b, Y, theirs)
    h.account.delete_everything(a1, page(session=a1[:8], peer=X1))  # A1's data gone: room at X
    say(h, "z" * (2 * KB), a2, X2, mine)
    assert len(runtime.store.get(f"anon:{a2}", mine).turns) == 2


def test_a_visitor_who_starts_over_without_its_token_is_still_counted_at_its_address(runtime):
    """A new identity from the same /64 (a browser that dropped its token) joins the same budget."""
    h = Handlers(runtime)
    first = new_owner_token()
    say(h, "x" * (4 * KB), first, X1)
    again = new_owner_token()
    with pytest.raises(gr.Error, match="LLMWEB_STORED_PER_ADDRESS_MB"):
        say(h, "y" * (4 * KB), again, X2)
    say(h, "y" * (4 * KB), new_owner_token(), Y)


def test_a_gradio_client_callers_conversations_count_at_their_address(runtime):
    """Without login, each /chat conversation is an owner of its own: they share their address's budget."""
    h = Handlers(runtime)
    say(h, "x" * (4 * KB), new_owner_token(), X1)
    with pytest.raises(gr.Error, match="LLMWEB_STORED_PER_ADDRESS_MB"):
        list(h.endpoints.api_chat("y" * (4 * KB), request=page(session="", peer=X2)))
    *_, (reply, conv) = h.endpoints.api_chat("y" * (4 * KB), request=page(session="", peer=Y))
    assert reply == "Paris" and conv


def test_an_upload_past_its_addresss_documents_budget_is_refused_on_the_page(runtime, tmp_path):
    """The upload box passes the store to the library: A1's documents fill most of X's budget, A2's
    upload (within A2's own quota) is refused with the sentence naming it, before it is read."""
    from llmweb.retrieval.library import Library

    settings = make_settings(tmp_path, single_user="0", shared_uploads="0", user_docs_mb=1)
    runtime.library = Library(settings, embedder=SimpleNamespace(dim=384, label="fake"))
    runtime.store.caps = OwnerCaps(address_doc_bytes=2**20)
    h = Handlers(runtime)
    a1, a2 = new_owner_token(), new_owner_token()
    h.account.visit(a1, "", page(session=a1[:8], peer=X1))
    runtime.store.claim_document_bytes(f"anon:{a1}", 900 * KB)  # what A1's uploads count
    notes = tmp_path / "notes.txt"
    notes.write_text("word " * 40_000)
    with pytest.raises(gr.Error) as refused:
        h.docs.upload([str(notes)], "", a2, page(session=a2[:8], peer=X2))
    message = refused.value.message
    assert "LLMWEB_DOCS_PER_ADDRESS_MB" in message and "Remove some documents" in message, message
    assert runtime.library.is_empty(f"anon:{a2}")
