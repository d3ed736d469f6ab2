"""The compile child: fills the on-disk compile cache with an engine's decode-step variants, off the serving
process (``python -m services.engine.cpu.compile_child``, started by decode_compiler.py; never by hand).

Why a process: a cold inductor compile of the batch-1 step of the embedded model took 1-10 min on a busy
2-core host, and in the engine's own process it slowed serving ~3x meanwhile (the compiling thread holds
the GIL while Dynamo and make_fx trace, and the trace fence stalls model steps). Here the compile runs at
nice 19, with one C++ compiler process at a time (inductor ``compile_threads = 1``; and one child per cache
directory at a time on the host: an flock on ``<cache dir>/compile.lock``), and shares no lock with the
server. The server then compiles each variant again FROM THE CACHE this child filled (inductor's FX graph
and AOTAutograd caches, keyed by the graph, the input shapes and dtypes, the thread count and torch's
version): seconds instead of minutes, and no make_fx trace window.

Protocol (local pipes only, nothing from the wire). stdin: one JSON object ``{"config": {EngineConfig
fields}, "weights": compile_cache.weight_plan(), "max_batch": N, "scratch_pages": P, "variants": [[batch, threads],
...]}``; the config names the dtype the parent resolved and ``weights`` the packed-weight choices its start-up
timing made (which linears and LM head read int4 weights, up to how many rows), so the child loads the same
model the same way, without timing anything, and builds the same graphs. stdout: one JSON line per variant as it lands in the cache, ``{"batch": b, "threads": t,
"seconds": s}``, or ``{"batch": b, "threads": t, "error": "..."}`` and exit 1 at the first failure. Logs go
to stderr. The cache directory is TORCHINDUCTOR_CACHE_DIR, set by the parent in the child's environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NICE = 19
"""Niceness of the child and of the C++ compiler processes it starts."""
# Not SCHED_IDLE: measured, a batch-1 decode step ran as much slower beside it (1.49x vs 1.38x at nice 19:
# the child's compiler competes for the cores' caches and memory, not for the scheduler), and under the
# serving gate (decode_compiler.CHILD_DUTY) it got almost no CPU in its run windows.
LOCK_NAME = "compile.lock"
"""flock'd file in the cache directory: one compile child at a time per directory."""


@contextlib.contextmanager
def _exclusive(cache_dir: Path) -> Iterator[None]:
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / LOCK_NAME, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        yield


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _apply_weight_plan(model: Any, spec: str | None, dtype: Any, plan: dict[str, int]) -> None:
    """Swap the same linears and LM head as the parent did (quant_linear.install, without its timing)."""
    if not plan["linear_rows"] and not plan["head_rows"]:
        return
    # deferred: the child imports torch and the engine only after main() has set nice 19 (see run)
    from services.engine.models import quant_linear as q
    from services.engine.weights.gguf_loader import GGUFFile
    from services.text.model.source import resolve

    src = resolve(spec)
    assert src.path is not None, "packed weights come from a GGUF file"
    gguf = GGUFFile(src.path)
    if plan["linear_rows"]:
        q.apply_swap(model, q.plan_swap(model, gguf, dtype), plan["linear_rows"])
    head = q.plan_head(model, gguf, dtype) if plan["head_rows"] else None
    if head is not None:
        model.logits_head = q.Q8_0Head(*head, plan["head_rows"])


def run(request: dict[str, Any]) -> int:
    """Compile every requested variant into the cache; 0 when all compiled, 1 at the first failure."""
    # deferred: seconds of imports, run only after main() set nice 19 and armed the parent-death signal, so
    # they never compete with the server at normal priority
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from services.engine.config import EngineConfig
    from services.engine.cpu.compiled_decode import _COMPILE_ERRORS, CompiledDecode
    from services.engine.engine import LLMEngine

    inductor_config.compile_threads = 1
    with _exclusive(Path(cache_dir())):
        config = EngineConfig(**request["config"])  # weight_format "dequantized": swapped below, as the parent
        engine = LLMEngine(config)
        runner = engine.runner
        _apply_weight_plan(runner.model, config.model, config.torch_dtype, request["weights"])
        compiled = CompiledDecode(runner.model, runner.kv_cache, int(request["max_batch"]))
        scratch = compiled.scratch_pool(int(request["scratch_pages"]))
        for batch, threads in request["variants"]:
            torch.set_num_threads(int(threads))
            t0 = time.monotonic()
            try:
                with torch.inference_mode():
                    compiled.compile(int(batch), scratch)
            except _COMPILE_ERRORS as e:
                _emit({"batch": batch, "threads": threads, "error": str(e).splitlines()[0][:500]})
                return 1
            _emit({"batch": batch, "threads": threads, "seconds": round(time.monotonic() - t0, 3)})
    return 0


def _die_with_parent() -> None:
    """SIGKILL this child when the thread that started it ends (Linux prctl PR_SET_PDEATHSIG): a server killed
    outright (SIGKILL, OOM) leaves no compiler behind. That thread waits for the child, so it never ends first
    otherwise."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def main() -> int:
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(NICE)  # inherited by the C++ compiler processes inductor starts
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s compile-child %(levelname)s %(name)s: %(message)s")
    request = json.loads(sys.stdin.read())
    if os.getppid() != request.get("parent_pid"):
        return 1  # the server died before the death signal was armed
    return run(request)


if __name__ == "__main__":
    sys.exit(main())
