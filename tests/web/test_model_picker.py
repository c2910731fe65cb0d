"""The page's model picker and "Get a model" box, through the handlers the page calls: the
machine's owner checks a Hub model's size before anything downloads, downloads it with progress
(a local stand-in for the Hub: tests/fake_hub.py), and finds it in the picker; a visitor of a
shared server sees the picker greyed, no box, and is refused by the handlers whatever the page sends."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr
import pytest

from llmweb.config import Settings
from llmweb.engine import catalog
from llmweb.engine.models import EMBEDDED_NAME
from llmweb.store.db import Store
from llmweb.web.panels.models import ModelHandlers
from tests.engine.test_catalog import write_gguf
from tests.fake_hub import FakeHub
from tests.web.test_ui import A_TOKEN, NOBODY

REPO = "someone/tiny-GGUF"


@pytest.fixture
def hub_with_a_gguf(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", False)
    data = write_gguf(tmp_path / "tiny-q4.gguf").read_bytes()
    with FakeHub() as h:
        h.add(REPO, {"README.md": b"# tiny", "tiny-q4.gguf": data})
        monkeypatch.setattr(hf, "ENDPOINT", h.url)  # as HF_ENDPOINT=<it> at import sets both
        monkeypatch.setattr(hf, "HUGGINGFACE_CO_URL_TEMPLATE", h.url + "/{repo_id}/resolve/{revision}/{filename}")
        yield h


def handlers(tmp_path, **kw) -> ModelHandlers:
    settings = Settings(data_dir=tmp_path / "data", sample_docs=False, **kw)
    runtime = SimpleNamespace(
        settings=settings,
        store=Store(tmp_path / "s.sqlite3"),
        model_id=EMBEDDED_NAME,
        models=lambda: catalog.scan(settings),
        loaded_ids=lambda: [EMBEDDED_NAME],
        secret="s" * 64,
    )
    return ModelHandlers(runtime)


def test_the_owner_checks_the_size_downloads_with_progress_and_picks_it(tmp_path, hub_with_a_gguf):
    h = handlers(tmp_path, single_user="1")  # every request is the machine's owner
    assert h.fetch_box(A_TOKEN, NOBODY)["visible"] is True
    said = h.check_fetch(REPO, "tiny-q4.gguf", A_TOKEN, NOBODY)
    assert REPO in said and "1 file" in said and "tiny-q4.gguf" in said
    assert not (h.settings.models_folder / "tiny-q4.gguf").exists(), "checked, nothing downloaded"
    seen = []
    report, picker = h.fetch(REPO, "tiny-q4.gguf", A_TOKEN, NOBODY, progress=lambda *a, **k: seen.append(k))
    assert "Downloaded tiny-q4.gguf" in report and any("tiny-q4.gguf" in k.get("desc", "") for k in seen)
    assert [value for _, value in picker["choices"]] == [EMBEDDED_NAME, "tiny-q4"] and picker["interactive"]


def test_a_visitor_of_a_shared_server_can_fetch_and_switch_nothing(tmp_path, hub_with_a_gguf):
    h = handlers(tmp_path, single_user="0")
    picker = h.picker(A_TOKEN, NOBODY)
    assert picker["interactive"] is False and picker["value"] == EMBEDDED_NAME
    assert h.fetch_box(A_TOKEN, NOBODY)["visible"] is False
    for call in (
        lambda: h.check_fetch(REPO, "tiny-q4.gguf", A_TOKEN, NOBODY),
        lambda: h.fetch(REPO, "tiny-q4.gguf", A_TOKEN, NOBODY, progress=lambda *a, **k: None),
        lambda: h.switch("tiny-q4", "", A_TOKEN, NOBODY),
    ):
        with pytest.raises(gr.Error, match="operator"):
            call()
    assert hub_with_a_gguf.requests == [], "not even a metadata call"
