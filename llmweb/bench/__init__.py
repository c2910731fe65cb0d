"""Benchmarks, apart from the product: `python -m llmweb bench
[all|ttft|continue|retrieval|quant|fidelity|concurrency|decode|hostile|load|document|loops|busy|peer|recycle|gpu|ocr|
constrained|router]`
and `capacity`.

One module per benchmark, each with `run(...) -> dict` and `markdown(dict) -> str`:

  suite.py      `bench` (all): one model load, then overhead, TTFT, memory replay, retrieval; a report
  overhead.py   our Engine vs a bare `model.generate` loop, decode tokens/s
  ttft.py       `bench ttft`: time-to-first-token over a growing chat, with and without KV reuse
  carry.py      `bench continue`: a 120-turn chat continued in a new chat: its first TTFT beside a fresh
                chat's, side by side, and the planted facts in its first prompt
  memory.py     the 200-turn replay: memory growth the KV store does not explain, live tensors
  quant.py      `bench quant`: weights size and decode speed per quantisation
  retrieval.py  `bench retrieval`: ingest chunks/s and query latency at ~10k chunks; ranking quality
                and the relevance gate's calibration on the guide and installed packages' READMEs
  fidelity.py   `bench fidelity`: do early facts stay in the prompt? three memory modes
  capacity.py   `capacity`: measured peak memory vs prediction per context length and concurrency
  decode.py     `bench decode`: decode and prefill tok/s before and after each decode optimisation, at
                prompt lengths 32/512/1536, with the per-step time breakdown
  concurrency.py `bench concurrency`: 1, 2, 4, 8 chats at once, batched vs serial engine: aggregate and
                per-request tok/s, TTFT p50/p95, peak memory
  hostile.py    `bench hostile`: each text function on pathological inputs at 1x and 16x their size; the
                ratio of the times (linear ~16, quadratic ~256; at most 25). No model.
  load.py       `bench load`: 16 visitors x 3 turns at once through `/chat` of a scratch server: busy
                refusals, p50/p95; one visitor's turn idle vs. while a client sends pathological messages
  document.py   `bench document`: a whole-document summary of a text several contexts long, cold and from
                the cache; the cold read rate against `llama-bench`'s prefill of the shipped file;
                another visitor's turn idle and while a task reads
  loops.py      `bench loops`: the most copies of one sentence per reply, loop guard off and on, for 8
                ordinary requests and 2 known loops
  busy.py       `bench busy`: a reply's speed as people get it: through the API alone, typed into the
                page in a headless Chromium, and during another visitor's upload, on one real server
  chatpath.py   `bench chatpath`: a new chat's four turns through the chat path against `llama-bench`'s
                decode at each turn's prompt depth, interleaved
  peer.py       `bench peer`: k chats at once through our API against llama.cpp's `llama-server -np k`
                on the same file, prompts, reply length and threads: aggregate tok/s side by side
  recycle.py    `bench recycle`: the engine process replaced gracefully: 20 turns 4 at a time with
                LLMWEB_RECYCLE_AFTER=5, and a chat's turn across a recycle, its caches handed over or dropped
  router.py     `bench router`: 1, 2, 3 llama-server replicas behind vLLM's router, per routing policy,
                against one llama-server with the same slots: prefix-cache reuse on turns 2+, tok/s, TTFT p95
  served.py     a real `python -m llmweb serve` on a scratch data dir, for busy and peer
  gpu.py        `bench gpu [--rehearse]`: the CUDA path part by part (NF4 load, a real OOM and its
                recovery, fragmentation, capacity of an 8B shape with random weights), each part's table
                written as it goes; parts in gpu_parts.py, the loan kit and preflight in gpu_kit.py
  ocr.py        `bench ocr`: OCR engines side by side on pages rendered from known text (a scan, a photo
                of a note): character error rate and seconds per page. No chat model.
  constrained.py `bench constrained`: the decode rate under a 30-field JSON schema against the free one
                at the same length, the schema's compile time, and a 200-step agent loop with 3,000-character
                tool results through the stateless API of a real server: answered, within the context
  common.py     scripted turns, scratch settings, single-request timing, the setup, report files

The contract: a benchmark changes engine settings only through public configuration (a Runtime
built from `settings.replace(...)`, or an `Engine` of its own from `EngineLimits`); it never
changes a running engine. Measurement helpers (peak meters, live tensors) live in engine/telemetry.py.
This module only builds the argument parsers (`register`); each command imports its benchmark
when it runs, so nothing heavy happens at import.
"""

