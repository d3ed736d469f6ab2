"""FP8 block-scaled GEMM (DeepSeek-V3 weights): y[M, N] = x[M, K] @ (W[N, K] * Ws[n // bn, k // bk])^T.

W is float8_e4m3fn, Ws fp32 with one scale per [bn, bk] block (the last row and column of blocks may be
partial). Two kernels:

- w8a8 (`_fp8_block_gemm_kernel`, the prefill path): x is first quantized per token per bk-group of K to
  e4m3 with an fp32 scale (`_act_quant_kernel`: xs[m, g] = amax|x[m, g-th group]| / 448), then every
  BLOCK_K slice (BLOCK_K divides bk) is one fp8 x fp8 ``tl.dot`` whose fp32 result is scaled by
  xs[m, k // bk] * Ws[n // bn, k // bk] and added to an fp32 accumulator (DeepSeek-V3's and vLLM's w8a8
  block fp8 scheme: the scale is applied per K slice, so the tensor cores never accumulate across blocks).
- w8a16 (`_fp8_block_gemm_w8a16_kernel`, the decode path): the fp8 weight tile is converted to x's dtype
  in the kernel (e4m3 values are exact in bf16/fp16) and multiplied by x in x's dtype; the block scale
  multiplies the dot's result (BLOCK_K divides bk) or, for blocks no power-of-two tile divides, the
  weight tile element by element. x is not rounded to fp8. Splits K over SPLIT_K programs when the N
  tiles alone cannot fill the GPU (few rows, narrow N), the partial sums added after in fp32.

Both read each weight byte once per M tile: at decode sizes the step costs the bytes of W (+ Ws), half
of a bf16 weight. Nothing syncs with the host and every buffer is sized from shapes, so both paths can
be captured in CUDA graphs.

Prefill-sized w8a8 products with DeepSeek-V3's 128 x 128 weight blocks may instead go to cuBLAS's
blockwise-scaled FP8 GEMM (``torch._scaled_mm`` with 1 x 128 activation and 128 x 128 weight scales: the
same quantized operands and scales as the w8a8 kernel, another accumulation order): where
``PDSERVE_FP8_GEMM`` is ``cublas``, or ``auto`` (the default) and ``CUBLAS_AUTO`` says so for products of at
least ``CUBLAS_AUTO_MIN_FLOP``, for at least ``CUBLAS_MIN_M`` rows, once a probe on the device (a small
product against the w8a8 kernel, outside any CUDA graph capture) found this torch and GPU run it; otherwise
the w8a8 kernel runs, as it does for every other block shape. Row counts are padded to a multiple of 16 for
cuBLAS (it found no algorithm for 1037 rows).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.kernels._triton_utils import _mma, dot_flags, interpret_mode
from services.kernels.fp8_kv import _quantize_rows  # the KV codec's row quantizer: same rounding rules
from services.kernels.fp8_layout import FP8_E4M3_MAX

FP8_DTYPE = torch.float8_e4m3fn
log = logging.getLogger(__name__)

W8A16_MAX_M = 32
"""Calls with at most this many rows take the w8a16 path (when w8a16 is not forced either way). Up to here
the GEMM is bound by the weight bytes on an H100/H200 (2*M FLOP per weight byte, <= 64, against a bf16
ridge of ~200 FLOP/byte), so converting the weight tile to bf16 costs no time, skips the activation-quant
kernel and keeps x unrounded; above it the fp8 tensor cores' 2x FLOP rate starts to count.
``benchmarks/fp8_gemm_bench.py`` times both paths at every M to check this choice."""


FP8_GEMM_BACKENDS = ("auto", "triton", "cublas")
FP8_GEMM_BACKEND = os.environ.get("PDSERVE_FP8_GEMM", "auto")
"""Which kernel runs prefill-sized w8a8 products with 128 x 128 blocks: ``triton`` (always the w8a8 kernel),
``cublas`` (cuBLAS's blockwise GEMM where the probe passes) or ``auto`` (cuBLAS when ``CUBLAS_AUTO``)."""
CUBLAS_AUTO = True
"""Whether ``auto`` takes cuBLAS's blockwise GEMM (for products of at least ``CUBLAS_AUTO_MIN_FLOP``). Measured
on an H100 (torch 2.11, CUDA 13; activation quant included in both): 1.3-2.2x the w8a8 kernel there on
DeepSeek-V3's shapes (18432 x 7168 at 2048 rows 1223 against 590 TFLOP/s), the two within 2e-5 of each other
(docs/PERFORMANCE.md)."""
CUBLAS_MIN_M = 256
"""Fewest rows that go to cuBLAS's blockwise GEMM (below, the w8a8 kernel, or w8a16 up to W8A16_MAX_M)."""
CUBLAS_AUTO_MIN_FLOP = 64e9
"""``auto`` also wants at least this much work (2 M N K): on the H100 cuBLAS's call (activation quant, scale copy,
algorithm lookup) lost to the w8a8 kernel on 7168 x 2048 and 2048 x 7168 at 2048 rows (60 GFLOP: 217 / 128 us
against 120 / 120) and won from 67 GFLOP up (7168 x 18432 at 256 rows: 81 against 134 us)."""
_CUBLAS_BLOCK = (128, 128)
_CUBLAS_ROWS = 16
"""Row counts cuBLAS's blockwise GEMM is given are padded to a multiple of this (H100, torch 2.11: 1037 rows found
no algorithm, 1000 and 16000 did)."""
_cublas_probed: dict[int, bool] = {}
_warned_unavailable = False


def _cublas_blockwise(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's FP8 GEMM with 1 x 128 scales on xq [M, K] (xs [M, K / 128]) and 128 x 128 ones on weight [N, K]
    (weight_scale [N / 128, K / 128]): ``torch._scaled_mm`` tells the blockwise recipes from the scales' shapes and
    wants the activation scales column-major and the weight as a column-major [K, N] with its scale grid
    transposed alike (views, but the one small copy of xs)."""
    m = xq.shape[0]
    rows = -(-m // _CUBLAS_ROWS) * _CUBLAS_ROWS
    if rows != m:  # cuBLASLt finds no algorithm for row counts off the alignment: zero rows, scale 1, cut after
        xq = torch.cat((xq, xq.new_zeros((rows - m, xq.shape[1]))))
        xs = torch.cat((xs, xs.new_ones((rows - m, xs.shape[1]))))
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs.t().contiguous().t(), scale_b=weight_scale.t(),
                         out_dtype=out_dtype)
    return y if rows == m else y[:m]


def cublas_blockwise_available(device: torch.device) -> bool:
    """Whether cuBLAS's blockwise FP8 GEMM runs on ``device`` with this torch and agrees with the w8a8 kernel on
    a small product (probed once per device, never while a CUDA graph is being captured: then False for now)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _cublas_probed:
        return _cublas_probed[index]
    if torch.cuda.is_current_stream_capturing():
        return False
    ok = False
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn((256, 512), generator=gen).to(device=device, dtype=torch.bfloat16)
        weight = (torch.randn((256, 512), generator=gen) * 100).clamp(-448, 448).to(device=device, dtype=FP8_DTYPE)
        scale = (torch.rand((2, 4), generator=gen) * 1e-3 + 1e-4).to(device)
        xq, xs = act_quant(x, 128)
        got = _cublas_blockwise(xq, xs, weight, scale, torch.bfloat16).float()
        want = fp8_block_gemm(x, weight, scale, _CUBLAS_BLOCK, w8a16=False, backend="triton").float()
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        ok = err < 1e-2
        if not ok:
            log.warning("cuBLAS blockwise FP8 GEMM disagrees with the w8a8 kernel (relative error %.2e): not used", err)
    except Exception as e:  # an older torch or cuBLAS, or a GPU without the kernel: the w8a8 kernel runs
        log.info("cuBLAS blockwise FP8 GEMM not available here (%s): the Triton w8a8 kernel runs", str(e)[:200])
    _cublas_probed[index] = ok
    return ok


def _takes_cublas(m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype, device: torch.device,
                  backend: str) -> bool:
    """Whether a w8a8 product of this shape goes to cuBLAS's blockwise GEMM (module docstring)."""
    wanted = backend == "cublas" or (backend == "auto" and CUBLAS_AUTO and 2.0 * m * n * k >= CUBLAS_AUTO_MIN_FLOP)
    fits = (wanted and m >= CUBLAS_MIN_M and tuple(block) == _CUBLAS_BLOCK and n % 128 == 0 and k % 128 == 0
            and dtype in (torch.bfloat16, torch.float16))
    if not fits:
        return False
    if cublas_blockwise_available(device):
        return True
    global _warned_unavailable
    if backend == "cublas" and not _warned_unavailable:
        _warned_unavailable = True
        log.warning("PDSERVE_FP8_GEMM=cublas: cuBLAS's blockwise FP8 GEMM does not run on this torch/GPU; the Triton "
                    "w8a8 kernel runs instead")
    return False


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tiles of one launch; split_k > 1 only on the w8a16 path."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit(do_not_specialize=["M"])  # row counts of one tile config share a compile
def _act_quant_kernel(
    X_ptr,
    Q_ptr,
    S_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ROWS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GRID_ROUND: tl.constexpr,
):
    """Rows m of this program's ROWS and group g = program_id(1) of GROUP_K columns (the last may be partial):

        S[m, g] = max_{k in g} |X[m, k]| / 448,   Q[m, k] = e4m3(clamp(X[m, k] / S[m, g], -448, 448))

    (a group of zeros: S = 0, Q = 0). GRID_ROUND rounds onto the e4m3 grid in fp32 first (the interpreter).
    """
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_k = g * GROUP_K + offs_g
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_g[None, :] < GROUP_K) & (offs_k[None, :] < K)
    rows = offs_m.to(tl.int64)
    x = tl.load(X_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_rows(x, FP8_MAX, GRID_ROUND)
    tl.store(Q_ptr + rows[:, None] * stride_qm + offs_k[None, :], q, mask=mask)
    tl.store(S_ptr + rows * stride_sm + g, scale, mask=mask_m)


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a 1-D grid walked in groups of GROUP_M row tiles x every N tile (L2 reuse of W)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit(do_not_specialize=["M"])  # row counts of one tile config share a compile
def _fp8_block_gemm_kernel(
    A_ptr,
    As_ptr,
    W_ptr,
    Ws_ptr,
    Y_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_ym,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """w8a8: A = e4m3 x [M, K] with As fp32 [M, cdiv(K, GROUP_K)], W e4m3 [N, K] with Ws fp32
    [cdiv(N, GROUP_N), cdiv(K, GROUP_K)], BLOCK_K dividing GROUP_K:

        Y[m, n] = sum_{k0 in 0, BLOCK_K, ..} (A[m, k0:k0+BK] . W[n, k0:k0+BK]) * As[m, k0 // GK] * Ws[n // GN, k0 // GK]

    each slice's dot accumulated in fp32 by the tensor cores, the sum in fp32; Y stored in Y's dtype.
    """
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    a_ptrs = A_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W_ptr + cols[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    as_ptrs = As_ptr + rows * stride_asm
    ws_ptrs = Ws_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        g = k0 // GROUP_K
        a_s = tl.load(as_ptrs + g, mask=mask_m, other=0.0)
        w_s = tl.load(ws_ptrs + g, mask=mask_n, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = Y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M"])  # row counts of one tile config share a compile
def _fp8_block_gemm_w8a16_kernel(
    X_ptr,
    W_ptr,
    Ws_ptr,
    Y_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_ys,
    stride_ym,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    TILE_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """w8a16: x [M, K] in bf16/fp16/fp32, W e4m3 [N, K], Ws fp32 [cdiv(N, GROUP_N), cdiv(K, GROUP_K)]; program
    (pid_n, pid_m, s) sums k in [s * k_per_split, (s + 1) * k_per_split):

        Y[s, m, n] = sum_k x[m, k] * W[n, k] * Ws[n // GN, k // GK]

    TILE_SCALES (BLOCK_K divides GROUP_K): each BLOCK_K slice's dot (W converted exactly to x's dtype) times
    the slice's scale row; otherwise W * Ws element by element, rounded to x's dtype, then the dot.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    scale_rows = (offs_n // GROUP_N).to(tl.int64) * stride_wsn
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < k_end
        x = tl.load(X_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = tl.load(W_ptr + cols[None, :] * stride_wn + ks[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0)
        if TILE_SCALES:
            w_s = tl.load(Ws_ptr + scale_rows + k0 // GROUP_K, mask=mask_n, other=0.0)
            acc += _mma(x, w.to(X_ptr.dtype.element_ty), UPCAST, DOT_PRECISION) * w_s[None, :]
        else:
            w_s = tl.load(Ws_ptr + scale_rows[None, :] + (ks // GROUP_K)[:, None],
                          mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            w = (w.to(tl.float32) * w_s).to(X_ptr.dtype.element_ty)
            acc += _mma(x, w, UPCAST, DOT_PRECISION)
    y_ptrs = Y_ptr + pid_s.to(tl.int64) * stride_ys + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    return min(n & -n, cap)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device (a host query, cached: no sync); 4 under the interpreter."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def w8a8_supported(block_k: int) -> bool:
    """Whether the w8a8 path can run with weight blocks of block_k columns: its fp8 dots take K slices of a
    power of two >= 32 that divides block_k."""
    return _pow2_divisor(block_k, 128) >= 32


def tile_config(m: int, n: int, k: int, block: tuple[int, int], w8a16: bool, num_sms: int) -> Fp8GemmConfig:
    """Tiles by the path and the row count: narrow N tiles (and a K split) for few rows, where the weights
    stream once and every SM must read its share; 64/128-row tiles with 128-wide N and K for prefill."""
    block_k = block[1]
    if w8a16:
        bk = _pow2_divisor(block_k, 128)
        bk = bk if bk >= 16 else 64  # no power of two divides the block: per-element scales
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        bn = 64
        while bn > 16 and triton.cdiv(n, bn) * triton.cdiv(m, bm) < num_sms:
            bn //= 2
        tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
        k_slices = triton.cdiv(k, bk)
        split = 1
        while tiles * split < num_sms and k_slices >= 8 * split:  # each split keeps >= 4 slices
            split *= 2
        return Fp8GemmConfig(bm, bn, bk, split_k=split, num_warps=4, num_stages=4)
    bk = _pow2_divisor(block_k, 128)
    if m <= 16:
        return Fp8GemmConfig(16, 64, bk, group_m=1, num_warps=4, num_stages=4)
    if m <= 64:
        return Fp8GemmConfig(32 if m <= 32 else 64, 64, bk, group_m=1, num_warps=4, num_stages=4)
    if m <= 256:
        return Fp8GemmConfig(64, 128, bk, group_m=8, num_warps=4, num_stages=3)
    return Fp8GemmConfig(128, 128, bk, group_m=8, num_warps=8, num_stages=3)


def act_quant(x: torch.Tensor, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, last dim contiguous) -> (e4m3 [M, K], fp32 scales [M, cdiv(K, group_k)]),
    one scale per token per group_k columns (see `_act_quant_kernel`)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with contiguous K"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {x.dtype}"
    m, k = x.shape
    groups = triton.cdiv(k, group_k)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales
    block_g = triton.next_power_of_2(group_k)
    rows = max(1, min(16, 4096 // block_g))
    _act_quant_kernel[(triton.cdiv(m, rows), groups)](
        x, q, scales, m, k, x.stride(0), q.stride(0), scales.stride(0),
        GROUP_K=group_k, BLOCK_G=block_g, ROWS=rows, FP8_MAX=FP8_E4M3_MAX, GRID_ROUND=interpret_mode(),
        num_warps=4,
    )  # fmt: skip
    return q, scales


def fp8_block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    *,
    w8a16: bool | None = None,
    config: Fp8GemmConfig | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (weight [N, K] * weight_scale[n // bn, k // bk])^T in x's dtype.

    weight float8_e4m3fn with contiguous rows; weight_scale fp32 [cdiv(N, bn), cdiv(K, bk)] with contiguous
    rows; block = (bn, bk), any positive sizes. w8a16: None picks by M (w8a16 for M <= W8A16_MAX_M, and
    whenever bk has no power-of-two divisor >= 32), True/False forces a path (False needs
    ``w8a8_supported(bk)``). config overrides the tiles (tests, benchmarks). backend: the w8a8 products'
    kernel, ``triton``, ``cublas`` or ``auto`` (None: ``FP8_GEMM_BACKEND``; module docstring).
    """
    backend = backend or FP8_GEMM_BACKEND
    if backend not in FP8_GEMM_BACKENDS:
        raise ValueError(f"FP8 GEMM backend {backend!r} (PDSERVE_FP8_GEMM) is not one of {', '.join(FP8_GEMM_BACKENDS)}")
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with contiguous K"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {x.dtype}"
    assert weight.dim() == 2 and weight.dtype == FP8_DTYPE and weight.stride(-1) == 1, \
        "weight must be float8_e4m3fn [N, K] with contiguous K"
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"x has K={k}, weight {tuple(weight.shape)}"
    bn, bk = block
    assert bn > 0 and bk > 0, f"block {block}"
    grid_shape = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    assert weight_scale.dtype == torch.float32 and tuple(weight_scale.shape) == grid_shape, \
        f"weight_scale must be fp32 {grid_shape}, got {weight_scale.dtype} {tuple(weight_scale.shape)}"
    assert weight_scale.stride(-1) == 1, "weight_scale rows must be contiguous"
    assert x.device == weight.device == weight_scale.device, "x, weight and weight_scale on one device"
    if w8a16 is None:
        w8a16 = m <= W8A16_MAX_M or not w8a8_supported(bk)
    assert w8a16 or w8a8_supported(bk), f"w8a8 needs a power-of-two divisor >= 32 of bk={bk}"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    cfg = config or tile_config(m, n, k, block, w8a16, _sm_count(x.device))
    if w8a16:
        return _w8a16(x, weight, weight_scale, block, cfg, y)
    assert bk % cfg.block_k == 0 and cfg.block_k >= 16, f"BLOCK_K {cfg.block_k} must divide bk={bk}"
    xq, xs = act_quant(x, bk)
    if config is None and _takes_cublas(m, n, k, block, x.dtype, x.device, backend):
        return _cublas_blockwise(xq, xs, weight, weight_scale, x.dtype)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_block_gemm_kernel[grid](
        xq, xs, weight, weight_scale, y, m, n, k,
        xq.stride(0), xs.stride(0), weight.stride(0), weight_scale.stride(0), y.stride(0),
        GROUP_N=bn, GROUP_K=bk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def _w8a16(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
           cfg: Fp8GemmConfig, y: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    bn, bk = block
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # splits that hold at least one K slice
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    upcast, dot_precision = dot_flags(x.dtype)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    _fp8_block_gemm_w8a16_kernel[grid](
        x, weight, weight_scale, out, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0) if split > 1 else 0, out.stride(-2),
        GROUP_N=bn, GROUP_K=bk, TILE_SCALES=bk % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, UPCAST=upcast, DOT_PRECISION=dot_precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split == 1:
        return y
    return torch.sum(out, dim=0, out=y) if y.dtype == torch.float32 else y.copy_(out.sum(dim=0))
