"""Document work in the web process, run on threads named as background work.

The engine process's thread governor (engine/runners/threads.py) counts the web process's CPU as
the reply's own (its streaming is the reply's work), and so keeps every decode thread while it
runs. An upload's embedding batches and OCR pages are not the reply's: they are another visitor's
work on the same cores, as a browser is. So they run, one piece at a time (a batch, a page), on a
thread of their own per kind, named BACKGROUND_PREFIX-<kind> from its start; the threads it starts
(torch's OpenMP workers, onnxruntime's pool, tokenizers' rayon pool) take the name from it at
birth, so their CPU counts as another process's for as long as they live. Callers wait for each
piece, so two uploads still take turns piece by piece.

Must not: decide what runs (callers do), or take a lock that a caller may hold while it waits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
BACKGROUND_PREFIX = "llmweb-bg"  # engine/runners/threads.py reads it (a test holds the two equal)
_PR_SET_NAME = 15
_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


@functools.cache
def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except OSError:
        return None


def _name_this_thread(name: str) -> None:
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def in_background(kind: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on the `kind` background thread; its result, or its exception, here."""
    with _pools_lock:
        pool = _pools.get(kind)
        if pool is None:
            name = f"{BACKGROUND_PREFIX}-{kind}"
            pool = _pools[kind] = ThreadPoolExecutor(1, name, initializer=_name_this_thread, initargs=(name,))
    return pool.submit(fn, *args, **kwargs).result()
