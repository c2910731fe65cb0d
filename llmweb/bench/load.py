"""`bench load`: many visitors at once through the public `/chat` API, as strangers use a server.

  crowd         `VISITORS` visitors x `TURNS` turns at once (gradio_client, one client and one
                conversation each, every visitor starting together): each turn's latency, the
                busy refusals the visitors met (a refused turn is retried after `RETRY_S`, as a
                patient client would, and counted), and the replies; p50/p95 in `summary`.
  under attack  one visitor's turn (a new conversation each time, the same message: the same work)
                on the idle server, then while another client sends pathological messages
                (`HOSTILE`: a 60,000-character line of dashes, a long line without punctuation
                then a newline, and shorter ones that get through) through `/chat`; the ratio of
                the median latencies, measured in one run (target: at most 2).
  beside a      `ORDINARY` visitors x `TURNS` turns at once, alone, then while one hostile client
  hostile owner sends ~1,000-token messages, each in a new chat, from two threads (two tabs),
                as fast as it is answered or refused; the ordinary turns' p95 beside it against
                their p95 alone, measured in one run (target: at most 2). Through the public
                `/chat` API each of its chats is its own owner, as an anonymous caller's is.

`run()` starts `python -m llmweb serve` in a scratch data dir (a separate process: the clients'
threads do not share its interpreter), every visitor its own owner (`LLMWEB_SINGLE_USER=0`) and its
own address (`X-Forwarded-For`, from a proxy the server trusts: loopback), as strangers on the
internet are, so the limits per address fall where they would; the server inherits the environment.
On a CPU shared with other work, OpenMP's threads can wait on each other for long: measured on a
2-core machine at a load of ~8, one 16-token turn took 7-16 s
with torch's default threads and ~1 s with `OMP_NUM_THREADS=1`, so the table says which it ran with.
tests/test_load.py runs `crowd` against an app launched in the test process.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VISITORS, TURNS = 16, 3
RETRY_S = 1.0  # a refused turn is sent again after this long
MAX_TRIES = 60
QUESTIONS = ("What is the capital of France?", "Name one large animal.", "Thank you, and goodbye.")
PROBE = "What colour is the sky on a clear day?"
ORDINARY = 8  # visitors beside the hostile owner
# the addresses of the pathological client, the hostile owner and the probe (documentation ranges, RFC 5737)
HOSTILE_ADDRESS, OWNER_ADDRESS, PROBE_ADDRESS = "203.0.113.66", "203.0.113.77", "198.51.100.250"
# a message of ~1,000 tokens (SmolLM2's tokenizer: ~10 a sentence), under the default message cap
LONG = "Please summarise what follows. " + "The quick brown fox jumps over the lazy dog again. " * 90
HOSTILE = (
    "-" * 60_000,  # one line of dashes
    "word " * 12_000 + "\nand then a question?",  # a long line without punctuation, then a newline
    "-" * 2_000,  # under the token cap: it is answered
    "no punctuation here at all " * 40 + "\n",
)


@dataclass
class TurnResult:
    visitor: int
    turn: int  # 1-based
    conv_id: str
    message: str
    reply: str
    latency_s: float  # from the first try to the reply, retries included
    refusals: int  # busy refusals met on the way


def client(url: str, address: str = ""):
    """A gradio_client `Client` whose requests say they come from `address` (a trusting server
    believes it: `LLMWEB_TRUSTED_PROXIES`; any other ignores it)."""
    from gradio_client import Client

    return Client(url, verbose=False, headers={"X-Forwarded-For": address} if address else None)


def visitor_address(visitor: int) -> str:
    return f"198.51.100.{visitor % 240 + 1}"


def is_busy(error: BaseException) -> bool:
    """A refusal for load: the engine's busy message, or Gradio's own full queue."""
    text = str(error).lower()
    return "busy" in text or "queue is full" in text


def ask(client, message: str, conv_id: str) -> tuple[str, str, float, int]:
    """One turn through `/chat`, retried while the server says it is busy: (reply, conv_id, s, refusals)."""
    t0, refusals = time.perf_counter(), 0
    while True:
        try:
            reply, conv_id = client.predict(message, conv_id, api_name="/chat")
            return reply, conv_id, time.perf_counter() - t0, refusals
        except Exception as e:  # gradio_client raises AppError / QueueError; only "busy" is retried
            if not is_busy(e) or refusals >= MAX_TRIES:
                raise
            refusals += 1
            time.sleep(RETRY_S)


def visit(url: str, visitor: int, turns: int, start: threading.Barrier | None = None) -> list[TurnResult]:
    """One visitor's conversation of `turns` turns, one after the other, from its own address."""
    visitor_client = client(url, visitor_address(visitor))
    if start is not None:
        start.wait()
    conv_id, out = "", []
    for turn in range(1, turns + 1):
        message = f"I am visitor {visitor}. {QUESTIONS[(turn - 1) % len(QUESTIONS)]}"
        reply, conv_id, latency, refusals = ask(visitor_client, message, conv_id)
        out.append(TurnResult(visitor, turn, conv_id, message, reply, latency, refusals))
    return out


