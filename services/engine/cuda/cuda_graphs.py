"""CUDA graphs for pure-decode steps: one captured forward (+ LM head + greedy argmax) per batch bucket.

A decode step of B sequences is padded to the smallest bucket >= B. The graph reads its inputs from
static device buffers that the runner fills before each replay; padded rows get slot -1 (store_kv skips
them) and context length 0 (attention writes zeros), so they never touch the cache. The decode kernel
is captured with ``max_context_len = max_model_len`` so one graph serves every context length; so is
DeepSeek-V3.2's top-k selection (an fp32 [bucket, max_model_len] score buffer per layer, -inf past each context).

The static inputs live in two device buffers mirrored by two pinned host buffers, so a step's inputs
travel in two host->device copies and no copy kernels:
  int64 [input_ids N | positions N | slot_mapping N]      (N = largest bucket)
  int32 [context_lens N | block_tables N x max_blocks]     (only the first B table rows are copied)
Besides the hidden state, each graph computes ``model.compute_logits`` (fp32 [bucket, vocab]) and their
argmax, so a greedy step copies back B token ids and launches nothing but the replay.

A step whose rows ask for logprobs replays a second, small graph per bucket after it (at tensor-parallel
size 1): `logprob_table` of the bucket's logits and the step's tokens (the argmax, or the sampler's draw
copied into ``head_tokens``), so such a step copies back one [B, 2 + 2 * 20] table (tokens, their logprobs,
the 20 most likely alternatives) instead of [B, vocab] logits.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.engine.attention import AttentionMetadata, ForwardContext
from services.engine.cuda.gpu_attention import TritonPagedAttention
from services.engine.sampler import logprob_table
from services.text.sampling_params import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from services.engine.sequence import Sequence

log = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: the fixed ladder up to max_num_seqs, plus max_num_seqs itself."""
    return sorted({b for b in _BUCKETS if b < max_num_seqs} | {max_num_seqs})


