"""The models folder, fast: real GGUF files written with the `gguf` package, real folders;
the header reader's checks on malformed files; a user's GGUF's tokenizer read once per file; sizing
to memory; who may switch the model; the API's listing and a request naming another model, with a
scripted runtime (the real-model tests are tests/engine/test_models_folder.py)."""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from llmweb.config import Settings
from llmweb.engine import catalog
from llmweb.engine.models import EMBEDDED_NAME
from llmweb.engine.sizing import MIN_CONTEXT, fit
from llmweb.errors import ConfigError, InputError
from llmweb.records import LOCAL_OWNER
from llmweb.runtime.resident import Lease
from llmweb.web.api import models as api_models
from llmweb.web.api.errors import ApiError
from llmweb.web.identity import Caller, login_owner, may_switch_models


def write_gguf(path: Path, arch: str = "qwen2", context: int = 32768, template: str | None = "{{ messages }}") -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(context)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    if template is not None:
        w.add_chat_template(template)
    w.add_token_list([f"tok{i}" for i in range(3000)])  # an array the reader skips
    w.add_tensor("t", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def folder(tmp_path) -> Settings:
    s = Settings(data_dir=tmp_path / "data", sample_docs=False)
    s.models_folder.mkdir(parents=True)
    return s


def test_the_folder_lists_gguf_files_and_safetensors_folders_after_the_embedded_model(folder):
    models = folder.models_folder
    write_gguf(models / "qwen-tiny.gguf")
    write_gguf(models / "no-template.gguf", arch="llama", context=4096, template=None)
    (models / "phi-folder").mkdir()
    (models / "phi-folder" / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Phi3ForCausalLM"],
                "num_hidden_layers": 4,
                "hidden_size": 128,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "max_position_embeddings": 131072,
            }
        )
    )
    (models / "phi-folder" / "model.safetensors").write_bytes(b"\0" * 1000)
    (models / "pickles").mkdir()  # pickled weights only: never loaded, so not listed
    (models / "pickles" / "config.json").write_text("{}")
    (models / "pickles" / "pytorch_model.bin").write_bytes(b"\0")
    (models / f"{EMBEDDED_NAME}-tokenizer").mkdir()  # llmweb's own copies are not models
    write_gguf(models / "qwen-tiny.q8_0-0123456789ab.gguf")
    (models / "qwen-tiny.tokenizer-0123456789ab").mkdir()  # its saved tokenizer, named like the copies
    (models / "qwen-tiny.tokenizer-0123456789ab" / "config.json").write_text("{}")
    (models / "qwen-tiny.tokenizer-0123456789ab" / "model.safetensors").write_bytes(b"\0")
    write_gguf(models / ".partial.gguf")
    entries = catalog.scan(folder)
    assert [e.id for e in entries] == [EMBEDDED_NAME, "no-template", "phi-folder", "qwen-tiny"]
    embedded, plain, phi, qwen = entries
    assert embedded.embedded and embedded.context_train == 8192 and embedded.kv_bytes_per_token == 23040
    assert (qwen.kind, qwen.context_train, qwen.kv_bytes_per_token, qwen.chat_template) == ("gguf", 32768, 256, True)
    assert not plain.chat_template and plain.architecture == "llama"
    assert (phi.kind, phi.context_train, phi.architecture) == ("transformers", 131072, "Phi3ForCausalLM")
    assert phi.kv_bytes_per_token == 4 * 2 * 16 * 2 * 2
    assert catalog.find(folder, "qwen-tiny") == qwen and catalog.find(folder, "../qwen-tiny") is None
    assert catalog.find(folder, "") == embedded


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b"GGUX" + b[4:],  # not GGUF
        lambda b: b[:40],  # cut short inside the header
        lambda b: b[:8] + struct.pack("<Q", 1) + struct.pack("<Q", 10**9) + b[24:],  # a billion keys
        lambda b: b[:24] + struct.pack("<Q", 2**62) + b[32:],  # the first key's length past the file
    ],
)
def test_a_malformed_gguf_is_left_out_with_a_reason(folder, damage, caplog):
    path = write_gguf(folder.models_folder / "bad.gguf")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(catalog.CatalogError):
        catalog.read_gguf_header(path)
    assert [e.id for e in catalog.scan(folder)] == [EMBEDDED_NAME]
    assert "bad.gguf is left out" in caplog.text


