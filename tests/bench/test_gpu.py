"""`bench gpu`: the loan plan's limits, the kit, and every part on the CPU (`--rehearse`).

The real embedded model in NF4 (bitsandbytes on the CPU), a real out-of-memory under an address-
space cap, a random tiny Llama for capacity; the command without CUDA refuses clearly; the loan
kit's cuts and checksums on small files made here; and the plan's commands from fresh copies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from llmweb.bench import gpu, gpu_kit

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / ".gpu"


def test_each_loan_command_fits_a_call_and_its_parts_fit_its_budget():
    calls = gpu.loan_commands()
    assert [c["name"] for c in calls][0] == "preflight"
    est = gpu.plan(rehearse=False)["estimate_s"]
    covered = []
    for call, (_, what, timeout) in zip(calls, gpu.LOAN_PLAN, strict=True):
        assert len(call["command"]) <= 2000 and len(call["carry"]) <= 8
        assert timeout <= 8 * 60, call  # well inside the tool's 10 minutes, with a rerun's room
        if what.startswith("parts "):
            _, parts, budget = what.split()
            titles = gpu.expand(parts.split(","))
            covered += [t.split("-")[0] for t, _ in titles]
            assert sum(est[t.split("-")[0]] for t, _ in titles) <= int(budget) <= timeout - 45, call
    assert sorted(set(covered)) == sorted(gpu.PARTS)  # every part runs in some command


def test_markdown_shows_a_failed_part():
    r = {
        "rehearse": True,
        "estimate_s": 60,
        "note": gpu.RANDOM_NOTE,
        "parts": [{"part": "oom", "rows": [], "error": "X"}],
    }
    assert "| oom | ERROR | X |" in gpu.markdown(r)


def test_a_part_writes_its_table_after_every_row(tmp_path):
    rows = gpu.Rows("model", True, tmp_path)
    rows.append(("a", "1", ""))
    rows.append(("b", "2", ""))
    written = json.loads((tmp_path / "gpu-model.json").read_text())
    assert written["rows"] == [["a", "1", ""], ["b", "2", ""]]
    assert "| model | b | 2 |" in (tmp_path / "gpu-model.md").read_text()


def test_a_part_that_no_longer_fits_the_budget_is_a_row_and_its_table(tmp_path):
    r = gpu.run(rehearse=True, parts=["header", "capacity"], out=tmp_path, budget_s=1, progress=lambda _m: None)
    assert [p["part"] for p in r["parts"]] == ["header", "capacity"]
    assert all(p["error"].startswith("skipped:") for p in r["parts"])
    assert sorted(x.name for x in tmp_path.iterdir()) == [
        "gpu-capacity.json",
        "gpu-capacity.md",
        "gpu-header.json",
        "gpu-header.md",
    ]


def test_the_cuda_parts_never_get_the_cpu_attention_switch(monkeypatch):
    monkeypatch.setenv(gpu.GQA_SWITCH, "1")
    assert gpu.GQA_SWITCH not in gpu.part_env(rehearse=False)
    assert gpu.part_env(rehearse=False, alloc=gpu.ALLOC["default"])["PYTORCH_ALLOC_CONF"] == gpu.ALLOC["default"]


def test_an_unknown_part_is_refused():
    from llmweb.errors import ConfigError

    with pytest.raises(ConfigError, match="no part 'nope'"):
        gpu.expand(["nope"])


def test_without_cuda_it_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    proc = subprocess.run([sys.executable, "-m", "llmweb", "bench", "gpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- the kit


def test_the_cut_wheel_keeps_only_the_named_libraries_and_its_record_matches(tmp_path):
    src = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    libs = ["cpu", "cuda118", "cuda128", "cuda130", "cuda132"]
    names = ["bitsandbytes/__init__.py"] + [f"bitsandbytes/libbitsandbytes_{x}.so" for x in libs]
    record = "bitsandbytes-0.50.2.dist-info/RECORD"
    with zipfile.ZipFile(src, "w") as z:
        for n in names:
            z.writestr(n, b"x" * 100)
        z.writestr(record, "".join(f"{n},sha256=abc,100\n" for n in names))
    cut = gpu_kit.cut_wheel(src, tmp_path / "out", ("cpu.so", "cuda130.so"))
    with zipfile.ZipFile(cut) as z:
        kept = sorted(n for n in z.namelist() if n.endswith(".so"))
        listed = [line.split(",")[0] for line in z.read(record).decode().splitlines()]
    assert cut.name == src.name
    assert kept == ["bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so"]
    assert sorted(x for x in listed if x.endswith(".so")) == kept


def test_the_cut_gguf_keeps_the_first_blocks_and_the_metadata(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    src = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_block_count(4)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c"])
    w.add_tensor("token_embd.weight", np.ones((8, 64), dtype=np.float16))
    for i in range(4):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.full(64, i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    kept = gpu_kit.cut_gguf(src, tmp_path / "cut.gguf", layers=2)
    r = gguf.GGUFReader(tmp_path / "cut.gguf")
    assert kept["of"] == 4 and kept["blocks"] == [0, 1]
    assert r.fields["llama.block_count"].contents() == 2
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    tensors = {t.name: t for t in r.tensors}
    assert sorted(tensors) == ["blk.0.attn_norm.weight", "blk.1.attn_norm.weight", "token_embd.weight"]
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
    assert float(tensors["blk.1.attn_norm.weight"].data[0]) == 1.0


def _small_kit(tmp_path: Path) -> Path:
    kit = tmp_path / "kit"
    (kit / "whl").mkdir(parents=True)
    (kit / "whl" / "a.whl").write_bytes(b"wheel")
    (kit / "reference.json").write_text("{}")
    gpu_kit.write_sums(kit)
    return kit


def test_a_changed_kit_file_is_found_and_the_device_script_stops_before_unpacking(tmp_path):
    kit = _small_kit(tmp_path)
    assert gpu_kit.check(kit) == []
    (kit / "whl" / "a.whl").write_bytes(b"wheel, cut short in transit")
    assert gpu_kit.check(kit) == ["whl/a.whl"]
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    (tree / "tools" / "gpu_device.sh").write_text((ROOT / "tools" / "gpu_device.sh").read_text())
    os.symlink(kit, tree / ".gpu")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": "false", "SITE": str(tmp_path / "site")}
    proc = subprocess.run(
        ["bash", "tools/gpu_device.sh", "parts", "header", "60"], cwd=tree, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 3, proc.stderr
    assert "differs from its SHA256SUMS" in proc.stderr
    assert not (tmp_path / "site").exists()


def test_each_rehearsed_command_starts_from_a_fresh_copy(tmp_path, monkeypatch):
    """The rehearsal gives each call its own tree, temp directory and $OUT: what one leaves, the
    next does not see (as on a machine given back between calls)."""
    kit = _small_kit(ROOT / ".pytest-kit")  # inside the tree, as the device tool's carry needs
    rel = str(kit.relative_to(ROOT))
    leave = 'touch leftover "$TMPDIR/leftover"; echo a > "$OUT/a.txt"'
    look = 'test ! -e leftover && test ! -e "$TMPDIR/leftover" && test -e tools/gpu_device.sh && ls "$OUT" | wc -l'
    calls = [
        {"name": "one", "command": leave, "carry": [rel], "timeout_s": 60},
        {"name": "two", "command": look + ' > "$OUT/count.txt"', "carry": [rel], "timeout_s": 60},
    ]
    monkeypatch.setattr(gpu, "loan_commands", lambda _kit=".gpu": calls)
    try:
        results = gpu_kit.rehearse_plan(ROOT, Path(rel), limit_s=60, progress=lambda _m: None)
    finally:
        import shutil

        shutil.rmtree(ROOT / ".pytest-kit", ignore_errors=True)
    assert [r["rc"] for r in results] == [0, 0], [r["tail"] for r in results]
    assert results[0]["files"] == ["a.txt"] and results[1]["files"] == ["count.txt"]
    assert all(r["sent_mib"] < 64 for r in results)


def test_the_random_model_is_never_materialised_in_float(monkeypatch):
    """The capacity part builds the 8B shape on the device: nothing may make the whole float model
    there (to_empty of the meta model made every parameter fp32: 30 GiB at 8B)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    from llmweb.bench import gpu_parts

    def refuse(*_a, **_k):
        raise AssertionError("to_empty materialises every parameter of the meta model")

    monkeypatch.setattr(torch.nn.Module, "to_empty", refuse)
    model = gpu_parts.random_llama(gpu.LLAMA_TINY, "cpu")
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    assert floats == {torch.bfloat16}, floats
    assert not any(type(m) is torch.nn.Linear for m in model.model.layers.modules())


