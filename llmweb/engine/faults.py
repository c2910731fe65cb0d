"""What a device error means for the engine: out of memory (one request gives way) or a sticky
fault (the process's CUDA context is poisoned, so the engine process must end and be restarted).

torch raises the caching allocator's OOM as `torch.OutOfMemoryError`, but memory runs out in
other places too: cuBLAS creating a handle or workspace raises a plain RuntimeError that names
CUBLAS_STATUS_ALLOC_FAILED, and a driver call raises `torch.AcceleratorError` (a RuntimeError,
torch >= 2.8) "CUDA error: out of memory". Those give way like the allocator's. A device-side
assert (an id past the embedding), an illegal address or an Xid is sticky: every later CUDA call
of the process fails, so answering on with errors would fail every request until an operator
restarts llmweb. Both come from native code whose only signal is the message, so these tests
read the class name and the text; nothing else in the engine does.

Owns: the two verdicts. Must not: import torch, or act on a verdict (the runner gives way,
engine/boundary.py ends the engine process).
"""

from __future__ import annotations

OOM_TEXTS = ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDA error: out of memory")


def out_of_memory(error: BaseException, classes: tuple[type[BaseException], ...] = ()) -> bool:
    """An allocator OOM (one of `classes`), or a device's other failure to get memory."""
    if classes and isinstance(error, classes):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in OOM_TEXTS)


def sticky(error: BaseException) -> bool:
    """A device error after which the process's device context is unusable (not an OOM)."""
    if out_of_memory(error):
        return False
    cuda = isinstance(error, RuntimeError) and str(error).startswith("CUDA error")
    return type(error).__name__ == "AcceleratorError" or cuda
