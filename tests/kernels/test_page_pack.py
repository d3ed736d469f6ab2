from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import llama_packed, requires_cuda

pytest.importorskip("triton")

from services.kernels.page_pack import pack_pages, unpack_pages
from services.kernels.reference import ref_pack_pages, ref_unpack_pages

SHAPES = [  # (layers, num_blocks, block_size, kvh, hd)
    (2, 9, 16, 2, 64),
    (3, 5, 7, 3, 128),
    (1, 4, 3, 1, 5),  # odd byte count per region: falls back to 2- or 1-byte words
]


def _cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    layers, nb, bs, kvh, hd = shape
    gen = torch.Generator().manual_seed(0)
    return torch.randn((layers, 2, nb, bs, kvh, hd), generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_pack_unpack_roundtrip(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, ...], id_dtype: torch.dtype
) -> None:
    kv_cache = _cache(shape, dtype, device)
    ids = torch.tensor([shape[1] - 1, 0, 2], dtype=id_dtype, device=device)
    buf = pack_pages(kv_cache, ids)
    expected = ref_pack_pages(kv_cache, ids)
    assert buf.shape == expected.shape and buf.dtype == dtype
    assert torch.equal(buf.view(torch.uint8), expected.view(torch.uint8))

    dst = torch.zeros_like(kv_cache)
    dst_ref = torch.zeros_like(kv_cache)
    dst_ids = torch.tensor([1, 3, 0], dtype=id_dtype, device=device)
    unpack_pages(buf, dst, dst_ids)
    ref_unpack_pages(expected, dst_ref, dst_ids)
    assert torch.equal(dst.view(torch.uint8), dst_ref.view(torch.uint8))
    assert torch.equal(dst[:, :, 3].view(torch.uint8), kv_cache[:, :, 0].view(torch.uint8))


def test_pack_empty(device: torch.device) -> None:
    kv_cache = _cache(SHAPES[0], torch.float32, device)
    ids = torch.empty(0, dtype=torch.int64, device=device)
    buf = pack_pages(kv_cache, ids)
    assert buf.shape == (0, 2, 2, 16, 2, 64)
    unpack_pages(buf, kv_cache, ids)


def test_unpack_rejects_wrong_shape(device: torch.device) -> None:
    kv_cache = _cache(SHAPES[0], torch.float32, device)
    ids = torch.tensor([1], device=device)
    with pytest.raises(AssertionError, match="buffer shape"):
        unpack_pages(torch.zeros((1, 2, 2, 16, 2, 32), device=device), kv_cache, ids)


@pytest.mark.gpu
@requires_cuda
def test_pack_gpu_llama_shapes() -> None:
    kv_cache, ids, buf = llama_packed(pack_pages, ref_pack_pages, 128)
    dst = torch.zeros_like(kv_cache)
    unpack_pages(buf, dst, ids)
    assert torch.equal(dst[:, :, ids.long()], kv_cache[:, :, ids.long()])