def test_a_gguf_files_tokenizer_is_read_once_and_again_when_the_file_changes(tmp_path, monkeypatch):
    """Reading a tokenizer out of a GGUF file takes seconds at every start: the first load saves it
    under the copies dir and the next loads that copy; a file rewritten in place (same size, new
    time) is read again, never served the older copy, which is removed. The reader is scripted: the
    file's text becomes the tokenizer's chat template, so which file was read shows."""
    from llmweb.engine import models
    from tests.chat.test_templates import tokenizer
    from tests.engine import zoo

    reads: list[Path] = []

    def read(path: Path):
        reads.append(path)
        return tokenizer(zoo.FAMILIES["qwen3"], path.read_text())

    monkeypatch.setattr(models, "read_gguf_tokenizer", read)
    path = tmp_path / "mine.gguf"
    path.write_text("first  {{ messages }}")
    s = Settings(data_dir=tmp_path / "data", sample_docs=False, model=str(path))
    first = models.load_tokenizer(s, "llama.cpp")
    again = models.load_tokenizer(s, "llama.cpp")
    assert reads == [path], "the second load reads the saved copy, not the file"
    [copy] = s.copies_dir.iterdir()  # no temporary folder left beside it
    assert copy.name.startswith("mine.tokenizer-") and (copy / "tokenizer.json").is_file()
    assert again.chat_template == first.chat_template == "first  {{ messages }}"
    text = "<|im_start|>user\nhi<|im_end|>"
    assert again.encode(text) == first.encode(text) and again.eos_token == first.eos_token == "<|im_end|>"

    path.write_text("second {{ messages }}")  # the same size: the time tells
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = models.load_tokenizer(s, "llama.cpp")
    assert reads == [path, path] and changed.chat_template == "second {{ messages }}"
    [newer] = s.copies_dir.iterdir()
    assert newer.name != copy.name and newer.name.startswith("mine.tokenizer-"), "the older copy is removed"


def test_a_tokenizer_whose_copy_would_tokenise_otherwise_is_read_from_the_file(tmp_path, monkeypatch, caplog):
    from llmweb.engine import models
    from tests.chat.test_templates import tokenizer
    from tests.engine import zoo

    read = tokenizer(zoo.FAMILIES["qwen3"], "{{ messages }}")
    monkeypatch.setattr(models, "read_gguf_tokenizer", lambda path: read)
    monkeypatch.setattr(models, "_save_tokenizer", lambda tok, folder: False)  # as if the copy split text otherwise
    path = tmp_path / "odd.gguf"
    path.write_text("x")
    s = Settings(data_dir=tmp_path / "data", sample_docs=False, model=str(path))
    with caplog.at_level(logging.WARNING, logger="llmweb.engine.models"):
        assert models.load_tokenizer(s, "llama.cpp") is read
    assert not any(s.copies_dir.iterdir()), "no copy, no temporary folder"
    assert "odd.gguf: a saved copy of its tokenizer would not tokenise as the file does" in caplog.text


def test_sizing_keeps_what_fits_and_cuts_the_context_then_the_slots():
    assert fit(2048, 4, 1000, 2048 * 4 * 1000) == fit(2048, 4, 1000, 10**12)  # fits: unchanged, no note
    assert not fit(2048, 4, 1000, 2048 * 4 * 1000).note
    cut = fit(32768, 1, 1000, 5000 * 1000, name="big")
    assert cut.context == 4864 and cut.slots == 1 and "context 4,864 tokens (not 32,768)" in cut.note
    fewer = fit(2048, 4, 1000, 4096 * 1000)  # 4 slots would leave 1,024 tokens each: 2 slots of 2,048
    assert (fewer.context, fewer.slots) == (2048, 2) and "2 requests at once (not 4)" in fewer.note
    with pytest.raises(ConfigError, match="does not fit in this machine's memory"):
        fit(8192, 1, 1000, (MIN_CONTEXT - 1) * 1000)


def test_only_the_machines_owner_or_an_operator_may_switch_the_model(tmp_path):
    single = Settings(data_dir=tmp_path)  # 127.0.0.1, no login: a single-user install
    shared = Settings(data_dir=tmp_path, single_user="0", operators="alice")
    assert may_switch_models(single, LOCAL_OWNER)
    assert not may_switch_models(single, "anon:" + "b" * 32)
    assert may_switch_models(shared, login_owner("alice"))
    assert not may_switch_models(shared, login_owner("bob")) and not may_switch_models(shared, LOCAL_OWNER)
    assert not may_switch_models(shared, "") and not may_switch_models(shared, "api:conversation")


