"""`bench busy`: a reply's speed as people get it, on one real server, side by side in one run.

  api       an API request with nothing else running: the quiet figure of the same server
  browser   the same message typed into the page by a visitor in a headless Chromium on this
            machine, which renders the stream as it arrives (a localhost user's laptop); one
            page, one chat that grows by a turn each time (WARM_TURNS turns before the first)
  upload    the API request again while another visitor's page uploads a PDF whose text is ten
            times its bytes (chunked, embedded and indexed in the server's process)

Each case runs once per repeat, interleaved (the machine's drift hits all alike). Per row: decode
tok/s (the turn's own stats), TTFT, and the turn's wall time measured from outside the server; the
ratios are each case's median against the api case's. CPU seconds of the server and of Chromium
during each turn show where the cores went.

The server is `python -m llmweb serve` as a user starts it (defaults on: the bundled guide, so
every turn retrieves; the loop guard; the thread governor) on a free port over a temporary data
dir. The browser is /usr/bin/chromium through playwright (requirements-dev.txt); without either,
the command says so and stops. Its turns are read back from the server's SQLite file, read-only.

Must not: be imported by the product; leave the server or Chromium running when it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llmweb.errors import ConfigError, LlmwebError

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
MESSAGE = "Write a poem about the sea."
MESSAGE_BOX = 'textarea[data-testid="textbox"][placeholder^="Ask anything"]'
CASES = ("api", "browser", "upload")
EXPANSION = 10  # the upload's text is at least this many times its file's bytes
WARM_TURNS = 2  # the page's chat has this many turns before its first measured one
UPLOAD_CHARS = 600_000  # its text (about 600 chunks to embed: tens of seconds on 2 cores)
START_S = 300.0
TURN_S = 300.0
UPLOAD_S = 900.0


def run(new_tokens: int = 160, repeats: int = 3, progress: Callable[[str], None] = print) -> dict:
    """Start a server and a browser, run every case `repeats` times, and return the rows."""
    sync_playwright = _playwright()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="llmweb-busy-") as tmp, _server(Path(tmp), new_tokens, progress) as srv:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                progress(f"bench busy: a warm-up turn through the API and {WARM_TURNS} through the page…")
                srv.api_turn(new_tokens)
                page = _open(browser.new_context(), srv)  # one visitor, whose chat grows as people's do
                for turn in range(WARM_TURNS):
                    _page_turn(srv, page, turn + 1)
                for r in range(repeats):
                    order = CASES if r % 2 == 0 else ("browser", "api", "upload")
                    for case in order:
                        progress(f"bench busy: repeat {r + 1}/{repeats}, {case}…")
                        if case == "browser":
                            row = _page_turn(srv, page, WARM_TURNS + r + 1)
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
        f"`bench busy`: {r['message']!r}, up to {r['new_tokens']} new tokens, {r['repeats']} repeats, one server.",
        "",
        "| case | decode tok/s | × api | turn wall s | × api |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in r["summary"]:
        head.append(
            f"| {s['case']} | {s['decode_tok_s']:.1f} | {s['decode_vs_api']:.2f} | {s['wall_s']:.2f} | "
            f"{s['wall_vs_api']:.2f} |"
        )
    head += ["", "| case | repeat | tokens | decode tok/s | TTFT s | wall s | server CPU s | Chromium CPU s | note |"]
    head.append("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for x in r["rows"]:
        head.append(
            f"| {x['case']} | {x['repeat']} | {x['tokens']} | {x['decode_tok_s']:.1f} | {x['ttft_s']:.2f} | "
            f"{x['wall_s']:.2f} | {x['server_cpu_s']:.1f} | {x['browser_cpu_s']:.1f} | {x.get('note', '')} |"
        )
    return "\n".join(head)


# -- the cases -------------------------------------------------------------------------------------


def _case(case: str, srv: _Server, browser, new_tokens: int, r: int, tmp: Path) -> dict:
    """The api case, or the upload case: a second visitor's page uploads, the API asks meanwhile."""
    if case == "api":
        return srv.measured(lambda: srv.api_turn(new_tokens))
    pdf = tmp / f"field-notes-{r + 1}.pdf"
    pdf.write_bytes(expanding_pdf(r))
    context = browser.new_context()
    try:
        page = _open(context, srv)
        page.locator("#llmweb-documents").get_by_text("Documents", exact=True).first.click()
        page.locator("#llmweb-upload input[type=file]").set_input_files(str(pdf))
        embedding = _wait(lambda: "embedding" in page.locator("body").inner_text().lower(), 120, "", quiet=True)
        row = srv.measured(lambda: srv.api_turn(new_tokens))
        listed = pdf.name in page.locator("#llmweb-doclist").inner_text()
        row["note"] = ("began before the upload embedded; " if not embedding else "") + (
            "the upload ended during the turn" if listed else "the upload still indexing at the end"
        )
        _wait(lambda: pdf.name in page.locator("#llmweb-doclist").inner_text(), UPLOAD_S, "the upload to finish")
        return row
    finally:
        context.close()


def _page_turn(srv: _Server, page, turn: int) -> dict:
    """The visitor's page asks MESSAGE in its chat (turn `turn` of it); the finished turn is read
    back from the server's store."""
    before = srv.finished_turns()

    def ask() -> dict:
        page.locator(MESSAGE_BOX).fill(MESSAGE)
        page.locator("#llmweb-send").click()
        return _wait(lambda: srv.newest_turn(before), TURN_S, "the page's turn to be stored")

    return srv.measured(ask) | {"note": f"turn {turn} of the page's chat"}


