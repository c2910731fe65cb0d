"""`python -m llmweb models fetch REPO [FILE] [--revision R]`: a model from the Hugging Face Hub into the
models folder, its plan (files, total size) printed first, then a progress line, then its path.
`python -m llmweb models list [--json]`: the models llmweb can serve (engine/catalog.py).

Each `models` subcommand registers in `add_parser` with its own `func`.
It owns the group's flags and output; it must not choose files or download (engine/hub.py does)
nor load a model. Refusals are LlmwebError sentences (cli/main.py prints them, exit 2).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from llmweb.config import Settings
from llmweb.engine import hub


def add_parser(sub) -> None:
    """Register `models fetch` on cli/main.py's subparsers."""
    m = sub.add_parser("models", help="models in the models folder: list them, fetch one from the Hugging Face Hub")
    models = m.add_subparsers(dest="models_command", metavar="COMMAND")
    models.required = True
    f = models.add_parser(
        "fetch",
        help="download a model from the Hugging Face Hub into the models folder (resumable)",
        description="A GGUF repo needs FILE, one of its .gguf files (without it, the command lists them); "
        "a transformers repo is fetched whole: config, tokenizer and safetensors, never pickle files. "
        "HF_TOKEN for gated repos, HF_ENDPOINT for a mirror, HF_HUB_OFFLINE=1 to refuse at once.",
    )
    f.add_argument("repo", metavar="REPO", help="the model's id on the Hub: owner/name")
    f.add_argument("file", metavar="FILE", nargs="?", default=None, help="a .gguf file of a GGUF repo")
    f.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    f.set_defaults(func=cmd_fetch)
    ls = models.add_parser("list", help="the models llmweb can serve: the embedded one and the models folder's")
    ls.add_argument("--json", action="store_true", help="one JSON object per model")
    ls.set_defaults(func=cmd_list)


def cmd_list(args, settings: Settings | None = None, out: TextIO = sys.stdout) -> int:
    """Every model with its format, size, trained context and KV bytes per token (engine/catalog.py)."""
    import json

    from llmweb.engine import catalog

    settings = settings or Settings.from_env()
    entries = catalog.scan(settings)
    if not args.json:
        print(f"models folder: {settings.models_folder}", file=out)
    for e in entries:
        row = {
            "id": e.id,
            "format": e.kind,
            "size_bytes": e.size_bytes,
            "context_train": e.context_train,
            "kv_bytes_per_token": e.kv_bytes_per_token,
            "architecture": e.architecture,
            "chat_template": e.chat_template,
            "embedded": e.embedded,
        }
        if args.json:
            print(json.dumps(row), file=out)
        else:
            template = "" if e.chat_template else " · no chat template (a plain one is used)"
            context = f"{e.context_train:,} ctx" if e.context_train else "context unknown"
            print(
                f"{e.id}  {e.kind} · {hub.human_bytes(e.size_bytes)} · {context} · {e.architecture}{template}",
                file=out,
            )
    return 0


def cmd_fetch(args, settings: Settings | None = None, out: TextIO = sys.stdout) -> int:
    settings = settings or Settings.from_env()
    plan = hub.plan(args.repo, args.file, args.revision)
    target = hub.destination(plan, settings.models_folder)
    print(f"fetching {plan.summary()}", file=out)
    for f in plan.files:
        print(f"  {f.name}  {hub.human_bytes(f.size)}", file=out)
    print(f"into {target}", file=out, flush=True)
    kept = hub.bytes_kept(plan, settings.models_folder)
    if kept and not target.exists():
        print(f"resuming: {hub.human_bytes(kept)} already here", file=out, flush=True)
    line = ProgressLine(out)
    try:
        path = hub.fetch(plan, settings.models_folder, line, max_bytes=settings.max_download_bytes)
    except KeyboardInterrupt:
        line.end()
        print("stopped: what arrived is kept, and the same command resumes from there", file=out, flush=True)
        raise
    line.end()
    print(f"fetched: {path}", file=out)
    print(f"to chat with it: LLMWEB_MODEL={path}", file=out, flush=True)
    return 0


class ProgressLine:
    """The progress callback of `fetch`: `52.4 MB of 105 MB (49%), 12.3 MB/s  model.gguf`, rewritten in
    place on a terminal (5 times a second at most); elsewhere (a log, a pipe) a line per 10%. The speed
    counts this run's bytes only, not those a resumed download already had."""

    def __init__(self, out: TextIO, tty: bool | None = None):
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self.t0 = 0.0
        self.first = -1
        self.shown_at = 0.0
        self.tenths = -1
        self.width = 0

    def __call__(self, done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if self.first < 0:
            self.t0, self.first = now, done
        speed = (done - self.first) / (now - self.t0) if now > self.t0 else 0.0
        pct = 100 * done / total if total else 100.0
        text = f"{hub.human_bytes(done)} of {hub.human_bytes(total)} ({pct:.0f}%), {hub.human_bytes(speed)}/s  {what}"
        if self.tty:
            if now - self.shown_at >= 0.2 or done == total:
                self.shown_at, self.width = now, max(self.width, len(text))
                self.out.write("\r" + text.ljust(self.width))
                self.out.flush()
        elif int(pct // 10) > self.tenths:
            self.tenths = int(pct // 10)
            print(text, file=self.out, flush=True)

    def end(self) -> None:
        if self.tty and self.width:
            self.out.write("\n")
            self.out.flush()
