"""Memory snapshots and per-request / per-turn statistics, as dataclasses.

`memory_snapshot(device)` reads CUDA allocator figures (allocated, reserved, peak, inactive
split bytes, retries, OOMs) when the device is CUDA, and the process RSS always. `RssPeak`
samples RSS during a request, because the OS keeps only a lifetime peak on CPU.

`GenerationStats` is what the engine knows about one request; `TurnStats` adds what the chat
knows (tokens per prompt section, what was left out, the summary). Both flatten to plain
dicts for the store, the replay JSON and the UI.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import psutil

_PROC = psutil.Process(os.getpid())


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    rss_bytes: int
    peak_rss_bytes: int = 0  # during the request (sampled), 0 when not measured
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None
    cuda_peak_bytes: int | None = None  # since the last reset_peak (one request)
    cuda_inactive_split_bytes: int | None = None
    cuda_alloc_retries: int | None = None
    cuda_ooms: int | None = None

    @property
    def fragmentation_bytes(self) -> int | None:
        if self.cuda_reserved_bytes is None or self.cuda_allocated_bytes is None:
            return None
        return self.cuda_reserved_bytes - self.cuda_allocated_bytes

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if self.fragmentation_bytes is not None:
            d["cuda_fragmentation_bytes"] = self.fragmentation_bytes
        return d


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


@dataclass(slots=True)
class GenerationStats:
    """What the engine measured for one request."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens served from the session's KV cache
    prefilled_tokens: int = 0  # prompt tokens computed this time
    queue_wait_s: float = 0.0
    ttft_s: float = 0.0  # from the start of processing to the first new token
    decode_tok_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""  # eos | length | cancelled | timeout
    kv_session_bytes: int = 0
    kv_store_bytes: int = 0
    predicted_bytes: int = 0  # admission control's estimate of the request's peak
    oom_retry: bool = False
    mem: MemorySnapshot | None = None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mem"}
        d["mem"] = self.mem.to_dict() if self.mem else {}
        return d


@dataclass(slots=True)
class TurnStats:
    """One chat turn: the engine's figures plus the prompt plan's itemisation."""

    turn: int
    gen: GenerationStats
    sections: dict[str, int] = field(default_factory=dict)
    context_limit: int = 0
    dropped_turns: int = 0
    summarized_turns: int = 0
    summary_tokens: int = 0
    dropped_chunks: int = 0

    def to_dict(self) -> dict:
        d = {"turn": self.turn}
        d.update(self.gen.to_dict())
        d.update(sections=dict(self.sections), context_limit=self.context_limit,
                 dropped_turns=self.dropped_turns, summarized_turns=self.summarized_turns,
                 summary_tokens=self.summary_tokens, dropped_chunks=self.dropped_chunks)
        return d
