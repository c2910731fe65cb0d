"""`python -m llmweb bench retrieval`: speed, ranking quality and the relevance gate, real embedder.

1) Speed. `run(settings, n_chunks, queries)` writes a synthetic corpus (deterministic: a fixed
   seed and a fixed word list) of about `n_chunks` chunks into a temporary folder, ingests it into
   a temporary data dir (never the user's), then times `queries` dense searches and as many hybrid
   ones (dense + keyword, fused, gated: what a chat turn pays). The embedder load is timed
   separately and is not part of the throughput.
2) Quality (`run(..., quality=True)`, what the CLI does; the suite skips it). Two real corpora:
   the bundled guide, and the README of each package in PACKAGES as installed in this environment
   (the long description in its `*.dist-info/METADATA`, copied into a temporary folder; nothing is
   downloaded, nothing large is committed). Labelled messages in data/eval/ (JSON lines):
   guide-questions.jsonl (the guide heading that answers each), packages-questions.jsonl (the
   package whose README answers each), off-topic.jsonl (messages no document answers: chit-chat,
   personal facts, requests about the conversation, general knowledge). Per corpus: recall@1,
   recall@4 and MRR@10 of the dense, keyword and hybrid rankings (no gate, no floor: ranking only),
   and the share of on-topic and of off-topic messages that retrieve anything, with the gate
   (hybrid.GATE) and with the old rule (dense, cosine >= min_score).
3) Calibration. `calibrate` searches the gate's rule family (hybrid.Gate) over a grid of its three
   constants, on the evidence of every labelled message over both corpora, and picks: of the rules
   that admit at most MAX_OFF_TOPIC of the off-topic messages on every corpus, the one with the
   best worst-corpus (on-topic admitted - off-topic admitted), then the best mean; exact ties go to
   the middle of the tied run. The table shows it, the constants in the code, the rule fit to one
   corpus alone, and plain cosine floors. hybrid.GATE records what this chose.

Every function returns plain numbers; `markdown(result)` renders them as tables.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmweb.config import REPO_DIR, SAMPLE_DIR, Settings
from llmweb.records import Chunk
from llmweb.retrieval import hybrid
from llmweb.retrieval.embedder import Embedder
from llmweb.retrieval.hybrid import Evidence, Gate
from llmweb.retrieval.index import Index

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
    *,
    quality: bool = False,
) -> dict:
    """Build, ingest and query a synthetic corpus; return the measured figures (and, with
    `quality`, the ranking and gate figures on the two real corpora: `run_quality`)."""
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
        hybrid_ms = []  # what a chat turn pays: embed once, both rankings, the gate, the fusion
        for q in asked:
            t0 = time.perf_counter()
            hybrid.search([index], q, settings.top_k, settings.min_score, embedder=embedder)
            hybrid_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        Index(bench_settings, namespace="bench", embedder=embedder).documents()  # a cold load from disk
        load_ms = (time.perf_counter() - t0) * 1000
        index_bytes = sum(p.stat().st_size for p in index.dir.iterdir() if p.name.startswith("vectors-"))
        fts_bytes = sum(p.stat().st_size for p in index.dir.iterdir() if p.name.startswith("fts-"))
    out = {
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
        "hybrid_p50_ms": round(statistics.median(hybrid_ms), 2) if hybrid_ms else 0.0,
        "hybrid_p95_ms": round(_percentile(hybrid_ms, 95), 2) if hybrid_ms else 0.0,
        "index_load_ms": round(load_ms, 1),
        "index_mb": round(index_bytes / 2**20, 1),
        "keyword_mb": round(fts_bytes / 2**20, 1),
    }
    if quality:
        out["quality"] = run_quality(settings, embedder, progress=progress)
    return out


# --------------------------------------------------------------------------- quality: data

EVAL_DIR = REPO_DIR / "data" / "eval"
GUIDE = SAMPLE_DIR / "llmweb-guide.md"
# The real corpus: these installed distributions' READMEs (a fixed selection; each is in requirements*.txt
# or installed with one of them). A package missing here is left out, with its questions, and reported.
PACKAGES = (
    "accelerate", "beautifulsoup4", "bitsandbytes", "faiss-cpu", "fastapi", "gradio", "httpx", "huggingface-hub",
    "hypothesis", "jinja2", "matplotlib", "numpy", "orjson", "pandas", "pillow", "playwright", "psutil", "pypdf",
    "pytest", "python-docx", "requests", "rich", "safetensors", "sentence-transformers", "tokenizers", "torch",
    "tqdm", "transformers", "typer", "uvicorn",
)  # fmt: skip
MAX_OFF_TOPIC = 0.10  # the calibration's limit: off-topic messages admitted, per corpus
K_METRICS = 10  # MRR@10; recall@1 and @4 read the same ranking


@dataclass(frozen=True, slots=True)
class Question:
    """One labelled message: on topic (with what answers it) or off topic (nothing should come back)."""

    text: str
    on_topic: bool
    headings: tuple[str, ...] = ()  # guide: a chunk under one of these headings answers it
    docs: tuple[str, ...] = ()  # packages: a chunk of one of these READMEs (file stem) answers it

    def answered_by(self, chunk: Chunk) -> bool:
        if self.headings:
            return chunk.heading in self.headings
        return Path(chunk.source).stem in self.docs


def load_questions(path: Path, on_topic: bool) -> list[Question]:
    """A JSON-lines file: {"q": ..., "heading": [...]} or {"q": ..., "docs": [...]} or {"q": ...} (off topic)."""
    out = []
    for n, line in enumerate(Path(path).read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        q = Question(row["q"], on_topic, tuple(row.get("heading", ())), tuple(row.get("docs", ())))
        assert not on_topic or q.headings or q.docs, f"{path}:{n}: an on-topic question needs 'heading' or 'docs'"
        out.append(q)
    return out


def write_packages_corpus(folder: Path, names: Sequence[str] = PACKAGES) -> list[str]:
    """Write each installed package's README as <name>.md (or .txt for reStructuredText); return the
    names written. Uses importlib.metadata: the environment's own METADATA files, nothing downloaded."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        try:
            meta = importlib.metadata.metadata(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        fields = meta.json  # the README is the "description" (the METADATA file's body)
        body = str(fields.get("description", "")).replace("\r\n", "\n")
        if not body.strip():
            continue
        rst = "rst" in str(fields.get("description_content_type", ""))
        (folder / f"{name}{'.txt' if rst else '.md'}").write_text(body, encoding="utf-8")
        written.append(name)
    return written


# --------------------------------------------------------------------------- quality: measures


def ranking_metrics(index: Index, questions: Sequence[Question], embedder: Embedder, mode: str) -> dict:
    """recall@1, recall@4 and MRR@10 of one ranking mode, no gate and no floor (ranking only)."""
    ranks = []
    for q in questions:
        found = hybrid.search([index], q.text, K_METRICS, -1.0, embedder=embedder, gate=None, mode=mode).chunks
        ranks.append(next((n for n, c in enumerate(found, 1) if q.answered_by(c)), None))
    n = max(len(ranks), 1)
    return {
        "recall_at_1": round(sum(r == 1 for r in ranks) / n, 3),
        "recall_at_4": round(sum(r is not None and r <= 4 for r in ranks) / n, 3),
        "mrr": round(sum(1 / r for r in ranks if r) / n, 3),
    }


def evidence(index: Index, questions: Sequence[Question], embedder: Embedder) -> list[tuple[Evidence, bool]]:
    """The gate's evidence for each message over `index`, with its label (True = on topic)."""
    out = []
    for q in questions:
        c = index.candidates(q.text, embedder.embed_query(q.text), index.settings.top_k, -1.0)
        out.append((Evidence.of(c), q.on_topic))
    return out


def admitted(rows: Sequence[tuple[Evidence, bool]], gate: Gate) -> tuple[float, float]:
    """(share of on-topic messages admitted, share of off-topic messages admitted)."""
    on = [gate.admits(e) for e, label in rows if label]
    off = [gate.admits(e) for e, label in rows if not label]
    return (round(sum(on) / max(len(on), 1), 3), round(sum(off) / max(len(off), 1), 3))


def retrieves(index: Index, questions: Sequence[Question], embedder: Embedder, settings: Settings) -> dict:
    """Share of messages that retrieve anything: with the gate (a chat turn now) and the old rule."""
    gated = [
        bool(hybrid.search([index], q.text, settings.top_k, settings.min_score, embedder=embedder).chunks)
        for q in questions
    ]
    floor = [bool(index.search(q.text, settings.top_k, settings.min_score)) for q in questions]
    n = max(len(questions), 1)
    return {"gated": round(sum(gated) / n, 3), "cosine_floor": round(sum(floor) / n, 3)}


# --------------------------------------------------------------------------- calibration


@dataclass(frozen=True, slots=True)
class Calibration:
    gate: Gate  # the rule chosen
    rows: list[dict]  # the table: a rule and its admitted shares per corpus


def calibrate(by_corpus: dict[str, list[tuple[Evidence, bool]]], max_off: float = MAX_OFF_TOPIC) -> Calibration:
    """Search hybrid.Gate's constants on labelled evidence (see the module docstring for the choice)."""
    import numpy as np

    names = list(by_corpus)
    cos = {c: np.array([e.cosine for e, _ in by_corpus[c]]) for c in names}
    cov = {c: np.array([e.coverage for e, _ in by_corpus[c]]) for c in names}
    agree = {c: np.array([e.agree for e, _ in by_corpus[c]]) for c in names}
    on = {c: np.array([label for _, label in by_corpus[c]]) for c in names}
    alone = np.round(np.arange(0.20, 0.601, 0.01), 2)
    with_words = np.round(np.arange(0.15, 0.401, 0.01), 2)
    coverage = np.round(np.arange(0.20, 1.201, 0.05), 2)

    # rates[c][i, j, l] = (on admitted, off admitted) for Gate(alone[i], with_words[j], coverage[l])
    rates = {}
    for c in names:
        first = cos[c][None, :] >= alone[:, None]  # (A, n)
        second = (cos[c][None, :] >= with_words[:, None])[:, None, :] & (
            (cov[c][None, :] >= coverage[:, None]) & agree[c][None, :]
        )[None, :, :]  # (B, R, n)
        adm = first[:, None, None, :] | second[None, :, :, :]  # (A, B, R, n)
        rates[c] = (adm[..., on[c]].mean(-1), adm[..., ~on[c]].mean(-1))

    def choose(over: list[str]) -> Gate:
        feasible = np.all([rates[c][1] <= max_off + 1e-9 for c in over], axis=0)
        feasible &= alone[:, None, None] >= with_words[None, :, None]
        j = np.array([rates[c][0] - rates[c][1] for c in over])  # Youden's J per corpus
        worst, mean = j.min(0), j.mean(0)
        best = np.round(np.where(feasible, worst, -9), 6)
        top = best == best.max()
        tied_mean = np.round(np.where(top, mean, -9), 6)
        tied = np.argwhere(tied_mean == tied_mean.max())
        i, jj, ll = tied[len(tied) // 2]
        return Gate(float(alone[i]), float(with_words[jj]), float(coverage[ll]))

    chosen = choose(names)
    rows = [_row("chosen (all corpora)", chosen, by_corpus)]
    rows.append(_row("in the code (hybrid.GATE)", hybrid.GATE, by_corpus))
    for c in names:
        rows.append(_row(f"fit to {c} alone", choose([c]), by_corpus))
    for floor in (0.25, 0.30, 0.35, 0.40, 0.45):
        rows.append(_row(f"cosine >= {floor:.2f} only", Gate(floor, floor, math.inf), by_corpus))
    return Calibration(chosen, rows)


def _row(name: str, gate: Gate, by_corpus: dict[str, list[tuple[Evidence, bool]]]) -> dict:
    shown = {k: (v if math.isfinite(v) else None) for k, v in dataclasses.asdict(gate).items()}  # JSON has no inf
    row: dict = {"rule": name, "gate": shown}
    for c, rows in by_corpus.items():
        row[c] = dict(zip(("on_topic_admitted", "off_topic_admitted"), admitted(rows, gate)))
    return row


# --------------------------------------------------------------------------- quality: the run


def run_quality(
    settings: Settings,
    embedder: Embedder | None = None,
    *,
    packages: Sequence[str] = PACKAGES,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict:
    """Both corpora: ranking metrics per mode, retrieval with and without the gate, the calibration."""
    embedder = embedder or Embedder.from_settings(settings)
    off_topic = load_questions(EVAL_DIR / "off-topic.jsonl", on_topic=False)
    out: dict = {"corpora": {}}
    by_corpus: dict[str, list[tuple[Evidence, bool]]] = {}
    with tempfile.TemporaryDirectory(prefix="llmweb-bench-quality-") as tmp:
        root = Path(tmp)
        qsettings = settings.replace(data_dir=root / "data")
        written = write_packages_corpus(root / "packages", packages)
        corpora = {
            "guide": ([GUIDE], load_questions(EVAL_DIR / "guide-questions.jsonl", on_topic=True)),
            "packages": ([root / "packages"], load_questions(EVAL_DIR / "packages-questions.jsonl", on_topic=True)),
        }
        for name, (paths, questions) in corpora.items():
            skipped = [q for q in questions if q.docs and not set(q.docs) & set(written)]
            questions = [q for q in questions if q not in skipped]
            index = Index(qsettings, namespace=f"eval-{name}", embedder=embedder)
            reports = index.ingest(paths, progress=progress)
            assert all(r.ok for r in reports), [r.message for r in reports if not r.ok]
            by_corpus[name] = evidence(index, [*questions, *off_topic], embedder)
            on_rate, off_rate = admitted(by_corpus[name], hybrid.GATE)
            out["corpora"][name] = {
                "documents": len(reports),
                "chunks": len(index),
                "on_topic": len(questions),
                "off_topic": len(off_topic),
                "skipped_questions": len(skipped),
                **{mode: ranking_metrics(index, questions, embedder, mode) for mode in ("dense", "keyword", "hybrid")},
                "on_topic_retrieves": retrieves(index, questions, embedder, settings),
                "off_topic_retrieves": retrieves(index, off_topic, embedder, settings),
                "gate": {"on_topic_admitted": on_rate, "off_topic_admitted": off_rate},
            }
    out["packages"] = written
    result = calibrate(by_corpus)
    out["calibration"] = {
        "chosen": dataclasses.asdict(result.gate),
        "in_code": dataclasses.asdict(hybrid.GATE),
        "matches_code": result.gate == hybrid.GATE,
        "table": result.rows,
    }
    return out


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
        (
            "hybrid search p50 / p95 (embed, both rankings, gate, fusion)",
            f"{result['hybrid_p50_ms']} / {result['hybrid_p95_ms']} ms",
        ),
        ("index load from disk (vectors, metadata, keyword index)", f"{result['index_load_ms']} ms"),
        ("index files", f"vectors {result['index_mb']} MB, keyword index {result['keyword_mb']} MB"),
    ]
    lines = ["| retrieval benchmark | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if "quality" in result:
        lines += ["", quality_markdown(result["quality"])]
    return "\n".join(lines)


def quality_markdown(q: dict) -> str:
    corpora = q["corpora"]
    lines = ["### Ranking (no gate, no floor)", ""]
    lines += [
        "| corpus | chunks | questions | ranking | recall@1 | recall@4 | MRR@10 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in corpora.items():
        for mode in ("dense", "keyword", "hybrid"):
            m = c[mode]
            lines.append(
                f"| {name} | {c['chunks']} | {c['on_topic']} | {mode} | "
                f"{m['recall_at_1']:.3f} | {m['recall_at_4']:.3f} | {m['mrr']:.3f} |"
            )
    lines += ["", "### What retrieves anything (share of messages)", ""]
    lines += ["| corpus | messages | with the gate | old rule: cosine >= min_score |", "|---|---|---|---|"]
    for name, c in corpora.items():
        for kind in ("on_topic", "off_topic"):
            r = c[f"{kind}_retrieves"]
            lines.append(
                f"| {name} | {c[kind]} {kind.replace('_', '-')} | {r['gated']:.1%} | {r['cosine_floor']:.1%} |"
            )
    cal = q["calibration"]
    lines += ["", "### Gate calibration (share admitted: on-topic / off-topic)", ""]
    names = list(corpora)
    lines += [
        "| rule | cosine alone | cosine with words | coverage | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for row in cal["table"]:
        g = row["gate"]
        words = g["coverage"] is not None  # the plain cosine floors have no second clause
        cells = [
            f"{row['rule']}",
            f"{g['cosine_alone']:.2f}",
            f"{g['cosine_with_words']:.2f}" if words else "-",
            f"{g['coverage']:.2f}" if words else "-",
            *(f"{row[n]['on_topic_admitted']:.1%} / {row[n]['off_topic_admitted']:.1%}" for n in names),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    verdict = "matches" if cal["matches_code"] else "DIFFERS FROM"
    lines += ["", f"The chosen rule {verdict} hybrid.GATE. Packages: {', '.join(q['packages'])}."]
    return "\n".join(lines)
