"""The front's end of an engine-core process (:mod:`services.engine.core_process`): an
:class:`~services.engine.async_engine.EngineFront` whose step loop runs in a child process, so the grpc.aio
servicer and the step loop never share an interpreter (or its GIL).

Everything travels as typed frames over a Unix socket pair (:mod:`core_wire`): the front sends commands
(admit, reserve, import-done, abort, page bytes), the core answers each once and sends every step's outputs
of all requests as one frame, which the event loop files to each request's route in one pass
(:meth:`EngineFront._put_all`). Published stats and step records arrive with the frames, so admission and
load reports never wait on the core.

The core dying (killed, crashed, its step loop failed) closes the channel: the front sees it at once, every
pending command and open stream fails with :class:`EngineDeadError`, the death callbacks run (the service
goes NOT_SERVING and exits, and its supervisor restarts it). Blocks a dead core held die with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from services.common.logging import LoggingConfig
from services.common.pb import common_pb2, decode_pb2
from services.engine import core_wire as w
from services.engine.async_engine import EngineDeadError, EngineFront
from services.engine.block_manager import NoFreeBlocksError
from services.engine.config import EngineConfig
from services.engine.convert import layout_from_pb
from services.engine.core_process import PREFILL, THREAD_ONLY, config_to_wire
from services.engine.step_loop import STEP_RECORDS_KEPT, StepRecord
from services.text.sampling_params import InvalidRequestError, SamplingParams, TopLogprobs

log = logging.getLogger(__name__)

STOP_WAIT_S = 10.0
"""Shutdown: how long the core may take to stop after STOP before it is killed (seconds)."""
STREAM_LIMIT = w.MAX_BODY + w.HEADER.size


class EngineCoreStartError(RuntimeError):
    """The engine core could not start (its model did not load, its config was refused): the core's own line."""


class EngineCoreThreadOnly(EngineCoreStartError):
    """A prefill's engine core loaded a model whose pages its front cannot read itself (core_process.thread_only):
    that prefill's loop runs on a thread."""


FDS_WAIT_S = 60.0
"""How long a prefill front waits for its core's pool descriptor after HELLO (seconds; sent just before it)."""


class CoreNoFreeBlocks(NoFreeBlocksError):
    """The core had too few free KV blocks (its message; the counts stay in the core)."""

    def __init__(self, message: str) -> None:
        RuntimeError.__init__(self, message)
        self.needed = 0
        self.free = 0


def _error_from_wire(v: list[Any]) -> BaseException:
    kind, message, field, code = v
    if kind == "invalid":
        return InvalidRequestError(field, message, code or "invalid_value")
    if kind == "no_blocks":
        return CoreNoFreeBlocks(message)
    if kind == "value":
        return ValueError(message)
    return RuntimeError(f"engine core: {message}")


