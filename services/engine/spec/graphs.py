"""CUDA graphs for speculative decode steps: the whole step (K draft forwards + the (K+1)-row verify) in one
replay per batch-size bucket.

A pure-decode step of B greedy sequences (each with n >= 2 tokens, n-1 computed, k_b <= K drafts the
scheduler reserved slots for) is padded to the smallest bucket >= B. The captured step, for every row:

  1. draft pass 0 over its last two tokens (positions n-2, n-1; the prefill kernel with 2 query rows)
     -> d1 = argmax of the draft logits after n-1;
  2. draft passes j = 1 .. K-1 (the decode kernel, one token at position n-1+j) -> d_{j+1};
  3. the target over [t_{n-1}, d1 .. dK] at positions n-1 .. n-1+K (the prefill kernel, K+1 rows)
     -> greedy tokens T[0 .. K].

Every row always runs K drafts and K+1 verify rows (fixed shapes); a row with k_b < K gets slot -1 for
positions past n-1+k_b (store_kv skips them, so no KV lands outside the blocks the scheduler reserved)
and the host reads only its first k_b drafts and k_b+1 verify tokens. Causality keeps every used output
exact: a query at position p <= n-1+k_b reads keys <= p only, all of them stored. Padded rows have
slot -1 everywhere and context 0. Positions may run K past max_model_len in unused rows, so the rotary
caches and the block-table width cover max_model_len + K + 2.

Inputs live in one int64 device buffer [tok2 N x 2 | pos0 N | slots N x (K+2)] and one int32 buffer
[ctx0 N | tables N x W], each mirrored by a pinned host buffer (two host->device copies per step); the
output is one int64 [B, 2K+1] tensor (drafts then verify tokens): one device->host copy per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.attention import AttentionMetadata, ForwardContext
from services.engine.cuda.cuda_graphs import capture_buckets, decode_buckets

log = logging.getLogger(__name__)


@dataclass
class GraphStep:
    """One sequence of a graph step: its token ids, block table and the drafts it may use (k <= K)."""

    token_ids: list[int]
    block_table: list[int]
    k: int


class SpecGraphs:
    """Captured speculative steps ``(last two tokens, slots, tables) -> (drafts [B, K], greedy [B, K+1])``."""

    def __init__(self, draft: torch.nn.Module, draft_backend, target: torch.nn.Module, target_backend,
                 spec_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.draft, self.draft_backend = draft, draft_backend
        self.target, self.target_backend = target, target_backend
        self.k = spec_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        #: Positions a row may touch, used or not: up to max_model_len - 1 + K (+1 spare).
        self.max_positions = max_model_len + spec_tokens + 2
        self.buckets = decode_buckets(max_num_seqs)
        n, k = self.buckets[-1], spec_tokens
        self.width = (self.max_positions + block_size - 1) // block_size
        n64 = 2 * n + n + n * (k + 2)
        n32 = n + n * self.width
        pin = device.type == "cuda"  # the step's body also runs uncaptured on CPU (tests, Triton interpreter)
        self.host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros(n64, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(n32, dtype=torch.int32, device=device)
        h64, h32 = self.host64.numpy(), self.host32.numpy()
        self.h_tok2 = h64[: 2 * n].reshape(n, 2)
        self.h_pos0 = h64[2 * n: 3 * n]
        self.h_slots = h64[3 * n:].reshape(n, k + 2)
        self.h_ctx0 = h32[:n]
        self.h_tables = h32[n:].reshape(n, self.width)
        self.tok2 = self.dev64[: 2 * n].view(n, 2)
        self.pos0 = self.dev64[2 * n: 3 * n]
        self.slots = self.dev64[3 * n:].view(n, k + 2)
        self.ctx0 = self.dev32[:n]
        self.tables = self.dev32[n:].view(n, self.width)
        self.h_slots[:] = -1
        self.slots.fill_(-1)
        self.cu2 = torch.arange(0, 2 * (n + 1), 2, dtype=torch.int32, device=device)
        self.cuv = torch.arange(0, (k + 1) * (n + 1), k + 1, dtype=torch.int32, device=device)
        self.offs = torch.arange(k + 2, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if pin else None
        if self._copied is not None:
            self._copied.record()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, slots: torch.Tensor, ctx: torch.Tensor, bs: int, q: int, cu: torch.Tensor | None
              ) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=slots, block_tables=self.tables[:bs], context_lens=ctx,
                                 query_lens=[q] * bs, context_lens_host=[self.max_positions] * bs,
                                 num_decode=bs if q == 1 else 0, cu_seqlens_q=cu)

    def _forward(self, bs: int) -> torch.Tensor:
        k = self.k
        pos0, ctx0 = self.pos0[:bs], self.ctx0[:bs]
        positions = pos0[:, None] + self.offs[None, :]  # [bs, K+2]: n-2 .. n-1+K
        # 1. draft pass 0: positions n-2, n-1.
        meta = self._meta(self.slots[:bs, :2].reshape(-1), ctx0, bs, 2, self.cu2[: bs + 1])
        h = self.draft(self.tok2[:bs].reshape(-1), positions[:, :2].reshape(-1),
                       ForwardContext(self.draft_backend, meta))
        d = self.draft.compute_logits(h.view(bs, 2, -1)[:, 1]).argmax(dim=-1)
        drafts = [d]
        # 2. draft passes 1 .. K-1: d_j at position n-1+j.
        for j in range(1, k):
            meta = self._meta(self.slots[:bs, 1 + j].contiguous(), ctx0 + j, bs, 1, None)
            h = self.draft(d, positions[:, 1 + j].contiguous(), ForwardContext(self.draft_backend, meta))
            d = self.draft.compute_logits(h).argmax(dim=-1)
            drafts.append(d)
        dr = torch.stack(drafts, dim=1)  # [bs, K]
        # 3. the target over [t_{n-1}, d1 .. dK].
        ids = torch.cat([self.tok2[:bs, 1:], dr], dim=1).reshape(-1)
        meta = self._meta(self.slots[:bs, 1:].reshape(-1), ctx0 + k, bs, k + 1, self.cuv[: bs + 1])
        h = self.target(ids, positions[:, 1:].reshape(-1), ForwardContext(self.target_backend, meta))
        greedy = self.target.compute_logits(h).argmax(dim=-1).view(bs, k + 1)
        return torch.cat([dr, greedy], dim=1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the kernels) and capture every bucket, largest first, into one memory pool."""
        backends = {id(self.draft_backend): self.draft_backend, id(self.target_backend): self.target_backend}
        for b in backends.values():
            b.decode_max_context_len = self.max_positions
        try:
            capture_buckets(self.buckets, self._forward, self.graphs, self.outputs)
        finally:
            for b in backends.values():
                b.decode_max_context_len = None
        log.info("captured speculative-step CUDA graphs (K=%d) for batch sizes %s", self.k, self.buckets)

    def bucket_for(self, batch: int) -> int | None:
        """The bucket a step of ``batch`` sequences replays in, or None (run eagerly)."""
        return next((b for b in self.buckets if b >= batch and b in self.graphs), None)

    def run(self, bucket: int, steps: list[GraphStep]) -> np.ndarray:
        """Fill the inputs from the host, copy, replay; int64 [B, 2K+1]: drafts [B, K], greedy [B, K+1]."""
        b, k, bs = len(steps), self.k, self.block_size
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's host->device copies have read the buffers
        tables, ctx0, tok2 = self.h_tables, self.h_ctx0, self.h_tok2
        kmax = np.empty(b, dtype=np.int64)
        for i, s in enumerate(steps):
            n = len(s.token_ids)
            tok2[i] = s.token_ids[n - 2:n]
            ctx0[i] = n
            nblk = min((n + s.k + bs - 1) // bs, len(s.block_table))  # blocks covering positions .. n-1+k
            tables[i, :nblk] = s.block_table[:nblk]
            tables[i, nblk:] = 0
            kmax[i] = s.k
        ctx0[b:bucket] = 0
        pos0 = self.h_pos0[:b]
        pos0[:] = ctx0[:b].astype(np.int64) - 2
        p = pos0[:, None] + np.arange(k + 2)  # [b, K+2]
        blk = np.take_along_axis(tables[:b], np.minimum(p // bs, self.width - 1), axis=1).astype(np.int64)
        slots = blk * bs + p % bs
        slots[np.arange(k + 2)[None, :] > kmax[:, None] + 1] = -1  # past n-1+k: not reserved, not stored
        self.h_slots[:b] = slots
        self.h_slots[b:bucket] = -1
        self.dev64.copy_(self.host64, non_blocking=True)
        n32 = len(self.h_ctx0) + b * self.width  # ctx0 of every row, the first b table rows
        self.dev32[:n32].copy_(self.host32[:n32], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b].cpu().numpy()


__all__ = ["GraphStep", "SpecGraphs"]
