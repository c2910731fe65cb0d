"""The llama.cpp runner's own pieces: which backend `auto` picks and why, its sampler against
transformers' processors, its tokenisation against the transformers tokenizer, the status line.

The engine behaviour on llama.cpp (streaming, cancel, batch, reuse, OOM) is in test_engine.py,
parametrised over both runners."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmweb.config import Settings
from llmweb.engine import gguf, models
from llmweb.engine.request import GenerationRequest
from llmweb.engine.runners.llama_cpp import llama_engine
from llmweb.engine.runners.sampling import NumpySampler
from llmweb.errors import ConfigError, LlmwebError


def settings(tmp_path, **kw) -> Settings:
    return Settings(data_dir=tmp_path, sample_docs=False, **kw)


def test_auto_picks_llama_cpp_for_the_embedded_gguf_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf, "available", lambda: None)
    assert models.resolve_backend(settings(tmp_path), "cpu") == ("llama.cpp", "")
    assert models.resolve_backend(settings(tmp_path), "cuda") == ("transformers", ""), "the GPU keeps 4-bit"
    assert models.resolve_backend(settings(tmp_path, quant="int8-cpu"), "cpu")[0] == "transformers", (
        "an explicit quantisation asks for the transformers path"
    )
    assert models.resolve_backend(settings(tmp_path, backend="transformers"), "cpu") == ("transformers", "")


def test_auto_falls_back_with_the_reason_and_a_forced_backend_says_why_it_cannot(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf, "available", lambda: "llama-cpp-python is not usable here (ImportError: x)")
    backend, note = models.resolve_backend(settings(tmp_path), "cpu")
    assert backend == "transformers" and "llama-cpp-python is not usable here" in note and "int8-cpu" in note
    with pytest.raises(ConfigError, match="LLMWEB_BACKEND=llama.cpp: llama-cpp-python is not usable"):
        models.resolve_backend(settings(tmp_path, backend="llama.cpp"), "cpu")
    monkeypatch.setattr(gguf, "available", lambda: None)
    backend, note = models.resolve_backend(settings(tmp_path, model="some/hub-model"), "cpu")
    assert backend == "transformers" and "is not one" in note
    with pytest.raises(ConfigError, match="runs GGUF files"):
        models.resolve_backend(settings(tmp_path, model="some/hub-model", backend="llama.cpp"), "cpu")
    with pytest.raises(ConfigError, match="on a GPU use transformers"):
        models.resolve_backend(settings(tmp_path, backend="llama.cpp"), "cuda")
    with pytest.raises(ConfigError, match="not there"):
        models.resolve_backend(settings(tmp_path, model=str(tmp_path / "missing.gguf")), "cpu")


def test_the_backend_setting_is_checked():
    with pytest.raises(ConfigError, match="LLMWEB_BACKEND must be one of auto, llama.cpp, transformers"):
        Settings(backend="vllm")


def _transformers_next(logits: np.ndarray, ids: list[int], penalty: float) -> int:
    from transformers import RepetitionPenaltyLogitsProcessor

    scores = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), torch.tensor(logits)[None, :])
    return int(scores.argmax())


def test_the_samplers_repetition_penalty_is_transformers_own():
    rng = np.random.default_rng(0)
    for _ in range(50):
        logits = rng.normal(size=64).astype(np.float32)
        prompt = list(rng.integers(0, 64, size=12))
        request = GenerationRequest(prompt, 4, repetition_penalty=1.3)
        ours = NumpySampler(request, prompt, 64)(logits.copy())
        assert ours == _transformers_next(logits, prompt, 1.3)


def test_the_samplers_penalty_covers_the_ids_it_generated():
    """Step by step over one request: every id the sampler chose joins those penalised, as in
    transformers' processor over prompt + generated ids."""
    rng = np.random.default_rng(1)
    prompt = [int(x) for x in rng.integers(0, 64, size=6)]
    sampler = NumpySampler(GenerationRequest(prompt, 30, repetition_penalty=1.5), prompt, 64)
    ids = list(prompt)
    for _ in range(30):
        logits = rng.normal(size=64).astype(np.float32)
        expected = _transformers_next(logits, ids, 1.5)
        assert sampler(logits.copy()) == expected
        ids.append(expected)
    assert len(set(ids)) > len(set(prompt)), "the request generated ids the prompt did not have"


def test_the_sampler_is_greedy_at_temperature_0_and_seeded_with_top_p():
    logits = np.array([0.0, 5.0, 4.9, -1.0], dtype=np.float32)
    assert NumpySampler(GenerationRequest([0], 1), [0], 4)(logits) == 1
    draws = {
        NumpySampler(GenerationRequest([0], 1, temperature=1.0, top_p=0.5, seed=s), [0], 4)(logits) for s in range(40)
    }
    assert draws == {1}, "top_p 0.5 keeps only the most likely id here (its probability is just over a half)"
    draws = {
        NumpySampler(GenerationRequest([0], 1, temperature=1.0, top_p=1.0, seed=s), [0], 4)(logits) for s in range(40)
    }
    assert {1, 2} <= draws
    same = [NumpySampler(GenerationRequest([0], 1, temperature=1.0, seed=7), [0], 4)(logits) for _ in range(5)]
    assert len(set(same)) == 1, "a seed makes the draw repeatable"


