"""GPU attention backend: the Triton kernels behind the `AttentionBackend` interface.

A step's flat batch holds ``meta.num_decode`` one-token sequences first, then prefill chunks. Each layer
writes the new K/V into the paged cache (``store_kv``), then runs the paged decode kernel over the
decode rows and the extend (prefill) kernel over the rest. Every launch size comes from host lists
(``meta.context_lens_host`` / ``meta.query_lens``), so a forward never waits on the device.

Latent attention (MLA, ``AttentionSpec.latent_value_dim``): k and v are the two halves of each token's latent,
stored by the same ``store_kv`` into the K and V planes; the latent kernels (``mla_decode_attention``,
``mla_prefill_attention``) read it from there in place, the query [T, H, key_dim] meeting the whole latent and the
output [T, H, value_dim] the weighted sum of its first value_dim values.

Sparse latent attention (DeepSeek-V3.2, ``AttentionSpec.index``): the step's index keys go into the index-key pool
(``IndexKeys.store``: fixed-size torch ops and, for fp8, the quantize kernel, so graph-safe); per part of the step
(decode rows, prefill tokens) `index_topk` scores every visible cached index key of each row (causal for prefill
tokens; fp8 keys dequantized with their per-token scale in the kernel) and keeps the top ``index.topk`` positions on
the device, then `sparse_mla_attention` attends to those latents only. The decode
part's sizes are the same host bound as the dense decode kernel's (a fixed one while CUDA graphs are captured);
the prefill part finds each token's sequence and causal end on the device (`prefill_rows`), once per step.

Fresh prompts (every prefill sequence of the step starts at position 0, full attention, no sinks, bf16/fp16, at
most `SDPA_MAX_SEQS` sequences of at least `SDPA_MIN_TOKENS` tokens) skip the paged extend kernel: their keys are
exactly the step's own k/v, so torch's SDPA runs on them contiguous, cuDNN's fused attention first (on an H100 at
8192 tokens, 32/4 heads of 128: 553 TFLOP/s against the extend kernel's 304 at its best tiles, `benchmarks/
attention_sweep.py`). Chunks after a prefix, windows and sinks stay on the Triton kernel. cuDNN builds an execution
graph for every new shape it meets (hundreds of ms each, then cached), so on CUDA each prompt runs padded at its end
to a length of `sdpa_bucket` (whole multiples of 256 up to 1024 tokens, then four lengths per doubling): at most
~4 graphs per doubling of prompt length per layer shape, instead of one per distinct prompt length. Causal attention
keeps the real rows exact: a padded key sits after every real query.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.attention import AttentionMetadata, IndexQuery
from services.engine.index_keys import IndexKeys
from services.kernels.index_topk import index_topk, prefill_rows
from services.kernels.mla_decode_attention import mla_decode_attention
from services.kernels.mla_prefill_attention import mla_prefill_attention
from services.kernels.paged_decode_attention import paged_decode_attention
from services.kernels.prefill_attention import prefill_attention
from services.kernels.sparse_mla_attention import sparse_mla_attention
from services.kernels.store_kv import store_kv

#: The fresh-prompt SDPA route: at most this many prefill sequences in the step (one SDPA call each) ...
SDPA_MAX_SEQS = 16
#: ... each of at least this many tokens (shorter ones cost more in launches than the fused kernel saves).
SDPA_MIN_TOKENS = 256

IndexPlanes = tuple[torch.Tensor, torch.Tensor | None]
"""One layer's index keys as `index_topk` reads them: values [slots, dim] and fp32 scales [slots] (None: unscaled)."""


