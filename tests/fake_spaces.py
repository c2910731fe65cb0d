"""A stand-in for Hugging Face's `spaces` package on ZeroGPU, for tests on the CPU.

It does to a decorated function's call what `spaces` 0.51 does (spaces/zero/wrappers.py,
zero/decorator.py, utils.py), without a GPU or the scheduling service:
- `GPU(fn)`, `GPU(duration=...)(fn)`: a generator function stays a generator (its yields come back one
  by one), any other function returns its value; `duration` may be a number or a callable of the
  call's own arguments (recorded per call in `durations`, with the Gradio request spaces would send
  in `requests`);
- each call forks a child (a fork-context `Process`: state the child changes dies with it, as in a
  worker the real package forked earlier or afresh) and puts `(args, kwargs)` on a fork-context
  `SimpleQueue`, which pickles at once: an unpicklable argument raises `PicklingError` in the caller;
  the results come back pickled the same way; an exception in the child is re-raised here by its
  class name ("ZeroGPU worker error"); closing the caller's generator stops the child's;
- the start-up check: `install` wraps `gradio.Blocks.launch`, and launching with no decorated function
  fails as ZeroGPU stops such a Space ("No @spaces.GPU function detected during startup").
It does not patch torch: the model stays on the CPU.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import pickle
import sys
import traceback
from multiprocessing.queues import SimpleQueue as _SimpleQueue

FORK = multiprocessing.get_context("fork")

decorated: list = []  # every function decorated, in order
durations: list = []  # each call's duration, as `duration` gave it (None: the default, 60 s)
requests: list = []  # each call's Gradio request, as spaces reads it to send the visitor's X-IP-Token
forked = False  # True in a child: a decorated function called there runs as it is


class SimpleQueue(_SimpleQueue):
    """spaces/utils.py's queue: fork context; pickling errors come out as `PicklingError`."""

    def __init__(self):
        super().__init__(ctx=FORK)

    def put(self, obj):
        try:
            super().put(obj)
        except pickle.PicklingError:
            raise
        except Exception as e:  # e.g. TypeError: cannot pickle '_thread.RLock' object
            if "pickle" not in str(e):
                raise
            raise pickle.PicklingError(str(e)) from e


class WorkerError(RuntimeError):
    """What the caller sees of an exception in the child (spaces raises a gr.Error titled so)."""


def GPU(task=None, *, duration=None, size=None):
    if task is None:
        return functools.partial(_decorate, duration=duration)
    return _decorate(task, duration=duration)


def _decorate(task, duration):
    decorated.append(task)
    if inspect.isgeneratorfunction(task):
        return _generator(task, duration)
    return _regular(task, duration)


def _schedule(duration, args, kwargs) -> None:
    from gradio.context import LocalContext

    requests.append(LocalContext.request.get(None))
    durations.append(duration(*args, **kwargs) if callable(duration) else duration)


def _start(task, args, kwargs):
    """A forked worker with the call's arguments on its queue (pickled now, here)."""
    arg_queue, res_queue, stop = SimpleQueue(), SimpleQueue(), FORK.Event()
    child = FORK.Process(target=_child, args=(task, arg_queue, res_queue, stop), daemon=True)
    child.start()
    try:
        arg_queue.put((args, kwargs))
    except pickle.PicklingError:
        child.kill()
        child.join()
        raise
    return child, res_queue, stop


def _regular(task, duration):
    @functools.wraps(task)
    def call(*args, **kwargs):
        if forked:
            return task(*args, **kwargs)
        _schedule(duration, args, kwargs)
        child, res_queue, _stop = _start(task, args, kwargs)
        try:
            kind, value = res_queue.get()
            if kind == "error":
                raise WorkerError(f"ZeroGPU worker error: {value}")
            return value
        finally:
            child.join()

    return call


def _generator(task, duration):
    @functools.wraps(task)
    def call(*args, **kwargs):
        if forked:
            yield from task(*args, **kwargs)
            return
        _schedule(duration, args, kwargs)
        child, res_queue, stop = _start(task, args, kwargs)
        try:
            while True:
                kind, value = res_queue.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise WorkerError(f"ZeroGPU worker error: {value}")
                try:
                    yield value
                except GeneratorExit:
                    stop.set()
                    raise
        finally:
            child.join(timeout=30)

    return call


def _child(task, arg_queue, res_queue, stop) -> None:
    global forked
    forked = True
    args, kwargs = arg_queue.get()
    try:
        if inspect.isgeneratorfunction(task):
            for value in task(*args, **kwargs):
                if stop.is_set():
                    break
                res_queue.put(("ok", value))
            res_queue.put(("end", None))
        else:
            res_queue.put(("ok", task(*args, **kwargs)))
    except Exception as e:
        traceback.print_exc()
        res_queue.put(("error", type(e).__name__))


def startup() -> None:
    """ZeroGPU's check when the app launches."""
    if not decorated:
        raise RuntimeError("No @spaces.GPU function detected during startup")


def install(monkeypatch) -> None:
    """Be `spaces` on a ZeroGPU Space for one test: SPACES_ZERO_GPU set, `import spaces` gives this
    module (fresh), and a Gradio launch runs the start-up check first."""
    import gradio

    for record in (decorated, durations, requests):
        record.clear()
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setitem(sys.modules, "spaces", sys.modules[__name__])
    launch = gradio.Blocks.launch

    def checked_launch(self, *args, **kwargs):
        startup()
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(gradio.Blocks, "launch", checked_launch)
