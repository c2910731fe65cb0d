"""The parts of `bench gpu` (bench/gpu.py runs each in a subprocess of its own).

Each part appends (figure, value, note) rows and may raise; the caller turns an exception into an
error row. Must not: download (only the embedded model and shapes built in memory), or reach into
a running engine's settings (each part builds its Engine from `EngineLimits`).
"""

from __future__ import annotations

import os
import resource
import time

MiB = 2**20


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / MiB:,.1f} MiB"


def _settings(p: dict):
    from llmweb.config import Settings

    return Settings.from_env().replace(device=p["device"], quant="4bit")


def _engine(loaded, max_batch: int, new_tokens: int, budget: int = 2**30):
    """An Engine over `loaded`; on the CPU with the app's memory limit (LLMWEB_MEM_LIMIT_MB, else 80%
    of RAM), so what admission lets in is what the app would let in."""
    from llmweb.config import Settings
    from llmweb.engine.backends import make_engine
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits
    from llmweb.runtime.engines import cpu_mem_limit_bytes

    limits = EngineLimits(
        mem_limit_bytes=cpu_mem_limit_bytes(Settings.from_env()) if loaded.on_cpu else 0,
        queue_size=256,
        queue_per_user=256,
        max_wait_s=3600.0,
        max_new_tokens=new_tokens,
        max_batch=max_batch,
        admission_wait_s=2.0,
        mem_margin_bytes=0,
    )
    return make_engine(loaded, KVStore(budget, 600), limits)


def _stats(device: str) -> dict:
    import torch

    if not device.startswith("cuda"):
        from llmweb.engine.telemetry import rss_bytes

        return {"rss": rss_bytes()}
    s = torch.cuda.memory_stats()
    return {
        "allocated": s.get("allocated_bytes.all.current", 0),
        "reserved": s.get("reserved_bytes.all.current", 0),
        "inactive_split": s.get("inactive_split_bytes.all.current", 0),
        "num_ooms": s.get("num_ooms", 0),
    }


def header(p: dict, rows: list) -> None:
    import torch

    from llmweb.bench.common import _version

    if p["device"].startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        rows.append(("device", props.name, f"{props.multi_processor_count} SMs"))
        rows.append(("memory", _mib(props.total_memory), ""))
    else:
        rows.append(("device", "CPU (rehearsal)", "no GPU figure"))
    rows.append(("torch", torch.__version__, f"CUDA {torch.version.cuda}"))
    rows.append(("bitsandbytes", _version("bitsandbytes"), ""))
    rows.append(("transformers", _version("transformers"), ""))
    rows.append(("allocator", os.environ.get("PYTORCH_ALLOC_CONF", ""), "PYTORCH_ALLOC_CONF, per part"))


