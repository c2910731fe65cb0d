"""`bench gpu`: one command that proves or disproves the CUDA path in a lent device's few minutes.

`python -m llmweb bench gpu` (CUDA only) or `python -m llmweb bench gpu --rehearse` (the same steps on
the CPU, tiny shapes, a small address-space cap standing in for the device's memory). Five parts,
each in a subprocess of its own (an allocator setting must be set before CUDA initialises, an
out-of-memory must not take the others down), each guarded so a failing part prints its error
as its row and the rest still run:

  header         device, memory, torch / CUDA / bitsandbytes versions, the allocator settings
  model          the embedded model in NF4 through the transformers runner and the Engine: load
                 time, weights' bytes, agreement with the CPU's fp32 (top-1 on fp32's own reply,
                 and free-running), KV reuse on a second turn, a batch of 8, cancel within a token
  oom            a real out-of-memory (CUDA: set_per_process_memory_fraction; rehearsal:
                 RLIMIT_AS), the engine's give-way and retry, the worker alive after it
  fragmentation  mixed-length requests, reserved − allocated and inactive split sampled, with
                 and without expandable_segments, and the idle release
  capacity       an 8B-shaped Llama with RANDOM weights (config only, no download), NF4: decode
                 tok/s and TTFT per batch and context, KV bytes per token, how many chats
                 admission lets in, and bench/capacity.py's prediction beside the measured peak

Must not: download anything (the device machine has no network), or change a running engine's
settings (each part builds its own Engine from `EngineLimits`). On the CPU, torch's allocator
raises RuntimeError rather than torch.OutOfMemoryError; the rehearsal's model wrapper turns
that one error into OutOfMemoryError so the runner's OOM path sees the class CUDA raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

PARTS = ["header", "model", "oom", "fragmentation", "capacity"]
RANDOM_NOTE = "part 4 (capacity) uses RANDOM weights: an 8B-shaped Llama built from its config, no download"
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
)
LLAMA_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
)


def plan(rehearse: bool, quick: bool = False) -> dict:
    """The sizes of every part, and each part's time estimate in seconds (printed at the start)."""
    if not rehearse:
        return {
            "device": "cuda",
            "prompts": 4,
            "new_tokens": 24,
            "frag_requests": 300,
            "shape": LLAMA_8B,
            "shape_name": "Llama 8B shape",
            "grid": [[1, 1024], [8, 1024], [32, 1024], [64, 1024], [1, 4096], [8, 4096], [1, 8192], [8, 8192]],
            "cap_new_tokens": 16,
            "estimate_s": {"header": 10, "model": 60, "oom": 45, "fragmentation": 120, "capacity": 200},
        }
    return {
        "device": "cpu",
        "prompts": 2 if quick else 4,
        "new_tokens": 8 if quick else 16,
        "frag_requests": 24 if quick else 120,
        "shape": LLAMA_TINY,
        "shape_name": "tiny Llama shape (rehearsal)",
        "grid": [[1, 64], [8, 64], [32, 64], [64, 64], [1, 256]] + ([] if quick else [[8, 256], [1, 512]]),
        "cap_new_tokens": 4 if quick else 8,
        "estimate_s": {"header": 5, "model": 40, "oom": 25, "fragmentation": 30, "capacity": 20},
    }


# ---- the parent: one subprocess per part


def run(rehearse: bool, quick: bool = False, progress: Callable[[str], None] = print, timeout_s: float = 600) -> dict:
    p = plan(rehearse, quick)
    est = sum(p["estimate_s"].values())
    progress(f"bench gpu{' --rehearse' if rehearse else ''}: {len(PARTS)} parts, about {est / 60:.1f} min by estimate")
    parts = []
    for part in PARTS:
        if part == "fragmentation":
            for setting in ("expandable_segments:True", "expandable_segments:False"):
                progress(f"  {part} ({setting})…")
                parts.append(_subprocess(part, p, rehearse, timeout_s, alloc=setting))
        else:
            progress(f"  {part}…")
            parts.append(_subprocess(part, p, rehearse, timeout_s))
    return {"rehearse": rehearse, "plan": p, "note": RANDOM_NOTE, "estimate_s": est, "parts": parts}


def _subprocess(part: str, p: dict, rehearse: bool, timeout_s: float, alloc: str = "") -> dict:
    env = dict(os.environ)
    env["PYTORCH_ALLOC_CONF"] = alloc or env.get("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if rehearse:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # the address-space cap measures live memory: no per-thread arenas, and large blocks are
        # mapped and unmapped (freed ones leave the address space instead of waiting in the heap)
        env["MALLOC_ARENA_MAX"] = "2"
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    title = f"{part} ({alloc})" if alloc else part
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "llmweb.bench.gpu", part, json.dumps({**p, "rehearse": rehearse})],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"part": title, "rows": [], "error": f"timed out after {timeout_s:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"part": title, "rows": [], "error": tail[0][:300], "wall_s": round(wall, 1)}
    out = json.loads(lines[-1])
    return {"part": title, "rows": out.get("rows", []), "error": out.get("error"), "wall_s": round(wall, 1)}


def markdown(r: dict) -> str:
    lines = [
        f"## bench gpu{' --rehearse (CPU stand-in: no GPU figure)' if r['rehearse'] else ''}",
        "",
        f"Estimate {r['estimate_s'] / 60:.1f} min. {r['note']}.",
        "",
        "| part | figure | value | note |",
        "| --- | --- | --- | --- |",
    ]
    for part in r["parts"]:
        if part.get("error"):
            lines.append(f"| {part['part']} | ERROR | {part['error']} | |")
        for figure, value, note in part["rows"]:
            lines.append(f"| {part['part']} | {figure} | {value} | {note} |")
        if "wall_s" in part:
            lines.append(f"| {part['part']} | wall time | {part['wall_s']} s | |")
    return "\n".join(lines)


# ---- the child: one part, its rows as one JSON line on stdout


def _child(part: str, p: dict) -> int:
    from llmweb.bench import gpu_parts

    rows: list = []
    error = None
    try:
        getattr(gpu_parts, part)(p, rows)
    except Exception as e:  # noqa: BLE001  (the table shows it; the other parts still run)
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"
    print(json.dumps({"rows": rows, "error": error}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], json.loads(sys.argv[2])))
