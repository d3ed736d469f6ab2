"""Compiles the CPU decode step in the background while the engine serves eager steps (``--cpu-compile-decode``).

The cold compile runs in a child process (compile_child.py: nice 19, one C++ compiler at a
time, no lock of the server; a gate thread runs it while the engine is idle, while this process builds a
variant from the cache, and for CHILD_DUTY of the time while it serves, stopped with SIGSTOP the rest) that fills the on-disk compile cache (compile_cache.py, ``--cpu-compile-cache-dir``) with
every variant: batch sizes 1..N at the engine's thread share, and again at the lent thread count when the
engine is in a core share group. One thread per engine (one at a time per process; not a daemon:
DecodeCompiler.__init__ says why) takes each variant as the child reports it: it compiles it in this process
from that cache (seconds; a cache miss compiles here, as before, logged) against a private scratch pool,
at the variant's thread count, checks it against the eager step on the same inputs (fp32 logits within a tolerance of the dtype, the same argmax in every row:
a variant that disagrees is dropped and logged), times compiled and eager steps alternating, and switches
the variant on (``CompiledDecode.activate``) only when it measured faster. A child that fails or dies is
logged once; the sizes it did not deliver stay eager (no retry, no restart). The engine thread reads the set
of switched-on sizes once per step, so a switch happens between steps, on the engine thread.

Sharing: the thread reads the model's weights and the RoPE tables and nothing else of the engine: its pool
is the scratch pool, its eager reference step uses a private copy of the rotary module (StepCachedRotary
keeps per-step rows on the module), and it never calls a variant the engine thread runs. torch.fx patches
``nn.Module`` itself while it traces, so model steps and tracer windows exclude each other (trace_fence.py):
a step waits while the compile thread traces (make_fx of one variant's graph: the longest stalls).

Cores: the thread keeps the engine's priority (NICE = 0): it holds the fence while it traces, and at
nice +10 on a loaded box the engine's steps waited behind a starved tracing thread (tests/engine/test_engine.py
took 6 min instead of 2). While it works (not while it waits for the child), the interpreter's switch
interval drops to 0.5 ms, so an engine step
waiting for the GIL after each torch op (ops release it) waits at most that long instead of 5 ms; inductor
compiles (cache misses) in this thread (compile_threads = 1: one C++ compiler process at a time, no worker
pool), at each variant's thread count (Dynamo guards on the thread count: a step at a count without a
variant of its size runs eager).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import math
import os
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch._inductor.config as inductor_config

from services.engine.config import EngineConfig
from services.engine.cpu import compile_cache, trace_fence
from services.engine.cpu.compiled_decode import _COMPILE_ERRORS, CompiledDecode
from services.engine.cpu.decode_check import (
    CONTEXT_TOKENS,
    CompileReport,
    EagerStep,
    VariantReport,
    crossover_keys,
    scratch_pages,
    tolerance,
)

log = logging.getLogger(__name__)

TIMED_PAIRS = 8
"""Eager/compiled step pairs timed per variant (order alternating; the first pair warms up, not kept)."""
LONG_CONTEXT_TOKENS = 2048
"""Context of the second timing of a switched-on variant (keys per sequence; less where the model's context
or LONG_TOTAL_KEYS is shorter). The compiled step gathers every key while an eager step over consecutive
blocks reads them in place, so past some context the eager step wins: the two timings place that crossover
(CompiledDecode.max_keys). Measured on the 2-core Xeon at 2 threads, batch 1 (SmolLM2-135M, bf16):
compiled 12.1 / eager 14.0 ms at 322 keys, 25.8 / 22.8 ms at 2600 keys."""
LONG_TOTAL_KEYS = 8192
"""Keys of all sequences of the long timing together at most (bounds its scratch pool)."""
LONG_POOL_MAX_BYTES = 256 << 20
"""Bytes of the long timing's scratch pool at most (a wide model gets fewer keys; freed after the timing)."""
LONG_PAIRS = 4
"""Eager/compiled step pairs of the long timing (alternating; the first pair warms up, not kept)."""
LONG_MIN_KEYS = 4 * CONTEXT_TOKENS
"""A model whose context cannot reach this many keys gets no long timing (its variants run at any context)."""
MIN_SPEEDUP = 1.0
"""A variant is switched on when eager ms / compiled ms (medians) exceeds this."""
SWITCH_INTERVAL_S = 0.0005
"""sys.setswitchinterval while compiling (the interpreter's default is 0.005 s)."""
NICE = 0
"""Niceness of the compile thread and of the compiler processes it starts (Linux, per thread; see above)."""
SERVING_IDLE_S = 0.02
"""The engine counts as idle once no model step ran for this long (s): the compile child then runs freely."""
CHILD_DUTY = 0.1
"""Share of wall time the compile child runs while the engine serves (it is stopped the rest). Measured on
the 2-core box: a batch-1 decode step ran 1.38-1.49x slower while the child compiled, at nice 19 and under
SCHED_IDLE alike (the cores, not the scheduler: the child's compiler competes for caches and memory); at a
fifth of the time (and a 20 ms tick) still 1.12x (eager steps) / 1.26x (compiled), hence a tenth and a
5 ms tick; an engine that serves without pauses still gets its variants, ten times slower."""
CHILD_PERIOD_S = 0.5
"""Length of one run/stop cycle of the child while the engine serves (s)."""
GATE_TICK_S = 0.005
"""How often the gate thread looks at the engine's activity to run or stop the child (s)."""
_ONE_AT_A_TIME = threading.Lock()
"""Held by the compiling thread: engines of one process compile one after another."""


