"""Scatter new tokens' K/V into the paged cache by slot index."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K_ptr,
    V_ptr,
    KC_ptr,
    VC_ptr,
    S_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """For token t with slot s = S[t] >= 0:  KC[s // bs, s % bs, h, d] = K[t, h, d]  (and VC from V)."""
    t = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # The slot is broadcast over the head axis so the skip test is an ordinary per-row mask.
    slot = tl.load(S_ptr + t + offs_h * 0).to(tl.int64)
    blk = slot[:, None] // block_size
    off = slot[:, None] % block_size
    mask = ((offs_h < NUM_KV_HEADS) & (slot >= 0))[:, None] & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(K_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = KC_ptr + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = VC_ptr + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v [T, kvh, hd] into k_cache/v_cache [num_blocks, bs, kvh, hd] at slot_mapping int64 [T].

    Token t goes to block slot // bs, offset slot % bs; slot -1 skips the token.
    """
    assert k.dim() == 3 and v.shape == k.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} must match"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    num_tokens, num_kv_heads, head_dim = k.shape
    _, block_size, kvh_cache, hd_cache = k_cache.shape
    assert (kvh_cache, hd_cache) == (num_kv_heads, head_dim), "cache heads/head_dim differ from k"
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, "k, v and caches must share a dtype"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v head_dim must be contiguous"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,)
    assert slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = triton.next_power_of_2(num_kv_heads)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )
