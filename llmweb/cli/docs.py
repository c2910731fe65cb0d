"""CLI for documents: `python -m llmweb ingest PATH...` and `python -m llmweb search QUERY`.

Both work on the SHARED library (what every visitor searches); visitors' private uploads are
the UI's business and are not reachable from here. `search` answers as a chat turn would: the
hybrid ranking behind the relevance gate, so an off-topic query prints "nothing relevant";
`--raw` skips the gate and shows every figure behind the ranking (cosine, dense and keyword
ranks, BM25, the fused score) and the gate's evidence.

It must not rank, gate or index itself (retrieval/ does) nor load the chat model.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from llmweb.config import Settings


def add_parsers(sub) -> None:
    i = sub.add_parser("ingest", help="add files or folders (recursively) to the shared document library")
    i.add_argument("paths", nargs="+")
    i.set_defaults(func=cmd_ingest)
    s = sub.add_parser("search", help="search the shared document library")
    s.add_argument("query")
    s.add_argument("--k", type=int, default=None)
    s.add_argument("--min-score", type=float, default=None)
    s.add_argument("--json", action="store_true")
    s.add_argument("--raw", action="store_true", help="skip the relevance gate; show the ranking's figures")
    s.set_defaults(func=cmd_search)


class _Bar:
    """A tqdm bar per phase (reading files, embedding chunks), fed by the index's progress calls."""

    def __init__(self):
        from tqdm import tqdm

        self.tqdm, self.bar, self.phase = tqdm, None, None

    def __call__(self, done: int, total: int, what: str) -> None:
        phase = "embedding" if what == "embedding" else "reading"
        if phase != self.phase:
            self.close()
            self.phase = phase
            self.bar = self.tqdm(
                total=total, desc=phase, unit="chunk" if phase == "embedding" else "file", file=sys.stderr
            )
        self.bar.total = total
        self.bar.n = done
        if phase == "reading":
            self.bar.set_postfix_str(what[-40:])
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_ingest(args) -> int:
    from llmweb.retrieval.library import Library

    library = Library(Settings.from_env())
    bar = _Bar()
    try:
        reports = library.ingest_shared(args.paths, progress=bar)
    finally:
        bar.close()
    for r in reports:
        print(("ok    " if r.ok else "error ") + r.describe())
    failed = sum(not r.ok for r in reports)
    print(
        f"{len(reports) - failed} of {len(reports)} files indexed; {len(library.shared)} chunks in the shared library."
    )
    return 1 if failed and failed == len(reports) else 0


def cmd_search(args) -> int:
    from llmweb.retrieval.hybrid import GATE
    from llmweb.retrieval.library import Library

    library = Library(Settings.from_env())
    found = library.retrieve(None, args.query, k=args.k, min_score=args.min_score, raw=args.raw)
    rows: list[dict[str, Any]] = []
    for s in found.scored:
        c = s.chunk
        row: dict[str, Any] = {"source": c.source, "page": c.page, "text": c.text, "score": round(float(c.score), 4)}
        if args.raw:
            row.update(
                heading=c.heading,
                start=c.start,
                end=c.end,
                fused=round(s.fused, 5),
                dense_rank=s.dense_rank,
                keyword_rank=s.keyword_rank,
                bm25=None if s.bm25 is None else round(s.bm25, 3),
                rerank=None if s.rerank is None else round(s.rerank, 4),
            )
        rows.append(row)
    if args.json:
        out: Any = rows
        if args.raw:
            gate = [{**dataclasses.asdict(e), "relevant": GATE.admits(e)} for e in found.evidence]
            out = {"results": rows, "gate": gate}
        print(json.dumps(out, ensure_ascii=False, indent=2))
        return 0
    if args.raw:
        for e in found.evidence:  # what the gate would say (--raw does not apply it)
            verdict = "relevant" if GATE.admits(e) else "NOT relevant"
            print(f"gate: {verdict} (top cosine {e.cosine:.3f}, keyword coverage {e.coverage:.2f}, agree {e.agree})\n")
    for i, r in enumerate(rows, 1):
        where = f", p. {r['page']}" if r["page"] else (f", {r['heading']}" if r.get("heading") else "")
        figures = f"score {r['score']:.3f}"
        if args.raw:
            ranks = f"dense #{r['dense_rank'] or '-'}, keyword #{r['keyword_rank'] or '-'}"
            bm25 = "" if r["bm25"] is None else f", bm25 {r['bm25']:.2f}"
            rerank = "" if r["rerank"] is None else f", rerank {r['rerank']:.3f}"
            figures = f"cosine {r['score']:.3f}, {ranks}{bm25}, fused {r['fused']:.4f}{rerank}"
        print(f"[{i}] {r['source']}{where} ({figures})\n    {' '.join(r['text'].split())[:300]}\n")
    if found.gated:
        print("Nothing relevant: the shared library does not seem to be about this (--raw shows the ranking anyway).")
    elif not rows:
        print("No matching passages (is anything indexed? `python -m llmweb ingest PATH`).")
    return 0