def test_llama_cpp_tokenises_as_the_transformers_tokenizer(llama_model):
    texts = [
        "Hello world, how are you?",
        "<|im_start|>user\nÜber 3.14 🐍 naïve café<|im_end|>\n",
        "  spaced\n\nlines\t",
    ]
    for text in texts:
        assert llama_model.model.tokenize(text) == llama_model.tokenizer.encode(text, add_special_tokens=False)


def test_the_status_line_names_llama_cpp(llama_model):
    assert "llama.cpp" in llama_model.describe() and "GGUF" in llama_model.describe()
    assert llama_model.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2 and llama_model.backend == "llama.cpp"


def test_the_installed_llama_cpp_runs_without_openmp(llama_model):
    """pre-requirements.txt builds llama.cpp without OpenMP, whose runtime torch shares and slows."""
    assert gguf.openmp_note() == ""
    assert not any("OpenMP" in note for note in llama_model.notes)


def test_an_openmp_build_is_named_with_the_fix(monkeypatch):
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX2 = 1 | OPENMP = 1 | REPACK = 1 |")
    note = gguf.openmp_note()
    assert "OpenMP" in note and "pre-requirements.txt" in note
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX2 = 1 | REPACK = 1 |")
    assert gguf.openmp_note() == ""


def test_the_requant_setting_is_checked():
    with pytest.raises(ConfigError, match="LLMWEB_GGUF_REQUANT must be one of auto, q8_0, none, off"):
        Settings(gguf_requant="q4_0")


def test_auto_reencodes_only_a_q4_1_file_and_none_or_off_keeps_any_file_as_it_ships():
    """The default (auto) re-encodes the type llama.cpp has no repacked CPU kernels for and Q8_0 holds
    exactly (Q4_1, the embedded file's); Q4_0 and Q4_K are repacked (faster than Q8_0 already), and
    a Q8_0 or F16 file gains nothing. q8_0 asks for it whatever the type; none and off never."""
    assert Settings().gguf_requant == "auto"
    assert gguf.requant_kind("auto", "Q4_1") == "q8_0"
    assert [gguf.requant_kind("auto", t) for t in ("Q4_0", "Q4_K", "Q8_0", "F16", "")] == [None] * 5
    assert gguf.requant_kind("q8_0", "Q4_K") == "q8_0"
    assert gguf.requant_kind("none", "Q4_1") is None and gguf.requant_kind("off", "Q4_1") is None


@pytest.mark.slow  # re-encodes the embedded file (~3 s) and loads it
def test_requant_reencodes_the_gguf_once_and_the_copy_answers(tmp_path):
    """LLMWEB_GGUF_REQUANT=q8_0: llama.cpp's own quantiser writes a Q8_0 copy under the models dir
    once (the status line says what it came from); the next start loads the copy without re-encoding;
    the copy answers as the model does."""
    from llmweb.chat.tokens import TemplateFormat, render_prompt
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits

    s = settings(tmp_path, cache_dir=tmp_path / "models", gguf_requant="q8_0", device="cpu")  # a models dir of its own
    said: list[str] = []
    loaded = models.load(s, progress=said.append)
    try:
        assert loaded.backend == "llama.cpp" and loaded.quant == "Q8_0 GGUF from Q4_1", loaded.quant
        copies = list(s.copies_dir.glob("*.q8_0-*.gguf"))
        assert [loaded.model.path] == copies and not list(s.copies_dir.glob(".*tmp*"))
        assert any("re-encoding" in m for m in said)
        fmt = TemplateFormat(loaded.tokenizer)
        ids = render_prompt(fmt, "You are helpful.", [("user", "What is the capital of France?")])
        engine = llama_engine(loaded.model, KVStore(0, 1), EngineLimits(max_new_tokens=24), 512)
        try:
            reply = fmt.decode(engine.submit(GenerationRequest(ids, 24, stop_ids=fmt.stop_ids)).result())
        finally:
            engine.close()
        assert "Paris" in reply, reply
    finally:
        loaded.model.close()
    stamp = copies[0].stat().st_mtime_ns
    said.clear()
    again = models.load(s, progress=said.append)
    again.model.close()
    assert again.model.path == copies[0] and copies[0].stat().st_mtime_ns == stamp
    assert not any("re-encoding" in m for m in said), "the second start reuses the copy"


