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
from collections.abc import Iterator

_LOCK = threading.RLock()
"""Held by a model step or by a tracer's patch window (re-entrant: tracers nest)."""
_active = 0
"""Background compiles running in this process (changed under _COUNT_LOCK)."""
_COUNT_LOCK = threading.Lock()
_installed = False


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
    return _LOCK if _installed else contextlib.nullcontext()
