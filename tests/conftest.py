"""Shared fixtures. Real models load once per session; each test gets its own data dir.

The converted embedded model is cached in the checkout's data/models (git-ignored), so only
the first run on a machine pays the ~20 s GGUF conversion.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from llmweb.config import Settings

REPO = Path(__file__).resolve().parent.parent
MODEL_CACHE = REPO / "data" / "models"
MODEL_FIXTURES = {"fp32_model", "app_model", "fmt"}  # a test that uses one of these loads the chat model


def pytest_collection_modifyitems(config, items):
    """Tests on the real chat model are `slow`: `make test-fast` (-m "not slow and not browser") skips them."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def make_settings(data_dir: Path, **kw) -> Settings:
    kw.setdefault("sample_docs", False)
    return Settings(data_dir=data_dir, cache_dir=MODEL_CACHE, **kw)


@pytest.fixture
def settings(tmp_path) -> Settings:
    return make_settings(tmp_path)


def _load(quant: str, tmp_path_factory):
    from llmweb.engine import models

    logging.getLogger("llmweb").setLevel(logging.INFO)
    return models.load(make_settings(tmp_path_factory.mktemp(f"load-{quant}"), quant=quant, device="cpu"))


@pytest.fixture(scope="session")
def fp32_model(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct in fp32 (exact greedy comparisons)."""
    return _load("fp32", tmp_path_factory)


@pytest.fixture(scope="session")
def app_model(tmp_path_factory):
    """The embedded model as the app loads it by default on this machine (`auto`: int8-cpu on the CPU;
    4-bit NF4 is loaded and run by test_decode's bench test)."""
    return _load("auto", tmp_path_factory)


@pytest.fixture(scope="session")
def fmt(fp32_model):
    from llmweb.chat.tokens import TemplateFormat

    return TemplateFormat(fp32_model.tokenizer)
