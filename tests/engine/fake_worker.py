"""An engine process that serves a FakeRunner (tests/fakes.py) over engine/boundary.py's wire: the
supervisor's tests (engine/process.py) with real processes, real deaths and real recycling, at
~0.2 s a process. `python -m tests.engine.fake_worker FD`; the spec is a dict of FakeRunner's
`token_delay_s` and `default_len`, `fail_load` (the load fails with that message) and `fail_if` (it
fails while that file exists), `load_wait_if` (its load takes 3 s while that file exists)."""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection

from llmweb.engine.boundary import serve
from llmweb.engine.kvcache import KVStore
from llmweb.errors import ConfigError
from tests.fakes import FakeRunner


def main() -> int:
    conn = Connection(int(sys.argv[1]))
    spec: dict = conn.recv()
    conn.send(("progress", "loading the fake model"))
    if spec.get("load_wait_if") and os.path.exists(spec["load_wait_if"]):
        time.sleep(3.0)
    if spec.get("fail_load") or (spec.get("fail_if") and os.path.exists(spec["fail_if"])):
        conn.send(("failed", ConfigError(spec.get("fail_load") or "the fake model is gone")))
        return 1
    runner = FakeRunner(token_delay_s=spec.get("token_delay_s", 0.0), default_len=spec.get("default_len", 3))
    conn.send(("ready", {"device": "cpu", "pid": os.getpid()}))
    serve(conn, runner, KVStore(1 << 20, 600))
    return 0


if __name__ == "__main__":
    sys.exit(main())
