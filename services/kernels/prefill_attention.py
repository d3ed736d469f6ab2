"""Prefill (extend) attention: new query tokens attend causally to their sequence's paged KV.

The new tokens' K/V are already in the pages (store_kv runs first), so every key is read from the
paged cache. One program per (BLOCK_M query tile, query head, sequence); key tiles strictly below
the tile's first query position (and, with a sliding window, inside every row's window) need no mask
and run in a separate, mask-free loop. With a window, key tiles before the first row's window are
never read. Attention sinks add a virtual key per head with logit sink_h and a zero value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._triton_utils import _mma, dot_flags

LOG2E = 1.4426950408889634
#: Window passed for full attention: larger than any context, so the window masks never bite.
_FULL_WINDOW = 1 << 30


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    n0,
    offs_pos,
    ctx,
    window,
    bt_row,
    K_ptr,
    V_ptr,
    k_off,
    v_off,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale_log2,
    block_size,
    offs_d,
    mask_d,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_N key tile of the online softmax; MASKED adds the causal, window and context-end masks
    (a row may see no key of a masked tile: its max stays -inf and the tile adds nothing)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tok = offs_n % block_size
    if MASKED:
        mask_n = offs_n < ctx
        kv_mask = mask_n[:, None] & mask_d[None, :]
        blk = tl.load(bt_row + offs_n // block_size, mask=mask_n, other=0).to(tl.int64)
    else:
        kv_mask = mask_d[None, :]
        blk = tl.load(bt_row + offs_n // block_size).to(tl.int64)
    k = tl.load(
        K_ptr + blk[:, None] * stride_kb + tok[:, None] * stride_kt + k_off + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    s = _mma(q, tl.trans(k), UPCAST, DOT_PRECISION) * qk_scale_log2
    if MASKED:
        dist = offs_pos[:, None] - offs_n[None, :]
        visible = (dist >= 0) & (dist < window) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2 finite (0, not NaN)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        V_ptr + blk[:, None] * stride_vb + tok[:, None] * stride_vt + v_off + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, UPCAST, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_attention_kernel(
    Q_ptr,
    K_ptr,
    V_ptr,
    O_ptr,
    BT_ptr,
    CU_ptr,
    CL_ptr,
    Sinks_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_ot,
    stride_oh,
    qk_scale_log2,
    block_size,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
):
    """For query i of sequence b at position p_i = ctx_b - q_len_b + i and head h (kv head h // G):

        O[cu_b + i, h] = sum_{n <= p_i} softmax_n(scale * q . K[page(b, n), n % bs, h // G]) V[page(b, n), n % bs, h // G]

    with page(b, n) = BT[b, n // bs], an online softmax over BLOCK_N key tiles and fp32 accumulation;
    the sum runs over p_i - window < n <= p_i (window: the launcher passes 2^30 for full attention), and
    with HAS_SINKS the softmax denominator also counts exp(sink_h - max).
    """
    pid_m = tl.program_id(0)
    if HEAVY_FIRST:  # the last query tiles see the most keys: start them first, the short ones fill the tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(CU_ptr + b)
    q_len = tl.load(CU_ptr + b + 1) - q_start
    ctx = tl.load(CL_ptr + b)
    prefix = ctx - q_len
    tile_start = pid_m * BLOCK_M
    tile_valid = tile_start < q_len

    offs_m = tile_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    offs_pos = prefix + offs_m
    rows = (q_start + offs_m).to(tl.int64)

    q = tl.load(
        Q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    bt_row = BT_ptr + b.to(tl.int64) * stride_btb
    kvh = h // GROUP
    k_off = kvh * stride_kh
    v_off = kvh * stride_vh
    # Keys in [mid_lo, full_end) are visible to every row of the tile: below its first query position
    # and inside its last row's window. Keys in [win_lo, mid_lo) are inside only some rows' windows;
    # keys before win_lo are outside every row's window and never read.
    first_pos = prefix + tile_start
    last_pos = first_pos + BLOCK_M - 1
    full_end = tl.where(tile_valid, first_pos // BLOCK_N * BLOCK_N, 0)
    causal_end = tl.where(tile_valid, tl.minimum(ctx, first_pos + BLOCK_M), 0)
    win_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    mid_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N, win_lo),
                        full_end)
    win_lo = tl.minimum(win_lo, mid_lo)
    for n0 in range(win_lo, mid_lo, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, offs_pos, ctx, window, bt_row, K_ptr, V_ptr, k_off, v_off, stride_kb,
            stride_kt, stride_vb, stride_vt, qk_scale_log2, block_size, offs_d, mask_d,
            True, BLOCK_N, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(mid_lo, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, offs_pos, ctx, window, bt_row, K_ptr, V_ptr, k_off, v_off, stride_kb,
            stride_kt, stride_vb, stride_vt, qk_scale_log2, block_size, offs_d, mask_d,
            False, BLOCK_N, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, offs_pos, ctx, window, bt_row, K_ptr, V_ptr, k_off, v_off, stride_kb,
            stride_kt, stride_vb, stride_vt, qk_scale_log2, block_size, offs_d, mask_d,
            True, BLOCK_N, UPCAST, DOT_PRECISION,
        )  # fmt: skip

    if HAS_SINKS:
        sink = tl.load(Sinks_ptr + h) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        rescale = tl.exp2(m_i - m_fin)
        l_i = l_i * rescale + tl.exp2(sink - m_fin)
        acc = acc * rescale[:, None]
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = O_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _tile_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for Hopper-class GPUs."""
    if dtype == torch.float32:
        return 64, 32, 4, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    # H100, head_dim 128, bf16 (benchmarks/attention_sweep.py): 3 stages 14% faster than 2 at 8192 tokens; the
    # best of 13 tile configs on every case but one (128 x 128 after a 6144-token prefix: 3% faster).
    return 128, 64, 8, 3


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heavy_first: bool = True,
) -> torch.Tensor:
    """Extend attention for q [total_new_tokens, num_heads, hd] -> out of the same shape and dtype.

    cu_seqlens_q int32 [B+1] delimits each sequence's new tokens; context_lens int32 [B] counts all its
    tokens (prefix + new), all already in the paged cache. max_seqlen_q (host int) avoids a device sync.
    block_m / block_n / num_warps / num_stages override the tile config (tests, benchmarks); heavy_first
    launches each sequence's query tiles last-first (most keys first).
    window: 0 for full attention, else the query at position p sees key k iff 0 <= p - k < window.
    sinks: fp32 [num_heads] logits of a virtual zero-value key per head, or None.
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    total, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, hd_cache = k_cache.shape
    assert hd_cache == head_dim, f"head_dim mismatch: q {head_dim}, cache {hd_cache}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} % num_kv_heads {num_kv_heads} != 0"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q, k_cache and v_cache must share a dtype"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, (
        "head_dim must be contiguous"
    )
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.dim() == 1 and cu_seqlens_q.is_contiguous()
    bsz = cu_seqlens_q.shape[0] - 1
    assert context_lens.dtype == torch.int32 and context_lens.shape == (bsz,) and context_lens.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == bsz
    assert block_tables.stride(-1) == 1
    assert window >= 0, f"window must be >= 0 (0 = full attention), got {window}"
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.shape == (num_heads,) and sinks.is_contiguous(), (
            f"sinks must be contiguous float32 [{num_heads}], got {sinks.dtype} {tuple(sinks.shape)}"
        )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if total == 0 or bsz == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())

    cfg_m, cfg_n, cfg_warps, cfg_stages = _tile_config(q.dtype, head_dim)
    block_m = block_m or cfg_m
    block_n = block_n or cfg_n
    num_warps = num_warps or cfg_warps
    num_stages = num_stages or cfg_stages
    upcast, dot_precision = dot_flags(q.dtype)
    grid = (triton.cdiv(max(1, max_seqlen_q), block_m), num_heads, bsz)
    _prefill_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_seqlens_q,
        context_lens,
        sinks if sinks is not None else out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        block_size,
        window if window > 0 else _FULL_WINDOW,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_SINKS=sinks is not None,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision,
        HEAVY_FIRST=heavy_first,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
