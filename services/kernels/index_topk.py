"""DeepSeek-V3.2's top-k key selection (the lightning indexer's scores) over the paged index keys, on the device.

Each layer caches an index key of ``index_dim`` values per token in the index-key pool (engine/index_keys.py), a
region of its own beside the latent: ``keys`` [slots, index_dim] (slot = block id * block_size + offset) in the
pool's dtype, or fp8-e4m3 with one fp32 scale per token in ``key_scales`` [slots] (both strided views of the pool's
rows). A query row t of the step sees keys [0, end_t) of its sequence (decode: its context; a prefill token: the
keys up to its own position) and scores each

    score[t, k] = sum_h w[t, h] * relu(scale * q[t, h] . index_key[k])      index_key = keys[slot] * key_scales[slot]

One program owns one (row, BLOCK_N keys): its index query [heads, index_dim] meets the tile of keys in one tl.dot
(fp8 keys converted exactly to q's dtype, each key's column of products then times its scale) and the head-weighted
sum reduces it to BLOCK_N scores; keys past end_t (and past
the tile of a padding row) get -inf. The selection is torch.topk over the [rows, max_context] fp32 buffer, on the
device. Every size comes from host values (the step's longest context, or a fixed bound while CUDA graphs are
captured), so a decode step is graph-safe: no host sync, no size read from the device. Rows are scored in chunks
whose score buffer stays under SCORE_BYTES, so a long prefill chunk at a long context does not allocate rows x
context at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._triton_utils import _mma, dot_flags

SCORE_BYTES = 1 << 28
"""Largest fp32 score buffer one chunk of rows allocates (256 MiB: 512 decode rows at 128K keys)."""
#: Keys per program (the N side of the score tl.dot).
BLOCK_N = 64


@triton.jit
def _index_score_kernel(
    Q_ptr,
    W_ptr,
    K_ptr,
    KS_ptr,
    BT_ptr,
    SEQ_ptr,
    END_ptr,
    S_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_ks,
    stride_ss,
    stride_btb,
    stride_st,
    scale,
    block_size,
    num_cols,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """For row t (sequence b = SEQ[t], or t itself without HAS_SEQ) and keys n of tile j, with slot(b, n) =
    BT[b, n // bs] * bs + n % bs and key(b, n) = K[slot] (times KS[slot] with HAS_SCALE):

        S[t, n] = sum_h W[t, h] * max(0, scale * Q[t, h] . key(b, n))    for n < END[t]
        S[t, n] = -inf                                                  for END[t] <= n < num_cols
    """
    t = tl.program_id(0)
    j = tl.program_id(1)
    end = tl.load(END_ptr + t)
    if HAS_SEQ:
        b = tl.load(SEQ_ptr + t)
    else:
        b = t
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    if j * BLOCK_N < end:
        offs_h = tl.arange(0, BLOCK_HI)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < HEADS
        mask_d = offs_d < DIM
        mask_n = offs_n < end
        q_ptrs = Q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        w = tl.load(W_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=mask_h, other=0.0)
        blk = tl.load(BT_ptr + b.to(tl.int64) * stride_btb + offs_n // block_size, mask=mask_n, other=0)
        slots = blk.to(tl.int64) * block_size + offs_n % block_size
        k = tl.load(K_ptr + slots[:, None] * stride_ks + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :],
                    other=0.0)
        s = _mma(q, tl.trans(k.to(q.dtype)), UPCAST, DOT_PRECISION) * scale  # [BLOCK_HI, BLOCK_N]
        if HAS_SCALE:  # fp8-e4m3 keys (exact in q's dtype): q . (k * ks) = (q . k) * ks, per key column
            s = s * tl.load(KS_ptr + slots * stride_ss, mask=mask_n, other=0.0)[None, :]
        s = tl.maximum(s, 0.0)
        total = tl.where(mask_n, tl.sum(s * w[:, None], 0), float("-inf"))
    tl.store(S_ptr + t.to(tl.int64) * stride_st + offs_n, total, mask=offs_n < num_cols)


def _check(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
           block_tables: torch.Tensor, row_end: torch.Tensor, row_seq: torch.Tensor | None) -> None:
    """The shape contract of the score kernel (index keys [slots, index_dim], fp8 ones with fp32 scales [slots])."""
    rows = q.shape[0]
    assert q.dim() == 3 and q.stride(-1) == 1, "q: [rows, index heads, index dim], contiguous last dim"
    assert weights.dtype == torch.float32 and weights.shape == q.shape[:2] and weights.stride(-1) == 1, (
        "weights: fp32 [rows, index heads], contiguous last dim")
    assert keys.dim() == 2 and keys.stride(-1) == 1, "keys: [slots, index dim], contiguous last dim"
    assert keys.shape[1] == q.shape[2], f"index keys of {keys.shape[1]} values do not fit queries of {q.shape[2]}"
    if key_scales is None:
        assert keys.dtype == q.dtype, "q and the index keys must share a dtype (or the keys be fp8 with scales)"
    else:
        assert keys.dtype == torch.float8_e4m3fn and key_scales.dtype == torch.float32, (
            "scaled index keys: float8_e4m3fn values with fp32 scales")
        assert key_scales.shape == keys.shape[:1], "key_scales: fp32 [slots], one per index key"
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert row_end.dtype == torch.int32 and row_end.shape == (rows,) and row_end.is_contiguous()
    if row_seq is None:
        assert block_tables.shape[0] == rows, "without row_seq, row t reads block table row t"
    else:
        assert row_seq.dtype == torch.int32 and row_seq.shape == (rows,) and row_seq.is_contiguous()


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
                 block_tables: torch.Tensor, row_end: torch.Tensor, block_size: int, scale: float,
                 max_context_len: int, row_seq: torch.Tensor | None = None, block_n: int = BLOCK_N) -> torch.Tensor:
    """fp32 [rows, max_context_len] index scores of q [rows, heads, index_dim] (weights fp32 [rows, heads]) against
    the index keys (``keys`` [slots, index_dim], fp8 ones times ``key_scales`` [slots]) of each row's sequence (block
    table row ``row_seq[t]``, or t when None; ``block_size`` slots per block), keys [0, row_end[t]) scored and the
    rest -inf. max_context_len (host int) bounds row_end."""
    _check(q, weights, keys, key_scales, block_tables, row_end, row_seq)
    rows, heads, dim = q.shape
    cols = max(1, max_context_len)
    scores = torch.empty((rows, cols), dtype=torch.float32, device=q.device)
    if rows == 0:
        return scores
    upcast, dot_precision = dot_flags(q.dtype)
    _index_score_kernel[(rows, triton.cdiv(cols, block_n))](
        q,
        weights,
        keys,
        keys if key_scales is None else key_scales,
        block_tables,
        row_end if row_seq is None else row_seq,
        row_end,
        scores,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        keys.stride(0),
        0 if key_scales is None else key_scales.stride(0),
        block_tables.stride(0),
        scores.stride(0),
        scale,
        block_size,
        cols,
        HEADS=heads,
        DIM=dim,
        BLOCK_HI=max(16, triton.next_power_of_2(heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=block_n,
        HAS_SEQ=row_seq is not None,
        HAS_SCALE=key_scales is not None,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision,
        num_warps=4,
    )
    return scores


def index_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
               block_tables: torch.Tensor, row_end: torch.Tensor, block_size: int, scale: float, topk: int,
               max_context_len: int, row_seq: torch.Tensor | None = None, max_rows: int | None = None,
               block_n: int = BLOCK_N) -> torch.Tensor:
    """int32 [rows, min(topk, max_context_len)]: the key positions of each row's top ``topk`` index scores
    (`index_scores`), in no particular order; -1 where the row has fewer visible keys. ``max_rows`` overrides the
    rows scored per chunk (tests); by default a chunk's score buffer stays under SCORE_BYTES."""
    assert topk > 0, f"topk={topk} must be positive"
    cols = max(1, max_context_len)
    width = min(topk, cols)
    out = torch.empty((q.shape[0], width), dtype=torch.int32, device=q.device)
    chunk = max_rows or max(1, SCORE_BYTES // (4 * cols))
    for r0 in range(0, q.shape[0], chunk):
        r1 = min(q.shape[0], r0 + chunk)
        tables = block_tables if row_seq is not None else block_tables[r0:r1]
        seq = None if row_seq is None else row_seq[r0:r1]
        scores = index_scores(q[r0:r1], weights[r0:r1], keys, key_scales, tables, row_end[r0:r1], block_size,
                              scale, cols, seq, block_n)
        vals, idx = scores.topk(width, dim=-1, sorted=False)
        out[r0:r1] = idx.masked_fill_(vals == float("-inf"), -1)
    return out


def prefill_rows(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, total: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_seq, row_end), int32 [total] each, of the query tokens of sequences delimited by cu_seqlens_q (int32
    [B+1], from 0): token t of sequence b at position ctx_b - q_len_b + i sees keys [0, ctx_b - q_len_b + i + 1).
    Device ops only (``total``, the number of tokens, is a host int): no sync."""
    t = torch.arange(total, dtype=torch.int32, device=cu_seqlens_q.device)
    seq = torch.searchsorted(cu_seqlens_q[1:], t, right=True, out_int32=True)
    end = context_lens[seq] - cu_seqlens_q[1:][seq] + t + 1
    return seq, end.to(torch.int32)


__all__ = ["SCORE_BYTES", "index_scores", "index_topk", "prefill_rows"]
