"""The top-level `kernels` helpers work without a GPU (torch reference path) and agree with the kernels."""

from __future__ import annotations

import torch

import kernels
from kernels import reference as ref


def test_cpu_dispatch_uses_reference() -> None:
    kv_cache = torch.randn((2, 2, 5, 4, 2, 8), generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([3, 1])
    pages = kernels.pack_pages(kv_cache, ids)
    assert torch.equal(pages, ref.ref_pack_pages(kv_cache, ids))
    dst = torch.zeros_like(kv_cache)
    kernels.unpack_pages(pages, dst, ids)
    assert torch.equal(dst[:, :, ids], kv_cache[:, :, ids])

    buf = kernels.pack_pages_fp8(kv_cache, ids)
    assert buf.shape == (2, kernels.fp8_page_nbytes(2, 4, 2, 8))
    kernels.unpack_pages_fp8(buf, dst, ids)
    torch.testing.assert_close(dst[:, :, ids], kv_cache[:, :, ids], atol=1e-4, rtol=1 / 16)

    q, s = kernels.fp8_quantize(kv_cache[0, 0])
    x = kernels.fp8_dequantize(q, s, torch.float32)
    torch.testing.assert_close(x, kv_cache[0, 0], atol=1e-4, rtol=1 / 16)
    assert kernels.HAS_TRITON in (True, False) and isinstance(kernels.has_cuda(), bool)