@contextlib.contextmanager
def _background_priority() -> Iterator[float]:
    """This thread's niceness, and the short switch interval until the end; yields the interval before."""
    with contextlib.suppress(OSError, AttributeError):  # per-thread nice: Linux
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield interval
    finally:
        sys.setswitchinterval(interval)


class _Stopped(BaseException):
    """stop() was called (the thread ends between two steps of its work), or the interpreter is exiting
    (raised inside the thread, wherever it is: a BaseException, so torch's handlers let it through)."""


class DecodeCompiler:
    """The background thread of one engine's CompiledDecode (start / stop; ``report`` while it runs)."""

    def __init__(self, compiled: CompiledDecode, cpu_threads: int, config: EngineConfig | None = None) -> None:
        self.compiled = compiled
        self.config = config
        """The engine's settings (the compile child loads the model from them); None: never started."""
        self.cpu_threads = cpu_threads
        """Threads of the generated kernels (the engine's --cpu-threads share)."""
        self.lent_threads = compile_cache.lent_threads(config) if config is not None else 0
        """The count core lending raises steps to (variants compiled there too); 0: none."""
        self.report = CompileReport()
        self._child: compile_cache.CompileChild | None = None
        self._child_running = True
        self.hold_child = False
        """Keep the child stopped whatever the engine does (benchmarks: serving with and without it)."""
        self.awaiting_child = False
        """The thread is blocked on the compile child's next record (it uses no core meanwhile)."""
        self._switch_interval = sys.getswitchinterval()
        """The interpreter's switch interval outside the compile (restored while the thread awaits the child)."""
        self._stop = threading.Event()
        # The thread holds this object weakly while it waits for its turn: an engine dropped meanwhile is
        # never compiled (and its model is not kept alive by the wait).
        # Not a daemon: a daemon thread still inside torch while the interpreter tears down aborts the
        # process ("terminate called without an active exception"). At exit _interrupt_all ends it first.
        self._thread = threading.Thread(target=_thread_main, args=(weakref.ref(self),), name="pdserve-compile")

    @property
    def working(self) -> bool:
        """Waiting for its turn or compiling in this process (the runner starts it at once): its thread uses,
        or is about to use, the engine's share of cores. False while the thread only waits for the compile
        child's next variant (the child is niced and gated, and uses no core of the engine's share)."""
        return self.report.status in ("pending", "compiling") and not self.awaiting_child

    def start(self) -> None:
        if not trace_fence.install():
            log.warning("engine: --cpu-compile-decode: this torch has no FX patcher to fence, so no background "
                        "compile: decode steps stay eager")
            self.report.status = "failed"
            return
        assert self.config is not None, "a started compiler needs the engine's settings"
        if compile_cache.cpp_compiler() is None:
            log.warning("engine: --cpu-compile-decode: no C++ compiler on PATH (inductor runs $CXX or g++), so no "
                        "background compile: decode steps stay eager (--cpu-compile-decode 0 says so quietly)")
            self.report.status = "failed"
            return
        path = compile_cache.cache_dir_of(self.config)
        try:
            compile_cache.use_cache_dir(path)
        except OSError as e:
            log.warning("engine: --cpu-compile-decode: compile cache directory %s unusable (%s), so no background "
                        "compile: decode steps stay eager", path, e)
            self.report.status = "failed"
            return
        _ALL.add(self)
        trace_fence.compiling(+1)  # CPU model steps of this process take the fence until the thread ends
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """No further step of the work is started; waits up to ``timeout`` s (a variant being traced or
        compiled cannot be cut: it finishes on the compile thread, which then ends; at interpreter exit
        _interrupt_all cuts it at its next bytecode)."""
        self._stop.set()
        self._kill_child()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the thread has ended or was never started (tests, benchmarks); True if so."""
        if self._thread.ident is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _gate_child(self) -> None:
        """Run the child while the engine is idle, for CHILD_DUTY of each CHILD_PERIOD_S while it serves, and
        always while this thread builds, checks or times a variant (it may wait on an inductor file lock the
        child holds: a stopped child would hold it until the gate ran it again)."""
        child = self._child
        if child is None:
            return
        now = time.monotonic()
        run = not self.hold_child and (not self.awaiting_child or not trace_fence.serving_within(SERVING_IDLE_S)
                                       or now % CHILD_PERIOD_S < CHILD_DUTY * CHILD_PERIOD_S)
        if run != self._child_running:
            child.pause(not run)
            self._child_running = run

    def _kill_child(self) -> None:
        child = self._child
        if child is not None:
            child.kill()

    def _stopping(self) -> None:
        if self._stop.is_set():
            raise _Stopped

    def _main(self) -> None:
        try:
            with _background_priority() as self._switch_interval, torch.inference_mode():
                self._compile_all()
        except _Stopped:
            self.report.status = "stopped"
        except Exception:  # anything unforeseen: this engine stays eager, the service keeps serving
            log.exception("engine: background compile of the decode step failed; decode steps stay eager")
            self.report.status = "failed"
        finally:
            self.report.finished = time.monotonic()

    def _compile_all(self) -> None:
        cd, r = self.compiled, self.report
        inductor_config.compile_threads = 1
        # The engine's share, on this thread (guards and generated kernels take it from here); it is what
        # the main thread set at start, so threads that start later and take the default see no change.
        torch.set_num_threads(self.cpu_threads)
        cd.threads = self.cpu_threads
        r.status, r.started = "compiling", time.monotonic()
        counts = [self.cpu_threads] + ([self.lent_threads] if self.lent_threads else [])
        wanted = [(b, t) for b in range(1, cd.max_batch + 1) for t in counts]
        pages = scratch_pages(cd.max_batch, cd.block_size)
        assert self.config is not None  # start() checked
        self._child = compile_cache.CompileChild(
            compile_cache.child_request(self.config, cd.model, cd.max_batch, pages, wanted))
        gate_stop = threading.Event()
        gate = threading.Thread(target=self._gate_main, args=(gate_stop,), name="pdserve-compile-gate", daemon=True)
        gate.start()  # daemon: it touches no torch state, and is stopped and joined below
        log.info("engine: --cpu-compile-decode: compile child (pid %d) started, filling the compile cache %s with %d "
                 "decode-step variants (a cold compile takes minutes; a warm cache, seconds); steps stay eager "
                 "until each lands", self._child.proc.pid, compile_cache.cache_dir_of(self.config), len(wanted))
        try:
            if self._stop.is_set():  # stop() ran before the child existed
                raise _Stopped
            self._build_from_child(wanted, pages)
        finally:
            torch.set_num_threads(self.cpu_threads)
            gate_stop.set()
            gate.join()
            self._child.kill()  # after the gate: it continues nothing once killed
            rc = self._child.wait()
        self._stopping()
        if r.status == "compiling" and len(r.variants) < len(wanted):
            log.warning("engine: --cpu-compile-decode: the compile child exited (status %d) after %d of %d variants; "
                        "the rest stay eager (no retry)", rc, len(r.variants), len(wanted))
            r.status = "failed"
        if r.status == "compiling":
            r.status = "done"
        # The first words are what benchmarks wait for (cpu_serving_systems.COMPILE_FINISHED).
        log.info("engine: %s in %.1f s; compiled decode steps at %d threads for batch sizes %s%s",
                 "background compile done" if r.status == "done" else
                 "background compile of the decode step failed (partly)", time.monotonic() - r.started,
                 self.cpu_threads, sorted(cd.active) or "none",
                 f", at {self.lent_threads} (lent) for {sorted(cd.sizes_at(self.lent_threads)) or 'none'}"
                 if self.lent_threads else "")

    def _build_from_child(self, wanted: list[tuple[int, int]], pages: int) -> None:
        """Each variant the child put in the cache: built here from it, checked, timed, maybe switched on."""
        cd, r = self.compiled, self.report
        assert self._child is not None
        bs = cd.block_size
        per_seq = pages // cd.max_batch
        scratch = cd.scratch_pool(pages)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(cd.max_batch)]
        eager = EagerStep(cd.model, scratch, bs, cd.eager_kernels)
        # Unequal contexts: sequence i holds CONTEXT_TOKENS - 5 i prompt tokens (fixed, in-vocabulary ids).
        vocab = cd.model.arch.vocab_size
        lens = [CONTEXT_TOKENS - 5 * i for i in range(cd.max_batch)]
        for i, n in enumerate(lens):
            self._stopping()
            eager.prefill([(7 * j + 3 * i) % vocab for j in range(n)], tables[i])
        for rec in self._awaited(self._child.records()):
            self._stopping()
            b, t = int(rec.get("batch", 0)), int(rec.get("threads", 0))
            if (b, t) not in wanted or "error" in rec:
                log.warning("engine: --cpu-compile-decode: the compile child failed on the decode step of %d sequences "
                            "at %d threads after %.1f s, that size and larger stay eager: %s", b, t,
                            time.monotonic() - r.started, rec.get("error", rec))
                r.status = "failed"
                return
            v = VariantReport(b, threads=t, child_s=float(rec.get("seconds", 0.0)))
            r.variants.append(v)
            torch.set_num_threads(t)
            misses = _cache_misses()
            try:
                v.compile_s = cd.compile(b, scratch)
            except _COMPILE_ERRORS as e:
                log.warning("engine: --cpu-compile-decode: building the decode step of %d sequences at %d threads "
                            "failed after %.1f s, that size and larger stay eager: %s", b, t,
                            time.monotonic() - r.started, str(e).splitlines()[0])
                r.status = "failed"
                return
            v.cache_misses = _cache_misses() - misses
            if v.cache_misses:
                log.warning("engine: compiled decode step of %d sequences at %d threads: %d inductor cache misses "
                            "(compiled in the serving process, %.1f s)", b, t, v.cache_misses, v.compile_s)
            rows = [((11 * i + 5) % vocab, lens[i], tables[i]) for i in range(b)]  # (token, position, table)
            self._check(v, rows, eager, scratch)
            if v.active and cd.serves_engine_pool(b, rows) is False:
                log.warning("engine: compiled decode step of %d sequences: its guards refuse the engine's KV pool "
                            "(it would run uncompiled there): stays eager", b)
                v.active = False
            if v.active:
                self._time_long(v)
            v.decided = time.monotonic()
            if v.active:
                cd.activate(b, t, v.max_keys)
            long = (f"; at {v.long_keys} keys {v.long_compiled_ms:.2f} ms vs eager {v.long_eager_ms:.2f} ms, "
                    + ("used at any context" if v.max_keys == math.inf else
                       f"used up to {v.max_keys:.0f} keys where the eager step reads views")) if v.long_keys else ""
            log.info("engine: compiled decode step of %d sequences at %d threads: %.1f s in the compile child, "
                     "%.1f s here, max |logit diff| %.2g, same argmax %s, %.2f ms vs eager %.2f ms per step%s: %s",
                     b, t, v.child_s, v.compile_s, v.max_logit_diff, v.same_argmax, v.compiled_ms, v.eager_ms, long,
                     "switched on" if v.active else "stays eager")

    def _gate_main(self, stop: threading.Event) -> None:
        """The gate's own thread, for the child's whole life (ticks while this thread waits and works alike)."""
        while not stop.wait(GATE_TICK_S):
            self._gate_child()

    def _awaited(self, records: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """``records`` with ``awaiting_child`` set while the next one is awaited, at the interpreter's usual
        switch interval (the short one only matters while this thread runs Python)."""
        while True:
            self.awaiting_child = True
            sys.setswitchinterval(self._switch_interval)
            try:
                rec = next(records)
            except StopIteration:
                return
            finally:
                sys.setswitchinterval(SWITCH_INTERVAL_S)
                self.awaiting_child = False
            yield rec

    def _check(self, v: VariantReport, rows: list[tuple[int, int, list[int]]], eager: EagerStep,
               scratch: torch.Tensor) -> None:
        """Same inputs through both paths: logits and argmax, then alternating timings."""
        cd = self.compiled
        want = eager.decode(rows)
        got = cd.forward(rows, scratch)
        v.max_logit_diff = (got - want).abs().max().item()
        v.same_argmax = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
        limit = tolerance(scratch.dtype) * max(1.0, want.abs().max().item())
        if not v.same_argmax or not v.max_logit_diff <= limit:
            log.warning("engine: compiled decode step of %d sequences disagrees with the eager step (max |logit "
                        "diff| %.3g, limit %.3g, same argmax %s): dropped", v.batch, v.max_logit_diff, limit,
                        v.same_argmax)
            return
        v.eager_ms, v.compiled_ms = self._timed_pairs(TIMED_PAIRS, rows, eager, scratch)
        v.active = v.eager_ms > MIN_SPEEDUP * v.compiled_ms


    def _timed_pairs(self, pairs: int, rows: list[tuple[int, int, list[int]]], eager: EagerStep,
                     pool: torch.Tensor) -> tuple[float, float]:
        """(eager ms, compiled ms): medians of ``pairs`` steps of each on ``pool``, in alternating order after
        one warm-up pair (not kept)."""
        cd = self.compiled
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for i in range(pairs + 1):
            for name in (("eager", "compiled") if i % 2 else ("compiled", "eager")):
                self._stopping()
                t0 = time.perf_counter()
                if name == "eager":
                    eager.decode(rows)
                else:
                    cd.forward(rows, pool)
                if i:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times["eager"]), statistics.median(times["compiled"])

    def long_keys(self, batch: int) -> int:
        """Keys per sequence of variant ``batch``'s long timing (0: too short a context to be worth one)."""
        cd = self.compiled
        limit = cd.model.rotary.cos_cache.shape[0]
        if self.config is not None and self.config.max_model_len:  # 0: the model's own context
            limit = min(limit, self.config.max_model_len)
        kv = cd.kv_cache
        token_bytes = kv[:, :, 0].numel() * kv.element_size() // cd.block_size  # every layer's K and V
        total = min(LONG_TOTAL_KEYS, LONG_POOL_MAX_BYTES // max(1, token_bytes))
        keys = min(LONG_CONTEXT_TOKENS, total // batch - 2 * cd.block_size, limit - 1)
        return keys if keys >= LONG_MIN_KEYS else 0

    def _time_long(self, v: VariantReport) -> None:
        """Variant ``v`` and the eager step at ``long_keys`` keys per sequence, every sequence's blocks
        consecutive (what the block manager gives a sequence): sets ``v.max_keys``."""
        cd = self.compiled
        keys = self.long_keys(v.batch)
        if not keys:
            return
        bs = cd.block_size
        per_seq = keys // bs + 2
        pool = cd.scratch_pool(v.batch * per_seq)
        pool.fill_(0.01)  # touched, not calloc's shared zero page: the timings read memory like the engine's pool
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(v.batch)]
        rows = [(5 + i, keys - 1, tables[i]) for i in range(v.batch)]
        if cd.serves_engine_pool(v.batch, rows, pool) is False:
            return
        eager = EagerStep(cd.model, pool, bs, cd.eager_kernels)
        v.long_eager_ms, v.long_compiled_ms = self._timed_pairs(LONG_PAIRS, rows, eager, pool)
        v.long_keys = keys
        v.max_keys = crossover_keys(CONTEXT_TOKENS, v.eager_ms, v.compiled_ms, keys, v.long_eager_ms,
                                    v.long_compiled_ms)


def _cache_misses() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"])


def _thread_main(ref: weakref.ref[DecodeCompiler]) -> None:
    try:
        _run_in_turn(ref)
    except _Stopped:  # raised into the thread at interpreter exit
        pass
    finally:
        trace_fence.compiling(-1)


def _run_in_turn(ref: weakref.ref[DecodeCompiler]) -> None:
    while not _ONE_AT_A_TIME.acquire(timeout=0.2):
        c = ref()
        if c is None:
            return
        if c._stop.is_set():
            c.report.status = "stopped"
            return
        del c
    try:
        c = ref()
        if c is not None:
            c._main()
    finally:
        _ONE_AT_A_TIME.release()


_ALL: weakref.WeakSet[DecodeCompiler] = weakref.WeakSet()


def _interrupt_all() -> None:
    """Interpreter exit, before threads are joined: raise _Stopped inside every compile thread (at its next
    bytecode: a C++ compiler run or a torch op finishes first), so the join below takes seconds, not the
    minutes a cold compile can."""
    for c in list(_ALL):
        c._stop.set()
        c._kill_child()
        tid = c._thread.ident
        if tid is not None and c._thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_Stopped))


# Runs before the interpreter joins non-daemon threads (plain atexit runs after: too late).
getattr(threading, "_register_atexit", atexit.register)(_interrupt_all)
