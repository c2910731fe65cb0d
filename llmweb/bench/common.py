"""What the benchmarks share: scripted turns, scratch settings, single-request timing, the setup, reports.

Nothing here changes a running engine: timing runs on an `Engine` built for the purpose
(`timing_engine`), and chats run on a Runtime built from Settings. Nothing heavy at import.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

SYSTEM = "You are a helpful assistant."

TOPICS = [
    "the history of tea",
    "how bridges carry load",
    "why the sky is blue",
    "what a compiler does",
    "how bees find flowers",
    "the rules of chess",
    "how vaccines work",
    "what makes bread rise",
    "how tides happen",
    "what a database index is",
    "how a bicycle stays up",
    "why leaves change colour",
    "how rainbows form",
    "what an operating system does",
    "how glaciers move",
    "why we sleep",
    "how batteries store energy",
    "what a black hole is",
    "how coffee is roasted",
    "why cats purr",
]


def scripted_turns(n: int) -> list[str]:
    """A deterministic conversation of n user messages of similar length."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        out.append(
            f"Question {i + 1}: in two or three sentences, explain {topic}. "
            f"Keep it simple, and mention one surprising fact about {topic.split()[-1]}."
        )
    return out


def scratch_settings(settings, folder: str | Path):
    """The same settings with their data in `folder` (never the user's database) and the model cache kept."""
    return settings.replace(data_dir=Path(folder), cache_dir=settings.copies_dir, sample_docs=False)


# ---- timing single requests


def prompt_ids(loaded, text: str) -> list[int]:
    """The chat template around one user message, after the short system prompt."""
    from llmweb.chat.tokens import TemplateFormat, render_prompt

    return render_prompt(TemplateFormat(loaded.tokenizer), SYSTEM, [("user", text)])


def timing_engine(loaded, new_tokens: int):
    """An Engine of its own (public constructor) for timing one request at a time: no KV reuse."""
    from llmweb.engine.backends import make_engine
    from llmweb.engine.kvcache import KVStore
    from llmweb.engine.request import EngineLimits

    return make_engine(loaded, KVStore(0, 1), EngineLimits(max_new_tokens=new_tokens, kv_reuse=False))


def engine_decode(engine, ids: list[int], new_tokens: int) -> tuple[float, float, int]:
    """(decode tokens/s, TTFT s, generated tokens) of one request; no stop ids, so always new_tokens."""
    from llmweb.engine.request import GenerationRequest

    h = engine.submit(GenerationRequest(ids, new_tokens))
    h.result()
    return h.stats.decode_tok_s, h.stats.ttft_s, h.stats.generated_tokens


# ---- the setup


def llama_tool(name: str) -> str | None:
    """A llama.cpp program built beside ours for a side-by-side reference (`llama-bench`,
    `llama-batched-bench`): LLMWEB_<NAME> names it, else the PATH has it; None when neither."""
    import shutil

    return os.environ.get("LLMWEB_" + name.upper().replace("-", "_")) or shutil.which(name)


def llama_bench_tests(gguf, args: list[str], progress, bench: str) -> list[dict] | None:
    """`llama-bench -m gguf ARGS -o json`: its tests (each with n_prompt, n_depth, n_threads and
    avg_ts); None when it is not installed or fails (said through `progress`)."""
    import subprocess

    exe = llama_tool("llama-bench")
    if not exe:
        return None
    done = subprocess.run([exe, "-m", str(gguf), *args, "-o", "json"], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        progress(f"bench {bench}: llama-bench failed ({done.returncode}): {done.stderr[-300:]}")
        return None
    return json.loads(done.stdout)


def describe_setup(settings, loaded, budget=None) -> dict:
    """The hardware, model, quantisation and the settings that shape the figures."""
    import torch

    from llmweb.runtime import cpu_mem_limit_bytes, kv_budget_bytes

    env = {
        "model": loaded.name,
        "quant": loaded.quant,
        "device": loaded.device,
        "weights_mib": round(loaded.weights_bytes / 2**20, 1),
        "context_limit": budget.context_limit if budget else None,
        "max_new_tokens": budget.max_new_tokens if budget else None,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(_ram_bytes() / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "bitsandbytes": _version("bitsandbytes"),
        "kv_bytes_per_token": loaded.kv_bytes_per_token,
        "kv_budget_mib": round(kv_budget_bytes(settings, loaded) / 2**20, 1),
        "kv_reuse": settings.kv_reuse,
        "notes": list(loaded.notes),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if loaded.on_cpu:
        env["mem_limit_mib"] = round(cpu_mem_limit_bytes(settings) / 2**20, 1)
    else:
        props = torch.cuda.get_device_properties(loaded.device)
        env.update(
            gpu=props.name, gpu_mem_gib=round(props.total_memory / 2**30, 1), mem_margin_mib=settings.mem_margin_mb
        )
    return env


def environment_markdown(env: dict) -> str:
    rows = [
        ("model", f"{env['model']} ({env['quant']}, {env['weights_mib']:.0f} MiB weights)"),
        ("device", env["device"] + (f" ({env['gpu']}, {env['gpu_mem_gib']} GiB)" if "gpu" in env else "")),
        (
            "CPU",
            f"{env['cpu']} · {env['cpus']} cores · torch threads {env['torch_threads']} · {env['ram_gib']} GiB RAM",
        ),
        (
            "software",
            f"Python {env['python']} · torch {env['torch']} · transformers {env['transformers']} · "
            f"bitsandbytes {env['bitsandbytes']}",
        ),
        (
            "settings (TTFT runs)",
            f"context {env['context_limit']} · max new tokens {env['max_new_tokens']} · "
            f"KV reuse {'on' if env['kv_reuse'] else 'off'} · KV budget {env['kv_budget_mib']:,.0f} MiB · "
            + (
                f"memory limit {env['mem_limit_mib']:,.0f} MiB"
                if "mem_limit_mib" in env
                else f"memory margin {env['mem_margin_mib']} MiB"
            ),
        ),
        ("KV bytes per token", f"{env['kv_bytes_per_token']:,}"),
        ("run at", env["time"]),
    ]
    rows += [("note", n) for n in env.get("notes", [])]
    return "\n".join(["## Environment", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], ""])


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def _ram_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


# ---- reports


def report_stem(data_dir: Path, name: str) -> Path:
    """`data_dir/reports/<name>-<timestamp>` (the folder is created); add a suffix per file."""
    folder = Path(data_dir) / "reports"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_reports(result: dict, markdown: str, data_dir: Path, stem: str = "bench") -> dict[str, Path]:
    """The Markdown and the JSON of one run under `data_dir/reports`."""
    base = report_stem(data_dir, stem)
    md, js = base.with_suffix(".md"), base.with_suffix(".json")
    md.write_text(markdown, encoding="utf-8")
    js.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return {"md": md, "json": js}