class Served:
    """A runtime's model side, as web/api/models.py reads it (a scripted switch)."""

    def __init__(self, settings: Settings):
        self.settings, self.model_id, self.ready, self.unloaded = settings, EMBEDDED_NAME, True, False
        self.budget = SimpleNamespace(context_limit=2048)
        self.loaded = SimpleNamespace(name=EMBEDDED_NAME, on_cpu=True)
        self.switched: list[str] = []

    def models(self):
        return catalog.scan(self.settings)

    def switch(self, wanted):
        if wanted not in [e.id for e in self.models()]:
            raise InputError("no such model")
        self.switched.append(wanted)
        self.model_id = wanted

    def wait_ready(self, timeout=None):
        return None

    def hold(self, model=None, timeout=None):
        return Lease(self.model_id, None) if model in (None, self.model_id) else None


def test_the_api_lists_every_model_and_a_request_switches_only_for_those_who_may(folder):
    write_gguf(folder.models_folder / "qwen-tiny.gguf")
    served = Served(folder)
    listed = {m["id"]: m for m in api_models.objects(served, 0)}
    assert listed["llmweb"]["loaded"] and listed[EMBEDDED_NAME]["loaded"] and not listed["qwen-tiny"]["loaded"]
    assert listed[EMBEDDED_NAME]["context_length"] == 2048
    assert listed["qwen-tiny"]["context_length"] == 2048 and listed["qwen-tiny"]["context_train"] == 32768
    assert set(api_models.names(served)) == {"llmweb", EMBEDDED_NAME, "qwen-tiny"}

    with pytest.raises(ApiError) as e:  # a stranger's conversation on a shared server
        api_models.ensure(served, Caller(None), "qwen-tiny")
    assert e.value.status == 409 and served.switched == [] and served.model_id == EMBEDDED_NAME
    assert api_models.ensure(served, Caller(None), "llmweb").model_id == EMBEDDED_NAME, "the served model is anyone's"
    assert api_models.ensure(served, Caller(LOCAL_OWNER), "qwen-tiny").model_id == "qwen-tiny"
    assert served.switched == ["qwen-tiny"]


def test_models_list_prints_each_model_and_says_when_one_has_no_template(folder):
    import io
    from types import SimpleNamespace as Args

    from llmweb.cli.models import cmd_list

    write_gguf(folder.models_folder / "bare.gguf", template=None)
    out = io.StringIO()
    assert cmd_list(Args(json=False), folder, out) == 0
    lines = out.getvalue().splitlines()
    assert lines[1].startswith(f"{EMBEDDED_NAME}  gguf") and "8,192 ctx" in lines[1]
    assert lines[2].startswith("bare  gguf") and "no chat template" in lines[2]
    out = io.StringIO()
    cmd_list(Args(json=True), folder, out)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["id"], r["chat_template"]) for r in rows] == [(EMBEDDED_NAME, True), ("bare", False)]


def hostile_gguf(path: Path, strings: int, key: bytes = b"tokenizer.ggml.tokens") -> Path:
    """A GGUF header of one key: an array of `strings` empty strings (8 bytes each)."""
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    path.write_bytes(header + struct.pack("<IIQ", 9, 8, strings) + b"\0" * (8 * strings))
    return path


def test_a_hostile_header_is_refused_or_read_in_a_bounded_time(tmp_path):
    import time

    started = time.perf_counter()
    with pytest.raises(catalog.CatalogError, match="more than 1,000,000 strings"):
        catalog.read_gguf_header(hostile_gguf(tmp_path / "many.gguf", catalog.MAX_HEADER_STRINGS + 1))
    assert time.perf_counter() - started < 0.5, "refused by its count, before the walk"
    started = time.perf_counter()
    assert catalog.read_gguf_header(hostile_gguf(tmp_path / "some.gguf", 600_000)) == {}  # 4.6 MB of lengths
    took = time.perf_counter() - started
    assert took < 1.5, f"{took:.2f} s for 600,000 strings: skipped from a buffer, not a read each"
    with pytest.raises(catalog.CatalogError, match="a metadata key of 70,000 bytes"):
        catalog.read_gguf_header(hostile_gguf(tmp_path / "key.gguf", 1, key=b"k" * 70_000))


def test_a_bad_file_is_read_and_logged_once_until_it_changes(folder, monkeypatch, caplog):
    path = hostile_gguf(folder.models_folder / "bad.gguf", catalog.MAX_HEADER_STRINGS + 1)
    reads: list[Path] = []
    real = catalog.read_gguf_header
    monkeypatch.setattr(catalog, "read_gguf_header", lambda p: reads.append(p) or real(p))
    for _ in range(3):
        assert [e.id for e in catalog.scan(folder)] == [EMBEDDED_NAME]
    assert reads == [path] and caplog.text.count("bad.gguf is left out") == 1
    write_gguf(path)  # replaced by a good file: read again, and listed
    assert [e.id for e in catalog.scan(folder)] == [EMBEDDED_NAME, "bad"] and len(reads) == 2
