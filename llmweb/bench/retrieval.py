"""`python -m llmweb bench retrieval`: ingest throughput and query latency with the real embedder.

`run(settings, n_chunks, queries)` writes a synthetic corpus (deterministic: a fixed seed and a
fixed word list) of about `n_chunks` chunks into a temporary folder, ingests it into a temporary
data dir (never the user's), then times `queries` searches. It returns plain numbers;
`markdown(result)` renders them as a table. The embedder load is timed separately and is not
part of the throughput.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..config import Settings
from ..retrieval import Embedder, Index

SEED = 1234
DOCS = 50  # the corpus is split into this many files (or fewer for small runs)
_WORDS = """
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door health person
art war history party result change morning reason research girl guy moment air teacher force education
memory cache token model index search engine budget queue summary window context document page chapter
river mountain forest garden kitchen market station bridge island harbour village castle library museum
""".split()
_VERBS = """
makes takes finds gives tells asks works seems feels leaves calls keeps begins shows hears plays runs
moves lives believes brings writes provides sits stands loses pays meets includes continues learns
changes leads understands watches follows stops creates speaks reads allows adds spends grows opens
""".split()


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 6))]
    verb = rng.choice(_VERBS)
    cut = rng.randint(1, len(words) - 1)
    text = " ".join(["the", *words[:cut], verb, "the", *words[cut:]])
    return text[0].upper() + text[1:] + "."


def _paragraph(rng: random.Random, tokens: int) -> str:
    """About `tokens` word pieces (every word in the list is one piece; '.' is one more)."""
    out, n = [], 0
    while n < tokens:
        s = _sentence(rng)
        out.append(s)
        n += len(s.split()) + 1
    return " ".join(out)


def make_corpus(folder: Path, n_chunks: int, chunk_tokens: int, seed: int = SEED) -> list[str]:
    """Write Markdown files with about n_chunks chunk-sized sections; return some query sentences."""
    rng = random.Random(seed)
    files = max(1, min(DOCS, n_chunks // 20))
    per_file = [n_chunks // files + (1 if i < n_chunks % files else 0) for i in range(files)]
    # A section of ~60% of a chunk plus its heading fits one chunk with the overlap carried in.
    size = max(16, int(chunk_tokens * 0.6))
    samples: list[str] = []
    for f, count in enumerate(per_file):
        parts: list[str] = []
        for s in range(count):
            body = _paragraph(rng, size)
            parts.append(f"## Section {f}.{s}\n\n{body}\n")
            if rng.random() < 0.05:
                samples.append(body.split(". ")[0])
        (folder / f"doc-{f:03d}.md").write_text("\n".join(parts), encoding="utf-8")
    return samples


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def run(
    settings: Settings,
    n_chunks: int = 10_000,
    queries: int = 200,
    progress: Callable[[int, int, str], None] | None = None,
    embedder: Embedder | None = None,
) -> dict:
    """Build, ingest and query a synthetic corpus; return the measured figures."""
    import torch

    embedder = embedder or Embedder.from_settings(settings)
    with tempfile.TemporaryDirectory(prefix="llmweb-bench-") as tmp:
        root = Path(tmp)
        (root / "corpus").mkdir()
        bench_settings = settings.replace(data_dir=root / "data")
        samples = make_corpus(root / "corpus", n_chunks, bench_settings.chunk_tokens)
        t0 = time.perf_counter()
        _ = embedder.max_tokens  # loads the model
        load_s = time.perf_counter() - t0
        index = Index(bench_settings, namespace="bench", embedder=embedder)
        t0 = time.perf_counter()
        reports = index.ingest([root / "corpus"], progress=progress)
        ingest_s = time.perf_counter() - t0
        errors = [r.message for r in reports if not r.ok]
        assert not errors, f"the synthetic corpus failed to ingest: {errors[:3]}"
        chunks = len(index)
        rng = random.Random(SEED + 1)
        asked = [rng.choice(samples) for _ in range(queries)] if samples else ["the river"] * queries
        index.search(asked[0])  # warm-up
        latencies = []
        hits = 0
        for q in asked:
            t0 = time.perf_counter()
            found = index.search(q, k=settings.top_k, min_score=0.0)
            latencies.append((time.perf_counter() - t0) * 1000)
            hits += bool(found) and q in found[0].text
        index_bytes = sum(p.stat().st_size for p in index.dir.iterdir() if p.name.startswith("vectors-"))
    return {
        "embedder": embedder.label,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "files": len(reports),
        "chunks": chunks,
        "chunk_tokens": min(settings.chunk_tokens, embedder.max_tokens),
        "embedder_load_s": round(load_s, 2),
        "ingest_s": round(ingest_s, 2),
        "chunks_per_s": round(chunks / ingest_s, 1) if ingest_s else 0.0,
        "queries": len(latencies),
        "query_p50_ms": round(statistics.median(latencies), 2) if latencies else 0.0,
        "query_p95_ms": round(_percentile(latencies, 95), 2) if latencies else 0.0,
        "top1_hit_rate": round(hits / len(latencies), 3) if latencies else 0.0,
        "index_mb": round(index_bytes / 2**20, 1),
    }


def markdown(result: dict) -> str:
    rows = [
        ("embedder", result["embedder"]),
        ("CPU threads (torch) / cores", f"{result['threads']} / {result['cpus']}"),
        ("corpus", f"{result['chunks']} chunks of <= {result['chunk_tokens']} tokens in {result['files']} files"),
        ("embedder load", f"{result['embedder_load_s']} s (not in the throughput)"),
        ("ingest (read + chunk + embed + save)", f"{result['ingest_s']} s = {result['chunks_per_s']} chunks/s"),
        (
            "query latency p50 / p95",
            f"{result['query_p50_ms']} / {result['query_p95_ms']} ms over {result['queries']} queries",
        ),
        ("top-1 contains the query sentence", f"{result['top1_hit_rate']:.1%}"),
        ("index file", f"{result['index_mb']} MB"),
    ]
    lines = ["| retrieval benchmark | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)
