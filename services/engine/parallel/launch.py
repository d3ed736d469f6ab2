"""Rank 0 starts ranks 1..N-1 of its instance and watches them.

The ranks are processes of this host (multiprocessing spawn) that meet rank 0 on a loopback TCPStore at
a port the OS picked. A watcher thread waits on their process sentinels: the first rank that exits while
the instance runs makes :meth:`RankSet.check` raise :class:`RankDiedError`, which the engine loop meets
at its next iteration (LLMEngine.has_work) or collective, so the service goes NOT_SERVING and exits
(services/worker/engine_service.py). The group is aborted at once, so a collective blocked on the dead
rank fails instead of waiting out its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
from multiprocessing.connection import wait

import torch

from services.engine.config import EngineConfig
from services.engine.errors import EngineDeadError
from services.engine.model_loader import LoadedModel
from services.engine.parallel.group import TPGroup, connect, open_store
from services.engine.parallel.loader import check_split, load_shard
from services.engine.parallel.runner import TPModelRunner
from services.engine.parallel.worker import rank_config, rank_device, worker_main

log = logging.getLogger(__name__)

STOP_WAIT_S = 10.0
"""How long a clean stop waits for each rank to exit before terminating it (seconds)."""


FAILURE_WAIT_S = 2.0
"""How long a failed collective waits for the watcher to name the rank that died (seconds)."""


class RankDiedError(EngineDeadError):
    """A rank of this tensor-parallel instance exited (or a collective with it failed): the instance cannot
    compute any more. An EngineDeadError, so the servicers answer UNAVAILABLE / ENGINE_DEAD."""


class RankSet:
    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel_size
        check_split(config.model, self.size)  # before any rank starts: one clear error
        self.config = rank_config(config, 0)
        torch.set_num_threads(self.config.cpu_threads)  # rank 0's share (LLMEngine applied the instance's)
        self.device = rank_device(config.device, 0)
        self.failed: RankDiedError | None = None
        self._failed_event = threading.Event()
        self._fail_lock = threading.Lock()
        self._stopping = False
        self.runner: TPModelRunner | None = None
        ctx = mp.get_context("spawn")
        store = open_store(self.size)
        self.procs = [ctx.Process(target=worker_main, args=(r, self.size, store.port, config), daemon=True,
                                  name=f"pdserve-tp-rank{r}") for r in range(1, self.size)]
        for p in self.procs:
            p.start()
        log.info("tensor parallel: rank 0 of %d; ranks 1..%d are pids %s (store 127.0.0.1:%d)", self.size,
                 self.size - 1, [p.pid for p in self.procs], store.port)
        self.group: TPGroup = connect(store, 0, self.size, self.device,
                                      fast_allreduce=config.tp_fast_allreduce)
        self._watcher = threading.Thread(target=self._watch, name="pdserve-tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        ready = wait([p.sentinel for p in self.procs])
        if self._stopping:
            return
        dead = next(p for p in self.procs if p.sentinel in ready)
        dead.join(1.0)
        rank = self.procs.index(dead) + 1
        self._fail(RankDiedError(f"tensor-parallel rank {rank} of {self.size} (pid {dead.pid}) exited with "
                                 f"status {dead.exitcode}"))

    def _fail(self, err: RankDiedError) -> None:
        """The instance cannot compute any more (the first cause is kept); a collective blocked on a rank fails."""
        with self._fail_lock:
            if self.failed is not None:
                return
            self.failed = err
        self._failed_event.set()
        log.error("%s: the instance stops serving", err)
        if self.group.pg is not None:
            with contextlib.suppress(Exception):
                self.group.pg.abort()

    def silent(self, ranks: list[int], reason: str) -> RankDiedError:
        """Live ranks that did not acknowledge their page writes in time are taken as dead: the instance fails
        and every rank 1..N-1 is killed and reaped before this returns, so no rank's write can land in a decode's
        pool after the request that owned those blocks has ended (its stream is aborted, decode frees them)."""
        self._fail(RankDiedError(f"tensor-parallel ranks {ranks} of {self.size} taken as dead: {reason}"))
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join(STOP_WAIT_S)
        assert self.failed is not None
        return self.failed

    def check(self) -> None:
        """Raise RankDiedError once any rank has died."""
        if self.failed is not None:
            raise self.failed

    def check_idle(self) -> None:
        """check(), then keep the ranks' plan receive alive (runner.keepalive) when no plan went out lately:
        the engine loop calls this on every iteration, idle or not."""
        self.check()
        if self.runner is not None:
            self.runner.keepalive()

    def failure(self, cause: BaseException) -> RankDiedError:
        """What a failed collective means: the rank the watcher saw die (waiting briefly for it to notice),
        else a group failure naming the cause."""
        if self._failed_event.wait(FAILURE_WAIT_S) and self.failed is not None:
            return self.failed
        return RankDiedError(f"a collective of the {self.size}-rank tensor-parallel group failed: {cause}")

    def load_model(self) -> LoadedModel:
        """Rank 0's shard; returns once every rank has loaded its own."""
        loaded = load_shard(self.config.model, self.config.torch_dtype, self.device, self.group)
        self.group.all_reduce(torch.zeros(1, device=self.device))
        self.check()
        return loaded

    def make_runner(self, loaded: LoadedModel) -> TPModelRunner:
        self.runner = TPModelRunner(loaded, self.config, self.group, self.check, self.failure, self.stop,
                                    self.silent)
        return self.runner

    def stop(self) -> None:
        """Stop every rank (a clean STOP when they are alive, then terminate what lingers)."""
        if self._stopping:
            return
        self._stopping = True
        if self.failed is None and self.runner is not None:
            with contextlib.suppress(Exception):
                self.runner.stop_ranks()
        for p in self.procs:
            p.join(STOP_WAIT_S)
            if p.is_alive():
                p.terminate()
                p.join(STOP_WAIT_S)
