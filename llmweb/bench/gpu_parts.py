"""The parts of `bench gpu` (bench/gpu.py runs each in a subprocess of its own).

Each part appends (figure, value, note) rows and may raise; the caller turns an exception into an
error row. Must not: download (only the embedded model and shapes built in memory), or reach into
a running engine's settings (each part builds its Engine from `EngineLimits`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20
GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / MiB:,.1f} MiB"


def _settings(p: dict):
    from llmweb.config import Settings

    return Settings.from_env().replace(device=p["device"], quant="4bit", model=_source(p))


def _kit_gguf(p: dict) -> Path | None:
    kit = p.get("kit")
    found = sorted((Path(kit) / "model").glob("*.gguf")) if kit else []
    return found[0] if found else None


def _source(p: dict) -> str:
    """The model the parts load: the kit's cut GGUF, converted to a safetensors folder in the temp
    directory (seconds; once per machine), or "" for the embedded model."""
    gguf = _kit_gguf(p)
    if gguf is None:
        return ""
    from llmweb.engine import models

    with open(gguf, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    target = Path(tempfile.gettempdir()) / f"llmweb-gpu-{digest[:12]}"
    if not (target / "model.safetensors").is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # save_pretrained refuses a GGUF-loaded model until it is detached
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config

        def save(folder: Path) -> bool:
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            return True

        models.write_folder(target, save)
    return str(target)


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
        cap = torch.cuda.get_device_capability(0)
        rows.append(("device", props.name, f"{props.multi_processor_count} SMs, capability {cap[0]}.{cap[1]}"))
        rows.append(("bf16 native", "yes" if cap >= (8, 0) else "no", "capability 8.0 or later"))
        rows.append(("memory", _mib(props.total_memory), ""))
    else:
        rows.append(("device", "CPU (rehearsal)", "no GPU figure"))
    rows.append(("torch", torch.__version__, f"CUDA {torch.version.cuda}"))
    rows.append(("bitsandbytes", _version("bitsandbytes"), ""))
    rows.append(("transformers", _version("transformers"), ""))
    rows.append(("allocator", os.environ.get("PYTORCH_ALLOC_CONF", ""), "PYTORCH_ALLOC_CONF, per part"))
    rows.append(("allocator in effect", *allocator_in_effect(p["device"])))


def allocator_in_effect(device: str) -> tuple[str, str]:
    """(what the allocator does, how that was read): the settings torch reports where it can,
    else whether a fresh segment is expandable; not the variable, which an older torch ignores."""
    import torch

    if not device.startswith("cuda"):
        return "n/a", "no CUDA allocator on the CPU"
    x = torch.empty(2 * MiB, dtype=torch.uint8, device=device)
    try:
        read = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        if read is not None:
            return str(read()), "torch._C._accelerator_getAllocatorSettings()"
        segments = torch.cuda.memory._snapshot().get("segments", [])
        expandable = sorted({bool(seg.get("is_expandable")) for seg in segments})
        return f"expandable segments: {expandable}", "is_expandable of the snapshot's segments"
    finally:
        del x


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


def reference(p: dict) -> dict:
    """The CPU's fp32 greedy replies to the scripted prompts (a process of its own: loading on the
    CPU sets the CPU's attention switch for the whole process)."""
    from llmweb.engine import models

    settings = _settings({**p, "device": "cpu"}).replace(quant="fp32")
    loaded = models.load_transformers(settings, "cpu", progress=lambda _m: None)
    prompts = _prompts(loaded, p["prompts"])
    gguf = _kit_gguf(p)
    return {
        "model": gguf.name if gguf else models.EMBEDDED_NAME,
        "new_tokens": p["new_tokens"],
        "prompts": prompts,
        "replies": _greedy(loaded, prompts, p["new_tokens"]),
    }


def _reference(p: dict) -> tuple[dict, str]:
    """(the reference, where it came from): the kit's reference.json for the kit's model, else one
    computed now in a subprocess on the CPU."""
    gguf = _kit_gguf(p)
    stored = Path(p["kit"]) / "reference.json" if p.get("kit") else None
    if gguf is not None and stored is not None and stored.is_file():
        ref = json.loads(stored.read_text())
        if ref.get("model") == gguf.name:
            return ref, "the kit's reference.json, computed before the loan"
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "reference.json"
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        subprocess.run(
            [sys.executable, "-m", "llmweb.bench.gpu", "reference", json.dumps(p), str(target)],
            env=env,
            check=True,
            capture_output=True,
            timeout=600,
        )
        return json.loads(target.read_text()), "computed just now in a CPU subprocess"


