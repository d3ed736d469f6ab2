"""Rank 0's model runner at TP>1: every forward and page move is one collective sequence that rank 0
announces with a plan (plan.py) and every rank runs in the same order.

A lock makes each sequence atomic: the engine thread's steps and a worker thread's page import (KVPages)
never interleave their collectives. Pages cross the instance boundary with all heads (pages.py).

On CUDA with --cuda-graphs every rank captured its decode graphs together (cuda_graphs.py); a pure-decode
step replays them: rank 0 fills its graph inputs, announces the bucket and the rows (Op.GRAPH), and every
rank replays its graph of that bucket, whose NCCL collectives meet the other ranks' in the same order.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch

from services.engine.attention import ForwardContext
from services.engine.config import EngineConfig
from services.engine.errors import EngineDeadError
from services.engine.kv_layout import FP8_CODEC
from services.engine.model_loader import LoadedModel
from services.engine.model_runner import ModelRunner
from services.engine.parallel.group import TPGroup
from services.engine.parallel.pages import as_cache, assemble, from_cache, per_rank_heads
from services.engine.parallel.plan import (
    HEADER,
    GraphPlan,
    Op,
    encode_graph,
    encode_step,
    encode_trace,
    simple,
)
from services.engine.sampler import Sampled, SamplingRow
from services.engine.scheduler import ScheduledChunk, SchedulerOutput
from services.engine.step_inputs import device_scope, sampled_rows
from services.kernels import pack_pages, pack_pages_fp8, unpack_pages, unpack_pages_fp8

KEEPALIVE_S = 30.0
"""Longest rank 0 goes without sending a plan (an idle instance sends Op.NOOP): well under the group's
collective timeout (group.COLLECTIVE_TIMEOUT_S), which a rank's pending plan receive would otherwise reach."""


def send(group: TPGroup, header: torch.Tensor, payload: torch.Tensor | None = None) -> None:
    """Rank 0: broadcast one plan (header, then its int64 payload)."""
    assert header.shape == (HEADER,)
    group.broadcast(header.to(group.device))
    if payload is not None:
        group.broadcast(payload.to(group.device))


