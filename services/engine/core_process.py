"""The engine-core process: owns the device and the step loop of one service; its front (the grpc.aio
process, :mod:`services.engine.core_client`) reaches it only through typed frames (:mod:`core_wire`).

``python -m services.engine.core_process FD``: FD is this end of the socket pair the front made. The first
frame is CONFIG; the model loads; HELLO (or FATAL, then exit 2) answers. Then two threads:

* the main thread runs the :class:`~services.engine.step_loop.StepLoop`: commands between steps, one OUT
  frame per step with every request's new tokens (and the step's record), a STATS frame when the figures
  change (or every ``STATS_EVERY_S`` while idle);
* the reader thread reads frames: ADD / RESERVE / IMPORT_DONE / ABORT become loop commands whose REPLY is
  sent from the loop thread once they ran (after any outputs they made, so order holds); PAGES are written
  into the pool on the reader thread beside the steps (the blocks belong to a reservation the engine does
  not read until IMPORT_DONE), as a decode's worker thread does in-process; TRACE profiles this process on a
  thread of its own.

A prefill's core (``python -m services.engine.core_process FD FDS``, role "prefill" in CONFIG) keeps its KV pool in
a memfd it passes to the front over the second socket FDS, so the front reads and writes pages itself (exports for
the wire, side-transport writes, the kvstore write-back; services/prefill/engine_port.py). Each OUT frame lists
the prompt chunks its step computed; the loop waits for the front's TAKEN before the next step, so no later step
reuses a block whose pages the front is still reading (the in-process engine thread's own order: its chunk
listeners run inside the step). A prompt's blocks are held past its last chunk until the front's RELEASE (or
an ABORT). PREFIX and ADMIT (with the kvstore's pages as payload) run on the loop as commands.

The channel closing (the front exited, or sent STOP) stops the loop and the process. SIGINT is ignored (a
terminal's Ctrl-C reaches the front, which stops the core), and so is SIGTERM once the model is loaded: a
group's SIGTERM reaches the core too, and the front stops it with STOP once it has drained (its in-flight
streams finish). A step loop that
dies sends FATAL and exits ``EXIT_LOOP_DIED``: the front reports the engine dead at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import fields
from typing import Any

import torch

from services.common.logging import LoggingConfig, setup_logging
from services.engine import core_wire as w
from services.engine.block_manager import NoFreeBlocksError
from services.engine.config import EngineConfig
from services.engine.convert import layout_to_pb
from services.engine.engine import LLMEngine, RequestOutput
from services.engine.kv_pages import pages_of
from services.engine.shared_kv import export_cuda_kv, front_pool_fd, serve_pool_to_front
from services.engine.step_loop import StepLoop
from services.text.sampling_params import InvalidRequestError, Sampled

log = logging.getLogger(__name__)

EXIT_LOAD_FAILED = 2
EXIT_LOOP_DIED = 3
PREFILL = "prefill"
"""The role of a prefill's core (CONFIG); any other role serves decode and colocated workers."""
THREAD_ONLY = "ThreadOnly"
"""FATAL kind of a prefill core whose engine its front cannot read pages of (its loop belongs on a thread)."""
STATS_EVERY_S = 0.5
"""Idle: the stats go out at least this often (seconds) though nothing changed (published_unix moves)."""


def config_to_wire(cfg: EngineConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init}


def error_to_wire(e: BaseException) -> list[Any]:
    """[kind, message, field]: the refusals a front maps to statuses keep their type; anything else is internal."""
    if isinstance(e, InvalidRequestError):
        msg = str(e)
        prefix = f"{e.field}: "
        return ["invalid", msg[len(prefix):] if msg.startswith(prefix) else msg, e.field, e.code]
    if isinstance(e, NoFreeBlocksError):
        return ["no_blocks", str(e), "", ""]
    if isinstance(e, ValueError):
        return ["value", str(e), "", ""]
    return ["internal", f"{type(e).__name__}: {e}", "", ""]


