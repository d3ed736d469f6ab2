"""Torch references, one per Triton kernel, with the kernels' signatures.

They are the ground truth for tests and benchmarks, and the CPU engine path: all work is vectorized
(gathers + `scaled_dot_product_attention`); the only Python loop is over sequences in prefill.

Layouts (shared with the kernels):
  k_cache, v_cache   [num_blocks, block_size, num_kv_heads, head_dim]   (kv_cache[layer, 0/1])
  kv_cache           [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
  block_tables       int32 [num_seqs, max_blocks_per_seq], padded with 0
  context_lens       int32 [num_seqs], tokens in the cache per sequence (including new ones)
  page buffer        [num_pages, num_layers, 2, block_size, num_kv_heads, head_dim]
  fp8 page buffer    uint8 [num_pages, fp8_page_nbytes(...)] (see kernels.fp8_layout)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from services.kernels.fp8_layout import FP8_E4M3_MAX, fp8_page_regions
from services.kernels.moe_args import check_moe_args

FP8_DTYPE = torch.float8_e4m3fn


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks_needed: int) -> torch.Tensor:
    """[B, num_blocks_needed * block_size, kvh, hd] from the first blocks of each table row."""
    table = block_tables[:, :num_blocks_needed].long()
    g = cache[table]  # [B, nblk, bs, kvh, hd]
    b, nblk, bs, kvh, hd = g.shape
    return g.reshape(b, nblk * bs, kvh, hd)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q [..., nh, n, hd] over k/v [..., kvh, S, hd] (GQA by repetition) with a boolean mask
    broadcast to [..., nh, n, S]; sinks fp32 [nh]: one more softmax column per head with logit sink_h
    and a zero value."""
    nh, kvh = q.shape[-3], k.shape[-3]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=nh != kvh)
    k = k.repeat_interleave(nh // kvh, dim=-3)
    v = v.repeat_interleave(nh // kvh, dim=-3)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(nh, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
    return (p @ v.float()).to(q.dtype)


def ref_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[b, h] = softmax(scale * q[b, h] . K[b, lo:ctx_b, h // G]^T) @ V[b, lo:ctx_b, h // G]; G = nh / kvh.

    lo = max(0, ctx_b - window) with a window (window > 0: the query at p = ctx_b - 1 sees key k iff
    0 <= p - k < window), else 0. sinks fp32 [nh]: a virtual key per head with logit sink_h and value 0.
    """
    bsz = q.shape[0]
    block_size = k_cache.shape[1]
    if max_context_len is None:
        max_context_len = int(context_lens.max().item()) if bsz > 0 else 0
    nblk = max(1, -(-max_context_len // block_size))
    k = _gather_kv(k_cache, block_tables, nblk).transpose(1, 2)  # [B, kvh, S, hd]
    v = _gather_kv(v_cache, block_tables, nblk).transpose(1, 2)
    pos = torch.arange(nblk * block_size, device=q.device)
    ctx = context_lens[:, None].to(pos.dtype)
    mask = pos[None, :] < ctx
    if window > 0:
        mask &= pos[None, :] >= ctx - window
    out = _attention(q[:, :, None, :], k, v, mask[:, None, None, :], scale, sinks)  # mask [B, 1, 1, S]
    return out[:, :, 0, :]


def ref_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal extend attention over paged KV.

    Query i of sequence b (q_len_b = cu[b+1] - cu[b]) sits at position p = ctx_b - q_len_b + i and
    attends to keys 0..p of that sequence: out = softmax(scale * q K[:p+1]^T) V[:p+1]; with a window
    (window > 0) only to keys k with 0 <= p - k < window. sinks fp32 [nh]: a virtual key per head with
    logit sink_h and value 0.
    """
    del max_seqlen_q
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    ctxs = context_lens.tolist()
    for b, ctx in enumerate(ctxs):
        q0, q1 = cu[b], cu[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        nblk = -(-ctx // block_size)
        k = _gather_kv(k_cache, block_tables[b : b + 1], nblk)[0, :ctx].transpose(0, 1)  # [kvh, ctx, hd]
        v = _gather_kv(v_cache, block_tables[b : b + 1], nblk)[0, :ctx].transpose(0, 1)
        qpos = torch.arange(ctx - q_len, ctx, device=q.device)
        kpos = torch.arange(ctx, device=q.device)
        dist = qpos[:, None] - kpos[None, :]
        mask = (dist >= 0) & (dist < window) if window > 0 else dist >= 0  # [q_len, ctx]
        o = _attention(q[q0:q1].transpose(0, 1), k, v, mask, scale, sinks)
        out[q0:q1] = o.transpose(0, 1)
    return out


def _latent(k_cache: torch.Tensor, v_cache: torch.Tensor, key_dim: int, value_dim: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of a latent cache: the planes [NB, bs, 1, half] joined into [NB, bs, 1, 2 * half], its first
    key_dim and first value_dim values."""
    joined = torch.cat([k_cache, v_cache], dim=-1)
    return joined[..., :key_dim], joined[..., :value_dim]


def ref_mla_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    value_dim: int,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Latent (MLA) decode: out[b, h] = softmax(scale * q[b, h] . L[b, :ctx_b, :key_dim]^T) @ L[b, :ctx_b, :value_dim]
    -> [B, H, value_dim], where L is each token's latent [K plane, V plane] and key_dim = q.shape[-1]; every head
    meets the same key (multi-query attention)."""
    bsz = q.shape[0]
    block_size = k_cache.shape[1]
    keys, values = _latent(k_cache, v_cache, q.shape[-1], value_dim)
    if max_context_len is None:
        max_context_len = int(context_lens.max().item()) if bsz > 0 else 0
    nblk = max(1, -(-max_context_len // block_size))
    k = _gather_kv(keys, block_tables, nblk).transpose(1, 2)  # [B, 1, S, key_dim]
    v = _gather_kv(values, block_tables, nblk).transpose(1, 2)
    pos = torch.arange(nblk * block_size, device=q.device)
    mask = pos[None, :] < context_lens[:, None].to(pos.dtype)
    # One shared key: the H heads are H query rows of one head (no per-head copy of the keys).
    out = _attention(q[:, None], k, v, mask[:, None, None, :], scale, None)  # [B, 1, H, value_dim]
    return out[:, 0]


def ref_mla_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    value_dim: int,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Causal latent (MLA) extend attention -> [T, H, value_dim]: query i of sequence b at p = ctx_b - q_len_b + i
    attends to the latents of keys 0..p, out = softmax(scale * q L[:p+1, :key_dim]^T) L[:p+1, :value_dim]."""
    del max_seqlen_q
    block_size = k_cache.shape[1]
    keys, values = _latent(k_cache, v_cache, q.shape[-1], value_dim)
    out = q.new_empty(*q.shape[:2], value_dim)
    cu = cu_seqlens_q.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        nblk = -(-ctx // block_size)
        k = _gather_kv(keys, block_tables[b : b + 1], nblk)[0, :ctx].transpose(0, 1)  # [1, ctx, key_dim]
        v = _gather_kv(values, block_tables[b : b + 1], nblk)[0, :ctx].transpose(0, 1)
        qpos = torch.arange(ctx - (q1 - q0), ctx, device=q.device)
        mask = qpos[:, None] >= torch.arange(ctx, device=q.device)[None, :]
        heads = q.shape[1]
        # One shared key: the (token, head) pairs are the query rows of one head, token-major.
        o = _attention(q[q0:q1].reshape(1, -1, q.shape[2]), k, v, mask.repeat_interleave(heads, 0), scale, None)
        out[q0:q1] = o.view(q1 - q0, heads, value_dim)
    return out


def _row_tables(block_tables: torch.Tensor, rows: int, row_seq: torch.Tensor | None) -> torch.Tensor:
    """int64 [rows, max_blocks]: the block table row of each query row (row_seq[t], or row t when None)."""
    seq = torch.arange(rows, device=block_tables.device) if row_seq is None else row_seq.long()
    return block_tables.long()[seq]


def ref_index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    row_end: torch.Tensor,
    block_size: int,
    scale: float,
    max_context_len: int,
    row_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3.2's index scores -> fp32 [rows, max_context_len]: S[t, n] = sum_h w[t, h] relu(scale q[t, h] .
    I(n)) for n < row_end[t], -inf after, where I(n) is key n's index key keys[slot] (times key_scales[slot] for
    fp8 keys), slot = its block id * block_size + offset in row t's sequence (block table row row_seq[t], or t)."""
    rows, _, dim = q.shape
    cols = max(1, max_context_len)
    index_keys = keys.float() if key_scales is None else keys.float() * key_scales.float()[:, None]
    index_keys = index_keys.reshape(-1, block_size, dim)  # [NB, bs, dim]
    tables = _row_tables(block_tables, rows, row_seq)[:, : -(-cols // block_size)]
    keys = index_keys[tables].reshape(rows, -1, dim)[:, :cols]  # [rows, <= cols, dim]
    s = torch.relu(torch.einsum("thd,tnd->thn", q.float(), keys) * scale)
    total = torch.einsum("th,thn->tn", weights.float(), s)
    out = torch.full((rows, cols), float("-inf"), device=q.device)
    n = torch.arange(total.shape[1], device=q.device)
    out[:, : total.shape[1]] = total.masked_fill(n[None, :] >= row_end[:, None].long(), float("-inf"))
    return out


def ref_sparse_mla_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    topk_indices: torch.Tensor,
    scale: float,
    value_dim: int,
    row_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse latent attention -> [rows, H, value_dim]: row t attends to the keys topk_indices[t] (positions in its
    sequence, -1: none), out = softmax(scale q[t, h] . L(n)[:key_dim]) L(n)[:value_dim] over them (0 with none),
    L(n) key n's latent [K plane, V plane] in row t's sequence (block table row row_seq[t], or t)."""
    rows, _, key_dim = q.shape
    block_size = k_cache.shape[1]
    keys, values = _latent(k_cache, v_cache, key_dim, value_dim)
    pos = topk_indices.long()
    valid = pos >= 0
    pos = pos.clamp(min=0)
    blocks = _row_tables(block_tables, rows, row_seq).gather(1, pos // block_size)
    slots = blocks * block_size + pos % block_size  # [rows, K]
    k = keys.reshape(-1, key_dim)[slots].float()  # [rows, K, key_dim]
    v = values.reshape(-1, value_dim)[slots].float()
    logits = torch.einsum("thd,tkd->thk", q.float(), k) * scale
    p = torch.softmax(logits.masked_fill(~valid[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("thk,tkd->thd", p, v).to(q.dtype)


def ref_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache[s // bs, s % bs] = k[t] for s = slot_mapping[t] >= 0 (same for v); s = -1 is skipped."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, k, v = slots[valid], k[valid], v[valid]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = k.to(k_cache.dtype)
    v_cache[blk, off] = v.to(v_cache.dtype)


def _block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(page index, first block, length) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for p, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((p, b, 1))
    return runs


def ref_pack_pages(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """buffer[p, l, kv] = kv_cache[l, kv, block_ids[p]] -> [P, L, 2, bs, kvh, hd], contiguous; into ``out``
    (contiguous, that many elements of the cache's dtype) when given."""
    num_layers, _, num_blocks = kv_cache.shape[:3]
    rows = kv_cache.reshape(num_layers * 2, num_blocks, -1)  # each row: one layer's K or V of one block
    shape = (len(block_ids), num_layers * 2, rows.shape[2])
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    else:
        assert out.is_contiguous() and out.dtype == kv_cache.dtype and out.numel() == math.prod(shape), \
            f"out {tuple(out.shape)} {out.dtype} cannot hold pages {shape} {kv_cache.dtype}"
        out = out.view(shape)
    if kv_cache.device.type == "cpu":  # one strided copy per run of consecutive blocks: no gathered temporary
        for p, b, n in _block_runs(block_ids.tolist()):
            out[p:p + n].copy_(rows[:, b:b + n].transpose(0, 1))
    else:
        out.copy_(rows.index_select(1, block_ids.long()).transpose(0, 1))
    return out.view(len(block_ids), *kv_cache.shape[:2], *kv_cache.shape[3:])


def ref_unpack_pages(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """kv_cache[l, kv, block_ids[p]] = buffer[p, l, kv]."""
    num_layers, _, num_blocks = kv_cache.shape[:3]
    rows = kv_cache.view(num_layers * 2, num_blocks, -1)  # kv_cache is contiguous (the runner owns it)
    src = buffer.reshape(buffer.shape[0], num_layers * 2, -1)
    if kv_cache.device.type == "cpu":
        for p, b, n in _block_runs(block_ids.tolist()):
            rows[:, b:b + n].copy_(src[p:p + n].transpose(0, 1))
    else:
        rows[:, block_ids.long()] = src.transpose(0, 1).to(kv_cache.dtype)


def ref_fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8-e4m3 quantization over the last dim.

    scale = amax(|x|) / 448; q = fp8(clamp(x / scale, -448, 448)) (x / 1 where scale == 0).
    Returns (q float8_e4m3fn shaped like x, scale fp32 shaped x.shape[:-1]).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # Divide by a tensor, not a Python scalar: CUDA torch turns `t / scalar` into `t * (1 / scalar)`,
    # one ulp off IEEE division, while the CPU and the Triton kernel (div_rn) divide exactly.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    qv = (xf / safe[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return qv, scale


def ref_fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x = q * scale[..., None], cast to dtype."""
    return (q.float() * scale[..., None]).to(dtype)


def _fp8_views(buffer: torch.Tensor, values_nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values [P, values_nbytes], fp32 scales [P, scales_nbytes / 4]) views of a uint8 buffer."""
    return buffer[:, :values_nbytes].view(FP8_DTYPE), buffer[:, values_nbytes:].view(torch.float32)


def ref_pack_pages_fp8(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """uint8 [P, fp8_page_nbytes]: per page fp8 values [L, 2, bs, kvh, hd] then fp32 scales [L, 2, bs, kvh]."""
    num_layers, _, _, block_size, kvh, hd = kv_cache.shape
    values_nbytes, scales_nbytes = fp8_page_regions(num_layers, block_size, kvh, hd)
    pages = ref_pack_pages(kv_cache, block_ids)  # [P, L, 2, bs, kvh, hd]
    qv, scale = ref_fp8_quantize(pages)
    buffer = torch.empty(
        (pages.shape[0], values_nbytes + scales_nbytes), dtype=torch.uint8, device=kv_cache.device
    )
    vals, scales = _fp8_views(buffer, values_nbytes)
    vals.copy_(qv.reshape(pages.shape[0], -1))
    scales.copy_(scale.reshape(pages.shape[0], -1))
    return buffer


def ref_unpack_pages_fp8(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """kv_cache[l, kv, block_ids[p]] = dequantize(fp8 page p), in kv_cache's dtype."""
    num_layers, _, _, block_size, kvh, hd = kv_cache.shape
    values_nbytes, _ = fp8_page_regions(num_layers, block_size, kvh, hd)
    vals, scales = _fp8_views(buffer, values_nbytes)
    n = buffer.shape[0]
    pages = ref_fp8_dequantize(
        vals.reshape(n, num_layers, 2, block_size, kvh, hd),
        scales.reshape(n, num_layers, 2, block_size, kvh),
        kv_cache.dtype,
    )
    ref_unpack_pages(pages, kv_cache, block_ids)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) in fp32, cast to x.dtype before the weight (as HF)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def ref_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ref_rms_norm(x + residual), x + residual), the sum in x.dtype."""
    s = x + residual
    return ref_rms_norm(s, weight, eps), s


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] = [gate | up] -> silu(gate) * up [T, N]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def ref_apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                      sin_cache: torch.Tensor) -> None:
    """In place: x = x * cos[p] + rotate_half(x) * sin[p] for q [T, H, D] and k [T, KVH, D] (neox layout)."""
    cos = cos_cache[positions][:, None, :]  # [T, 1, D] fp32
    sin = sin_cache[positions][:, None, :]
    for x in (q, k):
        half = x.shape[-1] // 2
        xf = x.float()
        rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        x.copy_(xf * cos + rot * sin)


def _moe_activation(gate: torch.Tensor, up: torch.Tensor, activation: str, swiglu_alpha: float | None,
                    swiglu_limit: float | None) -> torch.Tensor:
    """fp32 act(gate, up) of fused_moe (names checked by check_moe_args)."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate, approximate="tanh") * up
    assert swiglu_alpha is not None and swiglu_limit is not None
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(-swiglu_limit, swiglu_limit)
    return gate * torch.sigmoid(swiglu_alpha * gate) * (up + 1)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]), e = topk_ids[t, k].

    A loop over the experts hit (one host sync for the list), fp32 math, the intermediate rounded to
    x's dtype as the kernel does; returns [T, H] in x's dtype. w13 rows 0..I-1 are gate, I..2I-1 up.
    """
    check_moe_args(x, w13, w2, topk_ids, topk_weights, activation, w13_bias, w2_bias, swiglu_alpha, swiglu_limit)
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1)
    for e in torch.unique(flat).tolist():
        pair = torch.nonzero(flat == e).squeeze(1)
        tok = pair // topk_ids.shape[1]
        h = x[tok].float() @ w13[e].float().T
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        act = _moe_activation(h[:, :inter], h[:, inter:], activation, swiglu_alpha, swiglu_limit)
        y = act.to(x.dtype).float() @ w2[e].float().T
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, tok, y * weights[pair, None])
    return out.to(x.dtype)


def ref_fp8_block_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 W [N, K] and fp32 Ws [cdiv(N, bn), cdiv(K, bk)] -> fp32 W[n, k] * Ws[n // bn, k // bk]."""
    n, k = weight.shape
    bn, bk = block
    scale = weight_scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.float() * scale


def ref_fp8_act_quant(x: torch.Tensor, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, cdiv(K, group_k)]): `ref_fp8_quantize` per token per group
    of group_k columns (the last group may be partial)."""
    m, k = x.shape
    groups = -(-k // group_k)
    padded = torch.zeros((m, groups * group_k), dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    q, scale = ref_fp8_quantize(padded.view(m, groups, group_k))
    return q.view(m, groups * group_k)[:, :k], scale


def ref_fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                       act_group: int | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequantize(weight, weight_scale)^T in fp32, cast to x's dtype.

    act_group: x first goes through the per-token-per-group e4m3 round trip of the kernel's w8a8 path
    (`ref_fp8_act_quant`), so the result is what that path computes up to summation order."""
    xf = x.float()
    if act_group is not None:
        q, scale = ref_fp8_act_quant(x, act_group)
        xf = q.float() * scale.repeat_interleave(act_group, dim=1)[:, :x.shape[1]]
    return (xf @ ref_fp8_block_dequantize(weight, weight_scale, block).T).to(x.dtype)
