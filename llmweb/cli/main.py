"""Command line: `python -m llmweb serve | replay | ingest | search | user | models | bench | capacity`.

Settings come from `LLMWEB_*` variables; flags override them. Domain errors end the command
with their message and exit status 2, never a traceback; `replay` is the exception per turn: a
refused turn is reported in its row, the script goes on, and the exit status is 1.

It owns the commands' flags, their Settings and their output; it must not hold policy (the
runtime, the chat and the web layer do) nor start anything but through a `Runtime`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from llmweb.config import Settings
from llmweb.errors import LlmwebError
from llmweb.records import LOCAL_OWNER as LOCAL
from llmweb.records import VIEW_WORDS

log = logging.getLogger("llmweb")


def on_spaces(env=os.environ) -> bool:
    return env.get("SYSTEM") == "spaces"


# Gradio's own queue must never refuse before the engine's waiting room does (LLMWEB_MAX_WAIT_S: bounded by
# the estimated wait, not a count); with no concurrency limit its events leave it at once.
GRADIO_QUEUE_SIZE = 4096


PRIVATE_UMASK = 0o077  # every file and folder llmweb creates: 0600 / 0700


def serve_settings(args, env=os.environ) -> Settings:
    """Settings for `serve`: on Hugging Face Spaces, bind 0.0.0.0, keep data in a writable dir, and take
    the client's address from the Space's ingress (web/trust.py: SPACES_INGRESS), unless
    LLMWEB_TRUSTED_PROXIES says otherwise."""
    from llmweb.web.trust import SPACES_INGRESS

    overrides = {"host": args.host, "port": args.port}
    if on_spaces(env):
        overrides["host"] = args.host or "0.0.0.0"
        if not env.get("LLMWEB_TRUSTED_PROXIES"):
            overrides["trusted_proxies"] = SPACES_INGRESS
        if "LLMWEB_DATA_DIR" not in env:
            overrides["data_dir"] = Path("/data/llmweb") if os.access("/data", os.W_OK) else Path("/tmp/llmweb")
    return Settings.from_env(env, **overrides)


def cmd_serve(args) -> int:
    from llmweb.runtime import Runtime

    settings = serve_settings(args)
    runtime = Runtime(settings).start(background=True)
    demo, _url = launch_app(runtime, quiet=True, prevent_thread_lock=True)
    print(serving_lines(settings), flush=True)  # after the server is up, and the owner's link last
    demo.block_thread()
    return 0


def serving_lines(settings: Settings, port: int | None = None) -> str:
    """What `serve` prints: the address, and on a single-user install the owner's link (web/owner.py)."""
    from llmweb.web.owner import API_KEY_FILE, owner_link

    lines = [f"llmweb: serving on http://{settings.host}:{port or settings.port} (OpenAI-compatible API under /v1)"]
    if settings.is_single_user and settings.single_user != "1":
        lines += [
            "llmweb: open this link to use llmweb as this machine's owner (your chats and documents):",
            f"    {owner_link(settings, port)}",
            f"llmweb: the API's key for this machine is in {settings.data_dir / API_KEY_FILE}",
        ]
    return "\n".join(lines)


def launch_app(runtime, **overrides):
    """Serve the web UI and the OpenAI-compatible API (web/api/) on one port: Gradio's FastAPI app with
    the API's routes and the fixed page file (web/page_assets.py) in front of its own, and the owner
    link's middleware (web/owner.py) in front of all. Blocks, unless `prevent_thread_lock=True`
    (tests); returns (demo, url)."""
    from starlette.middleware import Middleware

    from llmweb.web.api.routes import api_routes
    from llmweb.web.body_cap import validation_handlers
    from llmweb.web.owner import OwnerLink
    from llmweb.web.page_assets import page_asset_routes
    from llmweb.web.ui import body_cap, build_app, launch_kwargs

    demo = build_app(runtime)
    demo.queue(default_concurrency_limit=None, max_size=GRADIO_QUEUE_SIZE)
    middleware = [Middleware(OwnerLink, settings=runtime.settings), body_cap(runtime.settings)]
    app_kwargs = {
        "routes": api_routes(runtime) + page_asset_routes(),
        "middleware": middleware,
        "exception_handlers": validation_handlers(),  # a 422 that never quotes the input
    }
    kw = {**launch_kwargs(runtime.settings), "app_kwargs": app_kwargs, **overrides}
    _app, url, _ = demo.launch(**kw)
    return demo, url


