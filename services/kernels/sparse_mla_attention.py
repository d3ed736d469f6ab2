"""Sparse multi-head latent attention (DeepSeek-V3.2): each query row attends only to its selected cached latents.

The selection is `index_topk.index_topk`'s: per row, up to topk key positions of its sequence (-1: none). The
latents are read in place from the two planes of the paged cache, through the block table, by the tile step of
the dense latent kernels (`mla_decode_attention._latent_tile`): the key is the first key_dim values of a
token's latent (c_kv then k_pe; the index key after them is not attended), the value its first value_dim. One
program owns one (row, group of BLOCK_H heads) and walks its selected keys in tiles of BLOCK_N positions, so
decode rows and prefill tokens take the same kernel; the row's sequence is the row itself (decode) or
``row_seq[t]`` (prefill tokens). A row whose keys are all -1 (a CUDA-graph padding row) writes zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._triton_utils import dot_flags
from services.kernels.mla_decode_attention import (
    BLOCK_H,
    LOG2E,
    _latent_columns,
    _latent_tile,
    check_latent_cache,
)


@triton.jit
def _sparse_mla_kernel(
    Q_ptr,
    K_ptr,
    V_ptr,
    BT_ptr,
    SEQ_ptr,
    IDX_ptr,
    O_ptr,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_btb,
    stride_it,
    stride_ot,
    stride_oh,
    qk_scale_log2,
    block_size,
    width,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    KEY_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """For row t (sequence b = SEQ[t], or t without HAS_SEQ), heads h of group hg and the selected keys
    N_t = {IDX[t, j] : j < width, IDX[t, j] >= 0}, with latent(b, n) = [K, V][BT[b, n // bs], n % bs, 0]:

        O[t, h] = sum_{n in N_t} softmax_n(scale * Q[t, h] . latent(b, n)[:KEY_DIM]) latent(b, n)[:VALUE_DIM]

    (online softmax over tiles of BLOCK_N selected positions, fp32 accumulation; O = 0 when N_t is empty)."""
    t = tl.program_id(0)
    hg = tl.program_id(1)
    if HAS_SEQ:
        b = tl.load(SEQ_ptr + t)
    else:
        b = t

    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < NUM_HEADS
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = VALUE_DIM + tl.arange(0, BLOCK_R)
    mask_c = offs_c < VALUE_DIM
    mask_r = offs_r < KEY_DIM

    q_row = Q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_row + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    cols_c = _latent_columns(K_ptr, V_ptr, offs_c, HALF)
    cols_r = _latent_columns(K_ptr, V_ptr, offs_r, HALF)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)

    bt_row = BT_ptr + b.to(tl.int64) * stride_btb
    idx_row = IDX_ptr + t.to(tl.int64) * stride_it
    for j0 in range(0, width, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        keys = tl.load(idx_row + offs_j, mask=offs_j < width, other=-1)
        mask_n = keys >= 0
        acc, m_i, l_i = _latent_tile(
            q_c, q_r, acc, m_i, l_i, keys, mask_n, mask_n[None, :], bt_row, cols_c, cols_r, mask_c, mask_r,
            stride_cb, stride_ct, qk_scale_log2, block_size, UPCAST, DOT_PRECISION,
        )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = O_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_c[None, :]
    tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])


def sparse_mla_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    topk_indices: torch.Tensor,
    scale: float,
    value_dim: int,
    row_seq: torch.Tensor | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Latent attention of q [rows, H, key_dim] over the selected latents of each row -> out [rows, H, value_dim]
    (q's dtype). topk_indices int32 [rows, K]: key positions in the row's sequence (-1: no key), as
    `index_topk.index_topk` returns them; the row's sequence is block table row ``row_seq[t]`` (int32 [rows]), or
    row t when None (decode rows). block_n overrides the key tile (tests)."""
    check_latent_cache(q, k_cache, v_cache, value_dim)
    rows, num_heads, key_dim = q.shape
    _, block_size, _, half = k_cache.shape
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.stride(-1) == 1
    assert topk_indices.dtype == torch.int32 and topk_indices.dim() == 2 and topk_indices.shape[0] == rows
    assert topk_indices.stride(-1) == 1, "topk_indices: contiguous rows"
    if row_seq is None:
        assert block_tables.shape[0] == rows, "without row_seq, row t reads block table row t"
    else:
        assert row_seq.dtype == torch.int32 and row_seq.shape == (rows,) and row_seq.is_contiguous()
    out = torch.empty((rows, num_heads, value_dim), dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    if block_n is None:
        block_n = 32 if q.dtype != torch.float32 else 16
    upcast, dot_precision = dot_flags(q.dtype)
    _sparse_mla_kernel[(rows, triton.cdiv(num_heads, BLOCK_H))](
        q,
        k_cache,
        v_cache,
        block_tables,
        topk_indices if row_seq is None else row_seq,
        topk_indices,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        topk_indices.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        block_size,
        topk_indices.shape[1],
        NUM_HEADS=num_heads,
        HALF=half,
        VALUE_DIM=value_dim,
        KEY_DIM=key_dim,
        BLOCK_H=BLOCK_H,
        BLOCK_C=max(16, triton.next_power_of_2(value_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(key_dim - value_dim)),
        BLOCK_N=block_n,
        HAS_SEQ=row_seq is not None,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision,
        num_warps=4,
        num_stages=2,
    )
    return out


__all__ = ["sparse_mla_attention"]
