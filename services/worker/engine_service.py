"""Lifecycle shared by the engine-backed services (prefill, decode): NOT_SERVING while the model
loads on a worker thread, Admin (load reports, trace capture), load gauges, engine shutdown.

Load reports and gauges read the engine's published stats (never wait on a step). If the engine
loop dies, health goes NOT_SERVING at once, open streams end with UNAVAILABLE/ENGINE_DEAD (the
servicers map the engine's error), the server shuts down and :func:`service_main` returns
:data:`EXIT_ENGINE_DEAD` so a supervisor restarts the process.

Before the model loads (the slow part), :func:`preflight` checks what one line can explain: the ports
are free, the model spec names something loadable, the device exists."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from services.common.config import ConfigError
from services.common.config_file import parse_settings
from services.common.kv_kinds import transport_kind
from services.common.logging import LoggingConfig, current_config, setup_logging
from services.common.metric_series import initialise
from services.common.pb import common_pb2_grpc
from services.common.server import (
    ServerConfig,
    ServiceServer,
    StartupError,
    check_ports,
    run_main,
    serve,
    server_ports,
)
from services.common.tracing import TracingUnavailableError
from services.engine.async_engine import AsyncEngine, EngineFront
from services.engine.config import EngineConfig
from services.engine.core_client import EngineCoreClient, EngineCoreThreadOnly
from services.engine.core_process import PREFILL
from services.text.model.errors import ModelLoadError
from services.text.model.source import resolve
from services.worker.admin import AdminServicer, TraceCapture

log = logging.getLogger(__name__)

GAUGE_PERIOD_S = 1.0
EXIT_ENGINE_DEAD = 3
"""Process exit status when the engine loop died (non-zero: the supervisor restarts the service)."""


class EngineDiedError(RuntimeError):
    """The engine loop died and the service shut down because of it."""


class EngineService:
    """Wires one servicer (with ``bind(engine)`` and ``drain()``; optionally ``admission(stats) ->
    (max_waiting, queue_full)`` for the load report) to a ServiceServer."""

    def __init__(self, name: str, cfg: ServerConfig, ecfg: EngineConfig) -> None:
        self.name = name
        self.cfg = cfg
        self.ecfg = ecfg
        self.engine: EngineFront | None = None
        self.server: ServiceServer | None = None
        self.servicer: Any = None
        self.died: BaseException | None = None
        """What killed the engine loop, once it died."""
        self.on_stats: list[Callable[[dict[str, float]], None]] = []
        self.on_close: list[Callable[[], Awaitable[None]]] = []
        self._tasks: set[asyncio.Future] = set()
        self._gauge_task: asyncio.Future | None = None

    async def stats(self) -> dict[str, float]:
        """The engine's published figures plus max_waiting and saturated (1.0/0.0); answers at once.
        Raises RuntimeError while the model loads or after the engine died (GetLoad: UNAVAILABLE)."""
        if self.engine is None:
            raise RuntimeError("model loading")
        if self.engine.dead is not None:
            raise RuntimeError("engine loop died")
        s = self.engine.published_stats()
        admission = getattr(self.servicer, "admission", None)
        max_waiting, full = admission(s) if admission is not None else (0, False)
        s["max_waiting"] = float(max_waiting)
        s["saturated"] = 1.0 if full or s.get("free_blocks", 1) <= 0 else 0.0
        for fn in self.on_stats:
            fn(s)
        return s

    async def _gauges(self) -> None:
        while True:
            try:
                await self.stats()
            except RuntimeError:  # the engine died: the service is going down
                return
            await asyncio.sleep(GAUGE_PERIOD_S)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _on_engine_death(self, loop: asyncio.AbstractEventLoop, exc: BaseException) -> None:
        """Engine thread: hand the death to the event loop."""
        loop.call_soon_threadsafe(self._begin_death, exc)

    def _begin_death(self, exc: BaseException) -> None:
        if self.died is not None:
            return
        self.died = exc
        log.error("%s: engine loop died (%r): NOT_SERVING, shutting down", self.name, exc)
        self._spawn(self._die())

    async def _die(self) -> None:
        srv = self.server
        if srv is None:
            return
        await srv.health.enter_graceful_shutdown()  # NOT_SERVING before anything else
        await srv.shutdown("engine loop died")

    async def run(self, servicer: Any, add_to_server: Callable[[Any, Any], None]) -> None:
        """Serve until shutdown. Raises EngineDiedError if the engine loop died."""
        async def shutdown() -> None:
            if self._gauge_task is not None:
                self._gauge_task.cancel()
            for fn in self.on_close:
                await fn()
            if self.engine is not None:  # joins the engine thread and stops the compile: seconds, off the loop
                await asyncio.to_thread(self.engine.shutdown)

        self.servicer = servicer
        srv = ServiceServer(self.name, self.cfg, drain=servicer.drain, on_shutdown=shutdown)
        self.server = srv
        servicer.draining = srv.draining
        servicer.metrics.engine_info.labels(**self.ecfg.info_labels()).set(1)  # pdserve_<name>_engine_info
        srv.add_service(add_to_server, servicer)
        trace = TraceCapture(self.name, self.cfg.instance or f"{self.cfg.host}:{self.cfg.port}", self.cfg.trace_dir)
        srv.add_service(common_pb2_grpc.add_AdminServicer_to_server, AdminServicer(self.stats, trace))

        async def warmup() -> None:
            trace.instance = srv.instance  # the bound address (port 0 picks one at start)
            t0 = time.monotonic()
            log.info("%s: loading %s on %s (stages follow)", self.name, self.ecfg.model or "the embedded default "
                     "model", self.ecfg.device)
            mode = engine_core_mode(self.cfg, self.ecfg, self.name)
            if mode == "process":
                try:
                    ecfg = prefill_core_config(self.ecfg) if self.name == PREFILL else self.ecfg
                    self.engine = await EngineCoreClient.start(ecfg, self.name, current_config(),
                                                               role=PREFILL if self.name == PREFILL else "")
                    trace.remote, trace.remote_loop = self.engine.trace, asyncio.get_running_loop()
                except EngineCoreThreadOnly as e:
                    if getattr(self.cfg, "engine_core", "") != "auto":
                        raise
                    log.info("%s: %s; its step loop runs on a thread of this process", self.name, e)
                    mode = "thread"
            if mode == "thread":
                self.engine = await asyncio.to_thread(AsyncEngine, self.ecfg)
            log.info("%s: engine up in %.1f s", self.name, time.monotonic() - t0)
            # The weight format is resolved while loading: replace the series set before (weight_format="pending").
            servicer.metrics.engine_info.clear()
            servicer.metrics.engine_info.labels(**self.ecfg.info_labels()).set(1)
            servicer.bind(self.engine)
            trace.ranks = self.engine.ranks  # a tensor-parallel instance's trace waits for every rank
            initialise(servicer.metrics, model=(servicer.model,))  # every known series at 0 before SERVING
            self.engine.add_death_callback(partial(self._on_engine_death, asyncio.get_running_loop()))
            await self.stats()
            self._gauge_task = self._spawn(self._gauges())

        try:
            await serve(srv, warmup=warmup)
        finally:  # the gauges; a death handler whose shutdown has completed
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.died is not None:
            raise EngineDiedError(f"{self.name}: engine loop died: {self.died!r}") from self.died


def engine_core_mode(cfg: Any, ecfg: EngineConfig, name: str = "") -> str:
    """Where this service's step loop runs: "process" or "thread". ``--engine-core auto`` is process unless the
    loop must share this process with what lives here: the Mooncake transfer engine that registers the pool
    (a decode's --kv-mooncake-host) or the tensor-parallel ranks this process drives; for a prefill, unless
    :func:`prefill_thread_only` names a reason. Services without the setting run the loop on a thread."""
    mode = getattr(cfg, "engine_core", "thread")
    if mode != "auto":
        return mode
    if name == PREFILL:
        return "thread" if prefill_thread_only(cfg, ecfg) else "process"
    return "thread" if ecfg.tensor_parallel_size > 1 or getattr(cfg, "kv_mooncake_host", "") else "process"


def prefill_thread_only(cfg: Any, ecfg: EngineConfig) -> str:
    """Why a prefill's step loop must run on a thread of its service ('' when an engine core can serve it: its
    front then reads and writes the pages itself, services/prefill/engine_port.py). A model whose pages have several
    regions is found only once loaded (the core refuses it, and auto falls back to a thread)."""
    return ("--tensor-parallel-size > 1 (the ranks are driven from this process)" if ecfg.tensor_parallel_size > 1 else
            "--kv-transport mooncake (the transfer engine registers the pool where the loop runs)"
            if getattr(transport_kind(getattr(cfg, "kv_transport", "")), "mooncake_host", False) else
            "--kv-export-layer-group-cpu (layer groups leave from inside the step)"
            if ecfg.kv_export_layer_group_cpu and ecfg.kv_export_layer_group else
            "--draft-model (pages carry the draft's region)" if ecfg.draft_model else "")


def prefill_core_config(ecfg: EngineConfig) -> EngineConfig:
    """A prefill engine core's config: no layer-group exports on a GPU (they feed only a Mooncake writer, which
    runs where the loop does: such a prefill's loop is on a thread; prefill_thread_only)."""
    if ecfg.kv_export_layer_group_cpu or not ecfg.kv_export_layer_group:
        return ecfg  # on CPU they are asked for explicitly, and the core refuses them (ThreadOnly)
    return dataclasses.replace(ecfg, kv_export_layer_group=0)