from __future__ import annotations

import json
import sys

from llmweb.errors import ConfigError

BENCHES = [
    "all",
    "ttft",
    "continue",
    "retrieval",
    "quant",
    "fidelity",
    "concurrency",
    "decode",
    "hostile",
    "load",
    "document",
    "loops",
    "busy",
    "chatpath",
    "peer",
    "recycle",
    "gpu",
    "ocr",
    "constrained",
    "router",
]


def register(sub) -> None:
    """Add the `bench` and `capacity` commands to the CLI's subparsers."""
    b = sub.add_parser(
        "bench",
        help="benchmarks: all (the default suite) | ttft | continue | retrieval | quant | fidelity | concurrency "
        "| decode | hostile | load | document | loops | busy | peer | recycle | gpu | ocr | constrained | router",
    )
    b.add_argument("which", nargs="?", default="all", choices=BENCHES)
    b.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="retrieval: corpus size in chunks (default 10000 for `bench retrieval`, 2000 in the suite)",
    )
    b.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="TTFT: reply length per turn (default 48 for `bench ttft`, 32 in the suite); concurrency: per chat "
        "(default 128)",
    )
    b.add_argument("--concurrency", default="1,2,4,8", help="concurrency: chats at once, comma-separated")
    b.add_argument(
        "--max-batch", type=int, default=0, help="concurrency: the batched engine's max_batch (0 = LLMWEB_MAX_BATCH)"
    )
    b.add_argument("--reuse-only", action="store_true", help="TTFT: skip the full-prefill run (for long chats)")
    b.add_argument(
        "--script",
        default="topics",
        choices=["topics", "facts"],
        help="TTFT: the scripted chat: topics (questions returning to 20 topics) or facts (fidelity's chat: "
        "statements about the user, fillers, questions about them; 76 turns, so pass --turns 76)",
    )
    b.add_argument(
        "--engine-url", default=None, help="TTFT: run the chat through a remote engine (LLMWEB_ENGINE_URL) instead"
    )
    b.add_argument("--replay-turns", type=int, default=200, help="suite: measured turns of the memory replay")
    b.add_argument(
        "--warmup-turns",
        type=int,
        default=10,
        help="suite: replay turns before memory is measured (at least until the first fold)",
    )
    b.add_argument("--replay-context", type=int, default=1024, help="suite: context limit of the memory replay")
    b.add_argument("--replay-new-tokens", type=int, default=16, help="suite: reply length in the memory replay")
    b.add_argument("--overhead-tokens", type=int, default=32, help="suite: new tokens per engine-overhead run")
    b.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="suite: A/B repeats of the engine-overhead runs; decode: repeats of every step; busy: of every case; "
        "ocr: timed reads of every page; document: llama-bench's repetitions, before and after the runs; "
        "continue: pairs of first turns (continued, fresh)",
    )
    b.add_argument("--fillers", type=int, default=12, help="fidelity: filler turns before each checkpoint")
    b.add_argument("--checkpoints", type=int, default=3, help="fidelity: times each planted fact is asked about")
    b.add_argument("--prompts", default="32,512,1536", help="decode: prompt lengths in tokens, comma-separated")
    b.add_argument("--parts", type=int, default=4, help="document: copies of the guide in the long text")
    b.add_argument(
        "--history",
        type=int,
        default=0,
        help="busy, ttft: turns of an imported chat the measured chat starts with (ttft: none folded); "
        "continue: turns of the chat continued (default 120)",
    )
    _gpu_arguments(b)
    _router_arguments(b)
    b.add_argument("--dpi", default="300,150", help="ocr: scan resolutions of the prose page, comma-separated")
    b.add_argument("--steps", type=int, default=200, help="constrained: agent-loop steps (0: none)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=bench_command)

    c = sub.add_parser("capacity", help="predicted vs measured peak memory per context and concurrency")
    c.add_argument("--context", default="512,1024,2048", help="tokens per session (prompt + reply), comma-separated")
    c.add_argument("--concurrency", default="1,2,4", help="sessions submitted at once, comma-separated")
    c.add_argument("--max-new-tokens", type=int, default=16, help="reply length per request")
    c.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    c.set_defaults(func=capacity_command)


def _router_arguments(b) -> None:
    """Also --turns and --chats, which other benches read too."""
    b.add_argument(
        "--turns", type=int, default=None, help="TTFT: turns of the scripted chat (40); router: per chat (10)"
    )
    b.add_argument(
        "--chats", default=None, help="peer: chats at once, comma-separated (1,4); router: chats at once (8)"
    )
    b.add_argument("--replicas", default="1,2,3", help="router: replica counts, comma-separated")
    b.add_argument("--policies", default="consistent_hash,cache_aware,round_robin", help="router: vllm-router policies")
    b.add_argument("--slots", type=int, default=2, help="router: llama-server slots per replica")


def _gpu_arguments(b) -> None:
    b.add_argument("--rehearse", action="store_true", help="gpu: the same steps on the CPU, tiny shapes, a memory cap")
    b.add_argument("--quick", action="store_true", help="gpu: the smallest settings (the slow test's)")
    b.add_argument("--gpu-parts", default="", help="gpu: the parts to run, comma-separated (default: all)")
    b.add_argument("--kit", default="", help="gpu: the loan kit's folder (tools/gpu_device.sh kit): model, reference")
    b.add_argument("--out", default="", help="gpu: also write each part's table here, gpu-<part>.{json,md}, as it goes")
    b.add_argument("--budget-s", type=float, default=0, help="gpu: skip the parts whose estimate no longer fits")


def parse_ints(text: str) -> list[int]:
    """ "512,1024" -> [512, 1024]; anything else is a ConfigError with the text."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, not {text!r}") from None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _print(result: dict, as_json: bool, markdown) -> None:
    print(json.dumps(result, indent=2) if as_json else markdown(result))


def bench_command(args) -> int:
    """Run the benchmark `args.which` names and print its result (a table, or JSON with --json)."""
    run = {
        "all": _bench_suite,
        "retrieval": _bench_retrieval,
        "fidelity": _bench_fidelity,
        "concurrency": _bench_concurrency,
        "decode": _bench_decode,
        "quant": _bench_quant,
        "ttft": _bench_ttft,
        "continue": _bench_continue,
        "hostile": _bench_hostile,
        "load": _bench_load,
        "document": _bench_document,
        "loops": _bench_loops,
        "busy": _bench_busy,
        "chatpath": _bench_chatpath,
        "peer": _bench_peer,
        "recycle": _bench_recycle,
        "gpu": _bench_gpu,
        "ocr": _bench_ocr,
        "constrained": _bench_constrained,
        "router": _bench_router,
    }.get(args.which)
    assert run is not None, f"unknown benchmark {args.which!r}"
    return run(args)


def _bench_suite(args) -> int:
    from llmweb.config import Settings

    from . import suite
    from .common import write_reports

    settings = Settings.from_env()
    result = suite.run(
        settings,
        turns=args.turns or 40,
        ttft_new_tokens=args.max_new_tokens or 32,
        chunks=args.chunks or 2000,
        replay_turns=args.replay_turns,
        warmup_turns=args.warmup_turns,
        replay_context=args.replay_context,
        replay_new_tokens=args.replay_new_tokens,
        overhead_tokens=args.overhead_tokens,
        overhead_repeats=args.repeats,
        progress=_stderr,
    )
    md = suite.markdown(result)
    paths = write_reports(result, md, settings.data_dir)
    if args.json:
        print(json.dumps({**result, "files": {k: str(p) for k, p in paths.items()}}, indent=2))
    else:
        print(md)
        for kind, p in paths.items():
            print(f"{kind}: {p}")
    return 0


def _bench_retrieval(args) -> int:
    from llmweb.config import Settings

    from . import retrieval

    result = retrieval.run(Settings.from_env(), n_chunks=args.chunks or 10_000, quality=True)
    _print(result, args.json, retrieval.markdown)
    return 0


def _bench_fidelity(args) -> int:
    from llmweb.config import Settings

    from . import fidelity

    # a small context by default, so the planted facts leave the window within the run
    settings = Settings.from_env(max_new_tokens=args.max_new_tokens or 32)
    if not settings.context_limit:
        settings = settings.replace(context_limit=512)
    result = fidelity.run(settings, fillers_between=args.fillers, checkpoints=args.checkpoints, progress=_stderr)
    _print(result, args.json, fidelity.markdown)
    return 0


def _bench_concurrency(args) -> int:
    from llmweb.config import Settings

    from . import concurrency

    result = concurrency.run(
        Settings.from_env(),
        parse_ints(args.concurrency),
        max_new_tokens=args.max_new_tokens or 128,
        max_batch=args.max_batch,
        progress=_stderr,
    )
    _print(result, args.json, concurrency.markdown)
    return 0


def _bench_decode(args) -> int:
    from llmweb.config import Settings

    from . import decode

    result = decode.run(
        Settings.from_env(),
        parse_ints(args.prompts),
        new_tokens=args.max_new_tokens or 64,
        repeats=args.repeats,
        progress=_stderr,
    )
    _print(result, args.json, decode.markdown)
    return 0


def _bench_quant(args) -> int:
    from llmweb.config import Settings

    from . import quant

    _print(quant.run(Settings.from_env()), args.json, quant.markdown)
    return 0


def _bench_ttft(args) -> int:
    import tempfile

    from llmweb.config import Settings
    from llmweb.engine import models

    from . import ttft
    from .common import scratch_settings

    settings = Settings.from_env(max_new_tokens=args.max_new_tokens or 48, engine_url=args.engine_url)
    loaded = None if settings.engine_url else models.load(settings, progress=_stderr)  # remote: the tokenizer only
    with tempfile.TemporaryDirectory(prefix="llmweb-bench-") as tmp:  # the chats never touch the user's database
        result = ttft.run(
            scratch_settings(settings, tmp),
            loaded,
            args.turns or 40,
            full=not args.reuse_only,
            script=args.script,
            history=args.history,
        )
    _print(result, args.json, ttft.markdown)
    return 0


def _bench_continue(args) -> int:
    import tempfile

    from llmweb.config import Settings
    from llmweb.engine import models

    from . import carry
    from .common import scratch_settings

    settings = Settings.from_env(max_new_tokens=args.max_new_tokens or 32)
    loaded = models.load(settings, progress=_stderr)
    with tempfile.TemporaryDirectory(prefix="llmweb-bench-") as tmp:  # the chats never touch the user's database
        result = carry.run(
            scratch_settings(settings, tmp), loaded, history=args.history or 120, repeats=args.repeats, progress=_stderr
        )
    _print(result, args.json, carry.markdown)
    return 0


def _bench_hostile(args) -> int:
    """Exit status 1 when a ratio is over the limit: a text function grew faster than linearly."""
    from . import hostile

    result = hostile.run(progress=_stderr)
    _print(result, args.json, hostile.markdown)
    return 0 if result["all_linear"] else 1


def _bench_load(args) -> int:
    """Exit status 1 when a visitor (not the hostile owner) was refused as busy or a turn went unanswered."""
    from llmweb.config import Settings

    from . import load

    result = load.run(Settings.from_env(), max_new_tokens=args.max_new_tokens or 16, progress=_stderr)
    _print(result, args.json, load.markdown)
    crowds = [result["load"], result["hostile_owner"]["alone"], result["hostile_owner"]["beside"]]
    fine = all(f["refusals"] == 0 and f["answered"] == f["turns"] and not f["errors"] for f in crowds)
    return 0 if fine else 1


def _bench_document(args) -> int:
    from llmweb.config import Settings

    from . import document

    settings = Settings.from_env(max_new_tokens=args.max_new_tokens or 64)
    result = document.run(settings, parts=args.parts, progress=_stderr, bench_repeats=args.repeats)
    _print(result, args.json, document.markdown)
    return 0


def _bench_loops(args) -> int:
    from llmweb.config import Settings

    from . import loops

    result = loops.run(Settings.from_env(), new_tokens=args.max_new_tokens or 256, progress=_stderr)
    _print(result, args.json, loops.markdown)
    return 0


def _bench_busy(args) -> int:
    from . import busy

    result = busy.run(
        new_tokens=args.max_new_tokens or 160, repeats=args.repeats, progress=_stderr, history=args.history
    )
    _print(result, args.json, busy.markdown)
    return 0


def _bench_chatpath(args) -> int:
    from llmweb.config import Settings

    from . import chatpath

    result = chatpath.run(Settings.from_env(), args.max_new_tokens or 128, args.repeats, progress=_stderr)
    _print(result, args.json, chatpath.markdown)
    return 0


def _bench_router(args) -> int:
    import signal

    from llmweb.config import Settings

    from . import router

    # a stopped bench still stops its servers (its `finally` blocks run)
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = router.run(
            Settings.from_env(),
            counts=parse_ints(args.replicas),
            policies=[p.strip() for p in args.policies.split(",") if p.strip()],
            chats=int(args.chats or 8),
            turns=args.turns or 10,
            slots=args.slots,
            new_tokens=args.max_new_tokens or 32,
            progress=_stderr,
        )
    finally:
        signal.signal(signal.SIGTERM, before)
    _print(result, args.json, router.markdown)
    answered = all(c["answered"] == c["turns"] for c in result["cases"])
    return 0 if answered else 1


def _bench_peer(args) -> int:
    from llmweb.config import Settings

    from . import peer

    result = peer.run(
        Settings.from_env(),
        concurrencies=parse_ints(args.chats or "1,4"),
        new_tokens=args.max_new_tokens or 128,
        repeats=args.repeats,
        progress=_stderr,
    )
    _print(result, args.json, peer.markdown)
    return 0


def _bench_recycle(args) -> int:
    from llmweb.config import Settings

    from . import recycle

    result = recycle.run(Settings.from_env(), turns=min(args.turns or 40, 20), progress=_stderr)
    _print(result, args.json, recycle.markdown)
    return 0


def _bench_gpu(args) -> int:
    """Exit status 2 without CUDA (unless --rehearse); 1 when a part failed."""
    from pathlib import Path

    import torch

    from llmweb.config import Settings

    from . import gpu
    from .common import write_reports

    if not args.rehearse and not torch.cuda.is_available():
        _stderr(
            "bench gpu needs a CUDA device, and torch sees none here; "
            "`bench gpu --rehearse` runs the same steps on the CPU."
        )
        return 2
    parts = [x.strip() for x in args.gpu_parts.split(",") if x.strip()] or None
    result = gpu.run(
        args.rehearse,
        quick=args.quick,
        progress=_stderr,
        parts=parts,
        out=Path(args.out) if args.out else None,
        kit=Path(args.kit) if args.kit else None,
        budget_s=args.budget_s,
    )
    md = gpu.markdown(result)
    paths = write_reports(result, md, Settings.from_env().data_dir, stem="gpu-rehearse" if args.rehearse else "gpu")
    _print(result, args.json, gpu.markdown)
    for kind, p in paths.items():
        _stderr(f"{kind}: {p}")
    return 1 if any(part.get("error") for part in result["parts"]) else 0


def _bench_ocr(args) -> int:
    from . import ocr

    result = ocr.run(dpis=parse_ints(args.dpi), repeats=args.repeats, progress=_stderr)
    _print(result, args.json, ocr.markdown)
    return 0


def capacity_command(args) -> int:
    from llmweb.config import Settings

    from . import capacity

    settings = Settings.from_env()
    result = capacity.run(
        settings, parse_ints(args.context), parse_ints(args.concurrency), max_new_tokens=args.max_new_tokens
    )
    paths = capacity.write_reports(result, settings.data_dir)
    if args.json:
        print(json.dumps({**result, "files": {k: str(p) for k, p in paths.items()}}, indent=2))
        return 0
    print(capacity.markdown(result))
    for kind, p in paths.items():
        print(f"{kind}: {p}")
    return 0


def _bench_constrained(args) -> int:
    from llmweb.config import Settings

    from . import constrained

    result = constrained.run(
        Settings.from_env(),
        new_tokens=args.max_new_tokens or 128,
        repeats=args.repeats,
        steps=args.steps,
        progress=_stderr,
    )
    _print(result, args.json, constrained.markdown)
    return 0
