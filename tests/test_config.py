"""Settings: parsing, checks, and docs/configuration.md's table staying in step with the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmweb.config import Settings, env_names
from llmweb.errors import ConfigError

CONFIGURATION = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_env_values_are_parsed_and_checked():
    s = Settings.from_env(
        {
            "LLMWEB_QUANT": "fp32",
            "LLMWEB_KV_REUSE": "0",
            "LLMWEB_TOP_K": "3",
            "LLMWEB_HISTORY_HIGH": "0.9",
            "LLMWEB_DATA_DIR": "/tmp/x",
        }
    )
    assert (s.quant, s.kv_reuse, s.top_k, s.history_high, str(s.data_dir)) == ("fp32", False, 3, 0.9, "/tmp/x")
    with pytest.raises(ConfigError, match="LLMWEB_QUANT must be one of"):
        Settings.from_env({"LLMWEB_QUANT": "3bit"})
    with pytest.raises(ConfigError, match="LLMWEB_TOP_K='many' is not a valid int"):
        Settings.from_env({"LLMWEB_TOP_K": "many"})
    with pytest.raises(ConfigError, match="user:password"):
        Settings.from_env({"LLMWEB_AUTH": "nocolon"})


def test_flags_override_env():
    assert Settings.from_env({"LLMWEB_PORT": "9000"}, port=9001).port == 9001
    assert Settings.from_env({"LLMWEB_PORT": "9000"}, port=None).port == 9000


def test_safe_defaults():
    s = Settings()
    assert s.host == "127.0.0.1" and s.max_file_mb > 0 and not s.auth


def test_configuration_table_lists_every_setting():
    text = CONFIGURATION.read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(LLMWEB_[A-Z0-9_]+)` \|", text, flags=re.M))
    assert documented == set(env_names())


def _as_written(value: object) -> str:
    """A default as the table writes it: booleans as 1/0, whole floats without the point."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_configuration_table_shows_the_code_defaults():
    """A default written as a plain literal (`256`, `auto`, `off`) is the field's default in
    Settings; the descriptive ones (*(a file)*, `$LLMWEB_DATA_DIR/models`) are prose."""
    text = CONFIGURATION.read_text(encoding="utf-8")
    rows = re.findall(r"^\| `LLMWEB_([A-Z0-9_]+)` \| `([^`$ ]+)` \|", text, flags=re.M)
    defaults = Settings()
    assert len(rows) > 40, "the table's literal defaults were not found"
    wrong = {f"LLMWEB_{name}": (doc, getattr(defaults, name.lower())) for name, doc in rows}
    wrong = {k: v for k, v in wrong.items() if _as_written(v[1]) != v[0]}
    assert not wrong, f"docs/configuration.md's default differs from config.py's: {wrong}"


def test_the_automatic_engine_process_follows_zerogpu_not_the_spaces_package(monkeypatch):
    """Every Gradio Space image has the `spaces` package, a GPU Space too: only ZeroGPU
    (SPACES_ZERO_GPU, read as `spaces` reads it) keeps the model in the web process."""
    import importlib.util
    import types

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: types.SimpleNamespace() if name == "spaces" else real(name, *a)
    )
    assert Settings.from_env({}).in_engine_process, "a dedicated GPU (or CPU) Space keeps its engine process"
    assert Settings.from_env({"SPACES_ZERO_GPU": "true"}).zero_gpu
    assert not Settings.from_env({"SPACES_ZERO_GPU": "true"}).in_engine_process
    assert not Settings.from_env({"SPACES_ZERO_GPU": "0"}).zero_gpu
    assert not Settings.from_env({"SPACES_ZERO_GPU": "1", "LLMWEB_ENGINE_PROCESS": "1"}).in_engine_process, "no GPU"
    assert not Settings.from_env({"LLMWEB_ENGINE_PROCESS": "0"}).in_engine_process
