"""The transformers runner's failure handling and memory accounting on a tiny random llama (CPU,
milliseconds a step): a device's non-allocator failures to get memory give way like the
allocator's OOM; an id past the embedding fails its request cleanly; an OOM while a request leaves
the batch costs its cache, not its reply or the batch; admission's prediction covers what the
left-padded batch really holds after joins."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmweb.engine.admission import predict_bytes
from llmweb.engine.kvcache import KVStore, cache_nbytes
from llmweb.engine.request import EngineLimits, GenerationRequest
from llmweb.engine.runners.transformers import LocalRunner, _Batch
from llmweb.engine.scheduler import Engine
from llmweb.errors import InputError, OutOfMemory

CONFIG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
KV_BYTES = 2 * 2 * 8 * 2 * 4  # layers x kv heads x head dim x (k, v) x fp32


def tiny_engine(**limits):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    kv = KVStore(64 * 2**20, 600)
    runner = LocalRunner(model, "cpu", kv, KV_BYTES)
    limits.setdefault("max_batch", 4)
    return Engine(runner, kv, EngineLimits(**limits)), runner


@pytest.fixture
def tiny():
    made = []

    def make(**limits):
        made.append(tiny_engine(**limits))
        return made[-1]

    yield make
    for engine, _ in made:
        engine.close()


def req(n_prompt: int, n: int, seed: int = 1, **kw) -> GenerationRequest:
    ids = [(seed * 7 + 3 * i) % 90 + 1 for i in range(n_prompt)]
    kw.setdefault("owner", f"visitor-{seed}")  # one owner may have only two waiting
    return GenerationRequest(prompt_ids=ids, max_new_tokens=n, **kw)


class Hooked:
    """The model with `before(inputs)` called ahead of each forward pass."""

    def __init__(self, model, before):
        self._model, self._before = model, before

    def __call__(self, **inputs):
        self._before(inputs)
        return self._model(**inputs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _accelerator_error(text: str) -> Exception:
    try:
        return torch.AcceleratorError(text)  # torch >= 2.8: what a driver call raises
    except (AttributeError, TypeError):
        return RuntimeError(text)


@pytest.mark.parametrize(
    "error",
    [
        "CUDA error: out of memory",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    ],
)
def test_a_non_allocator_out_of_memory_in_a_batched_step_makes_the_youngest_give_way(tiny, error):
    engine, runner = tiny()
    alone = [list(engine.submit(req(12, 8, seed=s)).result()) for s in (1, 2, 3)]
    fired = []

    def before(inputs):
        if inputs["input_ids"].shape[0] == 3 and not fired:  # the first step of all three together
            fired.append(1)
            raise _accelerator_error(error) if "out of memory" in error else RuntimeError(error)

    runner.model = Hooked(runner.model, before)
    handles = [engine.submit(req(12, 8, seed=s)) for s in (1, 2, 3)]
    with pytest.raises(OutOfMemory):
        handles[2].result()  # the youngest gave way; with no smaller prompt to retry, it ends so
    assert [list(h.result()) for h in handles[:2]] == alone[:2], "the rest of the batch went on as before"
    assert fired and engine.counters.ooms == 1
    assert list(engine.submit(req(12, 8, seed=3)).result()) == alone[2]


def test_an_id_past_the_embedding_fails_its_request_cleanly_and_the_next_is_answered(tiny):
    engine, _ = tiny()
    with pytest.raises(InputError, match="token id 96, outside this model's 96 embeddings"):
        engine.submit(GenerationRequest(prompt_ids=[5, 96, 7], max_new_tokens=4)).result()
    assert len(engine.submit(req(5, 4)).result()) == 4


def test_an_oom_while_a_request_leaves_costs_its_cache_not_its_reply_nor_the_batch(tiny, monkeypatch):
    engine, runner = tiny()
    requests = [req(10, 4, seed=1, session_id="a"), req(20, 12, seed=2), req(15, 12, seed=3)]
    alone = [list(engine.submit(r).result()) for r in requests]
    engine.kv.clear()
    real, leave = torch.Tensor.index_select, _Batch.leave
    calls, leaving = [], []

    def index_select(t, *args, **kw):
        if leaving and len(runner._batch.slots) == 3:  # the first leave of three rows: its second layer fails
            calls.append(1)
            if len(calls) == 3:
                raise torch.OutOfMemoryError("out of memory (injected into _Batch.leave)")
        return real(t, *args, **kw)

    def leave_watched(batch, slot):
        leaving.append(1)
        try:
            return leave(batch, slot)
        finally:
            leaving.clear()

    monkeypatch.setattr(torch.Tensor, "index_select", index_select)
    monkeypatch.setattr(_Batch, "leave", leave_watched)
    handles = [engine.submit(r) for r in requests]
    assert [list(h.result()) for h in handles] == alone, "the leaver's reply stands; the others decode on"
    assert len(calls) >= 3 and max(h.stats.batch_size for h in handles) == 3
    assert engine.kv.sessions() == [], "its cache was dropped"
    monkeypatch.setattr(torch.Tensor, "index_select", real)
    again = [engine.submit(r) for r in requests[1:]]
    assert [list(h.result()) for h in again] == alone[1:] and max(h.stats.batch_size for h in again) == 2


def test_admission_s_prediction_covers_the_left_padded_batch_after_each_join(tiny):
    engine, runner = tiny(max_batch=6)
    heads = CONFIG["num_attention_heads"]
    seen = []

    def kv_predicted(slot) -> int:  # a slot's prediction less its activation margin
        r = slot.request
        return slot.predicted - predict_bytes(KV_BYTES, heads, len(r.prompt_ids), r.max_new_tokens)[1]

    def tap(slot, row):
        batch = runner._batch
        if batch.cache is not None and slot is batch.slots[0]:
            predicted = sum(kv_predicted(s) for s in engine._running)
            seen.append((len(batch.slots), cache_nbytes(batch.cache), predicted))

    runner.tap = tap
    handles = [engine.submit(req(600, 40, seed=9))]  # one long chat, then short ones join beside it
    handles += [engine.submit(req(8, 40, seed=s)) for s in range(5)]
    for h in handles:
        assert len(h.result()) == 40
    assert max(rows for rows, _, _ in seen) == 6
    worst = max(seen, key=lambda s: s[1] / s[2])
    assert all(real <= predicted for _, real, predicted in seen), f"rows, real, predicted: {worst}"


def test_an_imported_cache_holds_what_the_exported_one_did(tiny):
    engine, runner = tiny()
    engine.submit(req(300, 8, session_id="s")).result()
    entry = engine.kv.peek("s")
    imported = runner.import_cache(runner.export_cache(entry.cache))  # a recycle's hand-over
    assert imported.get_seq_length() == entry.cache.get_seq_length() == len(entry.ids)
    assert cache_nbytes(imported) == cache_nbytes(entry.cache) == entry.nbytes, "the store's figure is the truth"


def test_the_step_timing_waits_for_the_device_only_when_asked(tiny):
    engine, runner = tiny()
    syncs = []
    runner._sync = lambda: syncs.append(1)
    engine.submit(req(5, 4)).result()
    assert syncs == [] and runner.timing.steps == 3, "serving never waits for the device to time a step"
    runner.timing.exact = True  # bench decode: a CUDA pass is asynchronous, the split needs the waits
    engine.submit(req(5, 4)).result()
    assert len(syncs) == 4 * 3 and runner.timing.steps == 6