def fill_decode_rows(seqs: list[Sequence], bucket: int, block_size: int, rows: list[tuple[int, int]], ids: np.ndarray,
                     pos: np.ndarray, slots: np.ndarray, ctx: np.ndarray, tables: np.ndarray) -> None:
    """Write one decode token per sequence into the host input arrays; rows [len(seqs), bucket) are padding
    (slot -1, context 0).

    ``rows[i] = (seq_id, context_len)`` records what table row i was last filled for: a row that held the
    same sequence one token earlier only gets its new table entries (block tables grow append-only
    while a sequence keeps decoding); any other row is rewritten up to its last block.
    """
    b = len(seqs)
    l_ids, l_pos, l_slots, l_ctx = [], [], [], []
    for i, seq in enumerate(seqs):
        p = seq.num_computed_tokens
        table = seq.block_table
        nblk = p // block_size + 1
        sid = seq.seq_id
        prev_sid, prev_ctx = rows[i]
        start = (prev_ctx - 1) // block_size + 1 if prev_sid == sid and prev_ctx == p else 0
        if start < nblk:
            tables[i, start:nblk] = table[start:nblk]
        rows[i] = (sid, p + 1)
        l_ids.append(seq.token_ids[p])
        l_pos.append(p)
        l_slots.append(table[p // block_size] * block_size + p % block_size)
        l_ctx.append(p + 1)
    ids[:b] = l_ids
    pos[:b] = l_pos
    slots[:b] = l_slots
    ctx[:b] = l_ctx
    # Padding rows run through the graph too (the embedding reads their ids): a stale id there may be an
    # async step's PLACEHOLDER_TOKEN (patched on the device only, never on the host), which the embedding
    # would index out of range. Token 0 and position 0 are valid for every model; slot -1 writes no KV.
    ids[b:bucket] = 0
    pos[b:bucket] = 0
    slots[b:bucket] = -1
    ctx[b:bucket] = 0


def capture_buckets(buckets: list[int], forward, graphs: dict, outputs: dict, mode: str = "global") -> None:
    """Run ``forward(bs)`` once per bucket on a side stream (compiles the kernels), then capture each, largest
    first, into one memory pool: ``graphs[bs]`` replays it, ``outputs[bs]`` is what it returns."""
    pool = torch.cuda.graph_pool_handle()
    # Both streams on the current device (the runner's): torch.cuda.graph's default capture stream is made
    # once per process, on whatever device was current then (cuda:0 for a second engine on cuda:1).
    stream, capture = torch.cuda.Stream(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for bs in reversed(buckets):
            forward(bs)
    torch.cuda.current_stream().wait_stream(stream)
    for bs in reversed(buckets):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=capture, capture_error_mode=mode):
            outputs[bs] = forward(bs)
        graphs[bs] = graph
    torch.cuda.synchronize()


class DecodeGraphs:
    """Captured decode steps ``ids, positions, meta -> (hidden, logits, greedy tokens)`` for each bucket."""

    def __init__(self, model: torch.nn.Module, backend: TritonPagedAttention, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device, lm_head: bool = True) -> None:
        self.model = model
        self.backend = backend
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.buckets = decode_buckets(max_num_seqs)
        #: Whether the graphs include compute_logits + argmax (a forward-only graph otherwise).
        self.lm_head = lm_head
        n = self.buckets[-1]
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        self.host64 = torch.zeros(3 * n, dtype=torch.int64, pin_memory=True)
        self.host32 = torch.zeros(n + n * self.max_blocks, dtype=torch.int32, pin_memory=True)
        self.dev64 = torch.zeros(3 * n, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(n + n * self.max_blocks, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.dev64.view(3, n)
        self.slot_mapping.fill_(-1)
        self.context_lens = self.dev32[:n]
        self.block_tables = self.dev32[n:].view(n, self.max_blocks)
        h64 = self.host64.numpy()
        h32 = self.host32.numpy()
        self.h_ids, self.h_pos, self.h_slots = h64[:n], h64[n:2 * n], h64[2 * n:]
        self.h_ctx = h32[:n]
        self.h_tables = h32[n:].reshape(n, self.max_blocks)
        self.h_slots[:] = -1
        self._copied = torch.cuda.Event()
        self._copied.record()
        # Row cache of the host block table: (seq_id, context_len) each row was last filled for.
        self._rows: list[tuple[int, int]] = [(-1, -1)] * n
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        self.head_tokens = torch.zeros(n, dtype=torch.int64, device=device)
        """The tokens the logprob graphs read (int64 [N]; rows [0, B) filled before each replay)."""
        self.head_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.head_outputs: dict[int, torch.Tensor] = {}
        """Per bucket the fp32 [bucket, 2 + 2k] table its logprob graph writes (k = min(20, vocab))."""

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
                                 context_lens=self.context_lens[:bs], query_lens=[1] * bs,
                                 context_lens_host=[self.max_model_len] * bs, num_decode=bs)

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs],
                            ForwardContext(self.backend, self._meta(bs)))
        if not self.lm_head:
            return hidden, None, None
        logits = self.model.compute_logits(hidden)
        return hidden, logits, logits.argmax(dim=-1)

    def _head(self, bs: int) -> torch.Tensor:
        logits = self.outputs[bs][1]
        assert logits is not None
        return logprob_table(logits, self.head_tokens[:bs], min(MAX_TOP_LOGPROBS, logits.shape[1]))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the kernels) and capture every bucket, largest first, into one memory pool.

        At TP>1 every rank calls this at the same time: the warm-up forwards run the model's collectives
        (NCCL, already connected), the captures record them, and each rank's graph of a bucket then replays
        only together with the other ranks' graph of the same bucket (rank 0's plan names it). Capture is
        thread-local there: NCCL's watchdog thread queries events while a rank captures."""
        mode = "thread_local" if self.model.tp_split.tp_size > 1 else "global"
        self.backend.decode_max_context_len = self.max_model_len
        try:
            capture_buckets(self.buckets, self._forward, self.graphs, self.outputs, mode)
        finally:
            self.backend.decode_max_context_len = None
        if self.lm_head and self.model.tp_split.tp_size == 1:
            capture_buckets(self.buckets, self._head, self.head_graphs, self.head_outputs)
        log.info("captured decode CUDA graphs for batch sizes %s (LM head in graph: %s, logprob graphs: %s)",
                 self.buckets, self.lm_head, bool(self.head_graphs))

    def bucket_for(self, batch: int, max_context_len: int) -> int | None:
        """The bucket a decode batch replays in, or None (run eagerly)."""
        if max_context_len > self.max_model_len:
            return None
        return next((b for b in self.buckets if b >= batch and b in self.graphs), None)

    def invalidate_rows(self) -> None:
        """Forget the host block-table row cache (called after any step that did not replay)."""
        self._rows = [(-1, -1)] * len(self._rows)

    def run_host(self, bucket: int, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Fill the inputs of one decode token per sequence from the host, copy, replay.

        Each sequence decodes its token at position ``num_computed_tokens`` (see `fill_decode_rows`).
        Returns (hidden, logits, tokens) views of the first len(seqs) rows.
        """
        self.fill_host(bucket, seqs)
        return self.replay(bucket, len(seqs))

    def fill_host(self, bucket: int, seqs: list[Sequence]) -> None:
        """The host inputs of one decode token per sequence (rows [len(seqs), bucket) padding)."""
        self._copied.synchronize()  # the previous step's host->device copies have read the buffers
        fill_decode_rows(seqs, bucket, self.block_size, self._rows, self.h_ids, self.h_pos, self.h_slots,
                         self.h_ctx, self.h_tables)

    def fill_rows(self, bucket: int, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, ctx: np.ndarray,
                  tables: np.ndarray) -> None:
        """The host inputs from arrays (a tensor-parallel rank > 0 replaying rank 0's plan): B rows of
        ids/positions/slots/context lengths and a [B, M] block table (M <= max_blocks)."""
        b, m = tables.shape
        self._copied.synchronize()
        self.invalidate_rows()
        self.h_ids[:b], self.h_pos[:b], self.h_slots[:b], self.h_ctx[:b] = ids, pos, slots, ctx
        self.h_tables[:b, :m] = tables
        self.h_ids[b:bucket] = 0
        self.h_pos[b:bucket] = 0
        self.h_slots[b:bucket] = -1
        self.h_ctx[b:bucket] = 0

    def replay(self, bucket: int, b: int, patch: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Copy the filled host inputs of b rows to the device and replay ``bucket``'s graph. ``patch`` (rows,
        token ids), device tensors: input ids written on the device after the copy (async scheduling feeds
        the previous step's in-flight tokens so)."""
        n = len(self.h_ctx)
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32[: n + b * self.max_blocks].copy_(self.host32[: n + b * self.max_blocks], non_blocking=True)
        self._copied.record()
        if patch is not None:
            self.input_ids[patch[0]] = patch[1]
        self.graphs[bucket].replay()
        hidden, logits, tokens = self.outputs[bucket]
        return hidden[:b], None if logits is None else logits[:b], None if tokens is None else tokens[:b]

    def logprob_table(self, bucket: int, tokens: torch.Tensor) -> torch.Tensor | None:
        """After `replay` of ``bucket``: the [B, 2 + 2k] `logprob_table` of its logits for ``tokens`` [B] (on the
        device), by the bucket's logprob graph; None where none was captured (tensor-parallel ranks)."""
        graph = self.head_graphs.get(bucket)
        if graph is None:
            return None
        b = tokens.shape[0]
        self.head_tokens[:b].copy_(tokens)
        graph.replay()
        return self.head_outputs[bucket][:b]


__all__ = ["DecodeGraphs", "capture_buckets", "decode_buckets"]
