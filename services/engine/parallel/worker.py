"""Ranks 1..N-1 of a tensor-parallel instance: a process that loads its shard, owns its KV shard, and
runs whatever rank 0 announces (plan.py) until STOP or until rank 0 goes away.

It serves nothing itself: no port, no RPC. Its exit (any cause) is seen by rank 0's watcher
(launch.py), which takes the instance down.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from services.engine.attention import ForwardContext
from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from services.engine.parallel.group import TPGroup, connect, open_store
from services.engine.parallel.loader import load_shard
from services.engine.parallel.plan import (
    HEADER,
    Op,
    decode_graph,
    decode_step,
    decode_trace,
    graph_payload_len,
    step_payload_len,
)
from services.engine.parallel.rank_pages import serve_op
from services.engine.parallel.trace import rank_trace_path, start_recording
from services.kernels import pack_pages, unpack_pages

log = logging.getLogger(__name__)


def rank_device(device: str, rank: int) -> torch.device:
    """cpu for every rank on CPU; cuda:(base + rank) on CUDA."""
    dev = torch.device(device)
    return dev if dev.type != "cuda" else torch.device("cuda", (dev.index or 0) + rank)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The engine settings of one rank: its device, its KV pool (shared, as --kv-cache-shared says: a side
    transport writes into every rank's own pool), CUDA graphs as configured (every rank captures its own,
    together, and replays them in lockstep: runner.py), and its share of the CPU threads (--cpu-threads 0:
    the instance's CPUs split over its ranks, not N ranks each using all of them)."""
    threads = config.cpu_threads or max(1, config.resolved_cpu_threads // config.tensor_parallel_size)
    return dataclasses.replace(config, device=str(rank_device(config.device, rank)), cpu_threads=threads)


def _recv(group: TPGroup, n: int, dtype: torch.dtype = torch.int64, shape: tuple[int, ...] | None = None
          ) -> torch.Tensor:
    return group.broadcast(torch.empty(shape or (n,), dtype=dtype, device=group.device))


@torch.inference_mode()
def serve(runner: ModelRunner, group: TPGroup) -> None:
    """Follow rank 0's plans until STOP (a collective error, e.g. rank 0 gone, propagates)."""
    model, split, dev = runner.model, runner.model.tp_split, runner.device
    L, _, _, bs, _, d = runner.kv_cache.shape
    traces: list[threading.Thread] = []  # captures in progress (daemon threads: a STOP does not wait for them)
    while True:
        header = _recv(group, HEADER).cpu()
        op = Op(int(header[0]))
        if op == Op.STOP:
            return
        if op == Op.NOOP:
            continue
        if op == Op.RANK_PAGES:  # pages rank to rank (side transports at TP>1)
            serve_op(runner, group, header)
            continue
        if op == Op.TRACE:
            start, duration, stem = decode_trace(header, _recv(group, int(header[3])).cpu())
            traces = [t for t in traces if t.is_alive()]
            traces.append(start_recording(start, duration, rank_trace_path(stem, group.rank)))
            continue
        if op == Op.GRAPH:
            gp = decode_graph(header, _recv(group, graph_payload_len(header)).cpu())
            assert runner.graphs is not None, "rank 0 replays decode graphs, this rank captured none"
            runner.graphs.fill_rows(gp.bucket, gp.ids, gp.positions, gp.slots, gp.context_lens, gp.block_tables)
            runner.graphs.replay(gp.bucket, len(gp.ids))
            continue
        if op == Op.STEP:
            plan = decode_step(header, _recv(group, step_payload_len(header)).cpu(), dev)
            hidden = model(plan.ids, plan.positions, ForwardContext(runner.attn_backend, plan.meta))
            if plan.sampled_rows:  # the vocab all-gather: every rank takes part, rank 0 samples
                model.compute_logits(hidden[torch.tensor(plan.sampled_rows, device=dev)])
            continue
        n = int(header[1])
        idx = _recv(group, n).to(dev)
        if op == Op.EXPORT:
            group.gather_to_root(pack_pages(runner.kv_cache, idx))
        else:
            mine = torch.empty((n, L, 2, bs, split.local_kv_heads, d), dtype=runner.dtype, device=dev)
            unpack_pages(group.scatter_from_root(mine), runner.kv_cache, idx)
            for region in runner.page_regions[1:]:  # replicated regions (index keys), whole from rank 0
                data = torch.empty((n, region.nbytes()), dtype=torch.uint8, device=dev)
                region.unpack(group.broadcast(data), idx)


def worker_main(rank: int, size: int, port: int, config: EngineConfig) -> None:
    """Process entry of rank ``rank`` (spawned by launch.RankSet with rank 0's store port)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    cfg = rank_config(config, rank)
    cfg.apply_host()
    torch.set_grad_enabled(False)
    device = rank_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton kernels launch on the current device: this rank's
    group = connect(open_store(size, port), rank, size, device, fast_allreduce=cfg.tp_fast_allreduce)
    loaded = load_shard(cfg.model, cfg.torch_dtype, device, group)
    group.all_reduce(torch.zeros(1, device=device))  # loaded (meets rank 0's RankSet.load_model)
    # Rank 0 builds its runner next as well: both allocate KV and capture decode graphs (collectives) together.
    runner = ModelRunner(loaded, cfg)
    log.info("tensor-parallel rank %d/%d ready: heads %s, KV heads %s", rank, size, loaded.model.tp_split.q_range,
             loaded.model.tp_split.kv_range)
    try:
        serve(runner, group)
    finally:  # a spawned process skips atexit: remove this rank's shared pool file here
        runner.release()
