"""`bench busy`: a reply's speed as people get it, on one real server, side by side in one run.

  api       an API request with nothing else running: the quiet figure of the same server
  browser   the same message typed into the page by a visitor in a headless Chromium on this
            machine, which renders the stream as it arrives (a localhost user's laptop); one
            page, one chat that grows by a turn each time (WARM_TURNS turns before the first;
            with `history`, after that many turns of an imported chat: a long session's page)
  upload    the API request again while another visitor's page uploads a PDF whose text is ten
            times its bytes (chunked, embedded and indexed in the server's process)

Before the cases, the page sits idle for IDLE_S (its warm-up turns over): Chromium's CPU then, in
cores, is what an open tab costs the machine between turns.

Each case runs once per repeat, interleaved (the machine's drift hits all alike). Per row: decode
tok/s (the turn's own stats), TTFT, and the turn's wall time measured from outside the server; the
ratios are each case's median against the api case's. CPU seconds of the web process, of the
engine process and of Chromium during each turn show where the cores went (the web process's, in
the browser case against the api case: what showing the page a reply costs the server).

The server is `python -m llmweb serve` as a user starts it (defaults on: the bundled guide, so
every turn retrieves; the loop guard; the thread governor) on a free port over a temporary data
dir. The browser is /usr/bin/chromium through playwright (requirements-dev.txt); without either,
the command says so and stops. Its turns are read back from the server's SQLite file, read-only.

Must not: be imported by the product; leave the server or Chromium running when it ends.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from llmweb.errors import ConfigError

from .served import START_S, TURN_S, Served, cpu_seconds, cpu_used, serve, wait_for

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
MESSAGE = "Write a poem about the sea."
MESSAGE_BOX = 'textarea[data-testid="textbox"][placeholder^="Ask anything"]'
CASES = ("api", "browser", "upload")
EXPANSION = 10  # the upload's text is at least this many times its file's bytes
WARM_TURNS = 2  # the page's chat has this many turns before its first measured one
UPLOAD_CHARS = 600_000  # its text (about 600 chunks to embed: tens of seconds on 2 cores)
UPLOAD_S = 900.0
SETTLE_S = 3.0  # after the last warm-up turn, before the idle page is measured
IDLE_S = 5.0


def run(new_tokens: int = 160, repeats: int = 3, progress: Callable[[str], None] = print, history: int = 0) -> dict:
    """Start a server and a browser, run every case `repeats` times, and return the rows. With
    `history`, the page's chat is an imported one of that many turns (as a long session's is)."""
    sync_playwright = _playwright()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="llmweb-busy-") as tmp, serve(Path(tmp), new_tokens, progress) as srv:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                progress(f"bench busy: a warm-up turn through the API and {WARM_TURNS} through the page…")
                srv.api_turn(MESSAGE, new_tokens)
                page = _open(browser.new_context(), srv)  # one visitor, whose chat grows as people's do
                if history:
                    progress(f"bench busy: importing a chat of {history} turns into the page…")
                    _import_chat(page, Path(tmp), history)
                for turn in range(WARM_TURNS):
                    _page_turn(srv, page, history + turn + 1)
                idle = _idle_browser_cores(srv)
                for r in range(repeats):
                    order = CASES if r % 2 == 0 else ("browser", "api", "upload")
                    for case in order:
                        progress(f"bench busy: repeat {r + 1}/{repeats}, {case}…")
                        if case == "browser":
                            row = _page_turn(srv, page, history + WARM_TURNS + r + 1)
                        else:
                            row = _case(case, srv, browser, new_tokens, r, Path(tmp))
                        rows.append({"case": case, "repeat": r + 1, **row})
            finally:
                browser.close()
    return {
        "bench": "busy",
        "message": MESSAGE,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "history": history,
        "idle_browser_cores": round(idle, 3),
        "rows": rows,
        "summary": summarize(rows),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per case: the median of each figure over its repeats, and the ratios to the api case's."""
    out = []
    by_case = {c: [r for r in rows if r["case"] == c] for c in CASES}
    quiet = by_case["api"]

    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs) if rs else 0.0

    for case, rs in by_case.items():
        if not rs:
            continue
        out.append(
            {
                "case": case,
                "runs": len(rs),
                "decode_tok_s": round(med(rs, "decode_tok_s"), 1),
                "wall_s": round(med(rs, "wall_s"), 2),
                "decode_vs_api": round(med(rs, "decode_tok_s") / max(med(quiet, "decode_tok_s"), 1e-9), 2),
                "wall_vs_api": round(med(rs, "wall_s") / max(med(quiet, "wall_s"), 1e-9), 2),
            }
        )
    return out


