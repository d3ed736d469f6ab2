"""FP8 codec tests. The Triton interpreter's fp32 -> fp8 cast mis-rounds across powers of two, so under
the interpreter the kernels round onto the e4m3 grid themselves (GRID_ROUND); on a GPU the hardware
cast is used. Both must match the torch reference bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import llama_packed, requires_cuda

pytest.importorskip("triton")

from services.kernels import fp8_layout_codec_name, fp8_page_nbytes
from services.kernels.fp8_kv import (
    fp8_dequantize,
    fp8_quantize,
    pack_pages_fp8,
    unpack_pages_fp8,
)
from services.kernels.reference import (
    ref_fp8_dequantize,
    ref_fp8_quantize,
    ref_pack_pages_fp8,
    ref_unpack_pages_fp8,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Dequantized output: fp32 exact; half types within one ulp (the interpreter truncates fp32 -> bf16).
OUT_TOL = {torch.float32: 0.0, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _assert_dequant_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=0.0, rtol=OUT_TOL[dtype])


def test_codec_name_and_page_size() -> None:
    assert fp8_layout_codec_name == "fp8-e4m3"
    # Llama-3-8B page: 32 layers x 2 x 16 tokens x 8 heads x (128 B values + 4 B scale).
    assert fp8_page_nbytes(32, 16, 8, 128) == 32 * 2 * 16 * 8 * (128 + 4)
    with pytest.raises(ValueError, match="head_dim"):
        fp8_page_nbytes(1, 16, 1, 6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "kvh", "hd"), [(1, 1, 64), (13, 3, 128), (37, 2, 64)])
def test_quantize_matches_reference(
    device: torch.device, dtype: torch.dtype, num_tokens: int, kvh: int, hd: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn((num_tokens, kvh, hd), generator=gen) * 3).to(dtype).to(device)
    x[0, 0] = 0.0  # all-zero row: scale 0, values 0
    q, s = fp8_quantize(x)
    rq, rs = ref_fp8_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (num_tokens, kvh)
    assert torch.equal(s, rs)
    assert torch.equal(q.float(), rq.float())
    deq = fp8_dequantize(q, s, dtype)
    _assert_dequant_close(deq, ref_fp8_dequantize(rq, rs, dtype), dtype)
    # Codec error bound: half an e4m3 ulp at the top binade = amax / 28 per row (plus output rounding).
    err = (deq.float() - x.float()).abs().amax(-1)
    assert bool((err <= x.float().abs().amax(-1) * (1 / 28 + OUT_TOL[dtype]) * 1.01 + 1e-6).all())


def test_quantize_strided_input(device: torch.device) -> None:
    base = torch.randn((5, 4, 64), generator=torch.Generator().manual_seed(0)).to(device)
    x = base[:, 1:3]
    q, s = fp8_quantize(x)
    rq, rs = ref_fp8_quantize(x)
    assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("layers", "bs", "kvh", "hd"), [(2, 16, 2, 64), (3, 7, 3, 128)])
def test_fp8_pages_match_reference(
    device: torch.device, dtype: torch.dtype, layers: int, bs: int, kvh: int, hd: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn((layers, 2, 6, bs, kvh, hd), generator=gen).to(dtype).to(device)
    ids = torch.tensor([4, 0, 5], dtype=torch.int32, device=device)
    buf = pack_pages_fp8(kv_cache, ids)
    ref = ref_pack_pages_fp8(kv_cache, ids)
    assert buf.shape == (3, fp8_page_nbytes(layers, bs, kvh, hd)) and buf.dtype == torch.uint8
    assert torch.equal(buf, ref)

    dst_ids = torch.tensor([1, 2, 3], dtype=torch.int64, device=device)
    dst = torch.zeros_like(kv_cache)
    dst_ref = torch.zeros_like(kv_cache)
    unpack_pages_fp8(buf, dst, dst_ids)
    ref_unpack_pages_fp8(ref, dst_ref, dst_ids)
    _assert_dequant_close(dst, dst_ref, dtype)
    assert not dst[:, :, 0].any() and not dst[:, :, 4:].any()


def test_fp8_page_layout_is_values_then_scales(device: torch.device) -> None:
    kv_cache = torch.randn((2, 2, 3, 4, 2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    buf = ref_pack_pages_fp8(kv_cache, torch.tensor([2], device=device))
    values_nbytes = 2 * 2 * 4 * 2 * 8
    vals = buf[0, :values_nbytes].view(torch.float8_e4m3fn).view(2, 2, 4, 2, 8)
    scales = buf[0, values_nbytes:].view(torch.float32).view(2, 2, 4, 2)
    src = kv_cache[:, :, 2]
    torch.testing.assert_close(scales, src.abs().amax(-1) / 448)
    # e4m3: relative error <= 2^-4 for normals; subnormals (|x| < scale * 2^-6) err <= scale * 2^-10.
    torch.testing.assert_close(vals.float() * scales[..., None], src, atol=1e-4, rtol=1 / 16)


@pytest.mark.gpu
@requires_cuda
def test_fp8_gpu_llama_shapes() -> None:
    kv_cache, _, _ = llama_packed(pack_pages_fp8, ref_pack_pages_fp8, 64)
    x = kv_cache[0, 0].reshape(-1, 8, 128)[:8192]
    q, s = fp8_quantize(x)
    rq, rs = ref_fp8_quantize(x)
    assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())
