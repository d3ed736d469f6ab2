"""GPU attention backend: the Triton kernels behind the `AttentionBackend` interface.

A step's flat batch holds ``meta.num_decode`` one-token sequences first, then prefill chunks. Each layer
writes the new K/V into the paged cache (``store_kv``), then runs the paged decode kernel over the
decode rows and the extend (prefill) kernel over the rest. Every launch size comes from host lists
(``meta.context_lens_host`` / ``meta.query_lens``), so a forward never waits on the device.
"""

from __future__ import annotations

import torch

from services.engine.attention import AttentionMetadata
from services.kernels.paged_decode_attention import paged_decode_attention
from services.kernels.prefill_attention import prefill_attention
from services.kernels.store_kv import store_kv


class TritonPagedAttention:
    """Paged attention over ``kv_cache[L, 2, num_blocks, block_size, kv_heads, head_dim]`` with Triton kernels."""

    def __init__(self, kv_cache: torch.Tensor, scale: float) -> None:
        self.kv_cache = kv_cache
        self.scale = scale
        self.decode_max_context_len: int | None = None
        """Fixed upper bound on decode context lengths, set while CUDA graphs are captured so the
        captured split-K launch covers any context up to it; None: the step's own maximum."""
        self._meta: AttentionMetadata | None = None
        self._prefill_cu: torch.Tensor | None = None

    def _prefill_cu_seqlens(self, meta: AttentionMetadata) -> torch.Tensor:
        """cu_seqlens_q of the prefill sequences alone (starting at 0); built once per step, not per layer."""
        if meta is not self._meta:
            assert meta.cu_seqlens_q is not None, "prefill chunks need meta.cu_seqlens_q"
            nd = meta.num_decode
            # The first nd sequences hold one token each, so the prefill rows start at token nd.
            self._prefill_cu = meta.cu_seqlens_q[nd:] - nd
            self._meta = meta
        assert self._prefill_cu is not None
        return self._prefill_cu

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> out [T, H, D]; k/v are stored at meta.slot_mapping first.
        ``window`` (tokens, 0: full) is a Python int per layer, so a captured CUDA graph holds each layer's own;
        ``sinks`` is fp32 [H] (the layer's parameter: a graph replay reads its current values)."""
        k_cache, v_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode
        nseq = len(meta.query_lens)
        if nd == nseq:
            return self._decode(q, k_cache, v_cache, meta, nd, window, sinks)
        if nd == 0:
            return self._prefill(q, k_cache, v_cache, meta, window, sinks)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, nd, window, sinks)
        out[nd:] = self._prefill(q[nd:], k_cache, v_cache, meta, window, sinks)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, nd: int, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
        max_len = self.decode_max_context_len or max(meta.context_lens_host[:nd])
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd],
                                      self.scale, max_context_len=max_len, window=window, sinks=sinks)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
        nd = meta.num_decode
        return prefill_attention(q, k_cache, v_cache, meta.block_tables[nd:], self._prefill_cu_seqlens(meta),
                                 meta.context_lens[nd:], self.scale, max_seqlen_q=max(meta.query_lens[nd:]),
                                 window=window, sinks=sinks)