def _greedy(loaded, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = _engine(loaded, 1, n)
    from llmweb.engine.request import GenerationRequest

    try:
        return [engine.submit(GenerationRequest(ids, n)).result() for ids in prompts]
    finally:
        engine.close()


def _prompts(loaded, k: int) -> list[list[int]]:
    from llmweb.bench.common import prompt_ids, scripted_turns

    return [prompt_ids(loaded, t) for t in scripted_turns(k)]


def model(p: dict, rows: list) -> None:
    from llmweb.engine import models

    settings = _settings(p)
    loaded = models.load_transformers(settings, p["device"], progress=lambda _m: None)
    rows.append(("4-bit load", loaded.quant, f"{loaded.load_s:.1f} s on {loaded.device}; {'; '.join(loaded.notes)}"))
    rows.append(("weights", _mib(loaded.weights_bytes), "get_memory_footprint"))
    if p["device"].startswith("cuda"):
        import torch

        rows.append(("weights VRAM", _mib(torch.cuda.memory_allocated()), "allocated after load"))
    n, prompts = p["new_tokens"], _prompts(loaded, p["prompts"])
    got = _greedy(loaded, prompts, n)
    ref_loaded = models.load_transformers(settings.replace(quant="fp32", device="cpu"), "cpu", progress=lambda _m: None)
    ref = _greedy(ref_loaded, prompts, n)
    same = sum(a == b for g, r in zip(got, ref, strict=True) for a, b in zip(g, r, strict=False))
    total = sum(len(r) for r in ref)
    first = sum(g[:1] == r[:1] for g, r in zip(got, ref, strict=True))
    forced = sum(_forced(loaded, ids, r) for ids, r in zip(prompts, ref, strict=True))
    rows.append(
        (
            "top-1 agreement vs CPU fp32",
            f"{forced / max(total, 1):.0%}",
            f"{forced}/{total} next tokens on fp32's own greedy reply (teacher-forced), {len(ref)} prompts; "
            f"free-running, {same}/{total} position by position (first token {first}/{len(ref)}): "
            "a reply diverges for good at its first different token",
        )
    )
    _engine_rows(loaded, prompts, n, rows)


def _forced(loaded, prompt: list[int], reply: list[int]) -> int:
    """How many of `reply`'s tokens the model predicts as its top-1, each after the prompt and
    the reply's tokens before it: agreement that one early difference does not end."""
    import torch

    ids = torch.tensor([prompt + reply[:-1]], device=loaded.device)
    with torch.inference_mode():
        logits = loaded.model(ids).logits[0, len(prompt) - 1 :]
    return int((logits.argmax(-1).cpu() == torch.tensor(reply)).sum())


def _engine_rows(loaded, prompts: list[list[int]], n: int, rows: list) -> None:
    from llmweb.bench.common import prompt_ids
    from llmweb.engine.request import GenerationRequest, Tokens

    engine = _engine(loaded, 8, 4 * n)
    try:
        first = engine.submit(GenerationRequest(prompts[0], n, session_id="s"))
        reply = first.result()
        second = prompts[0] + reply + prompt_ids(loaded, "And then?")[1:]
        h = engine.submit(GenerationRequest(second, n, session_id="s"))
        h.result()
        rows.append(("KV reuse, 2nd turn", f"{h.stats.reused_tokens} tokens", f"of a {len(second)}-token prompt"))
        t0 = time.perf_counter()
        handles = [engine.submit(GenerationRequest(prompts[i % len(prompts)], n)) for i in range(8)]
        done = sum(len(x.result()) for x in handles)
        wall = time.perf_counter() - t0
        rows.append(("batch of 8", f"{done / wall:.1f} tok/s", f"max active {engine.counters.max_active}"))
        h = engine.submit(GenerationRequest(prompts[0], 4 * n))
        seen = 0
        for ev in h.events(poll_s=0.05):
            if isinstance(ev, Tokens):
                seen += len(ev.ids)
                if seen == 1:
                    h.cancel()
        after = h.stats.generated_tokens - 1 if h.stats else -1
        rows.append(("cancel", f"{after} tokens after cancel", f"finish {h.stats.finish_reason if h.stats else '?'}"))
    finally:
        engine.close()


# ---- 2. a real out-of-memory


def _cpu_oom_class(model) -> None:
    """The rehearsal: torch's CPU allocator raises RuntimeError where CUDA's raises OutOfMemoryError;
    turn that one error into the CUDA class, so the runner's OOM path (it catches only that) runs."""
    import torch

    forward = model.forward

    def wrapped(*a, **kw):
        try:
            return forward(*a, **kw)
        except RuntimeError as e:
            if "can't allocate memory" not in str(e) and "not enough memory" not in str(e):
                raise
            message = str(e).splitlines()[0]
        raise torch.OutOfMemoryError(message)  # outside the handler: the failed pass's frames are gone

    model.forward = wrapped


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize"))


def oom(p: dict, rows: list) -> None:
    import torch

    from llmweb.engine import models
    from llmweb.engine.request import GenerationRequest, Restarted

    cuda = p["device"].startswith("cuda")
    loaded = models.load_transformers(_settings(p), p["device"], progress=lambda _m: None)
    short = _prompts(loaded, 1)[0]
    # the longest prompt the model takes (at most 8k): on the CPU its KV (~90 MiB at 4k tokens) is
    # more than the heap's free room under the cap, so an allocation truly fails part way through
    long = (short * 400)[: min(loaded.max_context, 8192) - 64]
    engine = _engine(loaded, 8, 8)
    engine.submit(GenerationRequest(short, 4)).result()  # warm: the worker and its buffers exist
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = torch.cuda.memory_reserved() + 64 * MiB
        torch.cuda.set_per_process_memory_fraction(cap / total)
        rows.append(("cap", _mib(cap), "set_per_process_memory_fraction: reserved after warm-up + 64 MiB"))
    else:
        _cpu_oom_class(loaded.model)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = _vm_bytes() + 2 * MiB
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        rows.append(("cap", _mib(cap), "RLIMIT_AS: address space after warm-up + 2 MiB (CPU stand-in)"))
    try:
        before = _stats(p["device"])
        h = engine.submit(GenerationRequest(long, 8, fallback=lambda: GenerationRequest(short, 8)))
        restarted = False
        for ev in h.events(poll_s=0.1):
            restarted = restarted or isinstance(ev, Restarted)
        after = _stats(p["device"])
        alive = len(engine.submit(GenerationRequest(short, 4)).result())
    finally:
        if not cuda:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        engine.close()
    rows.append(("long prompt", f"{len(long)} tokens", "with a fallback of the short prompt"))
    rows.append(("OOM", f"engine ooms {engine.counters.ooms}", f"num_ooms {after.get('num_ooms', 'n/a (CPU)')}"))
    rows.append(("recovery", "retried with the fallback" if restarted else "no retry", f"{len(h.generated)} tokens"))
    rows.append(("worker lives", f"{alive} tokens after", "a short request served after the OOM"))
    for key in after:
        rows.append(
            (
                f"{key} before/after",
                f"{_mib(before[key]) if key != 'num_ooms' else before[key]} / "
                f"{_mib(after[key]) if key != 'num_ooms' else after[key]}",
                "",
            )
        )


# ---- 3. fragmentation over time


def fragmentation(p: dict, rows: list) -> None:
    from llmweb.engine import models
    from llmweb.engine.request import GenerationRequest

    loaded = models.load_transformers(_settings(p), p["device"], progress=lambda _m: None)
    base = _prompts(loaded, 8)
    engine = _engine(loaded, 8, 16, budget=64 * MiB)
    samples = []
    try:
        for wave in range(0, p["frag_requests"], 8):
            handles = []
            for i in range(wave, min(wave + 8, p["frag_requests"])):
                ids = base[i % 8] * (1 + (i * 7) % 6)  # mixed lengths, 1x to 6x a message
                handles.append(engine.submit(GenerationRequest(ids, 4 + i % 13, session_id=f"s{i % 24}")))
            for h in handles:
                h.result()
            samples.append(_stats(p["device"]))
        time.sleep(0.2)
        before = _stats(p["device"])
        released = engine.release_fragmentation()
        after = _stats(p["device"])
    finally:
        engine.close()
    rows.append(("requests", p["frag_requests"], f"{len(samples)} samples, one per wave of 8"))
    if "reserved" in before:
        frag = [s["reserved"] - s["allocated"] for s in samples]
        rows.append(("reserved − allocated", f"max {_mib(max(frag))}, last {_mib(frag[-1])}", ""))
        rows.append(("inactive split", f"max {_mib(max(s['inactive_split'] for s in samples))}", ""))
        rows.append(
            ("idle release", _mib(released), f"reserved {_mib(before['reserved'])} -> {_mib(after['reserved'])}")
        )
    else:
        rss = [s["rss"] for s in samples]
        rows.append(
            (
                "RSS (CPU stand-in)",
                f"first {_mib(rss[0])}, max {_mib(max(rss))}, last {_mib(rss[-1])}",
                "no allocator segments on the CPU",
            )
        )
        rows.append(("idle release", _mib(released), "a no-op off CUDA"))


# ---- 4. capacity at a real size, random weights


def random_llama(shape: dict, device: str):
    """A Llama of `shape` with random weights, its decoder's linears NF4 (bitsandbytes), built on
    `device` one layer at a time, so neither the host nor the device holds the whole float model."""
    import bitsandbytes as bnb
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) or module is model.lm_head:
            torch.nn.init.normal_(module.weight, std=0.02)
            module.to(torch.bfloat16)
        elif hasattr(module, "variance_epsilon"):  # RMSNorm
            torch.nn.init.ones_(module.weight)
            module.to(torch.bfloat16)
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=False,
                    compute_dtype=torch.bfloat16,
                    quant_type="nf4",
                    device=device,
                )
                w = torch.randn(child.out_features, child.in_features, dtype=torch.bfloat16, device=device) * 0.02
                q.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4").to(device)
                setattr(parent, name, q)
                del w, child
    return model.eval()


