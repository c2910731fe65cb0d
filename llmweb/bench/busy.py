"""`bench busy`: a reply's speed as people get it, on one real server, side by side in one run.

  api       a turn through the API with nothing else running: the quiet figure of the same server
  browser   the same message typed into the page by a visitor in a headless Chromium on this
            machine, which renders the stream as it arrives (a localhost user's laptop); one
            page, one chat that grows by a turn each time (WARM_TURNS turns before the first;
            with `history`, after that many turns of an imported chat: a long session's page)
  upload    the API turn again while another visitor's page uploads a PDF whose text is ten
            times its bytes (chunked, embedded and indexed in the server's process)

The api and upload cases each ask in a stateful API chat of their own that grows as the page's
does (the same warm-up turns, the same imported history), so in every repeat the three replies
start at the same turn of their chats and the same prompt length: decoding slows as the context
grows (llama-bench: ~125 tok/s at a 45-token prompt, ~90 at 700, on the 2-core machine), so a
page turn at 700 tokens against a fresh one-message request would count the depth as the browser's
cost. Each row prints its prompt's tokens.

Before the cases, the page sits idle for IDLE_S (its warm-up turns over): Chromium's CPU then, in
cores, is what an open tab costs the machine between turns.

Each case runs once per repeat, interleaved (the machine's drift hits all alike), CASE_GAP_S after
the one before: long enough for the thread governor to read the pause as an idle spell, so that
no case starts on the decision the one before it left (a reply after a page turn would otherwise
start on one thread). Per row: decode tok/s (the turn's own stats), TTFT, and the turn's wall time
measured from outside the server; the ratios are the median of each repeat's case against that
repeat's api turn. CPU seconds of the web process, of the
engine process and of Chromium during each turn show where the cores went (the web process's, in
the browser case against the api case: what showing the page a reply costs the server).

The server is `python -m llmweb serve` as a user starts it (defaults on: the bundled guide, so
every turn retrieves; the loop guard; the thread governor) on a free port over a temporary data
dir. The browser is /usr/bin/chromium through playwright (requirements-dev.txt); without either,
the command says so and stops. Its turns are read back from the server's SQLite file, read-only.

Where llama.cpp's `llama-bench` is found (LLMWEB_LLAMA_BENCH or the PATH), it then decodes as many
tokens after each prompt length the page's turns had, on 1 thread and on every core: the bounds a
reply decoded on fewer threads meets (the governor gives one up while Chromium renders).

Must not: be imported by the product; leave the server or Chromium running when it ends.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from llmweb.engine.runners.threads import STALE_S
from llmweb.errors import ConfigError

from .served import START_S, TURN_S, Served, cpu_seconds, cpu_used, nginx_exe, nginx_proxy, serve, wait_for

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
MESSAGE = "Write a poem about the sea."
MESSAGE_BOX = 'textarea[data-testid="textbox"][placeholder^="Ask anything"]'
CASES = ("api", "browser", "upload", "proxy")
PAGES = ("browser", "proxy")  # the cases typed into a page: the first directly, the second through nginx
API_CHATS = ("api", "upload")  # the cases that ask through the API, each in a chat of its own
EXPANSION = 10  # the upload's text is at least this many times its file's bytes
WARM_TURNS = 2  # the page's chat has this many turns before its first measured one
UPLOAD_CHARS = 600_000  # its text (about 600 chunks to embed: tens of seconds on 2 cores)
UPLOAD_S = 900.0
SETTLE_S = 3.0  # after the last warm-up turn, before the idle page is measured
IDLE_S = 5.0
CASE_GAP_S = STALE_S + 0.5  # between cases: the governor's next reading spans an idle spell


def run(
    new_tokens: int = 160,
    repeats: int = 3,
    progress: Callable[[str], None] = print,
    history: int = 0,
    upload_chars: int = UPLOAD_CHARS,
) -> dict:
    """Start a server and a browser, run every case `repeats` times, and return the rows. With
    `history`, the page's chat is an imported one of that many turns (as a long session's is);
    `upload_chars`, the text of each upload (a test's shorter run)."""
    sync_playwright = _playwright()
    rows: list[dict] = []
    trusted = {"LLMWEB_TRUSTED_PROXIES": "127.0.0.1"}  # the proxy case's nginx, as a deployment lists it
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="llmweb-busy-"))
        srv = stack.enter_context(serve(Path(tmp), new_tokens, progress, env=trusted))
        proxy_url = stack.enter_context(nginx_proxy(srv.url, Path(tmp) / "nginx")) if nginx_exe() else None
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                # one visitor, whose chat grows as people's do; a second through nginx, if there is one
                pages = {"browser": _open(browser.new_context(), srv)}
                if proxy_url:
                    pages["proxy"] = _open(browser.new_context(), srv, url=proxy_url)
                else:
                    progress("bench busy: no nginx on the PATH, so no proxy case")
                chats = dict.fromkeys(API_CHATS, "new")  # the api and upload cases' own chats, through the API
                if history:
                    progress(f"bench busy: importing a chat of {history} turns into the pages and the API's chats…")
                    for case, page in pages.items():
                        _import_chat(page, Path(tmp), history, f"history-{case}.json")
                    chats = dict(zip(API_CHATS, _owner_imports(browser, srv, Path(tmp), history), strict=True))
                progress(f"bench busy: {WARM_TURNS} warm-up turns in each chat…")
                for turn in range(WARM_TURNS):
                    for page in pages.values():
                        _page_turn(srv, page, history + turn + 1)
                    for case in API_CHATS:
                        chats[case] = srv.api_turn(MESSAGE, new_tokens, chats[case])["conversation_id"]
                idle = _idle_browser_cores(srv)
                for r in range(repeats):
                    order = CASES if r % 2 == 0 else ("browser", "api", "proxy", "upload")
                    turn = history + WARM_TURNS + r + 1
                    for case in (c for c in order if c in pages or c in API_CHATS):
                        progress(f"bench busy: repeat {r + 1}/{repeats}, {case}…")
                        time.sleep(CASE_GAP_S)
                        if case in pages:
                            row = _page_turn(srv, pages[case], turn, through="nginx" if case == "proxy" else "")
                        else:
                            ask = (new_tokens, r, chats[case], turn, upload_chars)
                            row = _case(case, srv, browser, Path(tmp), *ask)
                        rows.append({"case": case, "repeat": r + 1, **row})
            finally:
                browser.close()
        depths = sorted({r["prompt_tokens"] for r in rows if r["case"] == "browser"})
        reference = _llama_bench(depths, new_tokens, progress)
    return {
        "bench": "busy",
        "message": MESSAGE,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "history": history,
        "idle_browser_cores": round(idle, 3),
        "rows": rows,
        "summary": summarize(rows),
        "llama_bench": reference,
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per case: the median of each figure over its repeats, and its ratios to the api case's, as
    the median over repeats of each repeat's own ratio (a repeat's cases are at the same turn of
    their chats: the same prompt length; the next repeat's are a turn further)."""
    out = []
    quiet = {r["repeat"]: r for r in rows if r["case"] == "api"}
    for case in CASES:
        rs = [r for r in rows if r["case"] == case]
        if not rs:
            continue

        def med(key: str, rs=rs) -> float:
            return statistics.median(r[key] for r in rs)

        def vs_api(key: str, rs=rs) -> float:
            pairs = [r[key] / max(quiet[r["repeat"]][key], 1e-9) for r in rs if r["repeat"] in quiet]
            return round(statistics.median(pairs), 2) if pairs else 0.0

        out.append(
            {
                "case": case,
                "runs": len(rs),
                "prompt_tokens": round(med("prompt_tokens")) if all("prompt_tokens" in r for r in rs) else 0,
                "decode_tok_s": round(med("decode_tok_s"), 1),
                "wall_s": round(med("wall_s"), 2),
                "decode_vs_api": vs_api("decode_tok_s"),
                "seen_ttft_s": _median_of(rs, "seen_ttft_s"),
                "wall_vs_api": vs_api("wall_s"),
            }
        )
    return out


def _median_of(rs: list[dict], key: str) -> float | None:
    got = [r[key] for r in rs if r.get(key) is not None]
    return round(statistics.median(got), 3) if got else None


def markdown(r: dict) -> str:
    head = [
        f"`bench busy`: {r['message']!r}, up to {r['new_tokens']} new tokens, {r['repeats']} repeats, one server"
        + (f"; the page's chat imported with {r['history']} turns." if r.get("history") else "."),
        "",
        "| case | prompt tokens | decode tok/s | × api | turn wall s | × api | first text seen s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in r["summary"]:
        seen = "—" if s.get("seen_ttft_s") is None else f"{s['seen_ttft_s']:.2f}"
        head.append(
            f"| {s['case']} | {s.get('prompt_tokens', 0)} | {s['decode_tok_s']:.1f} | {s['decode_vs_api']:.2f} | "
            f"{s['wall_s']:.2f} | {s['wall_vs_api']:.2f} | {seen} |"
        )
    head += ["", "(Medians over the repeats; each × api is the median of a repeat's case against its api turn.)"]
    if "idle_browser_cores" in r:
        cores = r["idle_browser_cores"]
        head += ["", f"Chromium with the page open and idle for {IDLE_S:.0f} s: {cores:.3f} of a core."]
    if r.get("llama_bench"):
        head += _reference_table(r)
    cpu = "web CPU s | engine CPU s | Chromium CPU s"
    seen = "first text seen s | updates seen"
    head += ["", f"| case | repeat | prompt tokens | tokens | decode tok/s | TTFT s | {seen} | wall s | {cpu} | note |"]
    head.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for x in r["rows"]:
        first = "—" if x.get("seen_ttft_s") is None else f"{x['seen_ttft_s']:.2f}"
        head.append(
            f"| {x['case']} | {x['repeat']} | {x.get('prompt_tokens', 0)} | {x['tokens']} | {x['decode_tok_s']:.1f} | "
            f"{x['ttft_s']:.2f} | {first} | {x.get('seen_updates', '—')} | "
            f"{x['wall_s']:.2f} | {x['web_cpu_s']:.2f} | {x['engine_cpu_s']:.1f} | {x['browser_cpu_s']:.2f} | "
            f"{x.get('note', '')} |"
        )
    return "\n".join(head)


def _reference_table(r: dict) -> list[str]:
    """Per repeat: the api and browser turns' decode beside llama-bench's at their prompt length."""
    ref = {(x["prompt_tokens"], x["threads"]): x["decode_tok_s"] for x in r["llama_bench"]}
    threads = sorted({t for _, t in ref})
    cols = " | ".join(f"llama-bench, {t} thread{'s' if t > 1 else ''}" for t in threads)
    out = ["", f"| repeat | prompt tokens | api tok/s | browser tok/s | {cols} |", "|---:" * (4 + len(threads)) + "|"]
    for rep in sorted({x["repeat"] for x in r["rows"]}):
        got = {x["case"]: x for x in r["rows"] if x["repeat"] == rep}
        if "browser" not in got or "api" not in got:
            continue
        depth = got["browser"]["prompt_tokens"]
        refs = " | ".join(f"{ref[(depth, t)]:.1f}" if (depth, t) in ref else "—" for t in threads)
        api = f"{got['api']['decode_tok_s']:.1f}" if got["api"]["prompt_tokens"] == depth else "—"
        out.append(f"| {rep} | {depth} | {api} | {got['browser']['decode_tok_s']:.1f} | {refs} |")
    return out


# -- the cases -------------------------------------------------------------------------------------


def _llama_bench(depths: list[int], new_tokens: int, progress: Callable[[str], None]) -> list[dict]:
    """llama-bench's decode of `new_tokens` after each of `depths` on the file served, on 1 thread
    and on every core (what the server decodes with); [] without llama-bench."""
    from llmweb.config import Settings
    from llmweb.engine import gguf, models

    from .common import llama_bench_tests, llama_tool

    if not llama_tool("llama-bench") or not depths:
        progress("bench busy: no llama-bench (LLMWEB_LLAMA_BENCH), so no reference rates")
        return []
    served, _, _ = models.served_gguf(Settings.from_env(), progress)  # the file the served app loads
    threads = sorted({1, gguf.default_threads()})
    progress(f"bench busy: llama-bench at the page's prompt lengths, on {' and '.join(map(str, threads))} threads…")
    args = ["-p", "0", "-n", str(new_tokens), "-d", ",".join(map(str, depths)), "-t", ",".join(map(str, threads))]
    tests = llama_bench_tests(served, [*args, "-r", "1"], progress, "busy") or []
    return [
        {"prompt_tokens": t["n_depth"], "threads": t["n_threads"], "decode_tok_s": round(float(t["avg_ts"]), 1)}
        for t in tests
    ]


def _case(
    case: str, srv: Served, browser, tmp: Path, new_tokens: int, r: int, chat: str, turn: int, upload_chars: int
) -> dict:
    """The api case, or the upload case: a second visitor's page uploads, the API asks meanwhile;
    either asks as turn `turn` of its own chat through the API, `chat`."""
    note = f"turn {turn} of its API chat"
    if case == "api":
        return srv.measured(lambda: srv.api_turn(MESSAGE, new_tokens, chat)) | {"note": note}
    pdf = tmp / f"field-notes-{r + 1}.pdf"
    pdf.write_bytes(expanding_pdf(r, upload_chars))
    context = browser.new_context()
    try:
        page = _open(context, srv)
        page.locator("#llmweb-documents").get_by_text("Documents", exact=True).first.click()
        page.locator("#llmweb-upload input[type=file]").set_input_files(str(pdf))
        embedding = wait_for(lambda: "embedding" in page.locator("body").inner_text().lower(), 120, "", quiet=True)
        row = srv.measured(lambda: srv.api_turn(MESSAGE, new_tokens, chat))
        listed = pdf.name in page.locator("#llmweb-doclist").inner_text()
        row["note"] = (
            f"{note}; "
            + ("began before the upload embedded; " if not embedding else "")
            + ("the upload ended during the turn" if listed else "the upload still indexing at the end")
        )
        wait_for(lambda: pdf.name in page.locator("#llmweb-doclist").inner_text(), UPLOAD_S, "the upload to finish")
        return row
    finally:
        context.close()


def _idle_browser_cores(srv: Served) -> float:
    """Chromium's CPU, in cores, while its one page sits idle for IDLE_S (after SETTLE_S)."""
    time.sleep(SETTLE_S)
    before = cpu_seconds(srv.proc.pid)
    t0 = time.perf_counter()
    time.sleep(IDLE_S)
    _web, _engine, browser = cpu_used(before, cpu_seconds(srv.proc.pid), srv.proc.pid)
    return browser / (time.perf_counter() - t0)


# Installed as Send is clicked: when the page first shows any of the new reply's text (not the "…"
# it shows before), and how many times its text changes, seen by a MutationObserver on the chat
# (no polling: it adds no frames)
WATCH_REPLY = """(sel) => {
    const bubbles = () => document.querySelectorAll(sel);
    const last = () => { const b = bubbles(); return b.length ? b[b.length - 1].textContent : ''; };
    const s = {t0: performance.now(), before: last(), text: null, first: null, updates: 0};
    window.__llmwebSeen = s;
    new MutationObserver(() => {
        const text = last();
        if (text === s.text || text === s.before) return;
        s.text = text;
        s.updates += 1;
        if (s.first === null && !['', PLACEHOLDER].includes(text.trim())) s.first = performance.now();
    }).observe(document.querySelector('#llmweb-chat'), {subtree: true, childList: true, characterData: true});
    document.querySelector('#llmweb-send').click();
}"""
PLACEHOLDER = "…"  # web/panels/chat.py's reply before its first words
REPLY_BUBBLES = '#llmweb-chat .message:not(.thought) > [data-testid="bot"]'


def _page_turn(srv: Served, page, turn: int, through: str = "") -> dict:
    """The visitor's page asks MESSAGE in its chat (turn `turn` of it); the finished turn is read
    back from the server's store, with when the page showed its first text after Send and how many
    times it showed the reply's text change."""
    before = srv.finished_turns()

    def ask() -> dict:
        page.locator(MESSAGE_BOX).fill(MESSAGE)
        page.evaluate(WATCH_REPLY.replace("PLACEHOLDER", repr(PLACEHOLDER)), REPLY_BUBBLES)
        return wait_for(lambda: srv.newest_turn(before), TURN_S, "the page's turn to be stored")

    row = srv.measured(ask)
    time.sleep(0.2)  # the last update's render
    seen = page.evaluate("() => window.__llmwebSeen")
    row["seen_ttft_s"] = round((seen["first"] - seen["t0"]) / 1000, 3) if seen["first"] is not None else None
    row["seen_updates"] = seen["updates"]
    return row | {"note": f"turn {turn} of the page's chat" + (f", through {through}" if through else "")}


IMPORT_INPUT = 'input[data-testid="Import .json-upload-button"]'  # the page's Import button's file input
SETTLED = 4  # the imported chat's turns not yet in its summary


def _import_chat(page, tmp: Path, turns: int, name: str = "history.json") -> None:
    """Open, on `page`, an imported chat of `turns` turns (the export of one written here, as the
    file `name`: a page's file input takes the same file twice as no change)."""
    exported = tmp / "history.json"
    if not exported.exists():
        _export_chat(tmp, turns)
    if name != exported.name:
        (tmp / name).write_bytes(exported.read_bytes())
    page.locator(IMPORT_INPUT).set_input_files(str(tmp / name))
    wait_for(lambda: "Imported" in page.locator("#llmweb-stats").inner_text(), START_S, "the imported chat to open")


def _owner_imports(browser, srv: Served, tmp: Path, turns: int) -> list[str]:
    """The API cases' chats: the same chat as the page's, imported by the owner's page (the API's
    local key acts for the owner) once per case; their ids."""
    context = browser.new_context()
    try:
        page = _open(context, srv, owner=True)
        ids: list[str] = []
        for case in API_CHATS:
            before = srv.conversations()
            _import_chat(page, tmp, turns, f"history-{case}.json")

            def new(before: set[str] = before) -> str | None:
                return next(iter(srv.conversations() - before), None)

            ids.append(wait_for(new, START_S, "the import"))
        return ids
    finally:
        context.close()


def _export_chat(tmp: Path, turns: int) -> None:
    from llmweb.records import LOCAL_OWNER
    from llmweb.store.db import Store

    with Store(tmp / "history.sqlite3") as store:
        conv = store.create_conversation(LOCAL_OWNER)
        for i in range(turns):
            store.add_turn(
                LOCAL_OWNER, conv, f"{MESSAGE} (number {i + 1})", f"A poem, number {i + 1}: " + "waves " * 80
            )
        # settled as a long session is: its older turns already in the summary (no backlog to fold)
        store.set_summary(LOCAL_OWNER, conv, "The user asked for poems about the sea.", max(turns - SETTLED, 0))
        exported = tmp / "history.json"
        exported.write_text(store.export_json(LOCAL_OWNER, conv), encoding="utf-8")


def _open(context, srv: Served, owner: bool = False, url: str = ""):
    """A page of the app: an anonymous visitor's (at `url`: a proxy's), or (`owner`) the owner's,
    through the link `serve` prints."""
    page = context.new_page()
    page.set_default_timeout(120_000)
    page.goto((url or srv.url) + (f"?token={srv.owner_token}" if owner else ""), wait_until="domcontentloaded")
    wait_for(lambda: "Ready" in page.locator("#llmweb-status").inner_text(), START_S, 'the status line to say "Ready"')
    page.locator(MESSAGE_BOX).wait_for(state="visible")
    return page


def expanding_pdf(seed: int, chars: int = UPLOAD_CHARS) -> bytes:
    """A PDF of field notes whose extracted text is at least EXPANSION times its bytes: Flate-
    compressed pages of lines that differ (so every chunk is its own), as a report generator writes."""
    from llmweb.bench.hostile import pdf_pages

    lines_per_page, line = 120, "Plot {n:06d} of survey {s}: soil moist, three oaks, one fallen birch, no frost."
    n_lines = chars // len(line.format(n=0, s=seed)) + 1
    streams = []
    for start in range(0, n_lines, lines_per_page):
        text = " ".join(
            f"({line.format(n=n, s=seed)}) Tj T*" for n in range(start, min(start + lines_per_page, n_lines))
        )
        streams.append(f"BT /F1 6 Tf 7 TL 36 760 Td {text} ET".encode("latin-1"))
    data = pdf_pages(streams, flate=True)
    assert n_lines * len(line.format(n=0, s=seed)) >= EXPANSION * len(data), "the PDF does not expand tenfold"
    return data


def _playwright():
    if not CHROMIUM.exists():
        raise ConfigError(f"bench busy needs a browser: {CHROMIUM} is missing (Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise ConfigError("bench busy needs playwright: pip install -r requirements-dev.txt") from None
    return sync_playwright
