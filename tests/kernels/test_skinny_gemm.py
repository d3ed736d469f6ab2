"""The skinny (weight-streaming) GEMM against torch's linear: row counts 1..16, odd N and K, bias, tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.kernel_cases import assert_close, requires_cuda

pytest.importorskip("triton")

from services.kernels.skinny_gemm import MAX_ROWS, SkinnyTiles, skinny_gemm, skinny_tiles


def _case(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=gen).to(dtype).to(device)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(dtype).to(device)
    b = (0.1 * torch.randn((n,), generator=gen)).to(dtype).to(device)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 64), (3, 100, 72), (16, 33, 200), (5, 8, 40)])
def test_skinny_gemm_matches_linear(device: torch.device, dtype: torch.dtype, m: int, n: int, k: int) -> None:
    x, w, b = _case(m, n, k, dtype, device)
    ref = F.linear(x.float(), w.float()).to(dtype)
    out = skinny_gemm(x, w)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close(out, ref, dtype)
    assert_close(skinny_gemm(x, w, b), F.linear(x.float(), w.float(), b.float()).to(dtype), dtype)


@pytest.mark.parametrize("tiles", [SkinnyTiles(16, 16, 4, 2), SkinnyTiles(64, 128, 4, 3), SkinnyTiles(32, 32, 2, 1)])
def test_skinny_gemm_tiles_agree(device: torch.device, tiles: SkinnyTiles) -> None:
    """Any tiles give the same fp32 products (each output one program's sum; K-slice order fixed)."""
    x, w, _ = _case(4, 70, 96, torch.float32, device, seed=1)
    torch.testing.assert_close(skinny_gemm(x, w, tiles=tiles), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_skinny_gemm_rows_of_a_view_and_bad_args(device: torch.device) -> None:
    x, w, _ = _case(6, 40, 64, torch.float32, device, seed=2)
    rows = x[1:4]  # a row slice: rows stay contiguous
    torch.testing.assert_close(skinny_gemm(rows, w), F.linear(rows, w), atol=1e-5, rtol=1e-5)
    assert skinny_gemm(x[:0], w).shape == (0, 40)
    with pytest.raises(AssertionError, match="at most"):
        skinny_gemm(torch.zeros((MAX_ROWS + 1, 64), device=device), w)
    with pytest.raises(AssertionError, match="do not multiply"):
        skinny_gemm(x[:, :32], w)
    with pytest.raises(AssertionError, match="share a dtype"):
        skinny_gemm(x.to(torch.bfloat16), w)


def test_skinny_tiles_fill_the_sms() -> None:
    assert skinny_tiles(2048, 4096, 132).block_n == 16  # 64 column blocks of 32 would leave SMs idle
    assert skinny_tiles(151936, 2048, 132).block_n == 32
    assert skinny_tiles(128, 40, 132).block_k == 64


def test_use_skinny_rule() -> None:
    from services.kernels.skinny_gemm import use_skinny

    assert use_skinny(1, 151936, 2048) and use_skinny(16, 128256, 4096)  # LM heads at decode row counts
    assert not use_skinny(17, 151936, 2048) and not use_skinny(0, 151936, 8)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 4, 16])
def test_skinny_gemm_gpu_real_shapes(m: int) -> None:
    for n, k in ((5120, 2048), (2048, 4096), (128, 2048), (4096, 14336)):
        x, w, _ = _case(m, n, k, torch.bfloat16, torch.device("cuda"))
        assert_close(skinny_gemm(x, w), F.linear(x, w), torch.bfloat16)
