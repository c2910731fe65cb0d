"""`python -m llmweb bench recycle`: what a graceful replacement of the engine process costs
(engine/process.py), measured on the real model in engine processes, as the app runs it.

  crowd      20 requests, 4 at a time, with LLMWEB_RECYCLE_AFTER=5: every one
             answered; how many engine processes served; the TTFT of the requests submitted while a
             replacement was loading (they meet a recycle) against the others'
  a chat     one chat of `turns` turns, then a recycle, then its next turn: TTFT and reused tokens
             with the kept caches handed over to the new process, and with them dropped (the
             chat's whole history prefilled again), in one run

Must not: be imported by the product.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .common import scratch_settings, scripted_turns

LOCAL = "local"


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3) if xs else 0.0


def _runtime(settings):
    """(runtime, chat, its ProcessRunner): the app's runtime, the model in engine processes."""
    from llmweb.engine.process import ProcessRunner
    from llmweb.runtime import Runtime

    rt = Runtime(settings.replace(engine_process="1")).start(background=False)
    runner = rt.engine.runner if rt.engine is not None else None
    assert isinstance(runner, ProcessRunner) and rt.chat is not None, "the model runs in an engine process"
    return rt, rt.chat, runner


def crowd(settings, requests: int = 20, clients: int = 4, after: int = 5, progress=print) -> dict:
    """`requests` chat turns from `clients` chats at once, recycling after `after` requests."""
    rt, chat, runner = _runtime(settings.replace(recycle_after=after))
    rows: list[dict] = []
    errors: list[str] = []
    texts = scripted_turns(requests)

    def client(i: int) -> None:
        conv = None
        for j in range(requests // clients):
            n = i * (requests // clients) + j
            meets = runner.loading
            try:
                ev = chat.ask(f"visitor{i}", conv, texts[n])  # one owner each: the queue's cap is per owner
            except Exception as e:  # noqa: BLE001 (counted and printed)
                errors.append(f"{type(e).__name__}: {e}")
                continue
            conv = ev.conv_id
            rows.append({"n": n, "ttft_s": ev.stats.gen.ttft_s, "meets_recycle": meets or runner.loading})

    try:
        progress(f"bench recycle: {requests} turns, {clients} at a time, recycling after {after}…")
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        rt.close()
    met = [r["ttft_s"] for r in rows if r["meets_recycle"]]
    rest = [r["ttft_s"] for r in rows if not r["meets_recycle"]]
    return {
        "requests": requests,
        "clients": clients,
        "after": after,
        "answered": len(rows),
        "errors": errors,
        "processes": runner.launched,
        "recycles": runner.recycles,
        "handed_over": runner.handed_over,
        "wall_s": round(wall, 2),
        "ttft_meets_recycle_s": _median(met),
        "ttft_meets_recycle_n": len(met),
        "ttft_other_s": _median(rest),
        "ttft_max_s": round(max((r["ttft_s"] for r in rows), default=0.0), 3),
    }


def chat_across(settings, turns: int, hand_over: bool, progress=print) -> dict:
    """One chat of `turns` turns, a recycle, one more turn: the last turns' TTFT and reuse."""
    rt, chat, runner = _runtime(settings)
    runner.hand_over_caches = hand_over
    try:
        texts = scripted_turns(turns + 1)
        conv, before = None, None
        for text in texts[:turns]:
            before = chat.ask(LOCAL, conv, text, wait_summary=True)
            conv = before.conv_id
        assert before is not None
        progress(f"bench recycle: a chat of {turns} turns; recycling ({'hand over' if hand_over else 'drop'})…")
        t0 = time.perf_counter()
        assert runner.recycle_now(timeout=300), "the new engine process did not come up"
        switch_s = time.perf_counter() - t0
        after = chat.ask(LOCAL, conv, texts[turns])
    finally:
        rt.close()
    b, a = before.stats.gen, after.stats.gen
    return {
        "mode": "hand over" if hand_over else "drop",
        "turns": turns,
        "switch_s": round(switch_s, 2),
        "before": {"ttft_s": round(b.ttft_s, 3), "prompt": b.prompt_tokens, "reused": b.reused_tokens},
        "after": {"ttft_s": round(a.ttft_s, 3), "prompt": a.prompt_tokens, "reused": a.reused_tokens},
    }


def run(settings, turns: int = 12, progress=print) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        s = scratch_settings(settings, Path(tmp) / "crowd")
        result: dict[str, Any] = {"bench": "recycle", "crowd": crowd(s, progress=progress), "chat": []}
        for hand_over in (True, False):
            s = scratch_settings(settings, Path(tmp) / f"chat-{hand_over}")
            result["chat"].append(chat_across(s, turns, hand_over, progress))
    return result


def markdown(r: dict) -> str:
    c = r["crowd"]
    lines = [
        f"## Recycling the engine process ({c['requests']} turns, {c['clients']} chats at a time, "
        f"LLMWEB_RECYCLE_AFTER={c['after']})",
        "",
        f"{c['answered']} of {c['requests']} answered ({len(c['errors'])} errors) by {c['processes']} engine "
        f"processes ({c['recycles']} recycles, {c['handed_over']} kept caches handed over), "
        f"in {c['wall_s']} s.",
        f"TTFT, median: **{c['ttft_meets_recycle_s']:.3f} s** for the {c['ttft_meets_recycle_n']} turns that met a "
        f"recycle (a replacement loading), {c['ttft_other_s']:.3f} s for the others; "
        f"the longest {c['ttft_max_s']:.3f} s.",
        "",
        "| kept caches at the recycle | switch s | turn before: TTFT s | prompt | reused | turn after: TTFT s | "
        "prompt | reused |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["chat"]:
        b, a = x["before"], x["after"]
        lines.append(
            f"| {x['mode']} | {x['switch_s']:.1f} | {b['ttft_s']:.3f} | {b['prompt']} | {b['reused']} | "
            f"{a['ttft_s']:.3f} | {a['prompt']} | {a['reused']} |"
        )
    return "\n".join(lines + [""])
