"""Reading memory: the figures behind every request's and turn's statistics, and the benchmarks' meters.

`memory_snapshot(device)` reads CUDA allocator figures (allocated, reserved, peak, inactive
split bytes, retries, OOMs) when the device is CUDA, and the process RSS always, into a
`llmweb.records.MemorySnapshot`. `RssPeak` samples RSS during a request, because the OS keeps
only a lifetime peak on CPU. For the benchmarks (llmweb/bench/): `PeakMeter` (a peak between two
points), `release_memory`, `current_bytes`, `private_bytes` and `live_tensors` (leaks).

Owns: how memory is read and printed (`mib`). Must not: define the records themselves (they
live in llmweb/records.py, with no dependencies: `MemorySnapshot`, `GenerationStats`,
`TurnStats`), decide anything from the figures (admission.py does), or import torch at module
level (only inside the functions that read CUDA figures).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from llmweb.records import MemorySnapshot

__all__ = [
    "PeakMeter",
    "current_bytes",
    "is_cuda",
    "live_tensors",
    "memory_snapshot",
    "mib",
    "private_bytes",
    "release_memory",
    "reset_peak",
    "rss_bytes",
    "RssPeak",
]

_PROC = psutil.Process(os.getpid())


def mib(n: int | float | None) -> str:
    """Bytes as "1,234 MiB": the one way llmweb prints a memory figure."""
    return f"{(n or 0) / 2**20:,.0f} MiB"


def rss_bytes() -> int:
    return _PROC.memory_info().rss


def is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def memory_snapshot(device="cpu", peak_rss: int = 0) -> MemorySnapshot:
    rss = rss_bytes()
    if not is_cuda(device):
        return MemorySnapshot(rss_bytes=rss, peak_rss_bytes=max(peak_rss, rss) if peak_rss else 0)
    import torch

    s = torch.cuda.memory_stats(device)
    return MemorySnapshot(
        rss_bytes=rss,
        peak_rss_bytes=max(peak_rss, rss) if peak_rss else 0,
        cuda_allocated_bytes=s.get("allocated_bytes.all.current", 0),
        cuda_reserved_bytes=s.get("reserved_bytes.all.current", 0),
        cuda_peak_bytes=s.get("allocated_bytes.all.peak", 0),
        cuda_inactive_split_bytes=s.get("inactive_split_bytes.all.current", 0),
        cuda_alloc_retries=s.get("num_alloc_retries", 0),
        cuda_ooms=s.get("num_ooms", 0),
    )


def reset_peak(device) -> None:
    if is_cuda(device):
        import torch

        torch.cuda.reset_peak_memory_stats(device)


class RssPeak:
    """The highest RSS seen by `sample()` calls (one per decode step costs ~20 us)."""

    def __init__(self):
        self.peak = rss_bytes()

    def sample(self) -> None:
        rss = rss_bytes()
        if rss > self.peak:
            self.peak = rss


# ---- measurement helpers for the benchmarks (llmweb/bench/): peaks, leaks, freed memory


def release_memory(device: str = "cpu") -> None:
    """Collect garbage and hand freed memory back (glibc malloc_trim; CUDA allocator cache)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS may keep freed pages, figures are upper bounds
        pass
    if is_cuda(device):
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def current_bytes(device: str = "cpu") -> int:
    """What we compare across time: CUDA allocated bytes, or the process RSS on CPU."""
    if is_cuda(device):
        import torch

        return int(torch.cuda.memory_allocated(device))
    return rss_bytes()


def private_bytes(device: str = "cpu") -> tuple[int, str]:
    """Memory a leak would grow, and its name: CUDA allocated; on CPU anonymous RSS (heap, not code).

    Total RSS also counts file-backed pages (shared libraries paged in the first time a code path
    runs), which move by tens of MiB without any leak; Linux reports the anonymous part apart.
    """
    import re

    if is_cuda(device):
        return current_bytes(device), "CUDA allocated"
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"RssAnon:\s+(\d+)\s+kB", f.read())
        if m:
            return int(m.group(1)) * 1024, "anonymous RSS"
    except OSError:
        pass
    return current_bytes(device), "RSS"


def live_tensors() -> tuple[int, int]:
    """(live torch tensors, of which held by live DynamicCaches), after a full collection.

    Types are tested with `type()`, not `isinstance()`: some torch objects warn when their
    `__class__` is read.
    """
    import gc

    import torch
    from transformers import DynamicCache

    gc.collect()
    tensors = in_caches = 0
    for o in gc.get_objects():
        kind = type(o)
        if issubclass(kind, torch.Tensor):
            tensors += 1
        elif issubclass(kind, DynamicCache):
            for layer in getattr(o, "layers", ()):
                in_caches += sum(issubclass(type(getattr(layer, n, None)), torch.Tensor) for n in ("keys", "values"))
    return tensors, in_caches


class PeakMeter:
    """Peak memory between `start()` and `stop()`: CUDA max_memory_allocated, or the process peak RSS.

    On Linux the kernel keeps the RSS high-water mark (VmHWM) and writing 5 to
    /proc/self/clear_refs resets it, so the CPU peak is exact. Elsewhere a thread samples RSS
    every 2 ms (a short spike can be missed).
    """

    def __init__(self, device: str = "cpu"):
        import threading

        self.device = str(device)
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampled = 0

    def start(self) -> PeakMeter:
        import threading

        if is_cuda(self.device):
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "cuda max_memory_allocated"
            return self
        if _reset_hwm():
            self.method = "VmHWM"
            return self
        self.method = "sampled RSS (2 ms)"
        self._sampled = rss_bytes()
        self._stop.clear()

        def sample():
            while not self._stop.wait(0.002):
                self._sampled = max(self._sampled, rss_bytes())

        self._thread = threading.Thread(target=sample, name="llmweb-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        if is_cuda(self.device):
            import torch

            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        if self._thread is None:
            return _read_hwm()
        self._stop.set()
        self._thread.join()
        self._thread = None
        return max(self._sampled, rss_bytes())


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _read_hwm() > 0
    except OSError:
        return False


def _read_hwm() -> int:
    import re

    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


@dataclass
class StepTiming:
    """Where a runner's decode steps' time went, summed since it started (bench decode reads it)."""

    steps: int = 0  # batched decode passes
    decode_s: float = 0.0  # in `decode`, all of it
    forward_s: float = 0.0  # the model's forward pass (then the RSS read: runner other)
    sample_s: float = 0.0  # sampling every row's next token
    # wait for the device at each reading (bench decode sets it): a CUDA pass runs asynchronously, so
    # without a sync forward_s is the kernel launches' time and sample_s absorbs the pass; off, no sync
    exact: bool = False

    def add(self, t0: float, t1: float, t2: float, t3: float) -> None:
        """One step: it began at t0, its forward pass ran t1..t2, and sampling ended at t3."""
        self.steps += 1
        self.decode_s += t3 - t0
        self.forward_s += t2 - t1
        self.sample_s += t3 - t2