def parse_service_args(name: str, config_cls: type, argv: list[str] | None, description: str
                       ) -> tuple[Any, EngineConfig] | None:
    """Flags of the service's config + EngineConfig + logging (and ``--config FILE``, section ``name``);
    sets up logging and tracing."""
    try:
        cfg, ecfg, lcfg = parse_settings([config_cls, EngineConfig, LoggingConfig], argv, prog=f"pdserve {name}",
                                         section=name, description=description)
    except (ConfigError, ValueError) as e:
        print(f"pdserve {name}: {e}", file=sys.stderr)
        return None
    setup_logging(name, lcfg)
    try:
        cfg.setup_tracing(f"pdserve-{name}")
    except TracingUnavailableError as e:
        print(f"pdserve {name}: error: {e}", file=sys.stderr)
        return None
    return cfg, ecfg


def check_device(device: str) -> None:
    """StartupError unless ``device`` is cpu or a CUDA device torch can see."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise StartupError(f"--device / PDSERVE_DEVICE: {device!r} is not a device ({e}); use cpu, cuda "
                           "or cuda:N") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise StartupError(f"--device / PDSERVE_DEVICE: {device!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "no GPU is visible (driver, CUDA_VISIBLE_DEVICES)")
        raise StartupError(f"--device / PDSERVE_DEVICE: {device} asked for, but {why}; use --device cpu")
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        raise StartupError(f"--device / PDSERVE_DEVICE: {device}: {n} CUDA device(s) visible, "
                           f"cuda:0..cuda:{n - 1}")


def preflight(cfg: ServerConfig, ecfg: EngineConfig, name: str = "") -> None:
    """What can fail before the model loads, checked before it does: ports, model spec, device, and the
    settings an engine-core process does not take (``name``: the service's)."""
    check_ports(server_ports(cfg))
    if getattr(cfg, "engine_core", "thread") == "process" and ecfg.tensor_parallel_size > 1:
        raise StartupError("--engine-core process: not with --tensor-parallel-size > 1 (the ranks are driven "
                           "from this process); use --engine-core thread")
    why = prefill_thread_only(cfg, ecfg) if name == PREFILL else ""
    if getattr(cfg, "engine_core", "thread") == "process" and why:
        raise StartupError(f"--engine-core process: not for this prefill: {why}; use --engine-core thread or auto")
    try:
        src = resolve(ecfg.model)
    except ModelLoadError as e:
        raise StartupError(f"--model / PDSERVE_MODEL: {e}") from e
    check_device(ecfg.device)
    log.info("model %s (%s%s), device %s, dtype %s", src.model_id, src.kind,
             f", {src.path}" if src.path is not None else "", ecfg.device, ecfg.resolved_dtype)


async def _checked(name: str, amain: Callable[[Any, EngineConfig], Awaitable[None]], cfg: Any, ecfg: EngineConfig
                   ) -> None:
    preflight(cfg, ecfg, name)
    await amain(cfg, ecfg)


def service_main(name: str, config_cls: type, amain: Callable[[Any, EngineConfig], Awaitable[None]],
                 argv: list[str] | None, description: str) -> int:
    """The ``main`` of an engine-backed service: parse flags, preflight, then run ``amain(cfg,
    engine_cfg)``; a failure is one line (:func:`run_main`), a dead engine exits EXIT_ENGINE_DEAD."""
    parsed = parse_service_args(name, config_cls, argv, description)
    if parsed is None:
        return 2
    return run_main(name, _checked(name, amain, *parsed), exit_codes={EngineDiedError: EXIT_ENGINE_DEAD})