class EngineCoreClient(EngineFront):
    in_process = False
    tokenizer = None

    def __init__(self, proc: subprocess.Popen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 info: dict[str, Any]) -> None:
        super().__init__()
        self.proc = proc
        self._reader = reader
        self._writer = writer
        self.pid = int(info["pid"])
        self.model_id = str(info["model_id"])
        self.layout = layout_from_pb(common_pb2.PageLayout.FromString(info["layout"]))
        self.fp8_layout = layout_from_pb(common_pb2.PageLayout.FromString(info["fp8_layout"]))
        for name, lay in (("layout", self.layout), ("fp8_layout", self.fp8_layout)):
            if lay.fingerprint != info[f"{name}_fingerprint"]:
                raise EngineCoreStartError(f"engine core: its {name} does not survive the channel "
                                           f"({info[f'{name}_fingerprint']} sent, {lay.fingerprint} rebuilt)")
        self.vocab_size = int(info["vocab_size"])
        self.max_model_len = int(info["max_model_len"])
        pool = info["offered_pool"]
        self.offered_pool = decode_pb2.KVDestination.FromString(pool) if pool is not None else None
        self.pool_spec: tuple[list[int], str] | None = tuple(info["pool"]) if info.get("pool") else None
        """A prefill core's pool: (shape, dtype name), mapped from ``pool_fd``."""
        self.pool_fd: int | None = None
        """The memfd of a prefill core's CPU pool (the front maps it; services/prefill/engine_port.py)."""
        ipc = info.get("pool_ipc")
        self.pool_ipc = decode_pb2.KVDestination.FromString(ipc).cuda_ipc if ipc is not None else None
        """A prefill core's CUDA pool by its IPC handle (the front opens it), instead of ``pool_fd``."""
        self.chunk_listener: Callable[[list[Any], float], float] | None = None
        """A prefill front's: called on the event loop with each OUT frame's computed chunks (wire form) and the
        step's start (monotonic); TAKEN goes back once it returned, or as many seconds later as it returns."""
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._published: dict[str, float] = {}
        self._step_start = 0.0
        self._steps: list[StepRecord] = []
        self.busy_s = 0.0
        """Seconds the core's step loop has spent in steps (the sum of the step records it sent)."""
        self._stopping_now = False
        self._fatal: str | None = None
        self._loop = asyncio.get_running_loop()
        self._stats_seen = asyncio.Event()
        self._reader_task = asyncio.ensure_future(self._read())

    # --- start / stop ---

    @classmethod
    async def start(cls, config: EngineConfig, service: str, logging_config: LoggingConfig | None = None,
                    role: str = "") -> EngineCoreClient:
        """Spawn the core, send its config, wait for the model to load (HELLO). Raises EngineCoreStartError
        with the core's one line if it cannot start (EngineCoreThreadOnly: a prefill core whose pages its front
        cannot read). ``role`` "prefill": the core's pool comes back as a memfd (``pool_fd``), or on a GPU as a
        CUDA IPC handle (``pool_ipc``)."""
        lcfg = logging_config or LoggingConfig(log_level=logging.getLevelName(logging.getLogger().level))
        if role == PREFILL and config.device.startswith("cuda"):
            # This front opens the core's pool, which needs a CUDA context of its own (~0.5 GiB): made now, before
            # the core loads, so the core's weights, pool and step activations see that memory gone (a pool sized
            # from free memory leaves it; an over-committed card fails the core's load, in one line, not a step).
            # Made after, it took memory the core's later activations needed: a full H100 failed a step.
            await asyncio.to_thread(_open_cuda_context, config.device)
        front, core = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds_front, fds_core = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) if role == PREFILL else (None, None)
        w.tune(front)
        ends = [core] + ([fds_core] if fds_core is not None else [])
        try:
            proc = await asyncio.to_thread(  # a fork of a large process: off the loop
                subprocess.Popen, [sys.executable, "-m", "services.engine.core_process",
                                   *(str(e.fileno()) for e in ends)],
                pass_fds=tuple(e.fileno() for e in ends), stdin=subprocess.DEVNULL)
        finally:
            for e in ends:
                e.close()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=front, limit=STREAM_LIMIT)
            for part in w.encode([w.CONFIG, config_to_wire(config), service, lcfg.log_level, lcfg.log_format, role]):
                writer.write(part)
            await writer.drain()
            msg = await _read_frame(reader)
            if msg is None:
                raise EngineCoreStartError(f"engine core exited before its model loaded (status "
                                           f"{await asyncio.to_thread(proc.wait)})")
            body, _ = msg
            if body[0] == w.FATAL:
                raise (EngineCoreThreadOnly if body[1] == THREAD_ONLY else EngineCoreStartError)(str(body[2]))
            if body[0] != w.HELLO:
                raise EngineCoreStartError(f"engine core: expected HELLO, got frame type {body[0]}")
            client = cls(proc, reader, writer, body[1])
            client.device = config.device
            if fds_front is not None and client.pool_ipc is None:
                client.pool_fd = await asyncio.to_thread(_receive_fd, fds_front, FDS_WAIT_S)
            seen = asyncio.ensure_future(client._stats_seen.wait())
            await asyncio.wait({seen, client._reader_task}, return_when=asyncio.FIRST_COMPLETED)
            seen.cancel()
            if client.dead is not None:
                raise EngineCoreStartError(str(client.dead))
            log.info("%s: engine core process %d up", service, proc.pid)
            return client
        except BaseException:
            with contextlib.suppress(OSError):
                front.close()
            await asyncio.to_thread(_stop_process, proc, STOP_WAIT_S)
            raise
        finally:
            if fds_front is not None:
                fds_front.close()

    def _stopping(self) -> bool:
        return self._stopping_now

    def shutdown(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop the core (blocking: called off the event loop, as AsyncEngine.shutdown is)."""
        self._stopping_now = True
        _stop_process(self.proc, timeout, send_stop=self._send_stop_blocking)

    def _send_stop_blocking(self) -> None:
        """STOP, written on the event loop (after every frame queued before it)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the core sees the channel close instead
            self._loop.call_soon_threadsafe(self._write_stop)

    def _write_stop(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self._writer.write(w.encode([w.STOP])[0])

    # --- the channel ---

    async def _read(self) -> None:
        why: BaseException | None = None
        try:
            while True:
                msg = await _read_frame(self._reader)
                if msg is None:
                    break
                self._dispatch(msg[0])
        except (OSError, w.WireError, asyncio.IncompleteReadError) as e:
            why = e
        except Exception as e:  # a frame that does not fit its type: the channel is broken
            log.exception("engine core channel: bad frame")
            why = e
        rc = await asyncio.to_thread(_wait_exit, self.proc, 5.0)
        stopped = self._stopping_now and self._fatal is None
        if stopped:
            err: BaseException = EngineDeadError("engine core stopped")
        else:
            detail = self._fatal or (f"channel failed: {why}" if why is not None else "channel closed")
            err = EngineDeadError(f"engine core process {self.pid} exited (status {rc}): {detail}")
            log.error("%s", err)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._die(err, stopped=stopped)

    def _dispatch(self, body: list[Any]) -> None:
        kind = body[0]
        if kind == w.OUT:
            if len(body) > 3 and body[3]:  # a prefill core's chunks: the front reads their pages, then TAKEN
                delay = 0.0
                try:
                    if self.chunk_listener is not None:
                        delay = self.chunk_listener(body[3], float(body[4]))
                finally:
                    if delay > 0:  # a testing aid's slow chunk: the core waits, this loop does not
                        self._loop.call_later(delay, self._send_taken)
                    else:
                        self._send_taken()
            outputs = [w.output_from_wire(v) for v in body[1]]
            if body[2]:
                records = [StepRecord(*s) for s in body[2]]
                self.busy_s += sum(r.seconds for r in records)
                self._steps.extend(records)
                if len(self._steps) > STEP_RECORDS_KEPT:
                    del self._steps[:-STEP_RECORDS_KEPT]
            if outputs:
                self._put_all(outputs)
        elif kind == w.STATS:
            self._published = body[1]
            self._step_start = body[2]
            self._stats_seen.set()
        elif kind == w.REPLY:
            fut = self._pending.pop(body[1], None)
            if fut is not None and not fut.done():
                if body[2]:
                    fut.set_result(body[3])
                else:
                    fut.set_exception(_error_from_wire(body[3]))
        elif kind == w.FATAL:
            self._fatal = f"{body[1]}: {body[2]}"
        else:
            raise w.WireError(f"unknown frame type {kind} from the engine core")

    def _send_taken(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):  # a closed channel: the core is gone or stopping
            self._writer.write(w.encode([w.TAKEN])[0])

    async def _command(self, op: int, *args: Any, payload: bytes | memoryview = b"") -> Any:
        self._check_alive()
        cid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        try:
            for part in w.encode([op, cid, *args], payload):
                self._writer.write(part)
            if payload:
                await self._writer.drain()
        except (OSError, RuntimeError) as e:
            self._pending.pop(cid, None)
            raise EngineDeadError(f"engine core channel: {e}") from e
        return await fut

    # --- EngineFront ---

    def published_stats(self) -> dict[str, float]:
        s = dict(self._published)
        start = self._step_start
        s["step_running_s"] = max(0.0, time.monotonic() - start) if start else 0.0
        return s

    def take_steps(self) -> list[StepRecord]:
        out, self._steps = self._steps, []
        return out

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  detokenize: bool) -> None:
        await self._command(w.ADD, request_id, prompt_token_ids, w.params_to_wire(params), detokenize)

    async def _reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       detokenize: bool) -> tuple[int, list[int]]:
        num_cached, table = await self._command(w.RESERVE, request_id, prompt_token_ids,
                                                w.params_to_wire(params), detokenize)
        return int(num_cached), list(table)

    async def kv_import_done(self, request_id: str, first_token: int, logprob: float | None,
                             top: TopLogprobs | None = None) -> bool:
        return bool(await self._command(w.IMPORT_DONE, request_id, first_token, logprob, w.top_to_wire(top)))

    async def abort(self, request_id: str) -> bool:
        return bool(await self._command(w.ABORT, request_id))

    async def import_payload(self, block_ids: list[int], payload: bytes | memoryview, fp8: bool) -> None:
        await self._command(w.PAGES, list(block_ids), fp8, payload=payload)

    async def prefix_blocks(self, prompt_token_ids: list[int]) -> int:
        """Leading full blocks of the prompt the core's prefix cache holds (LLMEngine.cached_prefix_blocks)."""
        return int(await self._command(w.PREFIX, list(prompt_token_ids)))

    async def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream_kv: bool,
                    first_block: int, pages: bytes | memoryview = b"") -> int:
        """A prefill's prompt, after the kvstore's ``pages`` (blocks first_block.., the pool's layout) went into the
        prefix cache; returns the blocks that loaded (LLMEngine.import_prefix_pages, add_request)."""
        return int(await self._command(w.ADMIT, request_id, list(prompt_token_ids), w.params_to_wire(params),
                                       stream_kv, first_block, payload=pages))

    async def release(self, request_id: str) -> bool:
        """Free the blocks the core held past the prompt's last chunk (LLMEngine.release_held)."""
        return bool(await self._command(w.RELEASE, request_id))

    async def trace(self, duration_s: float, path: str) -> str:
        """Profile the core process (torch.profiler, CPU and CUDA) for ``duration_s``; its trace goes to ``path``."""
        return str(await self._command(w.TRACE, duration_s, path))