@pytest.mark.slow  # loads the embedded file twice (its Q8_0 copy is in the shared models dir)
def test_the_default_serves_the_shipped_q4_1_file_as_q8_0_and_none_serves_it_as_it_ships(tmp_path):
    """On the CPU llama.cpp path the embedded Q4_1 file is served re-encoded as Q8_0 (about twice
    the prefill, docs/benchmarks.md), and the status names it; LLMWEB_GGUF_REQUANT=none turns it off."""
    from tests.conftest import make_settings

    loaded = models.load(make_settings(tmp_path, device="cpu", backend="llama.cpp"))
    loaded.model.close()
    assert loaded.quant == "Q8_0 GGUF from Q4_1" and "Q8_0 GGUF from Q4_1" in loaded.describe(), loaded.describe()
    plain = models.load(make_settings(tmp_path, device="cpu", backend="llama.cpp", gguf_requant="none"))
    plain.model.close()
    assert plain.quant == "Q4_1 GGUF" and plain.model.path.name == models.embedded_gguf()[1]


def test_requant_on_the_transformers_path_is_named_not_ignored_silently(tmp_path, monkeypatch):
    def stub(settings, device, progress):
        return models.LoadedModel(None, None, "m", "int8-cpu", "cpu", 0, 1, 1, 4, 0.0)

    monkeypatch.setattr(models, "load_transformers", stub)
    loaded = models.load(settings(tmp_path, backend="transformers", gguf_requant="q8_0", device="cpu"))
    assert loaded.notes == ["LLMWEB_GGUF_REQUANT=q8_0 is for llama.cpp only."]
    assert models.load(settings(tmp_path, backend="transformers", device="cpu")).notes == []


def test_a_file_llama_cpp_cannot_reencode_fails_clearly_and_leaves_no_half_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(LlmwebError, match="could not re-encode broken.gguf as q8_0"):
        gguf.requantised(bad, "q8_0", tmp_path / "models", 1, progress=str)
    assert list((tmp_path / "models").iterdir()) == []


def test_a_decode_batch_is_fed_in_sequence_id_order(llama_model):
    """llama.cpp runs a batch over KV streams as one pass per run of consecutive sequence ids, so
    slots that arrive as 2, 0, 3, 1 are fed as 0, 1, 2, 3, and the logits' rows follow that order."""
    from types import SimpleNamespace

    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.runners.llama_cpp import LlamaRunner

    runner = LlamaRunner(llama_model.model, KVStore(1 << 20, 60), 4, 256)
    try:
        slots = [SimpleNamespace(state=SimpleNamespace(seq=s, last=1, pos=0)) for s in (2, 0, 3, 1)]
        runner._feed(slots)
        assert [runner._batch.seq_id[i][0] for i in range(4)] == [0, 1, 2, 3]
        ran = runner._step(slots)
        assert ran is not None and [slot.state.seq for slot in ran[0]] == [0, 1, 2, 3]
    finally:
        runner.close()


def test_a_background_prompt_reads_in_small_chunks_even_alone(llama_model):
    """A whole-document step (background) reads its prompt in the runner's small chunks even with
    nobody else in the engine: whoever arrives waits for at most one of them
    (tests/engine/test_owner_share.py)."""
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits
    from llmweb.engine.runners.llama_cpp import SMALL_CHUNK

    engine = llama_engine(llama_model.model, KVStore(0, 1), EngineLimits(max_new_tokens=4), 1024)
    chunks: list[int] = []
    prefill = engine.runner._prefill

    def counted(seq, chunk, last):
        chunks.append(len(chunk))
        return prefill(seq, chunk, last)

    engine.runner._prefill = counted
    try:
        engine.submit(GenerationRequest(list(range(100, 700)), 2, owner="reader", background=True)).result()
    finally:
        engine.close()
    assert chunks == [SMALL_CHUNK] * (600 // SMALL_CHUNK) + [600 % SMALL_CHUNK], chunks


def test_a_copy_that_cannot_be_made_serves_the_file_as_it_ships_under_auto_and_fails_when_asked(tmp_path, monkeypatch):
    """The default must not stop a start on a read-only models dir or a full disk: the file as it
    ships, and a note for the status line; LLMWEB_GGUF_REQUANT=q8_0, asked for by name, fails."""

    class Shipped:
        threads, type_name = 2, "llama 135M Q4_1"

        def __init__(self, path, threads=0):
            pass

        def close(self):
            pass

    def no_room(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf, "GgufModel", Shipped)
    monkeypatch.setattr(gguf, "requantised", no_room)
    path, was, note = models.served_gguf(settings(tmp_path))
    assert path.name == models.embedded_gguf()[1] and was == ""
    assert note.startswith(f"Serving {path.name} as it ships: its Q8_0 copy could not be made") and "space" in note
    with pytest.raises(OSError):
        models.served_gguf(settings(tmp_path, gguf_requant="q8_0"))
