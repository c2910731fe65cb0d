"""CLI for documents: `python -m llmweb ingest PATH...` and `python -m llmweb search QUERY`.

Both work on the SHARED library (what every visitor searches); visitors' private uploads are
the UI's business and are not reachable from here.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .config import Settings


def add_parsers(sub) -> None:
    i = sub.add_parser("ingest", help="add files or folders (recursively) to the shared document library")
    i.add_argument("paths", nargs="+")
    i.set_defaults(func=cmd_ingest)
    s = sub.add_parser("search", help="search the shared document library")
    s.add_argument("query")
    s.add_argument("--k", type=int, default=None)
    s.add_argument("--min-score", type=float, default=None)
    s.add_argument("--json", action="store_true")
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
    from .library import Library

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
    from .library import Library

    hits = Library(Settings.from_env()).shared.search(args.query, k=args.k, min_score=args.min_score)
    rows: list[dict[str, Any]] = [
        {"source": c.source, "page": c.page, "text": c.text, "score": round(float(c.score), 4)} for c in hits
    ]
    if args.json:
        print(json.dumps(rows, ensure_ascii=False, indent=2))
    else:
        for i, r in enumerate(rows, 1):
            where = f", p. {r['page']}" if r["page"] else ""
            print(f"[{i}] {r['source']}{where} (score {r['score']:.3f})\n    {' '.join(r['text'].split())[:300]}\n")
        if not rows:
            print("No matching passages (is anything indexed? `python -m llmweb ingest PATH`).")
    return 0