def _open(context, srv: _Server):
    page = context.new_page()
    page.set_default_timeout(120_000)
    page.goto(srv.url, wait_until="domcontentloaded")
    _wait(lambda: "Ready" in page.locator("#llmweb-status").inner_text(), START_S, 'the status line to say "Ready"')
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


# -- the server --------------------------------------------------------------------------------------


class _Server:
    def __init__(self, proc: subprocess.Popen, url: str, data_dir: Path, log: Path):
        self.proc, self.url, self.data_dir, self.log = proc, url, data_dir, log
        self._key = ""

    @property
    def key(self) -> str:
        if not self._key:
            self._key = (self.data_dir / "local-api-key").read_text().strip()
        return self._key

    def api_turn(self, new_tokens: int) -> dict:
        """One chat completion without streaming; its stats from `x_llmweb`."""
        body = {"model": "llmweb", "messages": [{"role": "user", "content": MESSAGE}], "max_tokens": new_tokens}
        req = urllib.request.Request(
            self.url + "v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + START_S
        while True:
            try:
                with opener.open(req, timeout=TURN_S) as resp:
                    return json.loads(resp.read())["x_llmweb"]["stats"]
            except urllib.error.HTTPError as e:
                if e.code != 503 or time.monotonic() > deadline:  # 503: the model is still loading
                    raise LlmwebError(f"bench busy: the API answered {e.code}: {e.read()[:300]!r}") from None
            time.sleep(1.0)

    def finished_turns(self) -> set[tuple[str, int]]:
        with self._db() as db:
            return {(c, i) for c, i in db.execute("SELECT conversation_id, idx FROM turns WHERE stats != '{}'")}

    def newest_turn(self, before: set[tuple[str, int]]) -> dict | None:
        """The stats of a finished turn that is not in `before`, or None."""
        with self._db() as db:
            for c, i, stats in db.execute("SELECT conversation_id, idx, stats FROM turns WHERE stats != '{}'"):
                if (c, i) not in before:
                    d = json.loads(stats)
                    if d.get("total_s"):
                        return d
        return None

    def measured(self, turn: Callable[[], dict]) -> dict:
        """Run one turn; its figures, the wall time around it and the CPU the server and Chromium used."""
        cpu0 = _cpu(self.proc.pid)
        t0 = time.perf_counter()
        stats = turn()
        wall = time.perf_counter() - t0
        server_cpu, browser_cpu = _cpu_used(cpu0, _cpu(self.proc.pid), self.proc.pid)
        return {
            "tokens": int(stats.get("generated_tokens", 0)),
            "decode_tok_s": float(stats.get("decode_tok_s", 0.0)),
            "ttft_s": float(stats.get("ttft_s", 0.0)),
            "wall_s": round(wall, 3),
            "server_cpu_s": round(server_cpu, 2),
            "browser_cpu_s": round(browser_cpu, 2),
        }

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(f"file:{self.data_dir / 'llmweb.sqlite3'}?mode=ro", uri=True, timeout=30)
        try:
            yield db
        finally:
            db.close()


@contextlib.contextmanager
def _server(data_dir: Path, new_tokens: int, progress: Callable[[str], None]) -> Iterator[_Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, LLMWEB_DATA_DIR=str(data_dir), LLMWEB_MAX_NEW_TOKENS=str(new_tokens), PYTHONUNBUFFERED="1")
    env.pop("LLMWEB_AUTH", None)
    log = data_dir / "server.log"
    progress(f"bench busy: starting `python -m llmweb serve` on port {port}…")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmweb", "serve", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    srv = _Server(proc, f"http://127.0.0.1:{port}/", data_dir, log)
    try:
        _wait(
            lambda: (data_dir / "local-api-key").exists() and _status(srv.url + "gradio_api/info") == 200,
            START_S,
            "the server to serve",
            srv,
        )
        yield srv
    except BaseException:
        progress("bench busy: the server's log ends:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _status(url: str) -> int | None:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _wait(fn: Callable[[], Any], timeout: float, what: str, srv: _Server | None = None, quiet: bool = False) -> Any:
    """fn() once it is truthy; past `timeout` an error naming `what` (or, quiet, None)."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if srv is not None and srv.proc.poll() is not None:
            raise LlmwebError(f"bench busy: the server exited ({srv.proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            if quiet:
                return None
            raise LlmwebError(f"bench busy: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _cpu(server_pid: int) -> dict[int, float]:
    """CPU seconds so far of the server (its threads, under its pid) and of each Chromium process."""
    import psutil

    out: dict[int, float] = {}
    for p in psutil.process_iter(["name"]):
        if p.pid == server_pid or "chrom" in (p.info["name"] or "").lower():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
    return out


def _cpu_used(before: dict[int, float], after: dict[int, float], server_pid: int) -> tuple[float, float]:
    """(server, Chromium) CPU seconds between two `_cpu` readings: a process that started between
    them counts from 0; one that ended is left out (its last seconds are lost, never negative)."""
    used = {pid: t - before.get(pid, 0.0) for pid, t in after.items()}
    return used.pop(server_pid, 0.0), sum(used.values())


def _playwright():
    if not CHROMIUM.exists():
        raise ConfigError(f"bench busy needs a browser: {CHROMIUM} is missing (Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise ConfigError("bench busy needs playwright: pip install -r requirements-dev.txt") from None
    return sync_playwright