def model(p: dict, rows: list) -> None:
    from llmweb.engine import models

    cuda = p["device"].startswith("cuda")
    ref, origin = _reference(p)  # before anything touches the device
    rows.append(("reference", f"{len(ref['replies'])} fp32 replies", origin))
    settings = _settings(p)
    loaded = models.load_transformers(settings, p["device"], progress=lambda _m: None)
    rows.append(("4-bit load", loaded.quant, f"{loaded.load_s:.1f} s on {loaded.device}; {'; '.join(loaded.notes)}"))
    rows.append(("weights", _mib(loaded.weights_bytes), f"get_memory_footprint; {Path(loaded.name).name}"))
    if cuda:
        import torch

        rows.append(("weights VRAM", _mib(torch.cuda.memory_allocated()), "allocated after load"))
        free0, _ = torch.cuda.mem_get_info()
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        free1, _ = torch.cuda.mem_get_info()
        rows.append(
            (
                "free after load",
                f"{_mib(free0)} -> {_mib(free1)} after empty_cache",
                f"reserved − allocated was {_mib(cached)}: what sizing straight after load counts as used",
            )
        )
    gqa = os.environ.get(GQA_SWITCH)
    rows.append(
        (
            f"{GQA_SWITCH} in the rows",
            gqa or "unset",
            "production's CUDA setting (unset)" if cuda else "the CPU's production setting",
        )
    )
    if cuda and gqa is not None:
        raise AssertionError(f"{GQA_SWITCH}={gqa} while the CUDA rows run: not what production runs")
    n, prompts = ref["new_tokens"], ref["prompts"]
    got = _greedy(loaded, prompts, n)
    refs = ref["replies"]
    same = sum(a == b for g, r in zip(got, refs, strict=True) for a, b in zip(g, r, strict=False))
    total = sum(len(r) for r in refs)
    first = sum(g[:1] == r[:1] for g, r in zip(got, refs, strict=True))
    forced = sum(_forced(loaded, ids, r) for ids, r in zip(prompts, refs, strict=True))
    rows.append(
        (
            "top-1 agreement vs CPU fp32",
            f"{forced / max(total, 1):.0%}",
            f"{forced}/{total} next tokens on fp32's own greedy reply (teacher-forced), {len(refs)} prompts; "
            f"free-running, {same}/{total} position by position (first token {first}/{len(refs)}): "
            "a reply diverges for good at its first different token",
        )
    )
    _engine_rows(loaded, prompts, n, rows)
    del loaded
    gc.collect()
    _gguf_row(p, rows)


def _gguf_row(p: dict, rows: list) -> None:
    """The same checkpoint's .gguf file named as LLMWEB_MODEL, loaded on this device through the
    transformers path: a clean load, or a ConfigError that says why; anything else is a fault."""
    from llmweb.engine import models
    from llmweb.errors import ConfigError

    gguf = _kit_gguf(p)
    path = gguf if gguf is not None else Path.joinpath(*models.embedded_gguf())
    settings = _settings(p).replace(model=str(path), backend="transformers")
    try:
        loaded = models.load_transformers(settings, p["device"], progress=lambda _m: None)
        rows.append(("a .gguf on the device", f"loaded ({loaded.quant})", f"{path.name}: a clean load"))
    except ConfigError as e:
        rows.append(("a .gguf on the device", "ConfigError", f"{path.name}: {str(e)[:200]}"))
    except Exception as e:  # noqa: BLE001  (the row is the finding)
        rows.append(
            ("a .gguf on the device", f"FAILED: {type(e).__name__}", f"{path.name}: {str(e).splitlines()[0][:200]}")
        )


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
    weights = loaded.weights_bytes
    del engine, loaded, h
    _four_bit_under_cap(p, rows, weights)


