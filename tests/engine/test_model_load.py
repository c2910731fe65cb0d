"""The model's load on the transformers path, the way a GPU takes it, exercised on the CPU: a GGUF
file of an architecture transformers cannot read (refused with the reason, and not listed; the zoo's
GGUF files are converted in tests/engine/test_zoo.py), a load that runs
out of memory (DoesNotFit, the failed attempt's memory released, no float retry), the compute dtype
a device without bf16 gets, and the sizing after a load (the allocator's cache counted as room, the
4-bit weights' quantisation state counted as weights). CUDA functions are monkeypatched where the
mechanism needs a GPU's answer."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
import transformers

from llmweb.engine import models
from llmweb.engine.sizing import DoesNotFit, Fit
from llmweb.errors import ConfigError
from llmweb.runtime import engines, switching
from tests.conftest import make_settings
from tests.engine.test_catalog import write_gguf

MiB = 2**20


# ---- a GGUF file on transformers


def test_a_gguf_of_an_architecture_transformers_cannot_read_is_refused_with_the_reason(tmp_path):
    path = write_gguf(tmp_path / "rwkv-tiny.gguf", arch="rwkv6")
    settings = make_settings(tmp_path / "data", model=str(path), backend="transformers", quant="fp32")
    with pytest.raises(ConfigError, match=r"rwkv-tiny\.gguf: transformers cannot load a GGUF of architecture 'rwkv6'"):
        models.load(settings, progress=lambda _: None)
    assert not list(settings.copies_dir.glob("rwkv-tiny.*")), "nothing half-converted is left"


def test_transformers_reads_the_architectures_its_gguf_loader_maps():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    for arch in ("llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen3moe", "gpt-oss"):
        assert models.transformers_converts(arch), arch
    for arch in ("rwkv6", "bert", "general", "tokenizer", ""):
        assert not models.transformers_converts(arch), arch
    assert all(
        models.transformers_converts(a) for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")
    )


def test_the_listing_leaves_out_ggufs_transformers_cannot_read_where_ggufs_run_on_transformers(tmp_path):
    settings = make_settings(tmp_path / "data")
    settings.models_folder.mkdir(parents=True)
    write_gguf(settings.models_folder / "qwen-tiny.gguf")
    write_gguf(settings.models_folder / "rwkv-tiny.gguf", arch="rwkv6")

    def ids(**kw) -> set[str]:
        runtime = SimpleNamespace(settings=settings.replace(**kw), model_id=models.EMBEDDED_NAME, loaded=None)
        return {e.id for e in switching.listed(runtime)}

    assert {"qwen-tiny", "rwkv-tiny"} <= ids(backend="llama.cpp"), "llama.cpp runs both"
    on_transformers = ids(backend="transformers")
    assert "qwen-tiny" in on_transformers and models.EMBEDDED_NAME in on_transformers
    assert "rwkv-tiny" not in on_transformers, "transformers cannot load it: not offered"


# ---- running out of memory while loading


@pytest.fixture
def fake_weights(monkeypatch):
    """transformers' from_pretrained replaced: the first call allocates 64 MiB that only its own frame
    holds, then raises `state.error()` (a new exception each time: one kept here would keep its
    traceback); a later call records whether that tensor is still alive."""
    state = SimpleNamespace(calls=[], first=None, alive_at_retry=None, error=None)

    class Stop(Exception):
        pass

    def from_pretrained(source, **kw):
        state.calls.append(kw)
        if len(state.calls) == 1:
            held = torch.ones(64 * MiB // 4)
            state.first = weakref.ref(held)
            raise state.error()
        state.alive_at_retry = state.first() is not None
        raise Stop("the retry")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: SimpleNamespace())
    state.Stop = Stop
    return state


def _settings(tmp_path, **kw):
    return make_settings(tmp_path / "data", model=str(tmp_path / "folder-model"), quant="4bit", **kw)


def test_a_4bit_load_out_of_memory_says_so_and_never_retries_in_fp16(tmp_path, fake_weights):
    pytest.importorskip("bitsandbytes")
    fake_weights.error = lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(DoesNotFit, match="The 4-bit weights of .*folder-model do not fit") as caught:
        models.load_transformers(_settings(tmp_path), "cpu")
    assert len(fake_weights.calls) == 1, "no float attempt after running out of memory"
    assert fake_weights.first() is None, "the failed attempt's tensors are released"
    assert caught.value.__context__ is None, "the error does not hold the failed attempt's traceback"


def test_a_4bit_load_the_platform_cannot_run_falls_back_only_after_releasing_the_failed_attempt(tmp_path, fake_weights):
    pytest.importorskip("bitsandbytes")
    fake_weights.error = lambda: RuntimeError("no kernel image is available for execution on the device")
    with pytest.raises(fake_weights.Stop):
        models.load_transformers(_settings(tmp_path), "cpu")
    assert len(fake_weights.calls) == 2 and "quantization_config" not in fake_weights.calls[1]
    assert fake_weights.alive_at_retry is False, "the fallback ran while the failed attempt's tensors were alive"


# ---- the compute dtype by device


@pytest.mark.parametrize(("capability", "dtype"), [((7, 5), torch.float16), ((8, 0), torch.bfloat16)])
def test_4bit_and_8bit_compute_in_fp16_where_the_gpu_has_no_bf16(tmp_path, monkeypatch, capability, dtype):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    settings = make_settings(tmp_path / "data")
    kw4 = models.load_kwargs(settings, "4bit", "cuda")
    assert kw4["dtype"] == dtype and kw4["quantization_config"].bnb_4bit_compute_dtype == dtype
    assert models.load_kwargs(settings, "8bit", "cuda")["dtype"] == dtype
    assert models.load_kwargs(settings, "4bit", "cpu")["dtype"] == torch.bfloat16, "the CPU's is unchanged"


# ---- sizing after the load


@pytest.fixture
def gpu_after_load(monkeypatch):
    """A GPU the driver says has 1 GiB free while torch's allocator caches 2 GiB that no tensor uses."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1024 * MiB, 24 * 1024 * MiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 3072 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1024 * MiB)
    return models.LoadedModel(
        model=None,
        tokenizer=None,
        name="m",
        quant="4bit",
        device="cuda:0",
        weights_bytes=1024 * MiB,
        max_context=8192,
        kv_bytes_per_token=64 * 1024,
        dtype_bytes=2,
        load_s=0.0,
    )


