"""Rotary position embedding (neox / HF rotate_half layout) applied to q and k in place, optionally after a per-head
RMSNorm of each (Qwen3's q_norm / k_norm): one launch for what torch does in a dozen. Optionally the same launch
writes the rotated k and the v rows into the paged K/V cache at each token's slot (what ``store_kv`` does next
otherwise: one launch per layer fewer)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X_ptr, stride_h, NUM_HEADS: tl.constexpr, offs_h, offs_d, dmask, c, s, HALF: tl.constexpr,
                  W_ptr, eps, NORM: tl.constexpr):
    """In place, for the first NUM_HEADS heads of one token's rows at X_ptr (head stride ``stride_h``):
    x1' = x1 * c - x2 * s, x2' = x2 * c + x1 * s in fp32, stored back in x's dtype. With NORM, each head is first
    RMS-normed over its 2 * HALF values with weight W (fp32 math, rounded to x's dtype after the scaling and after
    the weight, as HF's RMSNorm), and rotated from those rounded values."""
    mask = (offs_h < NUM_HEADS)[:, None] & dmask[None, :]
    x1p = X_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(x1p, mask=mask, other=0.0)
    x2 = tl.load(x1p + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W_ptr + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        x1f = ((x1f * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        x2f = ((x2f * rstd).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    y1 = (x1f * c - x2f * s).to(x1.dtype)
    y2 = (x2f * c + x1f * s).to(x1.dtype)
    tl.store(x1p, y1, mask=mask)
    tl.store(x1p + HALF, y2, mask=mask)
    return y1, y2, mask


@triton.jit
def _token_cos_sin(P_ptr, COS_ptr, SIN_ptr, stride_cos, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """(t, offs_d, dmask, c, s) of this program's token t at position p = P[t]: c = COS[p, :HALF] and
    s = SIN[p, :HALF] as [1, BLOCK_D] fp32 rows (masked past HALF)."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(P_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HALF
    c = tl.load(COS_ptr + p * stride_cos + offs_d, mask=dmask, other=0.0)[None, :]
    s = tl.load(SIN_ptr + p * stride_cos + offs_d, mask=dmask, other=0.0)[None, :]
    return t, offs_d, dmask, c, s


@triton.jit
def _rotary_kernel(
    Q_ptr,
    K_ptr,
    P_ptr,
    COS_ptr,
    SIN_ptr,
    QW_ptr,
    KW_ptr,
    V_ptr,
    KC_ptr,
    VC_ptr,
    S_ptr,
    q_eps,
    k_eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    block_size,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
):
    """Token t at position p = P[t], with c = COS[p, :HALF], s = SIN[p, :HALF] (fp32), for every head:
        x1' = x1 * c - x2 * s,   x2' = x2 * c + x1 * s     (x1 = x[:HALF], x2 = x[HALF:]), fp32 math;
    with NORM, x is each head RMS-normed first (q with QW, q_eps; k with KW, k_eps). With STORE and slot
    s = S[t] >= 0: KC[s // bs, s % bs] = k' and VC[s // bs, s % bs] = V[t] (caches of one layout, strides
    stride_c*)."""
    t, offs_d, dmask, c, s = _token_cos_sin(P_ptr, COS_ptr, SIN_ptr, stride_cos, HALF, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)

    _rotate_heads(Q_ptr + t * stride_qt, stride_qh, NUM_Q_HEADS, offs_h, offs_d, dmask, c, s, HALF, QW_ptr, q_eps,
                  NORM)
    k1, k2, kmask = _rotate_heads(K_ptr + t * stride_kt, stride_kh, NUM_K_HEADS, offs_h, offs_d, dmask, c, s, HALF,
                                  KW_ptr, k_eps, NORM)
    if STORE:
        slot = tl.load(S_ptr + t)
        if slot >= 0:
            row = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct
            at = row + offs_h[:, None] * stride_ch + offs_d[None, :]
            tl.store(KC_ptr + at, k1, mask=kmask)
            tl.store(KC_ptr + at + HALF, k2, mask=kmask)
            vp = V_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            tl.store(VC_ptr + at, tl.load(vp, mask=kmask), mask=kmask)
            tl.store(VC_ptr + at + HALF, tl.load(vp + HALF, mask=kmask), mask=kmask)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                  sin_cache: torch.Tensor, q_norm: tuple[torch.Tensor, float] | None = None,
                  k_norm: tuple[torch.Tensor, float] | None = None,
                  store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place at int64 positions [T].

    cos_cache/sin_cache: fp32 [max_positions, D] with both halves equal (HF layout); only the first D/2
    columns are read. q/k may be strided views (e.g. of a fused qkv projection) with contiguous D.
    q_norm / k_norm: (weight [D] in q's dtype, eps) of a per-head RMSNorm applied first (both or neither).
    store: (v [T, KVH, D], k_cache, v_cache [blocks, block_size, KVH, D], slot_mapping int64 [T]): also write the
    rotated k and v at each token's slot (slot -1 skips the token), as ``store_kv`` does.
    """
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    t, hq, d = q.shape
    hk = k.shape[1]
    assert d % 2 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be even and contiguous"
    assert positions.shape == (t,) and positions.dtype == torch.int64 and positions.is_contiguous()
    assert cos_cache.shape == sin_cache.shape and cos_cache.shape[1] == d
    assert cos_cache.dtype == sin_cache.dtype == torch.float32 and cos_cache.stride() == sin_cache.stride()
    assert cos_cache.stride(-1) == 1
    assert (q_norm is None) == (k_norm is None), "q_norm and k_norm come together"
    for norm in (q_norm, k_norm):
        if norm is not None:
            assert norm[0].shape == (d,) and norm[0].dtype == q.dtype and norm[0].is_contiguous(), (
                f"norm weight must be contiguous [{d}] in {q.dtype}, got {norm[0].dtype} {tuple(norm[0].shape)}")
    if store is not None:
        v, k_cache, v_cache, slots = store
        assert v.shape == k.shape and v.stride(-1) == 1, f"v {tuple(v.shape)} must match k {tuple(k.shape)}"
        assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[2:] == (hk, d)
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, "k, v and caches must share a dtype"
        assert slots.dtype == torch.int64 and slots.shape == (t,) and slots.is_contiguous()
    if t == 0:
        return
    half = d // 2
    block_h = triton.next_power_of_2(max(hq, hk))
    block_d = triton.next_power_of_2(half)
    _rotary_kernel[(t,)](
        q,
        k,
        positions,
        cos_cache,
        sin_cache,
        q_norm[0] if q_norm else cos_cache,  # placeholders when NORM is off
        k_norm[0] if k_norm else cos_cache,
        *(store if store is not None else (k, k, k, positions)),  # placeholders when STORE is off
        float(q_norm[1]) if q_norm else 0.0,
        float(k_norm[1]) if k_norm else 0.0,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_cache.stride(0),
        *((store[0].stride(0), store[0].stride(1), *store[1].stride()[:3], store[1].shape[1]) if store is not None
          else (0, 0, 0, 0, 0, 1)),
        NUM_Q_HEADS=hq,
        NUM_K_HEADS=hk,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        NORM=q_norm is not None,
        STORE=store is not None,
        num_warps=4 if block_h * block_d >= 2048 else 2,
    )


@triton.jit
def _rope_heads_out(X_ptr, O_ptr, stride_xh, stride_oh, NUM_HEADS: tl.constexpr, offs_h, offs_d, dmask, c, s,
                    HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The first NUM_HEADS heads of one token's rows at X_ptr rotated into O_ptr (fp32 math, x's dtype):
    o[:HALF] = x1 * c - x2 * s, o[HALF:] = x2 * c + x1 * s, with (x1, x2) the pairs (x[2j], x[2j + 1]) when
    INTERLEAVE (the output de-interleaved) and (x[j], x[HALF + j]) otherwise."""
    mask = (offs_h < NUM_HEADS)[:, None] & dmask[None, :]
    xp = X_ptr + offs_h[:, None] * stride_xh
    if INTERLEAVE:
        x1 = tl.load(xp + 2 * offs_d[None, :], mask=mask, other=0.0)
        x2 = tl.load(xp + 2 * offs_d[None, :] + 1, mask=mask, other=0.0)
    else:
        x1 = tl.load(xp + offs_d[None, :], mask=mask, other=0.0)
        x2 = tl.load(xp + HALF + offs_d[None, :], mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    op = O_ptr + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(op, (x1f * c - x2f * s).to(x1.dtype), mask=mask)
    tl.store(op + HALF, (x2f * c + x1f * s).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_out_kernel(Q_ptr, K_ptr, QO_ptr, KO_ptr, P_ptr, COS_ptr, SIN_ptr, stride_qt, stride_qh, stride_kt,
                       stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos,
                       NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Token t at position p = P[t], c = COS[p, :HALF], s = SIN[p, :HALF] (fp32): q's and k's heads rotated
    (`_rope_heads_out`) into QO and KO."""
    t, offs_d, dmask, c, s = _token_cos_sin(P_ptr, COS_ptr, SIN_ptr, stride_cos, HALF, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    _rope_heads_out(Q_ptr + t * stride_qt, QO_ptr + t * stride_qot, stride_qh, stride_qoh, NUM_Q_HEADS, offs_h,
                    offs_d, dmask, c, s, HALF, INTERLEAVE)
    _rope_heads_out(K_ptr + t * stride_kt, KO_ptr + t * stride_kot, stride_kh, stride_koh, NUM_K_HEADS, offs_h,
                    offs_d, dmask, c, s, HALF, INTERLEAVE)


def rotary_out(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor, interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, R] and k [T, KVH, R] rotated at int64 positions [T] into new contiguous tensors, in one launch (the
    torch form takes about twenty at one row): rotate_half pairs, or with ``interleave`` DeepSeek's interleaved
    pairs with the output de-interleaved (all first members, then all second members, for q and k alike, so
    q . k is unchanged). q/k may be strided views with contiguous R (the rope part of a projection's output);
    cos_cache/sin_cache as `apply_rotary_` reads them (fp32 [max_positions, R], first R/2 columns)."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    t, hq, r = q.shape
    hk = k.shape[1]
    assert r % 2 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1, "the rope dim must be even and contiguous"
    assert q.dtype == k.dtype, "q and k must share a dtype"
    assert positions.shape == (t,) and positions.dtype == torch.int64 and positions.is_contiguous()
    assert cos_cache.shape == sin_cache.shape and cos_cache.shape[1] == r
    assert cos_cache.dtype == sin_cache.dtype == torch.float32 and cos_cache.stride() == sin_cache.stride()
    assert cos_cache.stride(-1) == 1
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty(
        k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    half = r // 2
    block_h = triton.next_power_of_2(max(hq, hk))
    block_d = triton.next_power_of_2(half)
    _rotary_out_kernel[(t,)](
        q, k, q_out, k_out, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_cache.stride(0),
        NUM_Q_HEADS=hq, NUM_K_HEADS=hk, HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, INTERLEAVE=interleave,
        num_warps=4 if block_h * block_d >= 2048 else 2,
    )  # fmt: skip
    return q_out, k_out