def _four_bit_under_cap(p: dict, rows: list, weights_bytes: int) -> None:
    """A 4-bit load under a memory fraction below its weights: a clear 4-bit error, never an fp16
    retry, and the memory allocated back to its baseline afterwards (CUDA only)."""
    import torch

    from llmweb.engine import models

    if not p["device"].startswith("cuda"):
        rows.append(("4-bit load under a cap", "skipped", "needs set_per_process_memory_fraction: CUDA only"))
        return
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + weights_bytes // 2) / total))
    outcome, note = "", ""
    try:
        loaded = models.load_transformers(_settings(p), p["device"], progress=lambda _m: None)
        outcome = f"FAILED: loaded {loaded.quant}"
        note = "; ".join(loaded.notes)[:200] or "it fit after all"
        del loaded
    except Exception as e:  # noqa: BLE001  (the row is the finding)
        text = str(e).splitlines()[0][:200] if str(e) else ""
        clear = ("4-bit" in text or "4bit" in text) and "fp16" not in text
        outcome = f"{'a clear 4-bit error' if clear else 'FAILED: unclear'}: {type(e).__name__}"
        note = text
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    torch.cuda.empty_cache()
    rows.append(("4-bit load under a cap", outcome, f"cap: reserved + half the weights; {note}"))
    after = torch.cuda.memory_allocated()
    rows.append(
        ("allocated after it", f"{_mib(after)} vs {_mib(base)} before", "back to baseline" if after <= base else "HELD")
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
    """A Llama of `shape` with random weights, its decoder's linears NF4 (bitsandbytes). The model
    is made on the meta device; each decoder linear is replaced by an NF4 one, quantised from one
    bf16 matrix at a time, before anything is materialised; then the rest (embeddings, norms, the
    head) is made in bf16 where it stands. Neither host nor device ever holds the float model."""
    import bitsandbytes as bnb
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, _nf4_linear(bnb, child.in_features, child.out_features, device))
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                fresh = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
                if isinstance(module, torch.nn.Embedding) or module is model.lm_head:
                    torch.nn.init.normal_(fresh, std=0.02)
                else:  # RMSNorm weights
                    torch.nn.init.ones_(fresh)
                module._parameters[name] = torch.nn.Parameter(fresh, requires_grad=False)
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"still on the meta device: {left[:3]}"
    return model.eval()


def _nf4_linear(bnb, n_in: int, n_out: int, device: str):
    """An NF4 Linear4bit of random bf16 weights, made without a float weight of its own."""
    import torch

    with torch.device("meta"):
        q = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    w = torch.randn(n_out, n_in, dtype=torch.bfloat16, device=device) * 0.02
    q.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4").to(device)
    del w
    return q


def _loaded(shape: dict, device: str):
    import time as _t

    from llmweb.engine.kvcache import kv_bytes_per_token
    from llmweb.engine.models import LoadedModel, weights_nbytes

    t0 = _t.perf_counter()
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()
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


def _guarded(rows: list, figure: str, step) -> None:
    """`step()`, or a row with its error: one failing step does not end the part."""
    try:
        step()
    except Exception as e:  # noqa: BLE001  (the row is the finding)
        rows.append((figure, f"FAILED: {type(e).__name__}", str(e).splitlines()[0][:200] if str(e) else ""))


def capacity(p: dict, rows: list) -> None:
    import torch

    cuda = p["device"].startswith("cuda")
    loaded = _loaded(p["shape"], p["device"])
    rows.append(("model", p["shape_name"], "RANDOM weights, built from the config (no download), NF4"))
    rows.append(("weights", _mib(loaded.weights_bytes), f"built in {loaded.load_s:.1f} s"))
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        ratio = peak / max(loaded.weights_bytes, 1)
        verdict = "below 1.5x the weights" if ratio < 1.5 else "OVER 1.5x the weights"
        rows.append(("build peak", _mib(peak), f"max_memory_allocated while it was built: {ratio:.2f}x, {verdict}"))
    else:
        rows.append(("build peak", "n/a", "max_memory_allocated: CUDA only"))
    rows.append(("KV bytes per token", f"{loaded.kv_bytes_per_token:,}", "bf16 keys and values"))
    gen = torch.Generator().manual_seed(0)
    for batch, ctx in p["grid"]:
        _guarded(rows, f"batch {batch} x {ctx} tokens", lambda b=batch, c=ctx: _grid_row(loaded, p, b, c, gen, rows))
    _guarded(rows, "mixed batch", lambda: _mixed(loaded, p, gen, rows))
    for batch in p["split"]:
        _guarded(rows, f"decode split, batch {batch}", lambda b=batch: _split(loaded, p, b, gen, rows))


def _random_prompts(p: dict, gen, n: int, length: int) -> list[list[int]]:
    import torch

    return [torch.randint(10, p["shape"]["vocab_size"], (length,), generator=gen).tolist() for _ in range(n)]


