"""A real `python -m llmweb serve` for the benchmarks that measure the server as people reach it
(`bench busy`, `bench peer`): started on a free port over a scratch data dir, asked through its
OpenAI API with the local key, its stored turns read back from its SQLite file (read-only), its
CPU and a browser's read from outside, stopped when the benchmark ends.

Must not: be imported by the product; leave the server running when the `with` block ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llmweb.errors import LlmwebError

START_S = 300.0  # the model's load and the guide's indexing on a fresh data dir
TURN_S = 300.0


class Served:
    def __init__(self, proc: subprocess.Popen, url: str, data_dir: Path, log: Path):
        self.proc, self.url, self.data_dir, self.log = proc, url, data_dir, log
        self._key = ""

    @property
    def key(self) -> str:
        if not self._key:
            self._key = (self.data_dir / "local-api-key").read_text().strip()
        return self._key

    @property
    def owner_token(self) -> str:
        return (self.data_dir / "owner-token").read_text().strip()

    def conversations(self) -> set[str]:
        """The ids of every stored conversation."""
        with self._db() as db:
            return {c for (c,) in db.execute("SELECT id FROM conversations")}

    def completion(self, body: dict) -> dict:
        """POST /v1/chat/completions (no streaming) with the local key; the response. A 503 (the model
        still loading) is asked again for up to START_S; any other error status is an LlmwebError."""
        return post_json(self.url + "v1/chat/completions", body, {"Authorization": f"Bearer {self.key}"}, START_S)

    def api_turn(self, message: str, new_tokens: int, conversation_id: str | None = None) -> dict:
        """One chat completion of `message`; its stats from `x_llmweb` (and, with `conversation_id`,
        a turn of that stateful conversation: "new" starts one, whose id is the stats' "conversation_id")."""
        body = {"model": "llmweb", "messages": [{"role": "user", "content": message}], "max_tokens": new_tokens}
        if conversation_id is not None:
            body["conversation_id"] = conversation_id
        x = self.completion(body)["x_llmweb"]
        return x["stats"] | ({"conversation_id": x["conversation_id"]} if conversation_id is not None else {})

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
        cpu0 = cpu_seconds(self.proc.pid)
        t0 = time.perf_counter()
        stats = turn()
        wall = time.perf_counter() - t0
        web_cpu, engine_cpu, browser_cpu = cpu_used(cpu0, cpu_seconds(self.proc.pid), self.proc.pid)
        return {
            "tokens": int(stats.get("generated_tokens", 0)),
            "prompt_tokens": int(stats.get("prompt_tokens", 0)),
            "decode_tok_s": float(stats.get("decode_tok_s", 0.0)),
            "ttft_s": float(stats.get("ttft_s", 0.0)),
            "wall_s": round(wall, 3),
            "web_cpu_s": round(web_cpu, 2),
            "engine_cpu_s": round(engine_cpu, 2),
            "browser_cpu_s": round(browser_cpu, 2),
        }

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(f"file:{self.data_dir / 'llmweb.sqlite3'}?mode=ro", uri=True, timeout=30)
        try:
            yield db
        finally:
            db.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(
    data_dir: Path, new_tokens: int, progress: Callable[[str], None], env: dict[str, str] | None = None
) -> Iterator[Served]:
    """`python -m llmweb serve` over `data_dir` at the defaults (with `env` over them), replies
    capped at `new_tokens`; yields once it serves, stops it after."""
    port = free_port()
    full_env = dict(os.environ, LLMWEB_DATA_DIR=str(data_dir), LLMWEB_MAX_NEW_TOKENS=str(new_tokens))
    full_env |= {"PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("LLMWEB_AUTH", None)
    log = data_dir / "server.log"
    progress(f"bench: starting `python -m llmweb serve` on port {port}…")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmweb", "serve", "--port", str(port)],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    srv = Served(proc, f"http://127.0.0.1:{port}/", data_dir, log)
    try:
        wait_for(
            lambda: (data_dir / "local-api-key").exists() and http_status(srv.url + "gradio_api/info") == 200,
            START_S,
            "the server to serve",
            srv.proc,
        )
        yield srv
    except BaseException:
        progress("bench: the server's log ends:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        raise
    finally:
        stop(proc)


NGINX_CONF = """worker_processes 1;
daemon off;
error_log {prefix}/error.log;
pid {prefix}/nginx.pid;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body; proxy_temp_path {prefix}/proxy; fastcgi_temp_path {prefix}/fcgi;
    uwsgi_temp_path {prefix}/uwsgi; scgi_temp_path {prefix}/scgi;
    client_max_body_size 100m;
    map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass {upstream};
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
        }}
    }}
}}
"""


def nginx_exe() -> str | None:
    import shutil

    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)


@contextlib.contextmanager
def nginx_proxy(upstream: str, prefix: Path) -> Iterator[str]:
    """nginx on a free port in front of `upstream` as a deployment's reverse proxy is set up (its
    default buffering, the WebSocket upgrade, the forwarding headers); yields its URL."""
    exe = nginx_exe()
    if exe is None:
        raise LlmwebError("bench: no nginx on the PATH")
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_CONF.format(prefix=prefix, port=port, upstream=upstream.rstrip("/")))
    proc = subprocess.Popen([exe, "-c", str(conf), "-p", str(prefix)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(lambda: http_status(url + "gradio_api/info") == 200, 30, "nginx to serve", proc)
        yield url
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def post_json(url: str, body: dict, headers: dict[str, str], retry_503_s: float = 0.0) -> dict:
    """POST `body` as JSON, no proxy; the JSON answer. A 503 is asked again for up to `retry_503_s`."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + retry_503_s
    while True:
        try:
            with opener.open(req, timeout=TURN_S) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.monotonic() > deadline:
                raise LlmwebError(f"bench: {url} answered {e.code}: {e.read()[:300]!r}") from None
        time.sleep(1.0)


def http_status(url: str) -> int | None:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_for(
    fn: Callable[[], Any], timeout: float, what: str, proc: subprocess.Popen | None = None, quiet: bool = False
) -> Any:
    """fn() once it is truthy; past `timeout` an error naming `what` (or, quiet, None); an error at
    once when `proc` exits meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise LlmwebError(f"bench: the server exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            if quiet:
                return None
            raise LlmwebError(f"bench: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


ENGINES = -1  # `cpu_seconds`' key for the server's engine processes, together


def cpu_seconds(server_pid: int) -> dict[int, float]:
    """CPU seconds so far of the server's web process (under its pid), of its engine processes
    (under ENGINES) and of each Chromium process."""
    import psutil

    out: dict[int, float] = {}
    for p in psutil.process_iter(["name", "ppid"]):
        engine = p.info["ppid"] == server_pid  # an engine process is its child
        if p.pid == server_pid or engine or "chrom" in (p.info["name"] or "").lower():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                key = ENGINES if engine else p.pid
                out[key] = out.get(key, 0.0) + t.user + t.system
    return out


def cpu_used(before: dict[int, float], after: dict[int, float], server_pid: int) -> tuple[float, float, float]:
    """(web process, engine processes, Chromium) CPU seconds between two `cpu_seconds` readings: a
    process that started between them counts from 0; one that ended is left out (its last seconds
    are lost, never negative)."""
    used = {pid: t - before.get(pid, 0.0) for pid, t in after.items()}
    return used.pop(server_pid, 0.0), used.pop(ENGINES, 0.0), sum(used.values())