async def _read_frame(reader: asyncio.StreamReader) -> tuple[list[Any], bytes] | None:
    try:
        header = await reader.readexactly(w.HEADER.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise
        return None
    n, p = w.decode_header(header)
    body = await reader.readexactly(n)
    payload = await reader.readexactly(p) if p else b""
    return w.decode_body(body), payload


def _open_cuda_context(device: str) -> None:
    import torch

    torch.empty(1, device=device)


def _receive_fd(sock: socket.socket, timeout: float) -> int:
    """The one descriptor the core sends over ``sock`` (blocking, bounded by ``timeout``)."""
    sock.settimeout(timeout)
    try:
        _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    except (OSError, TimeoutError) as e:
        raise EngineCoreStartError(f"engine core: its pool descriptor did not arrive ({e})") from None
    if len(fds) != 1:
        raise EngineCoreStartError("engine core: its pool descriptor did not arrive (the channel closed)")
    return fds[0]


def _wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _stop_process(proc: subprocess.Popen, timeout: float, send_stop: Any = None) -> None:
    """STOP (when given), then SIGTERM, then SIGKILL, each given part of ``timeout``."""
    if proc.poll() is not None:
        return
    if send_stop is not None:
        send_stop()
        if _wait_exit(proc, timeout * 0.7) is not None:
            return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    if _wait_exit(proc, timeout * 0.3) is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
