"""CUDA graphs for pure-decode steps: one captured forward per batch-size bucket.

A decode step of B sequences is padded to the smallest bucket >= B. The graph reads its inputs from
static device buffers that the runner fills before each replay; padded rows get slot -1 (store_kv skips
them) and context length 0 (attention writes zeros), so they never touch the cache. The decode kernel
is captured with ``max_context_len = max_model_len`` so one graph serves every context length.
"""

from __future__ import annotations

import logging

import torch

from services.engine.attention import AttentionMetadata, ForwardContext
from services.engine.gpu_attention import TritonPagedAttention

log = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: the fixed ladder up to max_num_seqs, plus max_num_seqs itself."""
    return sorted({b for b in _BUCKETS if b < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """Captured decode forwards ``model(ids, positions, ctx) -> hidden`` for each bucket."""

    def __init__(self, model: torch.nn.Module, backend: TritonPagedAttention, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_num_seqs)
        n = self.buckets[-1]
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
                                 context_lens=self.context_lens[:bs], query_lens=[1] * bs,
                                 context_lens_host=[self.max_model_len] * bs, num_decode=bs)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], ForwardContext(self.backend, self._meta(bs)))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the kernels) and capture every bucket, largest first, into one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        self.backend.decode_max_context_len = self.max_model_len
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for bs in reversed(self.buckets):
                    self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            for bs in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self._forward(bs)
                self.graphs[bs] = graph
            torch.cuda.synchronize()
        finally:
            self.backend.decode_max_context_len = None
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def bucket_for(self, batch: int, max_context_len: int) -> int | None:
        """The bucket a decode batch replays in, or None (run eagerly)."""
        if max_context_len > self.max_model_len:
            return None
        return next((b for b in self.buckets if b >= batch and b in self.graphs), None)

    def run(self, bucket: int, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
            ) -> torch.Tensor:
        """Copy a decode step's device inputs into the static buffers, replay, return hidden [B, hidden]."""
        b = ids.shape[0]
        nb = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.block_tables[:b, :nb].copy_(meta.block_tables)
        self.context_lens[:b].copy_(meta.context_lens)
        if bucket > b:  # padded rows: no KV write, empty context
            self.slot_mapping[b:bucket].fill_(-1)
            self.context_lens[b:bucket].zero_()
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b]