def markdown(r: dict) -> str:
    head = [
        f"`bench busy`: {r['message']!r}, up to {r['new_tokens']} new tokens, {r['repeats']} repeats, one server"
        + (f"; the page's chat imported with {r['history']} turns." if r.get("history") else "."),
        "",
        "| case | decode tok/s | × api | turn wall s | × api |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in r["summary"]:
        head.append(
            f"| {s['case']} | {s['decode_tok_s']:.1f} | {s['decode_vs_api']:.2f} | {s['wall_s']:.2f} | "
            f"{s['wall_vs_api']:.2f} |"
        )
    if "idle_browser_cores" in r:
        cores = r["idle_browser_cores"]
        head += ["", f"Chromium with the page open and idle for {IDLE_S:.0f} s: {cores:.3f} of a core."]
    cpu = "web CPU s | engine CPU s | Chromium CPU s"
    head += ["", f"| case | repeat | tokens | decode tok/s | TTFT s | wall s | {cpu} | note |"]
    head.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for x in r["rows"]:
        head.append(
            f"| {x['case']} | {x['repeat']} | {x['tokens']} | {x['decode_tok_s']:.1f} | {x['ttft_s']:.2f} | "
            f"{x['wall_s']:.2f} | {x['web_cpu_s']:.2f} | {x['engine_cpu_s']:.1f} | {x['browser_cpu_s']:.2f} | "
            f"{x.get('note', '')} |"
        )
    return "\n".join(head)


# -- the cases -------------------------------------------------------------------------------------


def _case(case: str, srv: Served, browser, new_tokens: int, r: int, tmp: Path) -> dict:
    """The api case, or the upload case: a second visitor's page uploads, the API asks meanwhile."""
    if case == "api":
        return srv.measured(lambda: srv.api_turn(MESSAGE, new_tokens))
    pdf = tmp / f"field-notes-{r + 1}.pdf"
    pdf.write_bytes(expanding_pdf(r))
    context = browser.new_context()
    try:
        page = _open(context, srv)
        page.locator("#llmweb-documents").get_by_text("Documents", exact=True).first.click()
        page.locator("#llmweb-upload input[type=file]").set_input_files(str(pdf))
        embedding = wait_for(lambda: "embedding" in page.locator("body").inner_text().lower(), 120, "", quiet=True)
        row = srv.measured(lambda: srv.api_turn(MESSAGE, new_tokens))
        listed = pdf.name in page.locator("#llmweb-doclist").inner_text()
        row["note"] = ("began before the upload embedded; " if not embedding else "") + (
            "the upload ended during the turn" if listed else "the upload still indexing at the end"
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


def _page_turn(srv: Served, page, turn: int) -> dict:
    """The visitor's page asks MESSAGE in its chat (turn `turn` of it); the finished turn is read
    back from the server's store."""
    before = srv.finished_turns()

    def ask() -> dict:
        page.locator(MESSAGE_BOX).fill(MESSAGE)
        page.locator("#llmweb-send").click()
        return wait_for(lambda: srv.newest_turn(before), TURN_S, "the page's turn to be stored")

    return srv.measured(ask) | {"note": f"turn {turn} of the page's chat"}


IMPORT_INPUT = 'input[data-testid="Import .json-upload-button"]'  # the page's Import button's file input
SETTLED = 4  # the imported chat's turns not yet in its summary


def _import_chat(page, tmp: Path, turns: int) -> None:
    """Open, on `page`, an imported chat of `turns` turns (the export of one written here)."""
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
    page.locator(IMPORT_INPUT).set_input_files(str(exported))
    wait_for(lambda: "Imported" in page.locator("#llmweb-stats").inner_text(), START_S, "the imported chat to open")


def _open(context, srv: Served):
    page = context.new_page()
    page.set_default_timeout(120_000)
    page.goto(srv.url, wait_until="domcontentloaded")
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
