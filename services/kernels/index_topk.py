"""DeepSeek-V3.2's top-k key selection (the lightning indexer's scores) over the paged latent cache, on the device.

Each layer caches an index key of ``index_dim`` values per token right after its latent, in the same two planes
(`mla_decode_attention.py`: value d of a token's cached values sits in the K plane below ``half``, in the V plane
from there on). A query row t of the step sees keys [0, end_t) of its sequence (decode: its context; a prefill
token: the keys up to its own position) and scores each

    score[t, k] = sum_h w[t, h] * relu(scale * q[t, h] . index_key[k])

One program owns one (row, BLOCK_N keys): its index query [heads, index_dim] meets the tile of keys in one tl.dot
and the head-weighted sum reduces it to BLOCK_N scores; keys past end_t (and past the tile of a padding row) get
-inf. The selection is torch.topk over the [rows, max_context] fp32 buffer, on the device. Every size comes from
host values (the step's longest context, or a fixed bound while CUDA graphs are captured), so a decode step is
graph-safe: no host sync, no size read from the device. Rows are scored in chunks whose score buffer stays under
SCORE_BYTES, so a long prefill chunk at a long context does not allocate rows x context at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._triton_utils import _mma, dot_flags
from services.kernels.mla_decode_attention import _latent_columns

SCORE_BYTES = 1 << 28
"""Largest fp32 score buffer one chunk of rows allocates (256 MiB: 512 decode rows at 128K keys)."""
#: Keys per program (the N side of the score tl.dot).
BLOCK_N = 64


@triton.jit
def _index_score_kernel(
    Q_ptr,
    W_ptr,
    K_ptr,
    V_ptr,
    BT_ptr,
    SEQ_ptr,
    END_ptr,
    S_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_cb,
    stride_ct,
    stride_btb,
    stride_st,
    scale,
    block_size,
    num_cols,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    KEY_START: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """For row t (sequence b = SEQ[t], or t itself without HAS_SEQ) and keys n of tile j, with
    key(b, n) = [K, V][BT[b, n // bs], n % bs, 0][KEY_START:KEY_START + DIM] (the two planes joined):

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
        rows = blk.to(tl.int64) * stride_cb + (offs_n % block_size) * stride_ct
        cols = _latent_columns(K_ptr, V_ptr, KEY_START + offs_d, HALF)
        k = tl.load(cols[None, :] + rows[:, None], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        s = tl.maximum(_mma(q, tl.trans(k), UPCAST, DOT_PRECISION) * scale, 0.0)  # [BLOCK_HI, BLOCK_N]
        total = tl.where(mask_n, tl.sum(s * w[:, None], 0), float("-inf"))
    tl.store(S_ptr + t.to(tl.int64) * stride_st + offs_n, total, mask=offs_n < num_cols)


def _check(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, row_end: torch.Tensor, key_start: int, row_seq: torch.Tensor | None) -> None:
    """The shape contract of the score kernel (index keys at [key_start, key_start + index_dim) of the planes)."""
    rows = q.shape[0]
    assert q.dim() == 3 and q.stride(-1) == 1, "q: [rows, index heads, index dim], contiguous last dim"
    assert weights.dtype == torch.float32 and weights.shape == q.shape[:2] and weights.stride(-1) == 1, (
        "weights: fp32 [rows, index heads], contiguous last dim")
    assert k_cache.dim() == 4 and k_cache.shape[2] == 1 and v_cache.shape == k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "the planes must share their strides"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the cache must share a dtype"
    assert 0 < key_start and key_start + q.shape[2] <= 2 * k_cache.shape[-1], (
        f"index keys [{key_start}, {key_start + q.shape[2]}) do not fit the cached {2 * k_cache.shape[-1]} values")
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert row_end.dtype == torch.int32 and row_end.shape == (rows,) and row_end.is_contiguous()
    if row_seq is None:
        assert block_tables.shape[0] == rows, "without row_seq, row t reads block table row t"
    else:
        assert row_seq.dtype == torch.int32 and row_seq.shape == (rows,) and row_seq.is_contiguous()


def index_scores(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, row_end: torch.Tensor, key_start: int, scale: float,
                 max_context_len: int, row_seq: torch.Tensor | None = None, block_n: int = BLOCK_N) -> torch.Tensor:
    """fp32 [rows, max_context_len] index scores of q [rows, heads, index_dim] (weights fp32 [rows, heads]) against
    the index keys of each row's sequence (block table row ``row_seq[t]``, or t when None), keys [0, row_end[t])
    scored and the rest -inf. max_context_len (host int) bounds row_end."""
    _check(q, weights, k_cache, v_cache, block_tables, row_end, key_start, row_seq)
    rows, heads, dim = q.shape
    cols = max(1, max_context_len)
    scores = torch.empty((rows, cols), dtype=torch.float32, device=q.device)
    if rows == 0:
        return scores
    upcast, dot_precision = dot_flags(q.dtype)
    _index_score_kernel[(rows, triton.cdiv(cols, block_n))](
        q,
        weights,
        k_cache,
        v_cache,
        block_tables,
        row_end if row_seq is None else row_seq,
        row_end,
        scores,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        scores.stride(0),
        scale,
        k_cache.shape[1],
        cols,
        HEADS=heads,
        DIM=dim,
        KEY_START=key_start,
        HALF=k_cache.shape[-1],
        BLOCK_HI=max(16, triton.next_power_of_2(heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=block_n,
        HAS_SEQ=row_seq is not None,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision,
        num_warps=4,
    )
    return scores


def index_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, row_end: torch.Tensor, key_start: int, scale: float, topk: int,
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
        scores = index_scores(q[r0:r1], weights[r0:r1], k_cache, v_cache, tables, row_end[r0:r1], key_start, scale,
                              cols, seq, block_n)
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
