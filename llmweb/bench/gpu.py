"""`bench gpu`: the CUDA path proved or disproved in a lent device's few minutes, part by part.

`python -m llmweb bench gpu [--parts a,b] [--kit .gpu] [--out DIR] [--budget-s S]` (CUDA only) or
with `--rehearse` (the same steps on the CPU, tiny shapes, a small address-space cap standing in for
the device's memory). Each part runs in a subprocess of its own (an allocator setting must be set
before CUDA initialises, an out-of-memory must not take the others down). A part writes its table,
DIR/gpu-<part>.json and .md, after every row, so a command stopped at its limit still leaves every
row it reached; a part that fails is a row with its error, and the next part runs. A part whose
estimate no longer fits the budget is a row saying so.

  header         device, capability and "bf16 native", memory, versions, the allocator settings
                 in effect (not only the variable)
  model          a real checkpoint in NF4 through the transformers runner and the Engine: load,
                 mem_get_info before/after empty_cache, weights, top-1 agreement with the CPU's
                 fp32 replies (computed beforehand, in another process), KV reuse, a batch of 8,
                 cancel; then the same checkpoint's .gguf file loaded on the device (a clean load or
                 a ConfigError, never an OSError)
  oom            a real out-of-memory and the engine's give-way and retry; then a 4-bit load under
                 a memory fraction below its weights (a clear 4-bit error, memory back to baseline)
  fragmentation  mixed-length requests, reserved − allocated and inactive split, with and without
                 expandable_segments (two subprocesses), and the idle release
  capacity       an 8B-shaped Llama with RANDOM weights built straight into NF4 (its build's peak
                 recorded), decode and TTFT per batch and context, prediction beside the measured
                 peak; a mixed batch (1 long + 7 short); the decode-step split with the forward
                 synchronised, and the runner's own split beside it

With a kit (bench/gpu_kit.py) the model is the kit's cut GGUF and the reference its reference.json;
without one, the embedded model, its reference computed first in a subprocess of its own.

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
from pathlib import Path

PARTS = ["header", "model", "oom", "fragmentation", "capacity"]
ALLOC = {"expandable": "expandable_segments:True", "default": "expandable_segments:False"}
RANDOM_NOTE = "part capacity uses RANDOM weights: an 8B-shaped Llama built from its config, no download"
GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"
# The loan: each command starts from a fresh copy of the tree and the kit (.gpu), and stays under
# 8 minutes on the device. (name, what tools/gpu_device.sh runs: the parts and their budget in
# seconds, timeout_s of the run call). Capacity comes first in its command: a budget that runs
# short skips what follows, and capacity's rows matter most.
LOAN_PLAN = [
    ("preflight", "preflight", 90),
    ("a", "parts header,model,oom 240", 300),
    ("b", "parts capacity,fragmentation 360", 420),
]
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
            "mixed": [8192, 256, 7],  # one long chat beside seven short ones, in one batch
            "split": [1, 8, 64],  # batch sizes of the decode-step split, at 1k context
            "split_context": 1024,
            "cap_new_tokens": 16,
            "estimate_s": {"header": 15, "model": 90, "oom": 90, "fragmentation": 60, "capacity": 240},
        }
    return {
        "device": "cpu",
        "prompts": 2 if quick else 4,
        "new_tokens": 8 if quick else 16,
        "frag_requests": 16 if quick else 120,  # quick: two waves of 8, every length and two samples
        "shape": LLAMA_TINY,
        "shape_name": "tiny Llama shape (rehearsal)",
        "grid": [[1, 64], [8, 64], [32, 64], [64, 64], [1, 256]] + ([] if quick else [[8, 256], [1, 512]]),
        "mixed": [512, 32, 7],
        "split": [1, 8],
        "split_context": 64,
        "cap_new_tokens": 4 if quick else 8,
        "estimate_s": {"header": 5, "model": 40, "oom": 40, "fragmentation": 30, "capacity": 25},
    }


def expand(parts: list[str]) -> list[tuple[str, str]]:
    """(title, allocator setting) per subprocess; fragmentation runs once per setting."""
    out = []
    for part in parts:
        if part not in PARTS:
            from llmweb.errors import ConfigError

            raise ConfigError(f"bench gpu: no part {part!r}; the parts are {', '.join(PARTS)}")
        if part == "fragmentation":
            out += [(f"fragmentation-{k}", v) for k, v in ALLOC.items()]
        else:
            out.append((part, ""))
    return out


# ---- the parent: one subprocess per part


def run(
    rehearse: bool,
    quick: bool = False,
    progress: Callable[[str], None] = print,
    parts: list[str] | None = None,
    out: Path | None = None,
    kit: Path | None = None,
    budget_s: float = 0,
) -> dict:
    """Every part of `parts` (all by default), each table written to `out` as it goes. `budget_s`
    (0: none): a part whose estimate no longer fits is skipped, and none runs past the budget."""
    p = plan(rehearse, quick)
    if kit is not None:
        p["kit"] = str(Path(kit).resolve())
    jobs = expand(parts or PARTS)
    est = sum(p["estimate_s"][t.split("-")[0]] for t, _ in jobs)
    progress(f"bench gpu{' --rehearse' if rehearse else ''}: {len(jobs)} parts, about {est / 60:.1f} min by estimate")
    t0 = time.perf_counter()
    results = []
    for title, alloc in jobs:
        left = budget_s - (time.perf_counter() - t0) if budget_s else 600.0
        need = p["estimate_s"][title.split("-")[0]]
        if budget_s and left < need:
            results.append(
                {"part": title, "rows": [], "error": f"skipped: {left:.0f} s of the budget left, needs ~{need} s"}
            )
        else:
            progress(f"  {title}…")
            results.append(_subprocess(title, alloc, p, rehearse, max(left, 10.0), out))
        if out is not None:
            write_part(out, results[-1], rehearse)
    return {"rehearse": rehearse, "plan": p, "note": RANDOM_NOTE, "estimate_s": est, "parts": results}


def part_env(rehearse: bool, alloc: str = "") -> dict:
    """A part's environment: its allocator setting, and on CUDA never the CPU's attention switch
    (production leaves it unset there; transformers reads it on every attention call)."""
    env = dict(os.environ)
    env["PYTORCH_ALLOC_CONF"] = alloc or env.get("PYTORCH_ALLOC_CONF", ALLOC["expandable"])
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env["PYTHONUNBUFFERED"] = "1"
    if rehearse:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # the address-space cap measures live memory: no per-thread arenas, and large blocks are
        # mapped and unmapped (freed ones leave the address space instead of waiting in the heap)
        env["MALLOC_ARENA_MAX"] = "2"
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    else:
        env.pop(GQA_SWITCH, None)
    return env


def _subprocess(title: str, alloc: str, p: dict, rehearse: bool, timeout_s: float, out: Path | None) -> dict:
    part = title.split("-")[0]
    args = [sys.executable, "-m", "llmweb.bench.gpu", part, json.dumps({**p, "rehearse": rehearse, "title": title})]
    if out is not None:
        args.append(str(out))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(args, env=part_env(rehearse, alloc), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        rows = _rows_so_far(out, title)
        return {
            "part": title,
            "rows": rows,
            "error": f"timed out after {timeout_s:.0f} s",
            "wall_s": round(e.timeout, 1),
        }
    wall = time.perf_counter() - t0
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"part": title, "rows": _rows_so_far(out, title), "error": tail[0][:300], "wall_s": round(wall, 1)}
    got = json.loads(lines[-1])
    return {"part": title, "rows": got.get("rows", []), "error": got.get("error"), "wall_s": round(wall, 1)}


def _rows_so_far(out: Path | None, title: str) -> list:
    """The rows a part wrote before it was stopped (the child writes its table after each row)."""
    path = out / f"gpu-{title}.json" if out is not None else None
    if path is None or not path.is_file():
        return []
    try:
        return json.loads(path.read_text()).get("rows", [])
    except ValueError:
        return []


def write_part(out: Path, part: dict, rehearse: bool) -> None:
    """out/gpu-<part>.json and .md, written whole each time (a reader never sees half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    md = markdown({"rehearse": rehearse, "parts": [part]})
    for suffix, text in ((".json", json.dumps(part, indent=2, default=str)), (".md", md + "\n")):
        tmp = out / f".gpu-{part['part']}{suffix}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out / f"gpu-{part['part']}{suffix}")


def markdown(r: dict) -> str:
    lines = [f"## bench gpu{' --rehearse (CPU stand-in: no GPU figure)' if r['rehearse'] else ''}", ""]
    if "estimate_s" in r:
        lines += [f"Estimate {r['estimate_s'] / 60:.1f} min. {r['note']}.", ""]
    lines += ["| part | figure | value | note |", "| --- | --- | --- | --- |"]
    for part in r["parts"]:
        if part.get("error"):
            lines.append(f"| {part['part']} | ERROR | {part['error']} | |")
        for figure, value, note in part["rows"]:
            lines.append(f"| {part['part']} | {figure} | {value} | {note} |")
        if "wall_s" in part:
            lines.append(f"| {part['part']} | wall time | {part['wall_s']} s | |")
    return "\n".join(lines)


def loan_commands(kit: str = ".gpu") -> list[dict]:
    """The device tool's `run` calls of a loan, in order: each self-contained (it carries the kit
    and checks it before unpacking), each under 8 minutes."""
    return [
        {"name": name, "command": f"bash tools/gpu_device.sh {what}", "carry": [kit], "timeout_s": timeout}
        for name, what, timeout in LOAN_PLAN
    ]


# ---- the child: one part, its rows as one JSON line on stdout (and its table under `out`)


class Rows(list):
    """A part's rows; with an `out` folder, the part's table is rewritten after every row."""

    def __init__(self, title: str, rehearse: bool, out: Path | None):
        super().__init__()
        self.title, self.rehearse, self.out = title, rehearse, out

    def append(self, row) -> None:
        super().append(row)
        if self.out is not None:
            write_part(self.out, {"part": self.title, "rows": list(self), "error": None}, self.rehearse)


def _child(part: str, p: dict, out: Path | None) -> int:
    from llmweb.bench import gpu_parts

    rows = Rows(p.get("title", part), p.get("rehearse", False), out)
    error = None
    try:
        getattr(gpu_parts, part)(p, rows)
    except Exception as e:  # noqa: BLE001  (the table shows it; the other parts still run)
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"
    print(json.dumps({"rows": list(rows), "error": error}, default=str), flush=True)
    return 0


def _reference_main(p: dict, target: Path) -> int:
    """The CPU's fp32 greedy replies, in this process only (it sets the CPU's attention switch)."""
    from llmweb.bench import gpu_parts

    target.write_text(json.dumps(gpu_parts.reference(p), indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        sys.exit(_reference_main(json.loads(sys.argv[2]), Path(sys.argv[3])))
    sys.exit(_child(sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None))
