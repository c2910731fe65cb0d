"""`bench gpu --rehearse`: every step of the GPU check on the CPU, with its smallest settings.

The real embedded model in NF4 (bitsandbytes on the CPU), a real out-of-memory under an address-
space cap, a random tiny Llama for capacity; and the command without CUDA refuses clearly.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmweb.bench import gpu


def test_plan_fits_its_estimate():
    assert sum(gpu.plan(rehearse=False)["estimate_s"].values()) <= 8 * 60
    assert {b for b, _ in gpu.plan(rehearse=True, quick=True)["grid"]} == {1, 8, 32, 64}


def test_markdown_shows_a_failed_part():
    r = {
        "rehearse": True,
        "estimate_s": 60,
        "note": gpu.RANDOM_NOTE,
        "parts": [{"part": "oom", "rows": [], "error": "X"}],
    }
    assert "| oom | ERROR | X |" in gpu.markdown(r)


def test_without_cuda_it_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    proc = subprocess.run([sys.executable, "-m", "llmweb", "bench", "gpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_rehearsal_runs_every_part():
    r = gpu.run(rehearse=True, quick=True, progress=lambda _m: None)
    parts = {p["part"]: p for p in r["parts"]}
    for p in r["parts"]:
        assert not p["error"], (p["part"], p["error"])
    rows = {part: {fig: (val, note) for fig, val, note in p["rows"]} for part, p in parts.items()}
    assert rows["model"]["4-bit load"][0] == "4bit"
    assert "tokens" in rows["model"]["KV reuse, 2nd turn"][0]
    oom = rows["oom"]
    assert int(oom["worker lives"][0].split()[0]) > 0
    for setting in ("expandable_segments:True", "expandable_segments:False"):
        assert int(rows[f"fragmentation ({setting})"]["requests"][0]) > 0
    cap = rows["capacity"]
    assert "RANDOM" in cap["model"][1]
    for batch in (1, 8, 32, 64):
        assert any(k.startswith(f"batch {batch} x") for k in cap), batch
    assert "RANDOM weights" in gpu.markdown(r)
    # a real out-of-memory under the address-space cap: the engine counted it, retried, and lived
    assert oom["OOM"][0] == "engine ooms 1", oom["OOM"]
    assert oom["recovery"][0] == "retried with the fallback"
    agreement = rows["model"]["top-1 agreement vs CPU fp32"][0]
    assert int(agreement.rstrip("%")) >= 50, agreement  # NF4 predicts most of fp32's own reply
