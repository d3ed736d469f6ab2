"""Paged multi-head latent attention (MLA, DeepSeek-V2/V3) for decode rows: one query token per sequence.

The paged cache holds one latent per token and layer, ``[c_kv (value_dim values), k_pe (rope values)]``, split
over the two planes of the engine's page (one KV "head" of ``half`` values per plane): latent value d sits in
the K plane at d < half and in the V plane at d - half otherwise. The kernels read it there in place, through a
per-program vector of column pointers (`_latent_columns`); nothing is gathered, joined or copied.

Each of the H query heads is a vector of key_dim = value_dim + rope values in the latent space (the absorbed
query ``[q_nope W_UK, q_pe]``); every head meets the same key per token (multi-query attention), whose first
value_dim values are also its value. One program owns one (sequence, group of BLOCK_H heads, context partition):
a tile of BLOCK_N latents is loaded once and feeds two tl.dots for all heads of the group, the scores
[BLOCK_H, BLOCK_N] and the weighted sum [BLOCK_H, value_dim], so each latent crosses from memory once per row
(DeepSeek-V2-Lite's 16 heads are one group; a model with more heads reads it once per 16 heads, from L2).
Partitions (flash-decoding) split long contexts when batch * head groups alone would leave most SMs idle; a
reduce kernel merges them. Launch sizes come from host values (the step's maximum context, or a fixed bound
while CUDA graphs are captured), never from the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._triton_utils import _mma, dot_flags
from services.kernels.paged_decode_attention import _partition_len, _spread

_MIN_PARTITION = 128
"""Fewest latent keys a split sequence's partition holds (the dense kernel's shorter ones are not measured here)."""

LOG2E = 1.4426950408889634
#: Query heads per program: the M side of both tl.dots (16 is tl.dot's smallest M).
BLOCK_H = 16


@triton.jit
def _latent_columns(K_ptr, V_ptr, offs, HALF: tl.constexpr):
    """Pointers to latent values ``offs`` of the cache's token (0, 0): the K plane below HALF, the V plane
    from HALF on; a token's latent is these plus its row offset (both planes share their strides)."""
    return tl.where(offs < HALF, K_ptr + offs, V_ptr + (offs - HALF))


