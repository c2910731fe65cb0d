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
MODEL_FIXTURES = {
    "fp32_model",
    "app_model",
    "llama_model",
    "int8_model",
    "runner",
    "fmt",
}  # a test that uses one of these loads the chat model


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


def _load(quant: str, tmp_path_factory, **kw):
    from llmweb.engine import models

    logging.getLogger("llmweb").setLevel(logging.INFO)
    return models.load(make_settings(tmp_path_factory.mktemp(f"load-{quant}"), quant=quant, device="cpu", **kw))


@pytest.fixture(scope="session")
def fp32_model(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct in fp32 (exact greedy comparisons)."""
    return _load("fp32", tmp_path_factory)


@pytest.fixture(scope="session")
def app_model(tmp_path_factory):
    """The embedded model as the app loads it by default on this machine (`auto`: the GGUF on
    llama.cpp on the CPU where llama-cpp-python is installed, else int8-cpu; 4-bit NF4 is loaded and
    run by test_decode's bench test)."""
    return _load("auto", tmp_path_factory)


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory):
    """The embedded GGUF file as it ships (Q4_1, not the Q8_0 copy the app serves by default), on
    llama.cpp (engine/runners/llama_cpp.py): the runner's tests keep their figures and replies."""
    return _load("auto", tmp_path_factory, backend="llama.cpp", gguf_requant="none")


@pytest.fixture(params=["transformers", "llama.cpp"])
def runner(request):
    """Each local runner in turn, for the engine tests that every runner must pass: the transformers
    runner on the fp32 model (exact greedy), and llama.cpp on the GGUF file."""
    from tests.fakes import RunnerKind

    if request.param == "transformers":
        import torch

        return RunnerKind("transformers", request.getfixturevalue("fp32_model"), torch.OutOfMemoryError)
    return RunnerKind("llama.cpp", request.getfixturevalue("llama_model"), MemoryError)


@pytest.fixture(scope="session")
def fmt(fp32_model):
    from llmweb.chat.tokens import TemplateFormat

    return TemplateFormat(fp32_model.tokenizer)
