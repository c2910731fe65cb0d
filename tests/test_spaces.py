"""Hugging Face Spaces readiness: binding, a writable data dir, and the ZeroGPU entry point."""

from __future__ import annotations

import argparse
import sys
import types

from llmweb.cli.main import serve_settings
from llmweb.runtime import gpu_entry


def args(**kw):
    return argparse.Namespace(host=kw.get("host"), port=kw.get("port"))


def test_local_default_binds_loopback():
    s = serve_settings(args(), env={})
    assert s.host == "127.0.0.1" and s.port == 7860


def test_on_spaces_binds_all_interfaces_and_writes_to_a_writable_dir(tmp_path):
    s = serve_settings(args(), env={"SYSTEM": "spaces"})
    assert s.host == "0.0.0.0" and s.port == 7860
    assert str(s.data_dir) in ("/data/llmweb", "/tmp/llmweb")
    # an explicit data dir still wins
    s = serve_settings(args(), env={"SYSTEM": "spaces", "LLMWEB_DATA_DIR": str(tmp_path)})
    assert s.data_dir == tmp_path


def test_on_spaces_the_client_address_comes_from_the_ingress_unless_proxies_are_configured(tmp_path):
    """A Space's ingress reaches the app from a private address and appends the visitor's address to
    X-Forwarded-For: that address is the one counted (web/trust.py), never one the client sent itself."""
    from types import SimpleNamespace

    from llmweb.web.trust import SPACES_INGRESS, origin_of

    space = serve_settings(args(), env={"SYSTEM": "spaces", "LLMWEB_DATA_DIR": str(tmp_path)})
    assert space.trusted_proxies == SPACES_INGRESS
    assert serve_settings(args(), env={}).trusted_proxies == "", "elsewhere: only what the operator trusts"
    mine = serve_settings(args(), env={"SYSTEM": "spaces", "LLMWEB_TRUSTED_PROXIES": "192.0.2.1"})
    assert mine.trusted_proxies == "192.0.2.1"

    def via_ingress(xff: str) -> SimpleNamespace:
        return SimpleNamespace(client=SimpleNamespace(host="10.16.3.80"), headers={"x-forwarded-for": xff})

    assert origin_of(space, via_ingress("203.0.113.7")).address == "203.0.113.7"
    assert origin_of(space, via_ingress("6.6.6.6, 10.0.0.9, 203.0.113.7")).address == "203.0.113.7", "forged hops"
    direct = SimpleNamespace(client=SimpleNamespace(host="198.51.100.4"), headers={"x-forwarded-for": "1.2.3.4"})
    assert origin_of(space, direct).address == "198.51.100.4", "a public peer is not the ingress"


def test_gpu_entry_is_a_no_op_without_spaces(monkeypatch):
    monkeypatch.setitem(sys.modules, "spaces", None)  # import fails

    def f(x):
        return x + 1

    assert gpu_entry(f) is f


def test_gpu_entry_uses_spaces_gpu_when_present(monkeypatch):
    calls = []
    fake = types.ModuleType("spaces")

    def GPU(fn):
        def wrapped(*a, **kw):
            calls.append(fn.__name__)
            return fn(*a, **kw)

        return wrapped

    fake.GPU = GPU
    monkeypatch.setitem(sys.modules, "spaces", fake)

    def generate(x):
        return x * 2

    assert gpu_entry(generate)(21) == 42 and calls == ["generate"]


def test_the_engine_runs_generations_through_the_gpu_entry(fp32_model, fmt):
    from llmweb.chat.tokens import render_prompt
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits, GenerationRequest
    from llmweb.engine.runners.transformers import local_engine

    calls = []

    def gpu(fn):
        def wrapped(*a, **kw):
            calls.append(1)
            return fn(*a, **kw)

        return wrapped

    e = local_engine(
        fp32_model.model, "cpu", KVStore(2**20, 60), EngineLimits(), fp32_model.kv_bytes_per_token, gpu=gpu
    )
    try:
        ids = render_prompt(fmt, "Be brief.", [("user", "Hi")])
        e.submit(GenerationRequest(ids, 4, stop_ids=fmt.stop_ids)).result()
        assert calls == [1]
    finally:
        e.close()