def read_script(path: Path) -> list[str | dict]:
    """A replay script's lines: {"user": "..."}, optionally with "documents": [names or ids] (the
    documents the chat reads from that line on; [] none) and "view": "keep" | "leave_out" |
    "as_planned" (the say its turn gets once answered, as the page's "What the model sees" gives
    it). A line is its message, or the object when it sets either."""
    lines: list[str | dict] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            user, documents, view = d["user"], d.get("documents"), d.get("view")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise LlmwebError(f'{path}:{n}: expected a JSON object like {{"user": "..."}}') from None
        if documents is not None and not (isinstance(documents, list) and all(isinstance(x, str) for x in documents)):
            raise LlmwebError(f'{path}:{n}: "documents" is a list of document names or ids') from None
        if view is not None and (not isinstance(view, str) or view not in VIEW_WORDS):
            raise LlmwebError(f'{path}:{n}: "view" is "keep", "leave_out" or "as_planned"') from None
        extra = {k: v for k, v in (("documents", documents), ("view", view)) if v is not None}
        lines.append({"user": user, **extra} if extra else user)
    return lines


def replay(
    runtime, users: list, *, prompt_text: bool = False, conv_id: str | None = None, seed: int | None = None
) -> Iterator[dict]:
    """Run a scripted conversation through the chat path; yield one dict per message of the script.

    `turn` is the message's place in the script (1-based). A message the chat refuses (empty, too
    long, not text, the model busy or out of memory: any LlmwebError) yields
    `{"turn", "user", "error"}` with the user's message, and the script goes on with the next one.
    """
    from llmweb.chat import scope

    chat = runtime.wait_ready()
    for n, line in enumerate(users, 1):
        user = line["user"] if isinstance(line, dict) else line
        said = line if isinstance(line, dict) else {}
        try:
            if "documents" in said:  # the documents the chat reads from here on, kept with it as in the page
                conv_id = conv_id or runtime.store.create_conversation(LOCAL)
                scope.choose(runtime.store, chat.library, LOCAL, conv_id, said["documents"])
            event = chat.ask(LOCAL, conv_id, user, wait_summary=True, seed=seed)  # the first turn creates the chat
            if "view" in said:  # this turn kept in context or left out from the next prompt on
                chat.set_view(LOCAL, event.conv_id, [(event.stats.turn - 1, VIEW_WORDS[said["view"]])])
        except LlmwebError as e:
            yield {"turn": n, "user": user, "error": str(e)}
            continue
        conv_id = event.conv_id
        d = {**event.stats.to_dict(), "turn": n, "reply": event.reply, "sources": [s.to_dict() for s in event.sources]}
        if prompt_text:
            d["prompt_text"] = event.prompt_text()
        yield d


def replay_line(d: dict) -> str:
    """A replay row for people (without --json)."""
    if "error" in d:
        return f"[{d['turn']}] refused: {d['error']}\n"
    reused = f"{d['reused_tokens']} reused" if d.get("reuse_reported", True) else "reuse not reported by the engine"
    return (
        f"[{d['turn']}] {d['prompt_tokens']} prompt tokens ({reused}), "
        f"{d['generated_tokens']} generated, TTFT {d['ttft_s']:.2f} s\n{d['reply']}\n"
    )


def cmd_replay(args) -> int:
    """Exit status 0 when every turn ran, 1 when any turn was refused (each in its row)."""
    from llmweb.runtime import Runtime

    settings = Settings.from_env()
    users = read_script(Path(args.file))
    runtime = Runtime(settings).start(background=False)
    refused = 0
    try:
        for d in replay(runtime, users, prompt_text=args.prompt_text, seed=args.seed):
            refused += "error" in d
            print(json.dumps(d, ensure_ascii=False) if args.json else replay_line(d), flush=True)
        if settings.engine_url:  # what this process holds while a server generates: no weights
            import psutil

            rss = psutil.Process().memory_info().rss
            print(f"llmweb: process RSS {rss / 2**20:,.0f} MiB (remote engine {settings.engine_url})", file=sys.stderr)
    finally:
        runtime.close()
    if refused:
        print(f"llmweb: {refused} of {len(users)} turns were refused", file=sys.stderr)
    return 1 if refused else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llmweb", description="llmweb: long local-LLM chat sessions")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command")

    s = sub.add_parser("serve", help="serve the web app (default)")
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("replay", help='run a scripted conversation (JSON lines of {"user": ...})')
    r.add_argument("file")
    r.add_argument("--json", action="store_true", help="one JSON object per turn")
    r.add_argument("--prompt-text", action="store_true", help="include each turn's full prompt text")
    r.add_argument("--seed", type=int, default=None)
    r.set_defaults(func=cmd_replay)

    from llmweb import bench
    from llmweb.cli import docs as docs_cli
    from llmweb.cli import models, user

    docs_cli.add_parsers(sub)
    user.add_parser(sub)  # user add | remove | list | key
    models.add_parser(sub)  # models fetch
    bench.register(sub)  # bench, capacity
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "-v", "--verbose"):
        argv = ["serve"] + argv
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(argv + ["serve"])
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from llmweb.engine.models import configure_allocator

    configure_allocator()
    os.umask(PRIVATE_UMASK)  # the database, users file, secret and indexes: this user's alone
    try:
        return args.func(args)
    except LlmwebError as e:
        print(f"llmweb: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
