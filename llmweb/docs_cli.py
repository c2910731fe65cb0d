"""CLI for documents: `python -m llmweb ingest PATH...` and `python -m llmweb search QUERY`."""

from __future__ import annotations

import json

from .config import Settings


def add_parsers(sub) -> None:
    i = sub.add_parser("ingest", help="add files or folders (recursively) to the document index")
    i.add_argument("paths", nargs="+")
    i.set_defaults(func=cmd_ingest)
    s = sub.add_parser("search", help="search the document index")
    s.add_argument("query")
    s.add_argument("--k", type=int, default=None)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_search)


def cmd_ingest(args) -> int:
    raise NotImplementedError


def cmd_search(args) -> int:
    raise NotImplementedError
