"""An engine process that serves a FakeRunner (tests/fakes.py) over engine/boundary.py's wire: the
supervisor's tests (engine/process.py) with real processes, real deaths and real recycling, at
~0.2 s a process. `python -m tests.engine.fake_worker FD`; the spec is a dict of FakeRunner's
`token_delay_s` and `default_len`, `fail_load` (the load fails with that message) and `fail_if` (it
fails while that file exists), `load_wait_if` (its load takes 3 s while that file exists), `keep_caches` (a
request with a session keeps its ids in the KV store, which `kv_export` gives as bytes), `fail_import` (`kv_import`
answers an error, as a CUDA OOM in the real runner's `import_cache` would), `raise_when` (path, text):
the next decode step after that file appears raises a RuntimeError with that text, and the file goes."""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection

from llmweb.engine.boundary import serve
from llmweb.engine.kvcache import KVStore
from llmweb.errors import ConfigError, OutOfMemory
from tests.fakes import FakeRunner


class HandOverRunner(FakeRunner):
    """A FakeRunner whose kept caches cross processes as bytes (a recycle's hand-over), and whose
    decode can raise a CUDA-like error once a file appears (the spec's `raise_when`)."""

    def __init__(self, spec: dict, kv: KVStore):
        super().__init__(token_delay_s=spec.get("token_delay_s", 0.0), default_len=spec.get("default_len", 3))
        self.kv = kv if spec.get("keep_caches") else None
        self.fail_import = spec.get("fail_import", False)
        self.raise_when = spec.get("raise_when")

    def padding(self, request, running) -> tuple[int, int]:
        return 0, 0

    def export_cache(self, cache) -> bytes:
        return bytes(cache)

    def import_cache(self, data: bytes):
        if self.fail_import:
            raise OutOfMemory("CUDA out of memory (injected into kv_import)")
        return list(data)

    def release(self, slot, keep: bool) -> None:
        super().release(slot, keep)
        if self.kv is not None and keep and slot.request.session_id:
            ids = list(slot.request.prompt_ids) + slot.generated
            self.kv.put(slot.request.session_id, ids, ids, len(ids))

    def decode(self, slots) -> bool:
        if self.raise_when and os.path.exists(self.raise_when[0]):
            os.unlink(self.raise_when[0])
            raise RuntimeError(self.raise_when[1])
        return super().decode(slots)


def main() -> int:
    conn = Connection(int(sys.argv[1]))
    spec: dict = conn.recv()
    conn.send(("progress", "loading the fake model"))
    if spec.get("load_wait_if") and os.path.exists(spec["load_wait_if"]):
        time.sleep(3.0)
    if spec.get("fail_load") or (spec.get("fail_if") and os.path.exists(spec["fail_if"])):
        conn.send(("failed", ConfigError(spec.get("fail_load") or "the fake model is gone")))
        return 1
    kv = KVStore(1 << 20, 600)
    runner = HandOverRunner(spec, kv)
    conn.send(("ready", {"device": "cpu", "pid": os.getpid()}))
    if serve(conn, runner, kv):
        os._exit(3)  # a sticky device error: the supervisor restarts the process
    return 0


if __name__ == "__main__":
    sys.exit(main())