class TritonPagedAttention:
    """Paged attention over ``kv_cache[L, 2, num_blocks, block_size, kv_heads, head_dim]`` with Triton kernels."""

    def __init__(self, kv_cache: torch.Tensor, scale: float, index_keys: IndexKeys | None = None) -> None:
        self.kv_cache = kv_cache
        self.scale = scale
        self.index_keys = index_keys
        """DeepSeek-V3.2's index-key pool (same block ids as kv_cache); None without an indexer."""
        self.decode_max_context_len: int | None = None
        """Fixed upper bound on decode context lengths, set while CUDA graphs are captured so the
        captured split-K launch covers any context up to it; None: the step's own maximum."""
        self._meta: AttentionMetadata | None = None
        self._prefill_cu: torch.Tensor | None = None
        self._rows_meta: AttentionMetadata | None = None
        self._prefill_rows: tuple[torch.Tensor, torch.Tensor] | None = None

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
                meta: AttentionMetadata, window: int = 0, sinks: torch.Tensor | None = None, scale: float = 0.0,
                value_dim: int = 0, index: IndexQuery | None = None, stored: bool = False,
                decode_only: bool = False) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> out [T, H, D]; k/v are stored at meta.slot_mapping first (``stored``: the
        caller's kernel did, into `store_target`'s caches).
        ``window`` (tokens, 0: full) is a Python int per layer, so a captured CUDA graph holds each layer's own;
        ``sinks`` is fp32 [H] (the layer's parameter: a graph replay reads its current values); ``scale``: the
        layer's softmax scale (0: this backend's). ``value_dim``: latent attention (k/v the latent's halves, q
        [T, H, key_dim] -> out [T, H, value_dim]); ``index``: DeepSeek-V3.2's top-k selection over the index keys
        cached in the index-key pool (sparse latent attention); ``decode_only``: AttentionSpec.decode_only (latent
        attention without an index)."""
        k_cache, v_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        if not stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        scale = scale or self.scale
        if value_dim and index is not None:
            assert self.index_keys is not None, "sparse attention (AttentionSpec.index) needs the backend's index_keys"
            self.index_keys.store(layer, index.key, meta.slot_mapping)
            keys = (self.index_keys.values(layer), self.index_keys.scales(layer))
            return self._rows(q, meta, value_dim,
                              lambda qd: self._sparse_decode(qd, index, keys, k_cache, v_cache, meta, scale, value_dim),
                              lambda qp: self._sparse_prefill(qp, index, keys, k_cache, v_cache, meta, scale,
                                                              value_dim))
        if value_dim:
            return self._rows(q, meta, value_dim,
                              lambda qd: self._latent_decode(qd, k_cache, v_cache, meta, scale, value_dim),
                              (lambda qp: qp.new_empty(*qp.shape[:2], value_dim)) if decode_only
                              else (lambda qp: self._latent_prefill(qp, k_cache, v_cache, meta, scale, value_dim)))
        nd = meta.num_decode
        fresh = not window and sinks is None and self._fresh_prompts(meta, q)
        return self._rows(q, meta, q.shape[-1],
                          lambda qd: self._decode(qd, k_cache, v_cache, meta, scale, window, sinks),
                          (lambda qp: fresh_prompt_attention(qp, k[nd:], v[nd:], meta.query_lens[nd:], scale)) if fresh
                          else (lambda qp: self._prefill(qp, k_cache, v_cache, meta, scale, window, sinks)))

    def store_target(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache, slot_mapping) of ``layer``: the RoPE kernel writes the step's K/V there itself."""
        return self.kv_cache[layer, 0], self.kv_cache[layer, 1], meta.slot_mapping

    @staticmethod
    def _fresh_prompts(meta: AttentionMetadata, q: torch.Tensor) -> bool:
        """True when the step's prefill sequences all start at position 0 and fit the SDPA route (see the module
        docstring); never while a CUDA graph is being captured."""
        nd = meta.num_decode
        lens = meta.query_lens[nd:]
        if not lens or len(lens) > SDPA_MAX_SEQS or min(lens) < SDPA_MIN_TOKENS:
            return False
        if q.dtype not in (torch.bfloat16, torch.float16):
            return False
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        return all(c == n for c, n in zip(meta.context_lens_host[nd:], lens, strict=True))

    @staticmethod
    def _rows(q: torch.Tensor, meta: AttentionMetadata, width: int, decode: Callable[[torch.Tensor], torch.Tensor],
              prefill: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[T, H, width]: ``decode`` of the first meta.num_decode rows, ``prefill`` of the rest."""
        nd = meta.num_decode
        if nd == len(meta.query_lens):
            return decode(q)
        if nd == 0:
            return prefill(q)
        out = q.new_empty(q.shape[0], q.shape[1], width)
        out[:nd] = decode(q[:nd])
        out[nd:] = prefill(q[nd:])
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
        nd = meta.num_decode
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd], scale,
                                      max_context_len=self._decode_bound(meta), window=window, sinks=sinks)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
        nd = meta.num_decode
        return prefill_attention(q, k_cache, v_cache, meta.block_tables[nd:], self._prefill_cu_seqlens(meta),
                                 meta.context_lens[nd:], scale, max_seqlen_q=max(meta.query_lens[nd:]),
                                 window=window, sinks=sinks)

    def _latent_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, value_dim: int) -> torch.Tensor:
        nd = meta.num_decode
        return mla_decode_attention(q, k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd], scale,
                                    value_dim, max_context_len=self._decode_bound(meta))

    def _latent_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, value_dim: int) -> torch.Tensor:
        nd = meta.num_decode
        return mla_prefill_attention(q, k_cache, v_cache, meta.block_tables[nd:], self._prefill_cu_seqlens(meta),
                                     meta.context_lens[nd:], scale, value_dim, max_seqlen_q=max(meta.query_lens[nd:]))

    def _sparse_decode(self, q: torch.Tensor, index: IndexQuery, keys: IndexPlanes, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, value_dim: int) -> torch.Tensor:
        """Decode rows: each sees its whole context; top-k over a [rows, decode bound] score buffer."""
        nd = meta.num_decode
        tables = meta.block_tables[:nd]
        sel = index_topk(index.q[:nd], index.weights[:nd], *keys, tables, meta.context_lens[:nd], k_cache.shape[1],
                         index.scale, index.topk, self._decode_bound(meta))
        return sparse_mla_attention(q, k_cache, v_cache, tables, sel, scale, value_dim)

    def _sparse_prefill(self, q: torch.Tensor, index: IndexQuery, keys: IndexPlanes, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, value_dim: int) -> torch.Tensor:
        """Prefill tokens: token i of a chunk sees its sequence's keys up to its own position."""
        nd = meta.num_decode
        seq, end = self._token_rows(meta, q.shape[0])
        tables = meta.block_tables[nd:]
        sel = index_topk(index.q[nd:], index.weights[nd:], *keys, tables, end, k_cache.shape[1], index.scale,
                         index.topk, max(meta.context_lens_host[nd:]), row_seq=seq)
        return sparse_mla_attention(q, k_cache, v_cache, tables, sel, scale, value_dim, row_seq=seq)

    def _token_rows(self, meta: AttentionMetadata, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, causal key end) of each prefill token, on the device; built once per step, not per layer."""
        if meta is not self._rows_meta or self._prefill_rows is None:
            nd = meta.num_decode
            self._prefill_rows = prefill_rows(self._prefill_cu_seqlens(meta), meta.context_lens[nd:], total)
            self._rows_meta = meta
        return self._prefill_rows

    def _decode_bound(self, meta: AttentionMetadata) -> int:
        """Host bound on the decode rows' contexts: the fixed one while graphs are captured, else the step's."""
        return self.decode_max_context_len or max(meta.context_lens_host[:meta.num_decode])


def sdpa_bucket(n: int) -> int:
    """The length a fresh prompt of ``n`` tokens runs at through SDPA on CUDA: n rounded up to a multiple of 256
    up to 1024, beyond that to a quarter of the power of two below it (1025 -> 1280, 2049 -> 2560, 4097 -> 5120):
    beyond 1024 tokens at most 25% padded rows, 4 lengths (cuDNN graphs) per doubling."""
    if n <= 1024:
        return -(-n // 256) * 256
    step = 1 << (n.bit_length() - 3)  # n in (2^k, 2^(k+1)] -> steps of 2^(k-2)
    return -(-n // step) * step


def fresh_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float,
                           bucket: Callable[[int], int] | None = None) -> torch.Tensor:
    """Causal self-attention of whole prompts laid end to end: q [T, H, D], k/v [T, KVH, D] with T = sum(lens),
    sequence i the rows [sum(lens[:i]), sum(lens[:i+1])). One SDPA call per sequence, cuDNN's kernel preferred
    (then flash, then memory-efficient); K/V heads are repeated to the query heads (GQA). ``bucket``: the length
    each sequence runs at, padded after its rows (default: `sdpa_bucket` on CUDA, its own length elsewhere)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if bucket is None and q.is_cuda:
        bucket = sdpa_bucket
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    start = 0
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
                     set_priority=True):
        for n in lens:
            rows = slice(start, start + n)
            m = bucket(n) if bucket is not None else n
            qi, ki, vi = (t[rows].transpose(0, 1) for t in (q, k, v))  # [H or KVH, n, D]
            if m > n:  # zero rows after the sequence's own
                qi, ki, vi = (torch.nn.functional.pad(t, (0, 0, 0, m - n)) for t in (qi, ki, vi))
            qi = qi.unsqueeze(0)  # [1, H, m, D]
            if group > 1:
                ki = ki.repeat_interleave(group, dim=0)
                vi = vi.repeat_interleave(group, dim=0)
            oi = torch.nn.functional.scaled_dot_product_attention(qi, ki.unsqueeze(0), vi.unsqueeze(0),
                                                                  is_causal=True, scale=scale)
            out[rows] = oi[0, :, :n].transpose(0, 1)
            start += n
    return out