def test_sizing_counts_the_allocators_cached_blocks_as_room(tmp_path, monkeypatch, gpu_after_load):
    settings = make_settings(tmp_path / "data", mem_margin_mb=0)
    assert engines.kv_budget_bytes(settings, gpu_after_load) == 3072 * MiB // 4
    rooms: list[int] = []

    def fit(wanted, slots, kv_bytes_per_token, room, *, name="the model"):
        rooms.append(room)
        return Fit(wanted, slots)

    monkeypatch.setattr("llmweb.engine.sizing.fit", fit)
    engines.size_to_memory(settings, gpu_after_load)
    from llmweb.engine.admission import ACTIVATION_FLOOR

    assert rooms == [3072 * MiB - ACTIVATION_FLOOR]


def test_the_weights_figure_counts_the_4bit_quantisation_state():
    bnb = pytest.importorskip("bitsandbytes")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = bnb.nn.Linear4bit(256, 256, bias=False, compress_statistics=True, quant_type="nf4").to("cpu")

        def get_memory_footprint(self):  # as transformers counts: parameters and buffers
            return sum(t.numel() * t.element_size() for t in (*self.parameters(), *self.buffers()))

    model = Tiny()
    state = model.proj.weight.quant_state
    extra = sum(
        t.numel() * t.element_size()
        for t in (state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code)
    )
    assert extra > 0
    assert models.weights_nbytes(model) == model.get_memory_footprint() + extra
