"""Core lending with compiled decode steps (step_loop._borrow_exactly, CoreShare.busy's ``exactly``): a
borrowed step runs at the lent count its variants are compiled at, or at the engine's own share, never at a
count in between (some peers idle, some not), where no variant exists and the step would run eager."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from services.engine.cpu import core_share as cs
from services.engine.step_loop import _borrow_exactly

HOLD = cs.HOLD_NS
T0 = 10**12
"""A CLOCK_MONOTONIC ns far from 0, so 'idle since start' is long past."""


def _join(tmp_path: Path, pid: int) -> cs.CoreShare:
    return cs.CoreShare.join("g1", 2, lambda n: None, shm_dir=tmp_path, pid=pid)


def test_a_borrowed_step_runs_at_the_compiled_lent_count_or_at_its_share(tmp_path: Path) -> None:
    """3 engines x 2 threads on 6 cores; variants at 2 and at 6 threads."""
    third = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        a, b, c = _join(tmp_path, os.getpid()), _join(tmp_path, os.getppid()), _join(tmp_path, third.pid)
        c.idle(T0)
        b.busy(T0)
        assert a.busy(T0 + HOLD) == 4  # no compiled sizes: whatever is idle
        assert a.busy(T0 + HOLD + 1, exactly=6) == 2  # 4 has no variant: its own share
        b.idle(T0 + HOLD + 2)
        assert a.busy(T0 + 3 * HOLD, exactly=6) == 6  # both peers idle: the compiled lent count
        assert a.busy(T0 + 3 * HOLD + 1, borrow=False, exactly=6) == 2
    finally:
        third.kill()
        third.wait()


def test_the_exact_count_is_the_lent_count_only_while_compiled_sizes_are_on() -> None:
    compiled = SimpleNamespace(active=frozenset({1}))
    eng = SimpleNamespace(runner=SimpleNamespace(compiled_decode=compiled,
                                                 decode_compiler=SimpleNamespace(lent_threads=6)))
    assert _borrow_exactly(eng) == 6  # type: ignore[arg-type]
    compiled.active = frozenset()
    assert _borrow_exactly(eng) == 0  # type: ignore[arg-type]  # all eager: any count
    eng.runner.compiled_decode = None
    assert _borrow_exactly(eng) == 0  # type: ignore[arg-type]