def _peak_reset(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _grid_row(loaded, p: dict, batch: int, ctx: int, gen, rows: list) -> None:
    import torch

    from llmweb.bench import capacity as cap
    from llmweb.engine.admission import predict_bytes
    from llmweb.engine.request import GenerationRequest

    cuda = p["device"].startswith("cuda")
    new = p["cap_new_tokens"]
    engine = _engine(loaded, batch, new, budget=0)
    try:
        prompts = _random_prompts(p, gen, batch, ctx - new)
        _peak_reset(cuda)
        t0 = time.perf_counter()
        handles = [engine.submit(GenerationRequest(ids, new)) for ids in prompts]
        done = sum(len(h.result()) for h in handles)
        wall = time.perf_counter() - t0
        ttft = sum(h.stats.ttft_s for h in handles) / batch
        decode = sum(h.stats.decode_tok_s for h in handles) / batch
        one = sum(predict_bytes(loaded.kv_bytes_per_token, p["shape"]["num_attention_heads"], ctx - new, new))
        admits = max(engine.runner.available(), 0) // max(one, 1)
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


def _mixed(loaded, p: dict, gen, rows: list) -> None:
    """One long chat beside seven short ones, in one batch: the measured peak above the weights
    against the sum of admission's predictions for the eight (left padding holds 8 x the long one)."""
    import torch

    from llmweb.engine.admission import predict_bytes
    from llmweb.engine.request import GenerationRequest

    cuda = p["device"].startswith("cuda")
    long, short, count = p["mixed"]
    new = p["cap_new_tokens"]
    heads = p["shape"]["num_attention_heads"]
    lengths = [long - new] + [short - new] * count
    engine = _engine(loaded, 1 + count, new, budget=0)
    try:
        prompts = [_random_prompts(p, gen, 1, n)[0] for n in lengths]
        _peak_reset(cuda)
        base = torch.cuda.memory_allocated() if cuda else 0
        handles = [engine.submit(GenerationRequest(ids, new)) for ids in prompts]
        for h in handles:
            h.result()
    finally:
        engine.close()
    predicted = sum(sum(predict_bytes(loaded.kv_bytes_per_token, heads, n, new)) for n in lengths)
    padded = (1 + count) * long * loaded.kv_bytes_per_token
    measured = torch.cuda.max_memory_allocated() - base if cuda else None
    rows.append(
        (
            f"mixed batch 1 x {long} + {count} x {short}",
            f"peak above weights {_mib(measured)} vs admission's {_mib(predicted)}",
            f"max active {engine.counters.max_active}; the padded batch's KV alone is {_mib(padded)}",
        )
    )


def _split(loaded, p: dict, batch: int, gen, rows: list) -> None:
    """Decode steps at `batch` rows (after one untimed): the forward timed with the device
    synchronised on both sides, then the product's sampler on every row; syncs per step counted
    by torch's sync debug mode."""
    import warnings

    import torch

    from llmweb.engine.request import GenerationRequest
    from llmweb.engine.runners.sampling import TorchSampler

    cuda = p["device"].startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ctx, steps = p["split_context"], 8
    prompts = _random_prompts(p, gen, batch, ctx)
    model = loaded.model
    with torch.inference_mode():
        out = model(torch.tensor(prompts, device=loaded.device), use_cache=True, logits_to_keep=1)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)  # the cache it filled
        samplers = [TorchSampler(GenerationRequest(ids, steps), ids, loaded.device) for ids in prompts]
        forward = sample = 0.0
        syncs = 0
        for step in range(steps + 1):  # the first is a warm-up, not counted
            sync()
            t0 = time.perf_counter()
            out = model(nxt, cache=past, use_cache=True, logits_to_keep=1)
            sync()
            t1 = time.perf_counter()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                picks = [s(out.logits[i : i + 1, -1]) for i, s in enumerate(samplers)]
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
            sync()
            t2 = time.perf_counter()
            past, nxt = out.past_key_values, torch.tensor(picks, device=loaded.device).unsqueeze(1)
            if step:
                syncs += sum("synchroniz" in str(w.message) for w in seen)
                forward += t1 - t0
                sample += t2 - t1
    rows.append(
        (
            f"decode split, batch {batch}",
            f"forward {forward / steps * 1e3:.1f} ms, sampling {sample / steps * 1e3:.1f} ms per step",
            f"{ctx}-token context, {steps} steps, forward synchronised; "
            + (f"{syncs / steps:.0f} syncs per step in sampling" if cuda else "syncs: CUDA only"),
        )
    )
