"""Paged decode attention (one query token per sequence), GQA-aware, with optional split-K.

Each program owns one (sequence, kv head, context partition) and all G = num_heads / num_kv_heads
query heads of that kv head, so every K/V tile is read once per group. Partitions (flash-decoding)
are used when batch * kv_heads alone would leave most SMs idle; a reduce kernel merges them. A
partition's length comes from its own sequence's length on the device (the span over the partitions
the batch calls for, >= 128 keys), not from the host's bound: a CUDA graph captured with the longest
context as its bound splits a 1K-token context as an eager step does, and computes the same sums.

A sliding window (the query at position ctx - 1 sees keys k > ctx - 1 - window) starts the key range
at ctx - window: blocks wholly before it are never read, and partitions cover only the window.
Attention sinks add a virtual key per head with logit sink_h and a zero value to the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._triton_utils import _mma, dot_flags

LOG2E = 1.4426950408889634
_MIN_PARTITION = 32
"""Fewest keys a split sequence's partition holds. Few rows leave SMs idle, so short partitions win: replayed from
CUDA graphs on an H100 (`attention_sweep --sections few-rows`), one row over 1K tokens took 11.6 us in 32-key
partitions against 15.6 in 128-key ones (Qwen3-30B-A3B heads; Llama-3-8B 12.8 against 16.1), 4K tokens 15.8
against 18.1, four rows 15.6 against 17.1."""
_MAX_PARTITIONS = 32


@triton.jit
def _partition_len(span, partition_size, spread, BLOCK: tl.constexpr, MIN_PART: tl.constexpr):
    """Keys per partition of a sequence that sees ``span`` keys: ``partition_size`` when > 0 (fixed), else the
    span spread over ``spread`` partitions, in whole BLOCK tiles and at least MIN_PART keys. Computed from
    the sequence's own length on the device, so a CUDA graph captured for the longest context still splits a
    short one across the partitions its grid has (a fixed length would leave one program walking it alone)."""
    spread_len = tl.maximum(tl.cdiv(tl.cdiv(span, spread), BLOCK) * BLOCK, MIN_PART)
    return tl.where(partition_size > 0, partition_size, spread_len)


@triton.jit
def _paged_decode_attention_kernel(
    Q_ptr,
    K_ptr,
    V_ptr,
    BT_ptr,
    CL_ptr,
    O_ptr,
    Mpart_ptr,
    Lpart_ptr,
    Apart_ptr,
    Sinks_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
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
    window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    MIN_PART: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """For heads h = kvh * G + g, keys n in [lo + part * P, min(ctx, lo + (part + 1) * P)), where
    lo = max(0, ctx - window) with a window (window > 0), else 0, and P is `_partition_len` of this sequence:

        s[g, n] = scale * q[b, h] . K[page(b, n), n % bs, kvh]          page(b, n) = BT[b, n // bs]
        m = max_n s,  l = sum_n 2^(log2e * (s - m)),  acc = sum_n 2^(log2e * (s - m)) V[page, n % bs, kvh]

    computed with an online softmax over BLOCK-token tiles. Without SPLIT: O = acc / l, where with
    HAS_SINKS l also counts 2^(log2e * sink_h - m) (m rebased to cover the sink). With SPLIT:
    (m in log2 units, l, acc) are written per partition for `_paged_decode_reduce_kernel`.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)

    ctx = tl.load(CL_ptr + b)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    psize = _partition_len(ctx - lo, partition_size, spread, BLOCK, MIN_PART)
    start = lo + part * psize
    end = tl.minimum(ctx, start + psize)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g

    q_ptrs = Q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    bt_row = BT_ptr + b.to(tl.int64) * stride_btb
    for n0 in range(start, end, BLOCK):
        offs_n = n0 + tl.arange(0, BLOCK)
        mask_n = offs_n < end
        blk = tl.load(bt_row + offs_n // block_size, mask=mask_n, other=0).to(tl.int64)
        tok = offs_n % block_size
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_ptrs = (
            K_ptr + blk[:, None] * stride_kb + tok[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        )
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        s = _mma(q, tl.trans(k), UPCAST, DOT_PRECISION) * qk_scale_log2
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = (
            V_ptr + blk[:, None] * stride_vb + tok[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
        )
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, UPCAST, DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        ml_off = b.to(tl.int64) * stride_mb + heads * stride_mh + part
        tl.store(Mpart_ptr + ml_off, m_i, mask=mask_g)
        tl.store(Lpart_ptr + ml_off, l_i, mask=mask_g)
        a_ptrs = (
            Apart_ptr
            + b.to(tl.int64) * stride_ab
            + heads[:, None] * stride_ah
            + part * stride_ap
            + offs_d[None, :]
        )
        tl.store(a_ptrs, acc, mask=mask_g[:, None] & mask_d[None, :])
    else:
        if HAS_SINKS:
            sink = tl.load(Sinks_ptr + heads, mask=mask_g, other=0.0) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            rescale = tl.exp2(m_i - m_fin)
            l_i = l_i * rescale + tl.exp2(sink - m_fin)
            acc = acc * rescale[:, None]
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_ptrs = O_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _paged_decode_reduce_kernel(
    O_ptr,
    Mpart_ptr,
    Lpart_ptr,
    Apart_ptr,
    CL_ptr,
    Sinks_ptr,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ab,
    stride_ah,
    stride_ap,
    partition_size,
    spread,
    window,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    MIN_PART: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Merge partitions j < cdiv(ctx - lo, P) of one (b, h) (lo as in the attention kernel):

    M = max_j m_j (and log2e * sink_h with HAS_SINKS),  w_j = 2^(m_j - M),
    O = sum_j w_j acc_j / (sum_j w_j l_j + [HAS_SINKS] 2^(log2e * sink_h - M))
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(CL_ptr + b)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    num_parts = tl.cdiv(ctx - lo, _partition_len(ctx - lo, partition_size, spread, TILE, MIN_PART))

    offs_p = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_p = offs_p < num_parts
    mask_d = offs_d < HEAD_DIM
    ml_off = b.to(tl.int64) * stride_mb + h * stride_mh + offs_p
    m = tl.load(Mpart_ptr + ml_off, mask=mask_p, other=float("-inf"))
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks_ptr + h) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(mask_p, tl.exp2(m - m_max), 0.0)
    lsum = tl.sum(w * tl.load(Lpart_ptr + ml_off, mask=mask_p, other=0.0), 0)
    if HAS_SINKS:
        lsum += tl.exp2(sink - m_max)
    a_ptrs = (
        Apart_ptr + b.to(tl.int64) * stride_ab + h * stride_ah + offs_p[:, None] * stride_ap + offs_d[None, :]
    )
    a = tl.load(a_ptrs, mask=mask_p[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(w[:, None] * a, 0) / tl.where(lsum > 0.0, lsum, 1.0)
    o_ptrs = O_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=mask_d)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _spread(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Partitions per sequence that bring batch x kv heads programs to about two per SM (1: no split)."""
    return min(_MAX_PARTITIONS, triton.cdiv(2 * _num_sms(device), max(1, batch * num_kv_heads)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    partition_size: int | None = None,
    block_n: int | None = None,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Decode attention for q [B, num_heads, hd] over paged K/V -> out [B, num_heads, hd] (q's dtype).

    max_context_len: an upper bound on context_lens (host int, avoids a device sync); defaults to the
    block table capacity. partition_size / block_n / num_warps / num_stages override the split-K and tile
    choices (tests, benchmarks).
    window: 0 for full attention, else the query at position p sees key k iff 0 <= p - k < window.
    sinks: fp32 [num_heads] logits of a virtual zero-value key per head, or None.
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    bsz, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, hd_cache = k_cache.shape
    assert hd_cache == head_dim, f"head_dim mismatch: q {head_dim}, cache {hd_cache}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} % num_kv_heads {num_kv_heads} != 0"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q, k_cache and v_cache must share a dtype"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, (
        "head_dim must be contiguous"
    )
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == bsz
    assert block_tables.stride(-1) == 1
    assert context_lens.dtype == torch.int32 and context_lens.shape == (bsz,) and context_lens.is_contiguous()
    assert window >= 0, f"window must be >= 0 (0 = full attention), got {window}"
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.shape == (num_heads,) and sinks.is_contiguous(), (
            f"sinks must be contiguous float32 [{num_heads}], got {sinks.dtype} {tuple(sinks.shape)}"
        )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if bsz == 0:
        return out
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    max_context_len = max(1, max_context_len)
    span = min(max_context_len, window) if window > 0 else max_context_len  # keys one query can see

    group = num_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_n is None:
        # 32-token tiles where the batch alone leaves SMs idle (the launches that split long contexts), else 64.
        # H100 sweep (benchmarks/attention_sweep.py, Llama-3-8B heads, bf16): batch 16 at 2K contexts 68.6 against
        # 119-142 us with 64-token tiles, batch 1 38.8 against 46-50 us; batch >= 64 even. Chosen by the batch, not
        # by the context bound, so a CUDA graph (captured with a long bound) and an eager step pick the same tile.
        few = bsz * num_kv_heads < 2 * _num_sms(q.device)
        block_n = 32 if q.dtype == torch.float32 or few else 64
    spread = 0
    if partition_size is None:
        # Split each sequence over `spread` partitions (sized on the device from its own length, _partition_len)
        # where the batch alone leaves SMs idle; the grid holds as many as the bound on the span can fill.
        spread = _spread(bsz, num_kv_heads, q.device)
        if spread <= 1:
            spread, partition_size = 0, triton.cdiv(span, block_n) * block_n
            num_parts = 1
        else:
            partition_size = 0
            num_parts = min(spread, triton.cdiv(span, _MIN_PARTITION))
    else:
        assert partition_size % block_n == 0, "partition_size must be a multiple of block_n"
        num_parts = triton.cdiv(span, partition_size)
    split = num_parts > 1
    upcast, dot_precision = dot_flags(q.dtype)

    if split:
        m_part = torch.empty((bsz, num_heads, num_parts), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        a_part = torch.empty((bsz, num_heads, num_parts, head_dim), dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = a_part = out  # unused placeholders
    sinks_arg = sinks if sinks is not None else out  # placeholder when HAS_SINKS is false
    grid = (bsz, num_kv_heads, num_parts)
    _paged_decode_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        m_part,
        l_part,
        a_part,
        sinks_arg,
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
        m_part.stride(0) if split else 0,
        m_part.stride(1) if split else 0,
        a_part.stride(0) if split else 0,
        a_part.stride(1) if split else 0,
        a_part.stride(2) if split else 0,
        scale * LOG2E,
        block_size,
        partition_size,
        max(spread, 1),
        window,
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK=block_n,
        MIN_PART=_MIN_PARTITION,
        SPLIT=split,
        HAS_SINKS=sinks is not None,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _paged_decode_reduce_kernel[(bsz, num_heads)](
            out,
            m_part,
            l_part,
            a_part,
            context_lens,
            sinks_arg,
            out.stride(0),
            out.stride(1),
            m_part.stride(0),
            m_part.stride(1),
            a_part.stride(0),
            a_part.stride(1),
            a_part.stride(2),
            partition_size,
            max(spread, 1),
            window,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK=max(2, triton.next_power_of_2(num_parts)),
            TILE=block_n,
            MIN_PART=_MIN_PARTITION,
            HAS_SINKS=sinks is not None,
            num_warps=4,
        )
    return out