class TPModelRunner(ModelRunner):
    def __init__(self, loaded: LoadedModel, config: EngineConfig, group: TPGroup, check: Callable[[], None],
                 failure: Callable[[BaseException], Exception], stop: Callable[[], None],
                 silent: Callable[[list[int], str], Exception]) -> None:
        super().__init__(loaded, config)
        self.group = group
        self.split = loaded.model.tp_split
        self._check = check
        """Raises when a rank has died (launch.RankSet.check); called before every collective sequence."""
        self._failure = failure
        """Maps a failed collective to the RankDiedError the engine dies of (launch.RankSet.failure)."""
        self._stop = stop
        self.silent = silent
        """Ranks that never acknowledged a chunk's page writes: kills them, fails the instance, returns the
        RankDiedError (launch.RankSet.silent)."""
        self.lock = threading.Lock()
        self._last_plan = time.monotonic()
        """When rank 0 last sent a plan (monotonic s)."""

    def release(self) -> None:
        super().release()
        self._stop()

    @contextlib.contextmanager
    def _sequence(self, header: torch.Tensor, payload: torch.Tensor | None = None) -> Iterator[None]:
        """One announced collective sequence, atomic; a collective that fails raises RankDiedError."""
        with self.lock:
            self._check()
            try:
                send(self.group, header, payload)
                self._last_plan = time.monotonic()
                yield
            except RuntimeError as e:
                if isinstance(e, EngineDeadError):
                    raise
                raise self._failure(e) from e

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[int, Sampled]:
        if not out.chunks:
            return {}
        with device_scope(self.device):  # rank 0's kernels launch on its device, from whichever thread steps
            return self._execute_tp(out)

    def _execute_tp(self, out: SchedulerOutput) -> dict[int, Sampled]:
        chunks = sorted(out.chunks, key=lambda c: c.num_new_tokens != 1)  # decode rows first
        bucket = self._graph_bucket(chunks)
        if bucket is not None:
            return self._replay(chunks, bucket)
        if self.graphs is not None:
            self.graphs.invalidate_rows()
        ids, pos, meta = self._prepare(chunks)
        ends, rows, seq_ids = sampled_rows(chunks)
        with self._sequence(*encode_step(ids, pos, meta, ends)):
            hidden = self.model(ids, pos, ForwardContext(self.attn_backend, meta))
            if not ends:
                return {}
            logits = self.model.compute_logits(hidden[torch.tensor(ends, device=hidden.device)])
        if self.device.type == "cuda":
            return self._sample_gpu(logits, None, rows, seq_ids)
        return dict(zip(seq_ids, self.sampler.sample(logits, rows), strict=True))

    def _graph_bucket(self, chunks: list[ScheduledChunk]) -> int | None:
        """The decode-graph bucket of a step, or None (eager): every chunk a sampling one-token decode and
        no compute_logits hook (a test's), since an LM head outside the graphs would be an unannounced
        collective."""
        if self.graphs is None or "compute_logits" in vars(self.model):
            return None
        if not all(c.num_new_tokens == 1 and c.sample for c in chunks):
            return None
        return self.graphs.bucket_for(len(chunks), max(c.seq.num_computed_tokens + 1 for c in chunks))

    def _replay(self, chunks: list[ScheduledChunk], bucket: int) -> dict[int, Sampled]:
        """One decode step in every rank's graph of ``bucket`` (LM head and greedy argmax included)."""
        g = self.graphs
        assert g is not None
        b = len(chunks)
        g.fill_host(bucket, [c.seq for c in chunks])
        width = -(-int(g.h_ctx[:b].max()) // self.block_size)  # table columns any row reads
        plan = GraphPlan(bucket, g.h_ids[:b], g.h_pos[:b], g.h_slots[:b], g.h_ctx[:b], g.h_tables[:b, :width])
        with self._sequence(*encode_graph(plan)):
            _, logits, tokens = g.replay(bucket, b)
        assert logits is not None
        rows = [SamplingRow(c.seq.params, c.seq.num_output_tokens) for c in chunks]
        return self._sample_gpu(logits, tokens, rows, [c.seq.seq_id for c in chunks])

    @torch.inference_mode()
    def read_pages(self, block_ids: list[int], codec: str | None = None) -> torch.Tensor:
        """Full-head pages of ``block_ids`` on the host (as ModelRunner.read_pages at TP=1)."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        with device_scope(self.device), self._sequence(simple(Op.EXPORT, len(block_ids)), idx.cpu()):
            full = assemble(self.group.gather_to_root(pack_pages(self.kv_cache, idx)), self.split)
        if codec == FP8_CODEC:
            with device_scope(self.device):  # the kernel launches on rank 0's device, not the thread's current one
                full = pack_pages_fp8(as_cache(full), torch.arange(len(block_ids), device=full.device))
        if not self.composite:
            return full.cpu()
        with device_scope(self.device):  # the other regions (index keys) are replicated: rank 0's are every rank's
            rest = [r.pack(idx, codec) for r in self.page_regions[1:]]
        return torch.cat([full.contiguous().view(torch.uint8).reshape(len(block_ids), -1), *rest], dim=1).cpu()

    @torch.inference_mode()
    def write_pages(self, block_ids: list[int], pages: torch.Tensor, codec: str | None = None) -> None:
        """Full-head pages (the layout read_pages returns) into every rank's shard of ``block_ids``; the regions
        beside the target's (index keys) go to every rank whole, broadcast after the target's scatter."""
        pages = pages.to(self.device)
        rest: list[torch.Tensor] = []
        if self.composite:
            pages, rest = self._split_regions(pages.reshape(len(block_ids), -1).view(torch.uint8), codec)
        if codec == FP8_CODEC:
            L, _, _, bs, _, d = self.kv_cache.shape
            cache = torch.empty((L, 2, len(block_ids), bs, self.split.num_kv_heads, d), dtype=self.dtype,
                                device=self.device)
            with device_scope(self.device):
                unpack_pages_fp8(pages, cache, torch.arange(len(block_ids), device=self.device))
            pages = from_cache(cache)
        pages = pages.to(self.dtype).contiguous()
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        with device_scope(self.device), self._sequence(simple(Op.IMPORT, len(block_ids)), idx.cpu()):
            mine = pages.new_empty((len(block_ids), *self.kv_cache.shape[:2], *self.kv_cache.shape[3:]))
            self.group.scatter_from_root(mine, per_rank_heads(pages, self.split))
            unpack_pages(mine, self.kv_cache, idx)
            for region, data in zip(self.page_regions[1:], rest, strict=True):  # worker.py receives them in order
                region.unpack(self.group.broadcast(data.contiguous()), idx)

    def _split_regions(self, pages: torch.Tensor, codec: str | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """uint8 [P, page bytes] -> (the target region's pages as read_pages gives them alone, each other region's
        uint8 [P, bytes])."""
        sizes = [r.nbytes(codec) for r in self.page_regions[1:]]
        cut = pages.shape[1] - sum(sizes)
        rest, start = [], cut
        for n in sizes:
            rest.append(pages[:, start:start + n])
            start += n
        target = pages[:, :cut].contiguous()
        if codec != FP8_CODEC:
            L, _, _, bs, _, d = self.kv_cache.shape
            target = target.view(self.dtype).view(len(pages), L, 2, bs, self.split.num_kv_heads, d)
        return target, rest

    def announce_trace(self, start_unix: float, duration_s: float, stem: str) -> None:
        """Ranks 1..N-1 start profiling the window and write ``<stem>-rank<r>.trace.json`` (parallel/trace.py)."""
        with self._sequence(*encode_trace(start_unix, duration_s, stem)):
            pass

    def keepalive(self) -> None:
        """Op.NOOP when no plan went out for KEEPALIVE_S (engine thread, between steps)."""
        if time.monotonic() - self._last_plan > KEEPALIVE_S:
            with self._sequence(simple(Op.NOOP)):
                pass

    def stop_ranks(self) -> None:
        """Tell ranks 1..N-1 to leave their loop (waits for a running step)."""
        with self.lock:
            send(self.group, simple(Op.STOP))
