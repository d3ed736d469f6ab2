"""The serving side of the compile child (compile_child.py): the on-disk compile cache directory, the thread
counts variants are compiled at, and the child process itself.

Cache directory: ``--cpu-compile-cache-dir`` (default ``~/.cache/pdserve/torch-compile``), local config only.
It becomes inductor's cache directory (TORCHINDUCTOR_CACHE_DIR, which inductor itself reads and writes in
this process's environment) for every compile of this process: one directory per process, set by each engine
that starts a background compile (the last one started wins: engines of one process name the same directory).
The child inherits it and fills it; the server's own compiles then read it. Inductor loads shared objects and
pickled code from it, so a directory not owned by this user, or writable by group or others, is refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from services.engine.config import EngineConfig
from services.engine.cpu.cpu_features import available_cpus
from services.engine.models.quant_linear import Int4Linear, Q8_0Head

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/pdserve/torch-compile"
CHILD_ARGV = (sys.executable, "-m", "services.engine.cpu.compile_child")
"""The child's command line (run from the directory holding the ``services`` package)."""
_ROOT = Path(__file__).resolve().parents[3]
"""The directory holding the ``services`` package."""


def weight_plan(model: Any) -> dict[str, int]:
    """The packed-weight choices of a loaded model (models/quant_linear.py): rows up to which the swapped
    linears (one bound for all) and the Q8_0 LM head read packed weights; 0: not swapped. The compile child
    swaps the same ones (compile_child._apply_weight_plan)."""
    rows = {m.max_rows for m in model.modules() if isinstance(m, Int4Linear)}
    head = getattr(model, "logits_head", None)
    return {"linear_rows": max(rows, default=0), "head_rows": head.max_rows if isinstance(head, Q8_0Head) else 0}



def cache_dir_of(config: EngineConfig) -> Path:
    return Path(config.cpu_compile_cache_dir or DEFAULT_CACHE_DIR).expanduser().resolve()


def use_cache_dir(path: Path) -> None:
    """Make ``path`` inductor's cache directory for this process (created, mode 0700 when new); PermissionError
    when it is not a directory of this user that only this user may write."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"not a directory of this user writable by this user only (mode {st.st_mode & 0o777:o}):"
                              " refused (inductor loads code from it)")
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(path):
        from torch._inductor.utils import clear_caches

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
        clear_caches()  # in-memory entries of another directory are not this one's


def cpp_compiler() -> str | None:
    """Path of the C++ compiler inductor would run (its ``cpp.cxx`` choice: $CXX or g++, looked up on PATH);
    None when there is none (inductor's optional conda install of g++ is not counted)."""
    import torch._inductor.config as inductor_config

    cxx = inductor_config.cpp.cxx
    for name in cxx if isinstance(cxx, (list, tuple)) else (cxx,):
        if name and (path := shutil.which(name)):
            return path
    return None


def lent_threads(config: EngineConfig) -> int:
    """The torch thread count core lending can raise this engine to (its share plus every peer's: the CPUs it
    may run on) when it is in a share group and lending applies (step_loop._join_share_group's rules);
    0 when it never runs at another count."""
    if not config.cpu_share_group or config.cpu_affinity_list or config.tensor_parallel_size > 1:
        return 0
    n = len(available_cpus())
    return n if n > config.resolved_cpu_threads else 0


def child_request(config: EngineConfig, model: Any, max_batch: int, scratch_pages: int,
                  variants: list[tuple[int, int]]) -> dict[str, Any]:
    """What the child needs to build the same graphs: the engine's settings with the dtype it resolved, the
    packed-weight choices it made, one small KV pool, nothing shared, no compile of its own."""
    cfg = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    cfg.update(dtype=config.resolved_dtype, weight_format="dequantized", cpu_compile_decode=0, num_kv_blocks=4,
               kv_cache_shared=False, cpu_share_group="", cpu_affinity="", draft_model="", spec_tokens=0,
               spec_synthetic_acceptance=0.0, tensor_parallel_size=1, device="cpu")
    return {"config": cfg, "weights": weight_plan(model), "max_batch": max_batch, "scratch_pages": scratch_pages,
            "variants": [list(v) for v in variants], "parent_pid": os.getpid()}


class CompileChild:
    """One compile child: started at construction, its per-variant records read as they come.

    It leads a process group of its own (its C++ compiler runs are in it): ``kill`` and ``pause`` reach
    them all, and a terminal's Ctrl-C reaches the server only, which kills the group as it stops. A server
    killed outright takes the child with it (its parent-death signal, compile_child._die_with_parent); the
    group stays in the server's session, so when the server dies the group is orphaned and the kernel sends
    it SIGHUP and SIGCONT: compiler runs stopped by the gate end too (in a session of its own the group
    would never be orphaned, and stay stopped forever). A compiler run that the gate had not stopped runs to
    its end."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(CHILD_ARGV, cwd=_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     process_group=0)
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # a child that died at start: its exit status tells
            self.proc.stdin.write(json.dumps(request).encode())
            self.proc.stdin.close()

    def records(self) -> Iterator[dict[str, Any]]:
        """Each variant's record as the child prints it; ends when the child exits or is killed."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):  # not JSON (or not UTF-8): not a record
                rec = json.loads(line)
                if isinstance(rec, dict):
                    yield rec

    def _signal(self, sig: int) -> None:
        if self.proc.returncode is None:  # not reaped yet: the group id is still this child's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue the child and its compiler runs (benchmarks: serving with and without
        it, alternating)."""
        self._signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def wait(self) -> int:
        """The child's exit status (negative: killed by that signal)."""
        rc = self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return rc
