"""Keeps model steps and FX tracing apart while a decode step compiles in the background (decode_compiler.py).

torch.fx's tracer (make_fx in AOTAutograd, inductor's pattern passes) patches ``torch.nn.Module.__call__``
and ``__getattr__`` ON THE CLASS for as long as it traces, in every thread: a model step that runs in
another thread meanwhile has its module calls routed into the tracer and fails ("module is not installed as
a submodule"). So while any background compile runs in this process, each tracer patch window and each
CPU model step take one lock (``fence``): a step waits for a trace window to close, a trace window waits
for the step. Before the first compile of this process ``fence`` is a no-op; once ``install`` ran, every
step takes the lock (uncontended when no compile traces): a step that read "no compile running" could
otherwise still be running when another engine's compile in this process opens its first window.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from types import TracebackType

_LOCK = threading.RLock()
"""Held by a model step or by a tracer's patch window (re-entrant: tracers nest)."""
_active = 0
"""Background compiles running in this process (changed under _COUNT_LOCK)."""
_COUNT_LOCK = threading.Lock()
_installed = False
_steps = 0
"""Model steps inside the fence now (engines of this process)."""
_last_step_end = 0.0
"""time.monotonic() a fenced model step last ended (0.0: none yet)."""


class _Step:
    """The fence around one model step: the lock, and the step's activity for ``serving_within``."""

    def __enter__(self) -> None:
        global _steps
        _LOCK.acquire()
        _steps += 1

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        global _steps, _last_step_end
        _steps -= 1
        _last_step_end = time.monotonic()
        _LOCK.release()


_STEP = _Step()


def install() -> bool:
    """Wrap torch.fx's patcher so its windows take the lock (once per process). False when this torch has
    no such hook: then no background compile may run."""
    global _installed
    with _COUNT_LOCK:
        if _installed:
            return True
        import torch.fx._symbolic_trace as st

        original = getattr(st, "_new_patcher", None)
        if original is None:
            return False

        @contextlib.contextmanager
        def fenced_patcher() -> Iterator[object]:
            with _LOCK, original() as patcher:
                yield patcher

        st._new_patcher = fenced_patcher
        _installed = True
        return True


def compiling(delta: int) -> None:
    """A background compile begins (+1) or ends (-1)."""
    global _active
    with _COUNT_LOCK:
        _active += delta


def fence() -> contextlib.AbstractContextManager[object]:
    """Around a CPU model step: the lock once a background compile was set up in this process (``install``;
    it stays True), else nothing."""
    return _STEP if _installed else contextlib.nullcontext()


def serving_within(seconds: float) -> bool:
    """A fenced model step runs now or ended less than ``seconds`` ago (the compile child's gate,
    decode_compiler.py; read without the lock: a stale answer costs one tick)."""
    return _steps > 0 or time.monotonic() - _last_step_end < seconds