# ---- slow: the parts themselves, on the CPU


@pytest.mark.slow
def test_rehearsal_runs_every_part(tmp_path):
    r = gpu.run(rehearse=True, quick=True, progress=lambda _m: None, out=tmp_path)
    parts = {p["part"]: p for p in r["parts"]}
    for p in r["parts"]:
        assert not p["error"], (p["part"], p["error"])
        assert (tmp_path / f"gpu-{p['part']}.json").is_file(), p["part"]
    rows = {part: {fig: (val, note) for fig, val, note in p["rows"]} for part, p in parts.items()}
    assert rows["header"]["allocator in effect"][0] == "n/a"
    model = rows["model"]
    assert model["4-bit load"][0] == "4bit"
    assert "tokens" in model["KV reuse, 2nd turn"][0]
    assert "CPU subprocess" in model["reference"][1]
    assert "a .gguf on the device" in model
    oom = rows["oom"]
    assert int(oom["worker lives"][0].split()[0]) > 0
    assert oom["4-bit load under a cap"][0] == "skipped"
    for setting in gpu.ALLOC:
        assert int(rows[f"fragmentation-{setting}"]["requests"][0]) > 0
    cap = rows["capacity"]
    assert "RANDOM" in cap["model"][1]
    for batch in (1, 8, 32, 64):
        assert any(k.startswith(f"batch {batch} x") for k in cap), batch
    assert any(k.startswith("mixed batch 1 x") for k in cap), cap
    assert "forward" in cap["decode split, batch 8"][0]
    assert "RANDOM weights" in gpu.markdown(r)
    # a real out-of-memory under the address-space cap: the engine counted it, retried, and lived
    assert oom["OOM"][0] == "engine ooms 1", oom["OOM"]
    assert oom["recovery"][0] == "retried with the fallback"
    agreement = model["top-1 agreement vs CPU fp32"][0]
    assert int(agreement.rstrip("%")) >= 50, agreement  # NF4 predicts most of fp32's own reply


@pytest.mark.slow
def test_the_preflight_reads_versions_and_imports_without_a_kit(tmp_path):
    r = gpu_kit.preflight(tmp_path / "no-kit", tmp_path / "out")
    assert r["kit_sha256_mismatch"] == ["(no kit)"]
    assert r["image_versions"]["tokenizers"]
    assert r["imports_with_kit"]["llmweb.engine.models"] == "ok"
    assert (tmp_path / "out" / "preflight.md").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not (KIT / "SHA256SUMS").is_file(), reason="no loan kit here: tools/gpu_device.sh kit builds it")
def test_the_loan_plan_runs_from_fresh_copies_each_well_under_eight_minutes():
    results = gpu_kit.rehearse_plan(ROOT, Path(".gpu"), limit_s=8 * 60, progress=lambda _m: None)
    for r in results:
        assert r["rc"] == 0, (r["name"], r["tail"])
        assert r["wall_s"] < 6 * 60, r
        assert len(r["files"]) <= 8 and r["sent_mib"] < 64, r
