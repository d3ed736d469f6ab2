"""FP8 block-scaled GEMM against the dequantize-then-matmul reference.

On CUDA (marked gpu): every shape of the grid below, both paths, CUDA-graph capture. Without a GPU the
Triton interpreter runs both kernels on the CPU (its fp8 ``tl.dot`` and fp8 casts work; the casts' rounding
is corrected by GRID_ROUND as in kernels/fp8_kv.py) at small shapes with small tiles.

Tolerances: the w8a16 path and the w8a8 path against a reference fed the same e4m3 activations differ only
by summation order and the output's rounding (kernel_cases.TOL per dtype); the w8a8 path against the exact
reference carries the activations' e4m3 rounding (3 mantissa bits: ~2% RMS relative), checked as a relative
Frobenius error.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import TOL, requires_cuda

pytest.importorskip("triton")

from services.kernels.fp8_block_gemm import (
    CUBLAS_MIN_M,
    W8A16_MAX_M,
    Fp8GemmConfig,
    act_quant,
    cublas_blockwise_available,
    fp8_block_gemm,
    tile_config,
    w8a8_supported,
)
from services.kernels.reference import ref_fp8_act_quant, ref_fp8_block_dequantize, ref_fp8_block_gemm

FP8 = torch.float8_e4m3fn
W8A8_REL_ERR = 0.04
"""Largest ||y - ref|| / ||ref|| of the w8a8 path against the exact reference (activation rounding)."""


def _quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (e4m3 [N, K], fp32 scales [cdiv(N, bn), cdiv(K, bk)]): each block's amax maps to 448."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk)
    padded[:n, :k] = w
    blocks = padded.view(gn, bn, gk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(gn * bn, gk * bk)[:n, :k].to(FP8)
    return q, scale


def _case(m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype, device: torch.device,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=gen)
    # Rows of different magnitudes per block, so the block scales differ.
    w = torch.randn((n, k), generator=gen) * torch.rand((n, 1), generator=gen).add(0.1) / k**0.5
    q, s = _quantize_blocks(w, block)
    return x.to(dtype).to(device), q.to(device), s.to(device)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12))


def _check(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block: tuple[int, int], w8a16: bool,
           config: Fp8GemmConfig | None = None) -> None:
    y = fp8_block_gemm(x, w, s, block, w8a16=w8a16, config=config)
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
    atol, rtol = TOL[x.dtype]
    atol, rtol = max(atol, 1e-4), max(rtol, 1e-4)  # fp32: the scale multiplies the dot, not the weight
    exact = ref_fp8_block_gemm(x, w, s, block)
    if w8a16:
        torch.testing.assert_close(y, exact, atol=atol, rtol=rtol)
        return
    same_input = ref_fp8_block_gemm(x, w, s, block, act_group=block[1])
    torch.testing.assert_close(y, same_input, atol=max(atol, 1e-2), rtol=rtol)
    assert _rel_err(y, exact) < W8A8_REL_ERR


# -- torch only ----------------------------------------------------------------------------------------------


def test_reference_act_quant_keeps_each_group_within_e4m3_rounding() -> None:
    x = torch.randn(5, 300) * torch.logspace(-3, 2, 300)  # groups of very different magnitudes
    x[2, :128] = 0.0  # an all-zero group: scale 0, codes 0
    q, s = ref_fp8_act_quant(x, 128)
    assert q.dtype == FP8 and q.shape == (5, 300) and s.shape == (5, 3)
    assert s[2, 0] == 0 and not q[2, :128].float().any()
    back = q.float() * s.repeat_interleave(128, dim=1)[:, :300]
    amax = x.abs().view(5, 300).split(128, dim=1)
    for g, part in enumerate(amax):
        torch.testing.assert_close(s[:, g], part.amax(dim=1) / 448.0)
    # e4m3: 3 mantissa bits, so every value is within 1/16 of itself (relative) or of the subnormal step.
    step = s.repeat_interleave(128, dim=1)[:, :300] * 2.0**-9
    assert ((back - x).abs() <= x.abs() / 16 + step).all()


def test_reference_gemm_is_the_dequantized_matmul() -> None:
    x, w, s = _case(3, 200, 328, (128, 128), torch.float32, torch.device("cpu"))
    dense = ref_fp8_block_dequantize(w, s, (128, 128))
    assert dense[130, 300] == w[130, 300].float() * s[1, 2]
    torch.testing.assert_close(ref_fp8_block_gemm(x, w, s, (128, 128)), x @ dense.T)


def test_tile_configs_fill_the_gpu_and_divide_the_blocks() -> None:
    for m in (1, 7, 16, 32):
        cfg = tile_config(m, 2048, 7168, (128, 128), True, 132)
        tiles = -(-2048 // cfg.block_n) * -(-m // cfg.block_m)
        assert cfg.block_n == 16 and tiles * cfg.split_k >= 132
        assert -(-7168 // cfg.block_k) // cfg.split_k >= 4  # each split keeps >= 4 K slices
    for m in (64, 300, 8192):
        cfg = tile_config(m, 7168, 2048, (128, 128), False, 132)
        assert cfg.block_k == 128 and cfg.split_k == 1
    assert tile_config(1, 64, 64, (24, 24), True, 132).block_k == 64  # no power of two divides 24: per element
    assert w8a8_supported(128) and w8a8_supported(96) and not w8a8_supported(24) and not w8a8_supported(16)
    assert W8A16_MAX_M >= 16


# -- the interpreter on CPU, or the GPU ----------------------------------------------------------------------

SMALL_W8A8 = Fp8GemmConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_stages=2)
SMALL_W8A16 = Fp8GemmConfig(block_m=16, block_n=32, block_k=32, split_k=2, num_stages=2)


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("n,k,block", [(64, 96, (32, 32)), (40, 80, (32, 64)), (48, 72, (24, 24))])
def test_small_shapes_both_paths(m: int, n: int, k: int, block: tuple[int, int], device: torch.device) -> None:
    x, w, s = _case(m, n, k, block, torch.float32, device)
    cfg = SMALL_W8A16 if block[1] % 32 == 0 else Fp8GemmConfig(16, 32, 64, split_k=2, num_stages=2)
    _check(x, w, s, block, w8a16=True, config=cfg)
    if w8a8_supported(block[1]):
        _check(x, w, s, block, w8a16=False, config=SMALL_W8A8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_quant_kernel_is_the_reference_bit_for_bit(dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn((9, 200), generator=gen) * torch.logspace(-2, 2, 200)).to(dtype)
    x[3, 64:128] = 0.0
    x[4, :3] = torch.tensor([124.3, -250.0, 7.99])  # roundings that carry into the next power of two
    q, s = act_quant(x.to(device), 64)
    q_ref, s_ref = ref_fp8_act_quant(x, 64)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def test_bf16_small_both_paths(device: torch.device) -> None:
    x, w, s = _case(20, 64, 128, (32, 64), torch.bfloat16, device, seed=3)
    _check(x, w, s, (32, 64), w8a16=True, config=SMALL_W8A16)
    _check(x, w, s, (32, 64), w8a16=False, config=SMALL_W8A8)


# -- GPU only: the real tiles at model sizes -----------------------------------------------------------------

GPU_SHAPES = [
    (256, 512, (128, 128)),  # multiples of the block
    (200, 328, (128, 128)),  # partial last row and column of blocks
    (576, 7168, (128, 128)),  # kv_a_proj_with_mqa-like: 4.5 row blocks, a long K
    (2048, 7168, (128, 128)),
    (300, 200, (64, 96)),  # other block shapes: BLOCK_K 32 on the w8a8 path
    (130, 250, (24, 24)),  # no power-of-two tile divides the block: w8a16 with per-element scales
    (96, 256, (1, 128)),  # one scale row per weight row (fused projections whose parts are unaligned)
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("n,k,block", GPU_SHAPES)
def test_gpu_shapes(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    x, w, s = _case(m, n, k, block, torch.bfloat16, torch.device("cuda"), seed=m + n)
    _check(x, w, s, block, w8a16=True)
    if w8a8_supported(block[1]):
        _check(x, w, s, block, w8a16=False)
    y = fp8_block_gemm(x, w, s, block)  # the automatic choice
    torch.testing.assert_close(y, fp8_block_gemm(x, w, s, block, w8a16=m <= W8A16_MAX_M or not
                                                 w8a8_supported(block[1])), atol=0, rtol=0)


def test_unknown_backend_is_refused(device: torch.device) -> None:
    x, w, s = _case(4, 64, 128, (128, 128), torch.float32, device)
    with pytest.raises(ValueError, match=r"'cutlass'.*auto, triton, cublas"):
        fp8_block_gemm(x, w, s, (128, 128), backend="cutlass")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m,n,k", [(CUBLAS_MIN_M, 384, 512), (1000, 256, 1024), (1037, 1536, 7168), (2048, 2048, 7168)])
def test_gpu_cublas_blockwise_matches_the_w8a8_kernel(m: int, n: int, k: int) -> None:
    """cuBLAS's blockwise FP8 GEMM takes the w8a8 kernel's quantized operands and scales: the two agree to
    accumulation order, and both stay within the w8a8 error of the exact product."""
    dev = torch.device("cuda")
    if not cublas_blockwise_available(dev):
        pytest.skip("cuBLAS blockwise FP8 GEMM (torch._scaled_mm, 1x128 / 128x128 scales) not available here")
    x, w, s = _case(m, n, k, (128, 128), torch.bfloat16, dev, seed=m)
    got = fp8_block_gemm(x, w, s, (128, 128), backend="cublas")
    kernel = fp8_block_gemm(x, w, s, (128, 128), backend="triton")
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert _rel_err(got, kernel) < 1e-2
    assert _rel_err(got, ref_fp8_block_gemm(x, w, s, (128, 128))) < W8A8_REL_ERR
    # other blocks, and fewer rows than CUBLAS_MIN_M, stay on the kernels
    assert torch.equal(fp8_block_gemm(x[:8], w, s, (128, 128), backend="cublas"),
                       fp8_block_gemm(x[:8], w, s, (128, 128), backend="triton"))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [7, 300])
def test_gpu_other_input_dtypes(dtype: torch.dtype, m: int) -> None:
    x, w, s = _case(m, 200, 328, (128, 128), dtype, torch.device("cuda"))
    _check(x, w, s, (128, 128), w8a16=True)
    _check(x, w, s, (128, 128), w8a16=False)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 300])
def test_gpu_cuda_graph_capture_and_replay(m: int) -> None:
    """The launch does no host sync and sizes every buffer from shapes: captured once, replayed on new
    inputs, it equals an eager call (M=1: w8a16 with a K split; M=300: activation quant + w8a8)."""
    x, w, s = _case(m, 2048, 7168, (128, 128), torch.bfloat16, torch.device("cuda"))
    fp8_block_gemm(x, w, s, (128, 128))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_block_gemm(x, w, s, (128, 128))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, fp8_block_gemm(x, w, s, (128, 128)), atol=0, rtol=0)
