"""Fused mixture-of-experts MLP: tokens sorted by expert, grouped GEMMs over the experts' weights.

Three steps, all on the device with fixed-size buffers sized from T*K (no host sync, no data-dependent
allocation, so the whole layer can be captured in a CUDA graph):

1. align: the T*K (token, slot) pairs are sorted by expert (one launch, ``moe_align.py``, for decode-sized
   batches; torch ops beyond); each expert's run is padded to a multiple of BLOCK_M with a sentinel pair id
   (T*K), so every BLOCK_M block of the sorted list belongs to one expert. At most cdiv(T*K, BLOCK_M) + min(E, T*K) blocks exist; the grid covers that
   bound and programs past the real block count return at once. Both GEMMs run on a 1-D grid walked in
   groups of group_m blocks x every N tile, so a group's x rows and expert weights stay in L2.
2. `_moe_gate_up_kernel`: per block, act(x @ w13[e, :I]^T + b, x @ w13[e, I:]^T + b) in one pass over
   x (gate and up accumulate side by side), written as [T*K, I] rows indexed by pair id.
3. `_moe_down_kernel`: per block, topk_weight * (act @ w2[e]^T + b2[e]) into [T*K, H] rows, then the
   K rows of each token are summed.

Few pairs (decode at small batches) take a second path with no sorting at all (`pair_path`): every
(token, slot) pair reads its expert's rows straight from topk_ids, one program per pair and gate/up column
tile (`_moe_pair_gate_up_kernel`, a GEMV: a single token per program, so no tensor-core tile is wasted on
padding rows), then one program per pair and hidden column tile applies the expert's down projection and
the routing weight (`_moe_pair_down_kernel`), and the K rows of each token are summed: three launches per
layer instead of the four of align + GEMMs + sum. It reads an expert once per pair that chose it, so it pays off only while few pairs
share an expert; `use_pair_path` decides from the expected number of distinct experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import services.kernels.moe_align as moe_align
from services.kernels._triton_utils import _mma, dot_flags
from services.kernels.moe_args import ACTIVATIONS, check_moe_args


@dataclass(frozen=True)
class MoETileConfig:
    """Tile sizes of both grouped GEMMs (tokens per block = block_m)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1  # consecutive programs cover group_m blocks x every N tile (L2 reuse of x and weights)


def tile_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoETileConfig:
    """Tiles by the mean number of pairs per expert: small blocks for decode (a few tokens per expert,
    the weights dominate and must stream), large ones for prefill (many tokens per expert, compute-bound)."""
    per_expert = num_tokens * top_k / max(1, num_experts)
    if dtype == torch.float32:
        return MoETileConfig(16 if per_expert <= 16 else 32, 32, 32, 4, 2)
    if per_expert <= 16:  # narrow N tiles: enough programs to keep every SM streaming weights
        return MoETileConfig(16, 32, 128, 4, 4)
    if per_expert <= 64:
        return MoETileConfig(32, 64, 128, 4, 4)
    if per_expert <= 256:
        return MoETileConfig(64, 64, 64, 4, 4, group_m=4)
    # H100 sweep of 35 configs at 8192 tokens (`pdserve bench moe --sweep --sweep-phase prefill`): 128-wide N
    # tiles 10% (qwen3-30b-a3b) and 17% (mixtral-8x7b) faster than 64.
    return MoETileConfig(128, 128, 64, 8, 3, group_m=8)


@dataclass(frozen=True)
class PairTileConfig:
    """Tiles of the pair (GEMV) path: gate/up columns per program, hidden columns per program of the down
    kernel, and the K slice each loads per iteration."""

    gate_up_n: int = 4
    down_n: int = 8
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3


