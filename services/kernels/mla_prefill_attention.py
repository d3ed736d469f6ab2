"""Paged multi-head latent attention (MLA) for prefill (extend) chunks: new query tokens attend causally to their
sequence's cached latents, in the absorbed form, read in place from the two planes of the paged cache.

Why this form: the chunk's latents are already in the pages (store_kv runs first), and the absorbed query meets
them directly, as the decode kernel does (`mla_decode_attention.py`, whose tile step this kernel shares) and as
the CPU engine computes: one shared key per token, so a program takes BLOCK_T tokens x BLOCK_H heads as the
M = BLOCK_T * BLOCK_H rows of its tiles and reads each latent once for all of them. The other choice, feeding
the per-head `prefill_attention` kernel an expanded view, needs per-head keys and values ([nope W_UK c_kv, k_pe]
and W_UV c_kv, 192 and 128 values per head for DeepSeek-V2) materialized for every cached token of the sequence
(the latent pages cannot be viewed as them), i.e. a copy of H x 320 values per key per layer written and read
back, plus the kernel's equal K/V widths. That form does fewer FLOPs per (query, key) pair (320 vs 1088 for
V2: 576 for the scores, 512 for the sum) and wins for long prompts; it is not built. For the chunks the engine
runs (up to a few thousand tokens) the absorbed kernel is exact, needs no scratch memory and no extra pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._triton_utils import dot_flags
from services.kernels.mla_decode_attention import _latent_columns, _latent_tile, check_latent_cache

LOG2E = 1.4426950408889634
#: Query heads per program (at most): with fewer heads the program takes more tokens (M = tokens x heads).
MAX_BLOCK_H = 16


@triton.jit
def _mla_prefill_kernel(
    Q_ptr,
    K_ptr,
    V_ptr,
    O_ptr,
    BT_ptr,
    CU_ptr,
    CL_ptr,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_btb,
    stride_ot,
    stride_oh,
    qk_scale_log2,
    block_size,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    KEY_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Row m of the tile is token i = pid * BLOCK_T + m // BLOCK_H of sequence b (position p_i = ctx_b - q_len_b + i)
    and head h = hg * BLOCK_H + m % BLOCK_H; with latent(b, n) = [K, V][BT[b, n // bs], n % bs, 0]:

        O[cu_b + i, h] = sum_{n <= p_i} softmax_n(scale * q[cu_b + i, h] . latent(b, n)[:KEY_DIM]) latent(b, n)[:VALUE_DIM]

    with an online softmax over BLOCK_N-key tiles and fp32 accumulation; the tile's keys end at its last token.
    """
    pid_t = tl.program_id(0)
    hg = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(CU_ptr + b)
    q_len = tl.load(CU_ptr + b + 1) - q_start
    ctx = tl.load(CL_ptr + b)
    prefix = ctx - q_len
    tile_start = pid_t * BLOCK_T

    offs_m = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = tile_start + offs_m // BLOCK_H
    heads = hg * BLOCK_H + offs_m % BLOCK_H
    mask_m = (tok < q_len) & (heads < NUM_HEADS)
    pos = prefix + tok
    rows = (q_start + tok).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = VALUE_DIM + tl.arange(0, BLOCK_R)
    mask_c = offs_c < VALUE_DIM
    mask_r = offs_r < KEY_DIM

    q_row = Q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_c[None, :], mask=mask_m[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_row + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    cols_c = _latent_columns(K_ptr, V_ptr, offs_c, HALF)
    cols_r = _latent_columns(K_ptr, V_ptr, offs_r, HALF)

    m_i = tl.full([BLOCK_T * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_C], dtype=tl.float32)

    bt_row = BT_ptr + b.to(tl.int64) * stride_btb
    end = tl.where(tile_start < q_len, tl.minimum(ctx, prefix + tile_start + BLOCK_T), 0)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        visible = (offs_n[None, :] <= pos[:, None]) & mask_n[None, :]
        acc, m_i, l_i = _latent_tile(
            q_c, q_r, acc, m_i, l_i, offs_n, mask_n, visible, bt_row, cols_c, cols_r, mask_c, mask_r,
            stride_cb, stride_ct, qk_scale_log2, block_size, UPCAST, DOT_PRECISION,
        )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = O_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_c[None, :]
    tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


def _tile_config(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(rows per program M, BLOCK_N, num_warps, num_stages): M x 512 fp32 accumulators stay in registers."""
    if dtype == torch.float32:
        return 16, 16, 4, 1
    return 32, 32, 8, 2


def mla_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    value_dim: int,
    max_seqlen_q: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Latent extend attention for q [total_new_tokens, H, key_dim] over the latent planes k_cache / v_cache
    [num_blocks, block_size, 1, half] -> out [total_new_tokens, H, value_dim] (q's dtype).

    cu_seqlens_q int32 [B+1] delimits each sequence's new tokens; context_lens int32 [B] counts all its tokens
    (prefix + new), all already in the cache. max_seqlen_q (host int) avoids a device sync; block_n overrides the
    key tile (tests).
    """
    check_latent_cache(q, k_cache, v_cache, value_dim)
    total, num_heads, key_dim = q.shape
    _, block_size, _, half = k_cache.shape
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.dim() == 1 and cu_seqlens_q.is_contiguous()
    bsz = cu_seqlens_q.shape[0] - 1
    assert context_lens.dtype == torch.int32 and context_lens.shape == (bsz,) and context_lens.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == bsz
    assert block_tables.stride(-1) == 1
    out = torch.empty((total, num_heads, value_dim), dtype=q.dtype, device=q.device)
    if total == 0 or bsz == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())

    rows, cfg_n, num_warps, num_stages = _tile_config(q.dtype)
    block_h = min(MAX_BLOCK_H, triton.next_power_of_2(num_heads))
    block_t = max(1, rows // block_h)
    block_n = block_n or cfg_n
    upcast, dot_precision = dot_flags(q.dtype)
    grid = (triton.cdiv(max(1, max_seqlen_q), block_t), triton.cdiv(num_heads, block_h), bsz)
    _mla_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_seqlens_q,
        context_lens,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        block_size,
        NUM_HEADS=num_heads,
        HALF=half,
        VALUE_DIM=value_dim,
        KEY_DIM=key_dim,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_C=max(16, triton.next_power_of_2(value_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(key_dim - value_dim)),
        BLOCK_N=block_n,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