@triton.jit
def _latent_tile(
    q_c,
    q_r,
    acc,
    m_i,
    l_i,
    offs_n,
    mask_n,
    visible,
    bt_row,
    cols_c,
    cols_r,
    mask_c,
    mask_r,
    stride_cb,
    stride_ct,
    qk_scale_log2,
    block_size,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One tile of keys ``offs_n`` (``mask_n``: they exist) of the online softmax, for M query rows:

        s = log2e * scale * (q_c . c_n + q_r . r_n)     c_n = latent[n, :value_dim], r_n = latent[n, value_dim:key_dim]
        m' = max(m, max_n s),  l' = 2^(m - m') l + sum_n 2^(s - m'),  acc' = 2^(m - m') acc + sum_n 2^(s - m') c_n

    over the (row, key) pairs ``visible`` [M, BLOCK_N] allows. The c tile is loaded once and serves both dots.
    A row that sees no key yet keeps m finite (0), so its exp2 terms are 0, not NaN."""
    blk = tl.load(bt_row + offs_n // block_size, mask=mask_n, other=0).to(tl.int64)
    rows = blk * stride_cb + (offs_n % block_size) * stride_ct
    c = tl.load(cols_c[None, :] + rows[:, None], mask=mask_n[:, None] & mask_c[None, :], other=0.0)
    r = tl.load(cols_r[None, :] + rows[:, None], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
    s = _mma(q_c, tl.trans(c), UPCAST, DOT_PRECISION) + _mma(q_r, tl.trans(r), UPCAST, DOT_PRECISION)
    s = tl.where(visible, s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mma(p.to(c.dtype), c, UPCAST, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _mla_decode_kernel(
    Q_ptr,
    K_ptr,
    V_ptr,
    BT_ptr,
    CL_ptr,
    O_ptr,
    Mpart_ptr,
    Lpart_ptr,
    Apart_ptr,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ab,
    stride_ah,
    stride_ap,
    qk_scale_log2,
    block_size,
    partition_size,
    spread,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    KEY_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_PART: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """For heads h in group hg and keys n in [part * P, min(ctx, (part + 1) * P)) (P: `_partition_len` of this
    sequence, paged_decode_attention.py), with
    latent(b, n) = [K, V][BT[b, n // bs], n % bs, 0] (the two planes joined):

        s[h, n] = scale * q[b, h, :KEY_DIM] . latent(b, n)[:KEY_DIM]
        m = max_n s,  l = sum_n 2^(log2e * (s - m)),  acc = sum_n 2^(log2e * (s - m)) latent(b, n)[:VALUE_DIM]

    Without SPLIT: O[b, h] = acc / l. With SPLIT: (m in log2 units, l, acc) per partition for
    `_mla_decode_reduce_kernel`. A sequence of no keys (a CUDA-graph padding row) writes zeros.
    """
    b = tl.program_id(0)
    hg = tl.program_id(1)
    part = tl.program_id(2)

    ctx = tl.load(CL_ptr + b)
    psize = _partition_len(ctx, partition_size, spread, BLOCK_N, MIN_PART)
    start = part * psize
    end = tl.minimum(ctx, start + psize)

    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < NUM_HEADS
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = VALUE_DIM + tl.arange(0, BLOCK_R)
    mask_c = offs_c < VALUE_DIM
    mask_r = offs_r < KEY_DIM

    q_row = Q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_row + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    cols_c = _latent_columns(K_ptr, V_ptr, offs_c, HALF)
    cols_r = _latent_columns(K_ptr, V_ptr, offs_r, HALF)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)

    bt_row = BT_ptr + b.to(tl.int64) * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        acc, m_i, l_i = _latent_tile(
            q_c, q_r, acc, m_i, l_i, offs_n, mask_n, mask_n[None, :], bt_row, cols_c, cols_r, mask_c, mask_r,
            stride_cb, stride_ct, qk_scale_log2, block_size, UPCAST, DOT_PRECISION,
        )  # fmt: skip

    if SPLIT:
        ml_off = b.to(tl.int64) * stride_mb + heads * stride_mh + part
        tl.store(Mpart_ptr + ml_off, m_i, mask=mask_h)
        tl.store(Lpart_ptr + ml_off, l_i, mask=mask_h)
        a_ptrs = (
            Apart_ptr
            + b.to(tl.int64) * stride_ab
            + heads[:, None] * stride_ah
            + part * stride_ap
            + offs_c[None, :]
        )
        tl.store(a_ptrs, acc, mask=mask_h[:, None] & mask_c[None, :])
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_ptrs = O_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
        tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])


@triton.jit
def _mla_decode_reduce_kernel(
    O_ptr,
    Mpart_ptr,
    Lpart_ptr,
    Apart_ptr,
    CL_ptr,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ab,
    stride_ah,
    stride_ap,
    partition_size,
    spread,
    VALUE_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    TILE: tl.constexpr,
    MIN_PART: tl.constexpr,
):
    """Merge partitions j < cdiv(ctx, P) of one (b, h):

    M = max_j m_j,  w_j = 2^(m_j - M),  O = sum_j w_j acc_j / sum_j w_j l_j

    (a loop over the partitions: a [partitions, value_dim] fp32 tile would not fit in registers)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(CL_ptr + b)
    num_parts = tl.cdiv(ctx, _partition_len(ctx, partition_size, spread, TILE, MIN_PART))

    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < num_parts
    ml_row = Mpart_ptr + b.to(tl.int64) * stride_mb + h * stride_mh
    m = tl.load(ml_row + offs_p, mask=mask_p, other=float("-inf"))
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(mask_p, tl.exp2(m - m_max), 0.0)
    l_row = Lpart_ptr + b.to(tl.int64) * stride_mb + h * stride_mh
    lsum = tl.sum(w * tl.load(l_row + offs_p, mask=mask_p, other=0.0), 0)

    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < VALUE_DIM
    a_row = Apart_ptr + b.to(tl.int64) * stride_ab + h * stride_ah + offs_c
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in range(0, num_parts):
        w_j = tl.exp2(tl.load(ml_row + j) - m_max)
        acc += w_j * tl.load(a_row + j * stride_ap, mask=mask_c, other=0.0)
    out = acc / tl.where(lsum > 0.0, lsum, 1.0)
    o_ptrs = O_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_c
    tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=mask_c)


def check_latent_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, value_dim: int) -> None:
    """The shape contract shared by the MLA kernels: q [.., H, key_dim] over a latent cache whose planes are
    [num_blocks, block_size, 1, half] with the same strides, value_dim < key_dim <= 2 * half."""
    assert q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    assert k_cache.shape[2] == 1, f"latent cache has one KV head per plane, got {k_cache.shape[2]}"
    key_dim, half = q.shape[-1], k_cache.shape[-1]
    assert 0 < value_dim < key_dim <= 2 * half, (
        f"need 0 < value_dim ({value_dim}) < key_dim ({key_dim}) <= 2 * plane width ({2 * half})"
    )
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q, k_cache and v_cache must share a dtype"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "the latent dimension must be contiguous"
    assert k_cache.stride() == v_cache.stride(), "the K and V planes must share their strides"


def mla_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    value_dim: int,
    max_context_len: int | None = None,
    partition_size: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Latent decode attention for q [B, H, key_dim] over the latent planes k_cache / v_cache
    [num_blocks, block_size, 1, half] -> out [B, H, value_dim] (q's dtype).

    The key of a token is the first key_dim values of its latent [K plane, V plane], the value its first value_dim.
    max_context_len: an upper bound on context_lens (host int, avoids a device sync; a fixed bound while CUDA graphs
    are captured); defaults to the block table capacity. partition_size / block_n override the split-K and tile
    choices (tests).
    """
    check_latent_cache(q, k_cache, v_cache, value_dim)
    bsz, num_heads, key_dim = q.shape
    _, block_size, _, half = k_cache.shape
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == bsz
    assert block_tables.stride(-1) == 1
    assert context_lens.dtype == torch.int32 and context_lens.shape == (bsz,) and context_lens.is_contiguous()
    out = torch.empty((bsz, num_heads, value_dim), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    max_context_len = max(1, max_context_len)

    groups = triton.cdiv(num_heads, BLOCK_H)
    block_c = max(16, triton.next_power_of_2(value_dim))
    block_r = max(16, triton.next_power_of_2(key_dim - value_dim))
    if block_n is None:
        block_n = 32 if q.dtype != torch.float32 else 16
    spread = 0
    if partition_size is None:  # partitions sized per sequence on the device, as paged_decode_attention's
        spread = _spread(bsz, groups, q.device)
        if spread <= 1:
            spread, partition_size, num_parts = 0, triton.cdiv(max_context_len, block_n) * block_n, 1
        else:
            partition_size, num_parts = 0, min(spread, triton.cdiv(max_context_len, _MIN_PARTITION))
    else:
        assert partition_size % block_n == 0, "partition_size must be a multiple of block_n"
        num_parts = triton.cdiv(max_context_len, partition_size)
    split = num_parts > 1
    upcast, dot_precision = dot_flags(q.dtype)

    if split:
        m_part = torch.empty((bsz, num_heads, num_parts), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        a_part = torch.empty((bsz, num_heads, num_parts, value_dim), dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = a_part = out  # unused placeholders
    _mla_decode_kernel[(bsz, groups, num_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        m_part,
        l_part,
        a_part,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        m_part.stride(0) if split else 0,
        m_part.stride(1) if split else 0,
        a_part.stride(0) if split else 0,
        a_part.stride(1) if split else 0,
        a_part.stride(2) if split else 0,
        scale * LOG2E,
        block_size,
        partition_size,
        max(spread, 1),
        NUM_HEADS=num_heads,
        HALF=half,
        VALUE_DIM=value_dim,
        KEY_DIM=key_dim,
        BLOCK_H=BLOCK_H,
        BLOCK_C=block_c,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        MIN_PART=_MIN_PARTITION,
        SPLIT=split,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision,
        num_warps=4,
        num_stages=2,
    )
    if split:
        _mla_decode_reduce_kernel[(bsz, num_heads)](
            out,
            m_part,
            l_part,
            a_part,
            context_lens,
            out.stride(0),
            out.stride(1),
            m_part.stride(0),
            m_part.stride(1),
            a_part.stride(0),
            a_part.stride(1),
            a_part.stride(2),
            partition_size,
            max(spread, 1),
            VALUE_DIM=value_dim,
            BLOCK_C=block_c,
            BLOCK_P=max(2, triton.next_power_of_2(num_parts)),
            TILE=block_n,
            MIN_PART=_MIN_PARTITION,
            num_warps=4,
        )
    return out
