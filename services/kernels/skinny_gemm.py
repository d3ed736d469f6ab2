"""y = x @ w.T (+ b) for the few rows of a small decode batch: a weight-streaming GEMM.

At one to a few rows a linear layer is a read of its weight matrix and nothing else, so what counts is how many
bytes of it are in flight on every SM. cuBLAS picks tiles for arbitrary shapes; at M = 1 on an H100 it reached 0.56
of the copy rate on a 4096 -> 2048 projection in an eager step (a split-K launch and its reduce) and ~0.5 on a
vocabulary-sized LM head. Here each program owns BLOCK_N output columns
of every row and walks the K dimension in BLOCK_K slices, pipelined ``num_stages`` deep; the row block is padded to
16 for ``tl.dot`` (the padding reads no memory). No split-K: every output is one program's fp32 sum, so results do
not depend on the launch, and a CUDA graph replays the same kernel at any batch up to its bound.

``skinny_tiles`` picks the tiles from measurements (benchmarks/skinny_gemm_bench.py); ``use_skinny`` says where
this kernel beats the library GEMM (measured per shape class on an H100: the LM head, its only caller).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.kernels._triton_utils import _mma, dot_flags

MAX_ROWS = 16
"""Largest row count the kernel takes (one 16-row dot tile)."""


@dataclass(frozen=True)
class SkinnyTiles:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(
    X_ptr,
    W_ptr,
    B_ptr,
    Y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Y[m, n] = sum_k X[m, k] W[n, k] (+ B[n]) for m < M and this program's BLOCK_N columns n (fp32 sums)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = X_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += _mma(x, tl.trans(w), UPCAST, DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


RULE: dict[str, int] = {"max_rows": MAX_ROWS}
"""Where ``use_skinny`` sends an LM head (models/gpu_linear.py): at most ``max_rows`` rows (0: never). Measured on an
H100 in CUDA graphs (benchmarks/skinny_gemm_bench.py, bf16, M 1-16): the LM heads ran 6-8% faster here (Qwen3's
151936 x 2048: 200.6-211 us against cuBLAS's 217-223; Llama-3-8B's 128256 x 4096: 338-351 against 369-375), where
cuBLAS won the attention projections and routers (qkv 5.8-6.9 us against 8.2, o 7.3-7.5 against 8.8-9.4) and tied the
MLP: so only the LM head calls it. Benchmarks set max_rows to compare (``--skinny-rows``)."""


def use_skinny(m: int, n: int, k: int) -> bool:
    """Whether an LM head's [m, k] x [n, k]^T product runs here rather than in the library GEMM."""
    return 0 < m <= min(RULE["max_rows"], MAX_ROWS)


def skinny_tiles(n: int, k: int, num_sms: int) -> SkinnyTiles:
    """Tiles for an [M <= 16, k] x [n, k]^T product: column blocks narrow enough that every SM gets work (16 where
    32 would leave SMs idle), 256-wide K slices, four stages in flight."""
    block_n = 32 if triton.cdiv(n, 32) >= num_sms else 16
    return SkinnyTiles(block_n=block_n, block_k=min(256, max(16, triton.next_power_of_2(k))))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, rows contiguous) @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (
        f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS, f"{m} rows: the skinny GEMM takes at most {MAX_ROWS}"
    assert x.dtype == weight.dtype, f"x {x.dtype} and weight {weight.dtype} must share a dtype"
    assert x.stride(-1) == 1 and weight.stride(-1) == 1, "rows of x and weight must be contiguous"
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous(), f"bias must be contiguous [{n}]"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if tiles is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        tiles = skinny_tiles(n, k, sms)
    upcast, dot_precision = dot_flags(x.dtype)
    _skinny_gemm_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, weight if bias is None else bias, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        UPCAST=upcast, DOT_PRECISION=dot_precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return y