#: Pairs per expected distinct expert above which the sorted path wins (the pair path reads an expert once
#: per pair that chose it). `pdserve bench moe --pair-sweep` on an H100, both paths in CUDA graphs: the pair path
#: won up to 1.58 (qwen3-30b-a3b shapes, 16 tokens: 270 vs 324 us) and 1.52 (mixtral, 4 tokens: 587 vs 639 us),
#: tied at 2.27 (mixtral, 8 tokens) and lost from 4 on (docs/PERFORMANCE.md, "MoE on one GPU").
PAIR_PATH_MAX_DUPLICATION = 2.0
#: Never the pair path beyond this many pairs (a prefill's pairs share experts whatever the count of experts).
PAIR_PATH_MAX_PAIRS = 256


def expected_distinct_experts(num_pairs: int, num_experts: int) -> float:
    """Expected number of distinct experts among num_pairs uniform choices of num_experts."""
    return num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** num_pairs)


def use_pair_path(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """True when the pair path should run: few pairs, few of them expected to share an expert."""
    pairs = num_tokens * top_k
    if pairs == 0 or pairs > PAIR_PATH_MAX_PAIRS:
        return False
    return pairs / expected_distinct_experts(pairs, num_experts) <= PAIR_PATH_MAX_DUPLICATION


@dataclass
class MoEAlignment:
    """Pairs sorted by expert, padded per expert to block_m (all device tensors, fixed sizes)."""

    sorted_pair_ids: torch.Tensor  # int32 [max_blocks * block_m]; pair id t*K + k, or T*K for padding
    block_experts: torch.Tensor  # int32 [max_blocks]; the expert of each block (clamped past the end)
    num_blocks: torch.Tensor  # int32 [1]; blocks in use (<= max_blocks)
    max_blocks: int


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the T*K pairs of topk_ids [T, K] by expert, each expert's run padded to block_m rows.

    Within an expert pairs keep token order. Decode-sized batches take the one-launch kernel of
    ``moe_align.py`` (int32 ids, as the router gives them); others the torch form.
    """
    if topk_ids.dtype == torch.int32 and moe_align.use_fused_align(topk_ids.numel(), num_experts):
        return MoEAlignment(*moe_align.align_pairs_fused(topk_ids, num_experts, block_m))
    return align_pairs_torch(topk_ids, num_experts, block_m)


def align_pairs_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """`align_pairs` in torch ops of fixed output size (a stable sort: pairs keep token order per expert)."""
    pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    cum_blocks = torch.cumsum(blocks, 0)
    start_row = (cum_blocks - blocks) * block_m  # first padded row of each expert
    first_pair = torch.cumsum(counts, 0) - counts  # rank of each expert's first pair in the sorted order
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(pairs, device=device) - first_pair[sorted_experts]
    max_blocks = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    sorted_pair_ids = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[start_row[sorted_experts] + rank] = order.to(torch.int32)
    block_idx = torch.arange(max_blocks, dtype=torch.int64, device=device)
    block_experts = torch.searchsorted(cum_blocks, block_idx, right=True).clamp_(max=num_experts - 1)
    return MoEAlignment(
        sorted_pair_ids, block_experts.to(torch.int32), cum_blocks[-1:].to(torch.int32), max_blocks
    )


@triton.jit
def _activate(gate, up, swiglu_alpha, swiglu_limit, ACTIVATION: tl.constexpr):
    """fp32 act(gate, up): silu(g) * u | gelu_tanh(g) * u | gpt-oss clamped glu * (u + 1)."""
    if ACTIVATION == 0:
        return gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        return 0.5 * gate * (1.0 + tanh) * up
    else:
        g = tl.minimum(gate, swiglu_limit)
        u = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        return g * tl.sigmoid(swiglu_alpha * g) * (u + 1.0)


@triton.jit
def _tile_ids(max_blocks, n, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program in a 1-D grid of max_blocks x cdiv(n, BLOCK_N): groups of GROUP_M
    blocks, each group's programs walking every N tile with the block index fastest."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(n, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(max_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _moe_gate_up_kernel(
    X_ptr,
    W_ptr,
    B_ptr,
    A_ptr,
    SortedIds_ptr,
    BlockExperts_ptr,
    NumBlocks_ptr,
    stride_xt,
    stride_we,
    stride_wn,
    stride_be,
    stride_at,
    num_pairs,
    max_blocks,
    hidden,
    inter,
    swiglu_alpha,
    swiglu_limit,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """For the pairs p (token t = p // K) of block pid_m, expert e, and columns n of tile pid_n:

        g = x[t] . W[e, n] + b[e, n],  u = x[t] . W[e, I + n] + b[e, I + n],  A[p, n] = act(g, u)

    with fp32 accumulation over BLOCK_K slices of the hidden dim; A is stored in A's dtype.
    """
    pid_m, pid_n = _tile_ids(max_blocks, inter, BLOCK_N, GROUP_M)
    if pid_m >= tl.load(NumBlocks_ptr):
        return
    expert = tl.load(BlockExperts_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds_ptr + offs_m)
    mask_m = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = X_ptr + token[:, None] * stride_xt + offs_k[None, :]
    w_base = W_ptr + expert * stride_we
    wg_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    wu_ptrs = wg_ptrs + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        mask_k = offs_k < hidden - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wg = tl.load(wg_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc_g += _mma(a, wg, UPCAST, DOT_PRECISION)
        acc_u += _mma(a, wu, UPCAST, DOT_PRECISION)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    if HAS_BIAS:
        b_base = B_ptr + expert * stride_be
        acc_g += tl.load(b_base + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_base + inter + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    act = _activate(acc_g, acc_u, swiglu_alpha, swiglu_limit, ACTIVATION)
    a_ptrs = A_ptr + pair[:, None].to(tl.int64) * stride_at + offs_n[None, :]
    tl.store(a_ptrs, act.to(A_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_kernel(
    A_ptr,
    W_ptr,
    B_ptr,
    TW_ptr,
    Y_ptr,
    SortedIds_ptr,
    BlockExperts_ptr,
    NumBlocks_ptr,
    stride_at,
    stride_we,
    stride_wn,
    stride_be,
    stride_yt,
    num_pairs,
    max_blocks,
    hidden,
    inter,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """For the pairs p of block pid_m, expert e, and hidden columns n of tile pid_n:

        Y[p, n] = topk_weight[p] * (A[p] . W2[e, n] + b2[e, n])

    with fp32 accumulation over BLOCK_K slices of the intermediate dim; Y is stored in Y's dtype.
    """
    pid_m, pid_n = _tile_ids(max_blocks, hidden, BLOCK_N, GROUP_M)
    if pid_m >= tl.load(NumBlocks_ptr):
        return
    expert = tl.load(BlockExperts_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds_ptr + offs_m)
    mask_m = pair < num_pairs
    rows = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = A_ptr + rows[:, None] * stride_at + offs_k[None, :]
    w_ptrs = W_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        mask_k = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += _mma(a, w, UPCAST, DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(TW_ptr + rows, mask=mask_m, other=0.0)
    acc = acc * weight[:, None]
    y_ptrs = Y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_pair_gate_up_kernel(
    X_ptr,
    W_ptr,
    B_ptr,
    A_ptr,
    Ids_ptr,
    stride_xt,
    stride_we,
    stride_wn,
    stride_be,
    stride_at,
    hidden,
    inter,
    swiglu_alpha,
    swiglu_limit,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Pair p = program 0 (token p // K, expert ids[p]), columns n of program 1's tile:

        A[p, n] = act(x[t] . W[e, n] + b[e, n], x[t] . W[e, I + n] + b[e, I + n])

    as a GEMV: products and sums in fp32 over BLOCK_K slices of the hidden dim."""
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(Ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X_ptr + token * stride_xt + offs_k
    wg_ptrs = W_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    wu_ptrs = wg_ptrs + inter * stride_wn
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        mask_k = offs_k < hidden - k0
        x = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        wg = tl.load(wg_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        wu = tl.load(wu_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * x[None, :], axis=1)
        acc_u += tl.sum(wu * x[None, :], axis=1)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    if HAS_BIAS:
        b_base = B_ptr + expert * stride_be
        acc_g += tl.load(b_base + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc_u += tl.load(b_base + inter + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    act = _activate(acc_g, acc_u, swiglu_alpha, swiglu_limit, ACTIVATION)
    tl.store(A_ptr + pair.to(tl.int64) * stride_at + offs_n, act.to(A_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _moe_pair_down_kernel(
    A_ptr,
    W_ptr,
    B_ptr,
    Ids_ptr,
    TW_ptr,
    Y_ptr,
    stride_at,
    stride_we,
    stride_wn,
    stride_be,
    stride_yt,
    hidden,
    inter,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Pair p = program 0 (expert ids[p]), hidden columns n of program 1's tile, as a GEMV in fp32:

        Y[p, n] = topk_weight[p] * (A[p] . W2[e, n] + b2[e, n])

    stored in Y's dtype; the caller sums each token's K rows (as the sorted path does)."""
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(Ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A_ptr + pair * stride_at + offs_k
    w_ptrs = W_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        mask_k = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[None, :], axis=1)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    acc = acc * tl.load(TW_ptr + pair)
    tl.store(Y_ptr + pair * stride_yt + offs_n, acc.to(Y_ptr.dtype.element_ty), mask=mask_n)


def fused_moe(
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
    config: MoETileConfig | None = None,
    path: str | None = None,
    pair_config: PairTileConfig | None = None,
    down_config: MoETileConfig | None = None,
    reduce: bool = True,
) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]), e = topk_ids[t, k].

    x [T, H]; w13 [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up); w2 [E, H, I]; topk_ids int32 [T, K] with
    values in [0, E) (not checked on the device: that would need a host sync); topk_weights fp32 [T, K].
    Returns [T, H] in x's dtype. The intermediate act(...) is rounded to x's dtype. path: "pair" or "sorted"
    (None: `use_pair_path` decides); config / pair_config override the tile choice (tests, benchmarks);
    down_config, the sorted path's down-projection tiles where they differ from config's (same block_m).
    reduce=False returns the K weighted rows of each token unsummed, [T, K, H] (x's dtype), for a consumer that
    sums them itself (kernels/rms_norm.fused_add_rms_norm does, in the pass that adds the residual).
    """
    check_moe_args(x, w13, w2, topk_ids, topk_weights, activation, w13_bias, w2_bias, swiglu_alpha, swiglu_limit)
    for name, w in (("w13", w13), ("w2", w2)):
        assert w.stride(-1) == 1, f"{name}: the last dim must be contiguous"
    t, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    if t == 0 or top_k == 0:
        return out.zero_() if reduce else out.zero_().view(t, 1, hidden)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13_bias = None if w13_bias is None else w13_bias.contiguous()
    w2_bias = None if w2_bias is None else w2_bias.contiguous()
    if path is None:
        path = "pair" if use_pair_path(t, top_k, num_experts) else "sorted"
    if path == "pair":
        return _pair_path(x, w13, w2, topk_ids, topk_weights, out, activation, w13_bias, w2_bias,
                          swiglu_alpha, swiglu_limit, pair_config or PairTileConfig(), reduce)
    if path != "sorted":
        raise ValueError(f"fused_moe: path {path!r} is not 'pair' or 'sorted'")
    cfg = config or tile_config(t, top_k, num_experts, x.dtype)
    align = align_pairs(topk_ids, num_experts, cfg.block_m)
    num_pairs = t * top_k
    weights = topk_weights.contiguous().view(-1)
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    upcast, dot_precision = dot_flags(x.dtype)
    b13 = w13_bias if w13_bias is not None else w13  # placeholder when HAS_BIAS is false
    _moe_gate_up_kernel[(align.max_blocks * triton.cdiv(inter, cfg.block_n),)](
        x, w13, b13, act, align.sorted_pair_ids, align.block_experts, align.num_blocks,
        x.stride(0), w13.stride(0), w13.stride(1),
        w13_bias.stride(0) if w13_bias is not None else 0, act.stride(0),
        num_pairs, align.max_blocks, hidden, inter,
        float(swiglu_alpha or 0.0), float(swiglu_limit or 0.0),
        TOP_K=top_k, ACTIVATION=ACTIVATIONS[activation], HAS_BIAS=w13_bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        UPCAST=upcast, DOT_PRECISION=dot_precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    b2 = w2_bias if w2_bias is not None else w2
    down = down_config or cfg
    assert down.block_m == cfg.block_m, f"down_config.block_m {down.block_m} != config.block_m {cfg.block_m}"
    _moe_down_kernel[(align.max_blocks * triton.cdiv(hidden, down.block_n),)](
        act, w2, b2, weights, y, align.sorted_pair_ids, align.block_experts, align.num_blocks,
        act.stride(0), w2.stride(0), w2.stride(1),
        w2_bias.stride(0) if w2_bias is not None else 0, y.stride(0),
        num_pairs, align.max_blocks, hidden, inter,
        HAS_BIAS=w2_bias is not None, BLOCK_M=down.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        GROUP_M=down.group_m,
        UPCAST=upcast, DOT_PRECISION=dot_precision, num_warps=down.num_warps, num_stages=down.num_stages,
    )  # fmt: skip
    if not reduce:
        return y.view(t, top_k, hidden)
    if top_k == 1:
        return out.copy_(y)
    return torch.sum(y.view(t, top_k, hidden), dim=1, out=out)


def _pair_path(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor, out: torch.Tensor, activation: str, w13_bias: torch.Tensor | None,
               w2_bias: torch.Tensor | None, swiglu_alpha: float | None, swiglu_limit: float | None,
               cfg: PairTileConfig, reduce: bool = True) -> torch.Tensor:
    """The GEMV path of `fused_moe` (module docstring): act rows per pair, weighted down rows per pair, then
    each token's K rows summed into out (``reduce``; else returned unsummed, [T, K, H])."""
    t, hidden = x.shape
    inter, top_k = w13.shape[1] // 2, topk_ids.shape[1]
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    b13 = w13_bias if w13_bias is not None else w13  # placeholder when HAS_BIAS is false
    _moe_pair_gate_up_kernel[(t * top_k, triton.cdiv(inter, cfg.gate_up_n))](
        x, w13, b13, act, ids,
        x.stride(0), w13.stride(0), w13.stride(1), w13_bias.stride(0) if w13_bias is not None else 0, act.stride(0),
        hidden, inter, float(swiglu_alpha or 0.0), float(swiglu_limit or 0.0),
        TOP_K=top_k, ACTIVATION=ACTIVATIONS[activation], HAS_BIAS=w13_bias is not None,
        BLOCK_N=cfg.gate_up_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    b2 = w2_bias if w2_bias is not None else w2
    y = out if top_k == 1 else torch.empty((t * top_k, hidden), dtype=x.dtype, device=x.device)
    _moe_pair_down_kernel[(t * top_k, triton.cdiv(hidden, cfg.down_n))](
        act, w2, b2, ids, weights, y,
        act.stride(0), w2.stride(0), w2.stride(1), w2_bias.stride(0) if w2_bias is not None else 0, y.stride(0),
        hidden, inter,
        HAS_BIAS=w2_bias is not None, BLOCK_N=cfg.down_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if not reduce:
        return y.view(t, top_k, hidden)
    return out if top_k == 1 else torch.sum(y.view(t, top_k, hidden), dim=1, out=out)
