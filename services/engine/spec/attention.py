"""CPU attention for speculative forwards: rows of one common query length in ONE batched SDPA per layer.

A verify forward of a pure-decode batch is B rows of k+1 query tokens each, the draft's first pass B
rows of 2; the torch backend runs multi-token rows one at a time (one gather + SDPA per row per layer).
When every row has the same query length q > 1, this runs them together: K/V of all rows gathered once,
a causal mask per row ``key position <= context_len - q + i`` (which also hides the padding past each
row's context). Any other step, and any sliding-window or sink layer, goes to the wrapped backend unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.attention import AttentionMetadata, TorchPagedAttention


class UniformQueryAttention:
    def __init__(self, inner: TorchPagedAttention) -> None:
        self.inner = inner

    @property
    def kv_cache(self) -> torch.Tensor:
        """The wrapped backend's paged pool (what a model that reads its own cache back gathers from)."""
        return self.inner.kv_cache

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, window: int = 0, sinks: torch.Tensor | None = None, scale: float = 0.0,
                value_dim: int = 0, index=None, decode_only: bool = False) -> torch.Tensor:
        lens = meta.query_lens
        if scale or value_dim:  # a layer's own scale / latent attention: the wrapped backend's path
            return self.inner.forward(layer, q, k, v, meta, window, sinks, scale, value_dim, index, decode_only)
        if (meta.num_decode or len(lens) < 2 or lens[0] == 1 or any(n != lens[0] for n in lens)
                or window or sinks is not None):  # sliding / sink layers: the wrapped backend's masks
            return self.inner.forward(layer, q, k, v, meta, window, sinks)
        inner = self.inner
        inner._store(layer, k, v, meta.slot_mapping)
        b, n = len(lens), lens[0]
        heads, dim = q.shape[1], q.shape[2]
        max_len = max(meta.context_lens_host)
        keys, values = inner._gather(layer, meta.block_tables, max_len)  # [B, KVH, max_len, D]
        qpos = (meta.context_lens.to(torch.int64)[:, None] - n
                + torch.arange(n, device=q.device)[None, :])  # [B, n] absolute positions
        mask = torch.arange(max_len, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, n, max_len]
        qb = q.view(b, n, heads, dim).transpose(1, 2)  # [B, H, n, D]
        out = F.scaled_dot_product_attention(qb, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None],
                                             scale=inner.scale, enable_gqa=heads != inner.num_kv_heads)
        return out.transpose(1, 2).reshape(b * n, heads, dim)