class Core:
    def __init__(self, chan: w.BlockingChannel, cfg: EngineConfig, engine: LLMEngine, role: str = "") -> None:
        self.chan = chan
        self.engine = engine
        self._sent_stats: dict[str, float] = {}
        self._sent_at = 0.0
        self.loop: StepLoop | None = None
        self.loop = StepLoop(engine, cfg, self._deliver, self._on_publish)
        self._pages = None
        self._chunks: list[list[Any]] = []
        """A prefill core's chunks computed in the current step (wire form), sent with its OUT frame."""
        self._taken = threading.Semaphore(0)
        """Released by each TAKEN (and by the channel closing): the front has read the last OUT's chunk pages."""
        self._closed = False
        pool = engine.runner.kv_cache
        self._cuda: torch.device | None = pool.device if role == PREFILL and pool.is_cuda else None
        """A prefill core's GPU, whose queued work (every stream's) is done before an OUT frame lists chunks."""
        if role == PREFILL:
            engine.chunk_listeners.append(self._on_chunk)

    # --- loop thread ---

    def _on_chunk(self, ch: Any, sampled: Sampled | None) -> None:
        """Inside the step: the chunk goes out with the step's OUT; a prompt's last chunk holds its blocks for the
        front (RELEASE or ABORT frees them)."""
        if ch.sample:
            self.engine.hold_blocks(ch.seq)
        self._chunks.append(w.chunk_to_wire(ch.seq, ch.num_new_tokens, ch.sample, sampled))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        steps = [[s.seconds, s.tokens, s.sequences, s.graphed] for s in self.loop.take_steps()]
        chunks, self._chunks = self._chunks, []
        if chunks and self._cuda is not None:
            torch.cuda.synchronize(self._cuda)  # the chunks' KV is in the pool before the front reads it (another process)
        if outputs or steps or chunks:
            self.chan.send([w.OUT, [w.output_to_wire(o) for o in outputs], steps, chunks,
                            self.engine.last_step_start])
        while chunks and not self._taken.acquire(timeout=1.0) and not self._closed:
            pass  # the front reads the chunks' pages (a busy host may take long); its death closes the channel

    def _on_publish(self, s: dict[str, float]) -> None:
        now = time.monotonic()
        same = len(s) == len(self._sent_stats) and all(
            k == "published_unix" or self._sent_stats.get(k) == v for k, v in s.items())
        if same and now - self._sent_at < STATS_EVERY_S:
            return
        self._sent_stats, self._sent_at = s, now
        self.chan.send([w.STATS, s, self.loop.step_start if self.loop is not None else 0.0])

    def _reply(self, cid: int, fut: Any) -> None:
        """A command's future is done (on the loop thread, or at once if it failed queued)."""
        try:
            value = fut.result()
        except BaseException as e:
            self.chan.send([w.REPLY, cid, False, error_to_wire(e)])
        else:
            self.chan.send([w.REPLY, cid, True, value])

    def _submit(self, cid: int, fn: Any) -> None:
        self.loop.submit(fn).add_done_callback(lambda f: self._reply(cid, f))

    # --- commands (loop thread) ---

    def _add(self, rid: str, ids: list[int], params: list[Any], detok: bool) -> None:
        self.engine.add_request(rid, ids, w.params_from_wire(params), detok)

    def _reserve(self, rid: str, ids: list[int], params: list[Any], detok: bool) -> list[Any]:
        seq, num_cached = self.engine.add_kv_import(rid, ids, w.params_from_wire(params), detok)
        return [num_cached, list(seq.block_table)]

    def _import_done(self, rid: str, first: int, logprob: float | None, top: list[Any] | None) -> bool:
        outputs = self.engine.kv_import_done(rid, first, logprob, w.top_from_wire(top))
        if outputs is None:
            return False
        self._deliver(outputs)
        return True

    def _abort(self, rid: str) -> bool:
        out = self.engine.abort(rid)
        if out is not None:
            self._deliver([out])
        return out is not None

    def _admit(self, rid: str, ids: list[int], params: list[Any], stream_kv: bool, first: int,
               payload: bytearray) -> int:
        """A prefill's prompt: the kvstore's pages for blocks [first, ...) into the prefix cache, then the request
        (one loop command, so the loaded pages cannot be evicted in between). Returns the blocks loaded."""
        loaded = 0
        if payload:
            loaded = self.engine.import_prefix_pages(ids, first, pages_of(self.engine).payload_pages(payload))
        self.engine.add_request(rid, ids, w.params_from_wire(params), False, stream_kv=stream_kv)
        return loaded

    # --- reader thread ---

    def _import_pages(self, cid: int, block_ids: list[int], fp8: bool, payload: bytearray) -> None:
        try:
            pages_of(self.engine).import_payload(block_ids, payload, fp8)
        except Exception as e:
            self.chan.send([w.REPLY, cid, False, error_to_wire(e)])
        else:
            self.chan.send([w.REPLY, cid, True, None])

    def _trace(self, cid: int, duration_s: float, path: str) -> None:
        import torch

        try:
            activities = [torch.profiler.ProfilerActivity.CPU,
                          *([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
            with torch.profiler.profile(activities=activities) as prof:
                time.sleep(duration_s)
            prof.export_chrome_trace(path)
        except Exception as e:
            self.chan.send([w.REPLY, cid, False, error_to_wire(e)])
        else:
            self.chan.send([w.REPLY, cid, True, path])

    def read(self) -> None:
        """Frames until the channel closes or says STOP; then the loop stops."""
        try:
            while True:
                frame = self.chan.recv()
                if frame is None:
                    return
                msg, payload = frame
                op = msg[0]
                if op == w.STOP:
                    return
                if op == w.TAKEN:
                    self._taken.release()
                    continue
                cid = msg[1]
                if op == w.ADD:
                    self._submit(cid, lambda m=msg: self._add(*m[2:6]))
                elif op == w.RESERVE:
                    self._submit(cid, lambda m=msg: self._reserve(*m[2:6]))
                elif op == w.IMPORT_DONE:
                    self._submit(cid, lambda m=msg: self._import_done(*m[2:6]))
                elif op == w.ABORT:
                    self._submit(cid, lambda m=msg: self._abort(m[2]))
                elif op == w.PAGES:
                    self._import_pages(cid, msg[2], bool(msg[3]), payload)
                elif op == w.PREFIX:
                    self._submit(cid, lambda m=msg: self.engine.cached_prefix_blocks(m[2]))
                elif op == w.ADMIT:
                    self._submit(cid, lambda m=msg, p=payload: self._admit(*m[2:7], p))
                elif op == w.RELEASE:
                    self._submit(cid, lambda m=msg: self.engine.release_held(m[2]))
                elif op == w.TRACE:
                    threading.Thread(target=self._trace, args=(cid, float(msg[2]), str(msg[3])),
                                     name="pdserve-core-trace", daemon=True).start()
                else:
                    raise w.WireError(f"unknown frame type {op}")
        except (OSError, w.WireError, IndexError, TypeError, ValueError) as e:
            log.error("engine core: channel from the front failed (%s); stopping", e)
        finally:
            self._closed = True
            self._taken.release()
            self.loop.stopping = True
            self.loop.wake.set()


def thread_only(engine: LLMEngine) -> str:
    """Why a prefill's front cannot read this engine's pages itself ('' when it can): the pool must be one target
    region of an unsharded instance without layer-group exports, in a memfd (CPU) or one CUDA allocation the
    front opens by its IPC handle."""
    pages = pages_of(engine)
    return ("the KV pool is on neither the CPU nor a CUDA GPU" if pages.device.type not in ("cpu", "cuda") else
            "pages of several regions (index keys, a draft's KV)" if pages.composite else
            "a tensor-parallel pool" if pages.sharded else
            "layer-group exports (--kv-export-layer-group-cpu)" if getattr(engine, "layer_group", 0) else
            "the KV pool could not be shared with the front"
            if pages.device.type == "cpu" and front_pool_fd() is None else "")


def _cuda_pool(engine: LLMEngine, role: str) -> bytes | None:
    """A prefill core's CUDA pool as the KVDestination (cuda_ipc) its front opens; None otherwise."""
    pool = engine.runner.kv_cache
    return export_cuda_kv(pool).SerializeToString() if role == PREFILL and pool.is_cuda else None


def hello(engine: LLMEngine, role: str = "") -> list[Any]:
    dest = pages_of(engine).destination
    pool = engine.runner.kv_cache
    return [w.HELLO, {
        "pool": ([list(pool.shape), str(pool.dtype).removeprefix("torch."), engine.runner.model.tp_split.num_heads]
                 if role == PREFILL else None),
        "pid": os.getpid(),
        "model_id": engine.loaded.model_id,
        "layout": layout_to_pb(engine.layout).SerializeToString(),
        "layout_fingerprint": engine.layout.fingerprint,
        "fp8_layout": layout_to_pb(engine.fp8_layout).SerializeToString(),
        "fp8_layout_fingerprint": engine.fp8_layout.fingerprint,
        "vocab_size": engine.vocab_size,
        "max_model_len": engine.max_model_len,
        "offered_pool": dest.SerializeToString() if dest is not None else None,
        "pool_ipc": _cuda_pool(engine, role),
    }]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or not all(a.isdigit() for a in args):
        print("usage: python -m services.engine.core_process FD [FDS] (started by a service's front)",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(args[0]))
    fds = socket.socket(fileno=int(args[1])) if len(args) == 2 else None
    chan = w.BlockingChannel(sock)
    first = chan.recv()
    if first is None or first[0][0] != w.CONFIG:
        print("engine core: the front sent no CONFIG frame", file=sys.stderr)
        return 2
    _, cfg_dict, service, log_level, log_format, role = first[0]
    setup_logging(f"{service}-core", LoggingConfig(log_level=log_level, log_format=log_format))
    if role == PREFILL:
        serve_pool_to_front()
    try:
        cfg = EngineConfig(**cfg_dict)
        engine = LLMEngine(cfg)
    except Exception as e:
        log.debug("engine core: load failed", exc_info=True)
        chan.send([w.FATAL, type(e).__name__, str(e)])
        return EXIT_LOAD_FAILED
    if role == PREFILL:
        why = thread_only(engine)
        if why or fds is None:
            chan.send([w.FATAL, THREAD_ONLY, f"a prefill engine core's front reads its pages itself; not here: "
                                             f"{why or 'no descriptor channel'}"])
            return EXIT_LOAD_FAILED
        if not engine.runner.kv_cache.is_cuda:  # a CUDA pool goes by its IPC handle, in HELLO
            socket.send_fds(fds, [b"P"], [front_pool_fd()])
    # Serving, the front owns the stop: a SIGTERM to the whole process group (a supervisor's, a container
    # runtime's) reaches this process too, and stopping here would cut the front's drain short. The front sends
    # STOP once it has drained; its death closes the channel, which stops the loop. (While the model loads,
    # SIGTERM still ends this process: nothing is in flight yet.)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    chan.send(hello(engine, role))
    core = Core(chan, cfg, engine, role)
    reader = threading.Thread(target=core.read, name="pdserve-core-reader", daemon=True)
    reader.start()
    log.info("engine core: serving (pid %d)", os.getpid())
    try:
        core.loop.run()
    except BaseException as e:
        log.exception("engine loop died")
        try:
            chan.send([w.FATAL, type(e).__name__, f"engine loop died: {e!r}"])
        except OSError:
            pass
        return EXIT_LOOP_DIED
    finally:
        core.loop.leave_share_group()
        engine.runner.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