def crowd(url: str, visitors: int = VISITORS, turns: int = TURNS) -> tuple[list[TurnResult], list[str]]:
    """Every visitor at once: (their turns, the errors that ended a visit)."""
    start = threading.Barrier(visitors, timeout=300)
    results: list[TurnResult] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            done = visit(url, i, turns, start)
            with lock:
                results.extend(done)
        except Exception as e:
            with lock:
                errors.append(f"visitor {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(visitors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(results, key=lambda r: (r.visitor, r.turn)), errors


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(results: list[TurnResult], errors: list[str], seconds: float) -> dict:
    latencies = [r.latency_s for r in results]
    return {
        "turns": len(results),
        "answered": sum(1 for r in results if r.reply.strip()),
        "refusals": sum(r.refusals for r in results),
        "errors": errors,
        "p50_s": round(percentile(latencies, 50), 2),
        "p95_s": round(percentile(latencies, 95), 2),
        "max_s": round(max(latencies, default=0.0), 2),
        "wall_s": round(seconds, 1),
    }


def under_attack(url: str, repeats: int = 5) -> dict:
    """One visitor's turn on the idle server vs. the same turn while a client sends `HOSTILE`."""
    prober = client(url, PROBE_ADDRESS)

    def probe() -> float:
        return ask(prober, PROBE, "")[2]

    time.sleep(3.0)  # what came before settles (its streams close, its background jobs end)
    probe()  # warm: the first turn pays one-off costs
    idle = [probe() for _ in range(repeats)]
    stop, sent, outcomes = threading.Event(), [0], {"answered": 0, "refused": 0}

    def attacker() -> None:
        hostile = client(url, HOSTILE_ADDRESS)
        while not stop.is_set():
            message = HOSTILE[sent[0] % len(HOSTILE)]
            sent[0] += 1
            try:
                hostile.predict(message, "", api_name="/chat")
                outcomes["answered"] += 1
            except Exception:  # refused: too long, busy...; it sends the next one
                outcomes["refused"] += 1

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    time.sleep(2.0)  # the attack is under way
    attacked = [probe() for _ in range(repeats)]
    stop.set()
    thread.join(300)
    ratio = statistics.median(attacked) / max(statistics.median(idle), 1e-9)
    return {
        "idle_s": [round(x, 2) for x in idle],
        "attacked_s": [round(x, 2) for x in attacked],
        "ratio": round(ratio, 2),
        "hostile_sent": sent[0],
        "hostile_answered": outcomes["answered"],
        "hostile_refused": outcomes["refused"],
    }


def beside_hostile(url: str, visitors: int = ORDINARY, turns: int = TURNS, message: str = LONG, tabs: int = 2) -> dict:
    """`visitors` x `turns` at once, alone, then while a hostile client sends `message` in a new chat
    from `tabs` threads: the ordinary turns' figures both ways and the ratio of their p95."""
    time.sleep(3.0)  # what came before settles
    t0 = time.perf_counter()
    alone = summary(*crowd(url, visitors, turns), time.perf_counter() - t0)
    stop, lock = threading.Event(), threading.Lock()
    outcomes = {"sent": 0, "answered": 0, "refused": 0}

    def tab() -> None:
        hostile = client(url, OWNER_ADDRESS)
        while not stop.is_set():
            try:
                hostile.predict(message, "", api_name="/chat")
                outcome = "answered"
            except Exception:  # refused (busy, over a limit...): it sends the next one at once
                outcome = "refused"
            with lock:
                outcomes["sent"] += 1
                outcomes[outcome] += 1

    threads = [threading.Thread(target=tab, daemon=True) for _ in range(tabs)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the attack is under way
    t0 = time.perf_counter()
    beside = summary(*crowd(url, visitors, turns), time.perf_counter() - t0)
    stop.set()
    for t in threads:
        t.join(300)
    return {
        "visitors": visitors,
        "turns_each": turns,
        "message_chars": len(message),
        "tabs": tabs,
        "alone": alone,
        "beside": beside,
        "p95_ratio": round(beside["p95_s"] / max(alone["p95_s"], 1e-9), 2),
        "hostile": outcomes,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(data_dir: Path, env: dict[str, str], progress: Callable[[str], None]) -> tuple[subprocess.Popen, str]:
    """`python -m llmweb serve` on a free loopback port; returns once `/chat` answers."""
    from gradio_client import Client

    port = _free_port()
    full = {**os.environ, **env, "LLMWEB_DATA_DIR": str(data_dir), "LLMWEB_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "llmweb", "serve"], env=full, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 600
    while True:
        try:
            Client(url, verbose=False).predict("Hello.", "", api_name="/chat")
            return proc, url
        except Exception as e:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.terminate()
                raise RuntimeError(f"the server did not start: {e}") from None
            progress("bench load: waiting for the server...")
            time.sleep(2.0)


def run(settings, visitors: int = VISITORS, turns: int = TURNS, max_new_tokens: int = 16, progress=print) -> dict:
    """The crowd, then the attack, against one scratch server (`settings` gives the model cache)."""
    env = {
        "LLMWEB_SINGLE_USER": "0",
        "LLMWEB_TRUSTED_PROXIES": "127.0.0.1",  # each client names its own address (`client`)
        "LLMWEB_SAMPLE_DOCS": "0",
        "LLMWEB_MAX_NEW_TOKENS": str(max_new_tokens),
        "LLMWEB_CACHE_DIR": str(settings.copies_dir),
    }
    with tempfile.TemporaryDirectory(prefix="llmweb-load-") as tmp:
        proc, url = serve(Path(tmp), env, progress)
        try:
            progress(f"bench load: {visitors} visitors x {turns} turns at once...")
            t0 = time.perf_counter()
            results, errors = crowd(url, visitors, turns)
            load = summary(results, errors, time.perf_counter() - t0)
            progress("bench load: one visitor, idle and while a client sends pathological messages...")
            attack = under_attack(url)
            progress(f"bench load: {ORDINARY} visitors, alone and beside a hostile owner's two tabs...")
            hostile = beside_hostile(url)
        finally:
            proc.terminate()
            proc.wait(30)
    return {
        "visitors": visitors,
        "turns_each": turns,
        "max_new_tokens": max_new_tokens,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "default"),  # the server inherits it
        "load": load,
        "attack": attack,
        "hostile_owner": hostile,
    }


def markdown(result: dict) -> str:
    load, attack = result["load"], result["attack"]
    lines = [
        f"## bench load: {result['visitors']} visitors x {result['turns_each']} turns at once "
        f"(replies of at most {result['max_new_tokens']} tokens; OMP_NUM_THREADS {result['omp_num_threads']})",
        "",
        "| turns | answered | busy refusals | p50 | p95 | max | wall |",
        "|---|---|---|---|---|---|---|",
        f"| {load['turns']} | {load['answered']} | {load['refusals']} | {load['p50_s']} s | {load['p95_s']} s "
        f"| {load['max_s']} s | {load['wall_s']} s |",
        "",
        *(f"- error: {e}" for e in load["errors"]),
        "## one visitor's turn, idle vs. while another client sends pathological messages",
        "",
        f"idle: {attack['idle_s']} s; under attack: {attack['attacked_s']} s; ratio of the medians: "
        f"**{attack['ratio']}x** (target <= 2x); the attacker sent {attack['hostile_sent']} messages "
        f"({attack['hostile_answered']} answered, {attack['hostile_refused']} refused)",
        "",
        *hostile_markdown(result["hostile_owner"]),
    ]
    return "\n".join(lines)


def hostile_markdown(h: dict) -> list[str]:
    """The section of `beside_hostile`'s figures."""
    alone, beside, sent = h["alone"], h["beside"], h["hostile"]
    rows = [
        f"| {name} | {f['answered']}/{f['turns']} | {f['refusals']} "
        f"| {f['p50_s']} s | {f['p95_s']} s | {f['max_s']} s |"
        for name, f in (("alone", alone), ("beside the hostile owner", beside))
    ]
    return [
        f"## {h['visitors']} visitors x {h['turns_each']} turns, alone and beside one hostile owner "
        f"({h['tabs']} tabs of {h['message_chars']:,}-character messages, each in a new chat)",
        "",
        "| ordinary turns | answered | busy refusals | p50 | p95 | max |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"p95 beside / alone: **{h['p95_ratio']}x** (target <= 2x); the hostile owner sent {sent['sent']} "
        f"messages ({sent['answered']} answered, {sent['refused']} refused)",
        *(f"- error: {e}" for e in alone["errors"] + beside["errors"]),
    ]
