"""Several models loaded (LLMWEB_MAX_LOADED), over fakes: the bookkeeping of runtime/resident.py
(least recently used first, holds, room), then the real `Runtime` switching between three tiny
GGUF files whose load is a fake engine (no model, milliseconds): a switch back to a parked model
loads nothing, a held model is not closed under its turn, the least recently used goes first,
room is made for a model that would not fit, and the keep-alive closes a parked model on its own
clock. tests/engine/test_models_folder.py does the same with real engine processes."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from llmweb.chat.context import Budget
from llmweb.engine.sizing import DoesNotFit
from llmweb.runtime import Runtime
from llmweb.runtime.resident import Lease, Resident, Residents, to_free
from llmweb.runtime.switching import sizing_settings
from tests.conftest import make_settings
from tests.engine.test_catalog import write_gguf
from tests.fakes import FakeFormat, FakeRunner, fake_engine

BUDGET = Budget(context_limit=200, max_new_tokens=20, summary_tokens=30, retrieved_tokens=40, user_tokens=60)


def record(name: str) -> Resident:
    return Resident(name, engine=None, chat=name, loaded=None, budget=None)


# ---- the bookkeeping


def test_the_least_recently_used_parked_model_goes_first_and_a_turn_counts_as_use():
    r = Residents(max_loaded=2)
    a, b = record("a"), record("b")
    r.serve(a)
    assert r.over(loading=1) == [], "a and the next one: 2"
    r.park()
    r.serve(b)
    r.park()  # b parked after a: a is the least recently used
    assert r.ids() == ["b", "a"] and r.over(loading=1) == [a]
    with r.hold("a") as chat:  # a turn on a: now b is the older
        assert chat == "a" and a.holds == 1
    assert a.holds == 0 and r.over(loading=1) == [b] and r.ids() == ["a", "b"]
    assert r.hold("nobody") is None and r.hold(None) is None, "nothing served"
    assert r.unpark("a") is a and r.serving is a and r.ids() == ["a", "b"] and r.hold("a").chat == "a"
    assert r.unserve() is a and not r.remove(a) and r.remove(b) and r.ids() == []


def test_a_held_model_is_waited_for_and_the_keep_alive_skips_it():
    r = Residents(max_loaded=3)
    a = record("a")
    r.serve(a)
    r.park()
    lease = r.hold("a")
    assert not r.wait_unheld(a, 0.05), "a turn holds it"
    assert r.idle(0.0) == [], "held: not idle"
    lease.release()
    lease.release()  # once only
    assert a.holds == 0 and r.wait_unheld(a, 0.05)
    assert r.idle(0.0) == [a] and r.idle(60.0) == []


def test_a_lease_around_events_is_released_when_they_end_or_are_closed():
    released = []
    done = Lease("a", None, lambda: released.append("done"))
    assert list(done.around(iter([1, 2]))) == [1, 2] and released == ["done"]
    left = Lease("a", None, lambda: released.append("left"))
    events = left.around(iter([1, 2, 3]))
    assert next(events) == 1
    events.close()  # a client gone mid-turn
    assert released == ["done", "left"]


def test_room_is_made_from_the_least_recently_used_and_no_more_than_needed():
    a, b, c = record("a"), record("b"), record("c")
    size = {"a": 300, "b": 500, "c": 100}.__getitem__

    def footprint(r):
        return size(r.model_id)

    assert to_free([a, b, c], footprint, room=1000, need=800) == []
    assert to_free([a, b, c], footprint, room=400, need=800) == [a, b], "a's 300 is not enough: b too"
    assert to_free([a, b, c], footprint, room=0, need=5000) == [a, b, c], "all, and the load says the rest"


# ---- the runtime, with fake loads


@pytest.fixture
def folder(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    for name in ("a", "b", "c"):
        write_gguf(models / f"{name}.gguf", context=4096)
    return models


@pytest.fixture
def fake_loads(monkeypatch):
    """Every load is a fake engine: the runtime's `_load_local` wires it as a real load would.
    Yields the ids loaded, in order; `fail` makes a load raise."""
    monkeypatch.setattr(Runtime, "library", property(lambda self: None))
    monkeypatch.setattr("llmweb.chat.tokens.TemplateFormat", lambda tokenizer, model_stops=(): FakeFormat())
    loads: list[str] = []
    fail: list = []

    def load_local(self, t0: float) -> None:
        if fail and fail[0](self):
            raise DoesNotFit(f"{self.model_id} does not fit")
        loads.append(self.model_id)
        engine, _runner = fake_engine(FakeRunner(), max_new_tokens=BUDGET.max_new_tokens)
        self.loaded = SimpleNamespace(name=self.model_id, notes=[], describe=lambda: self.model_id)
        self._wire(engine, BUDGET, None)
        self._status.ready_local(self.loaded, BUDGET, 0.0)

    monkeypatch.setattr(Runtime, "_load_local", load_local)
    yield SimpleNamespace(loads=loads, fail=fail)


def runtime(tmp_path, folder, **kw) -> Runtime:
    s = make_settings(tmp_path / "data", models_dir=folder, model=str(folder / "a.gguf"), **kw)
    return Runtime(s).start(background=False)


def switch(rt: Runtime, model: str) -> None:
    rt.switch(model)
    rt.wait_ready(10)


def closed(resident_engine) -> bool:
    return resident_engine._stopped


def test_one_loaded_a_switch_closes_the_served_model_as_before(tmp_path, folder, fake_loads):
    rt = runtime(tmp_path, folder)
    try:
        a = rt.engine
        switch(rt, "b")
        assert closed(a) and rt.loaded_ids() == ["b"] and fake_loads.loads == ["a", "b"]
        assert rt.hold("a") is None, "a is not loaded: the caller would switch"
        switch(rt, "a")
        assert fake_loads.loads == ["a", "b", "a"] and "Kept" not in rt.status
    finally:
        rt.close()


def test_two_loaded_a_switch_back_is_instant_and_a_parked_model_answers_its_requests(tmp_path, folder, fake_loads):
    rt = runtime(tmp_path, folder, max_loaded=2)
    try:
        a_engine, a_chat = rt.engine, rt.chat
        switch(rt, "b")
        assert rt.loaded_ids() == ["b", "a"] and not closed(a_engine) and "Kept a loaded." in rt.status
        with rt.hold("a") as chat:  # a request naming a, while b is served
            assert chat is a_chat and rt.model_id == "b"
        switch(rt, "a")
        assert fake_loads.loads == ["a", "b"], "no load"
        assert rt.engine is a_engine and rt.chat is a_chat and "switched at once" in rt.status, rt.status
        assert rt.status.startswith("Ready: a") and rt.loaded_ids() == ["a", "b"]
    finally:
        rt.close()


def test_a_held_model_is_closed_only_after_its_turn_and_the_least_recently_used_goes(tmp_path, folder, fake_loads):
    rt = runtime(tmp_path, folder, max_loaded=2)
    try:
        switch(rt, "b")  # a parked
        switch(rt, "a")  # b parked
        b_engine = rt.residents.parked()[0].engine
        lease = rt.hold("b")  # a turn on b (a request naming it)
        assert lease is not None and lease.model_id == "b"
        to_c = threading.Thread(target=switch, args=(rt, "c"))
        to_c.start()  # a and c would be three: b, the least recently used, goes once its turn ends
        time.sleep(0.3)
        assert to_c.is_alive() and not closed(b_engine), "the switch waits for the turn on b"
        lease.release()
        to_c.join(10)
        assert closed(b_engine) and rt.loaded_ids() == ["c", "a"] and rt.model_id == "c"
        assert "Unloaded b (the least recently used; LLMWEB_MAX_LOADED=2)." in rt.status, rt.status
    finally:
        rt.close()


def test_room_is_made_for_a_model_that_would_not_fit_beside_the_parked_ones(tmp_path, folder, fake_loads, monkeypatch):
    """Three may be loaded, but the memory limit holds two parked models' 1 GiB each and not the
    third model beside them: the least recently used goes first; the next load is sized to what
    the other leaves."""
    monkeypatch.setattr(Resident, "footprint", lambda self: 2**30)
    rt = runtime(tmp_path, folder, max_loaded=3, mem_limit_mb=2048 + 100, mem_margin_mb=64, engine_process="1")
    try:
        switch(rt, "b")
        switch(rt, "c")
        assert rt.loaded_ids() == ["c", "b"] and "Unloaded a to make room for c." in rt.status, rt.status
        assert sizing_settings(rt).mem_limit_mb == 2148 - 1024, "c's engine process: the limit less b's"
    finally:
        rt.close()


def test_a_load_that_does_not_fit_lets_a_parked_model_go_and_loads_again(tmp_path, folder, fake_loads):
    rt = runtime(tmp_path, folder, max_loaded=3)
    fake_loads.fail.append(lambda rt: rt.model_id == "c" and len(rt.residents.parked()) > 1)
    try:
        switch(rt, "b")
        switch(rt, "c")
        assert rt.loaded_ids() == ["c", "b"] and fake_loads.loads == ["a", "b", "c"]
        assert "Unloaded a to make room for c." in rt.status, rt.status
    finally:
        rt.close()


def test_a_4bit_load_that_runs_out_of_gpu_memory_lets_a_parked_model_go(tmp_path, folder, fake_loads, monkeypatch):
    """The weights' load itself runs out of memory (from_pretrained raising torch's OutOfMemoryError
    while two models are parked): DoesNotFit, so a parked model goes, not a float retry."""
    pytest.importorskip("bitsandbytes")
    import torch
    import transformers

    from llmweb.engine import models

    def from_pretrained(source, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: SimpleNamespace())

    def gpu_full(rt) -> bool:
        if rt.model_id == "c" and len(rt.residents.parked()) > 1:
            models.load_transformers(rt.settings.replace(model=str(tmp_path), quant="4bit"), "cpu")
        return False

    rt = runtime(tmp_path, folder, max_loaded=3)
    fake_loads.fail.append(gpu_full)
    try:
        switch(rt, "b")
        switch(rt, "c")
        assert rt.loaded_ids() == ["c", "b"] and fake_loads.loads == ["a", "b", "c"], rt.status
        assert "Unloaded a to make room for c." in rt.status, rt.status
    finally:
        rt.close()


def test_the_keep_alive_closes_a_parked_model_on_its_own_clock(tmp_path, folder, fake_loads):
    rt = runtime(tmp_path, folder, max_loaded=2, model_keep_alive_s=0.6)
    try:
        a_engine = rt.engine
        switch(rt, "b")
        with rt.hold("b"):  # b busy: served and used, it stays
            deadline = time.monotonic() + 10
            while rt.loaded_ids() != ["b"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert rt.loaded_ids() == ["b"] and closed(a_engine) and not rt.unloaded
        deadline = time.monotonic() + 10
        while not rt.unloaded and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.unloaded and rt.loaded_ids() == [], "then b, idle, as before"
    finally:
        rt.close()