def _loaded(shape: dict, device: str):
    import time as _t

    from llmweb.engine.kvcache import kv_bytes_per_token
    from llmweb.engine.models import LoadedModel, weights_nbytes

    t0 = _t.perf_counter()
    m = random_llama(shape, device)
    return LoadedModel(
        m,
        None,
        "random Llama",
        "4bit",
        device,
        weights_nbytes(m),
        shape["max_position_embeddings"],
        kv_bytes_per_token(m.config, 2),
        2,
        _t.perf_counter() - t0,
    )


def capacity(p: dict, rows: list) -> None:
    import torch

    from llmweb.bench import capacity as cap
    from llmweb.engine.admission import predict_bytes
    from llmweb.engine.request import GenerationRequest

    cuda = p["device"].startswith("cuda")
    loaded = _loaded(p["shape"], p["device"])
    rows.append(("model", p["shape_name"], "RANDOM weights, built from the config (no download), NF4"))
    rows.append(("weights", _mib(loaded.weights_bytes), f"built in {loaded.load_s:.1f} s"))
    rows.append(("KV bytes per token", f"{loaded.kv_bytes_per_token:,}", "bf16 keys and values"))
    new = p["cap_new_tokens"]
    gen = torch.Generator().manual_seed(0)
    for batch, ctx in p["grid"]:
        engine = _engine(loaded, batch, new, budget=0)
        try:
            prompts = [
                torch.randint(10, p["shape"]["vocab_size"], (ctx - new,), generator=gen).tolist() for _ in range(batch)
            ]
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            handles = [engine.submit(GenerationRequest(ids, new)) for ids in prompts]
            done = sum(len(h.result()) for h in handles)
            wall = time.perf_counter() - t0
            ttft = sum(h.stats.ttft_s for h in handles) / batch
            decode = sum(h.stats.decode_tok_s for h in handles) / batch
            heads = p["shape"]["num_attention_heads"]
            one = sum(predict_bytes(loaded.kv_bytes_per_token, heads, ctx - new, new))
            free = engine.runner.available()
            admits = max(free, 0) // max(one, 1)
        finally:
            engine.close()
        peak = torch.cuda.max_memory_allocated() if cuda else None
        predicted = cap.predict(loaded, ctx - new, new, batch, batch)["predicted_bytes"]
        rows.append(
            (
                f"batch {batch} x {ctx} tokens",
                f"{batch * decode:.1f} tok/s decode, TTFT {ttft:.2f} s",
                f"{done} tokens in {wall:.1f} s; max active {engine.counters.max_active}; "
                f"peak {_mib(peak)} vs capacity's {_mib(predicted)}; admission lets in {admits:,} such chats",
            )
        )
