"""The top-level `services.kernels` helpers work without a GPU (torch reference path) and agree with the kernels."""

from __future__ import annotations

import torch

import services.kernels as kernels
from services.kernels import reference as ref


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


def test_moe_experts_dispatch_on_cpu_is_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn((3, 8), generator=gen), torch.randn((4, 6, 8), generator=gen), torch.randn((4, 8, 3), generator=gen)
    ids = torch.tensor([[0, 3], [1, 3], [2, 0]], dtype=torch.int32)
    weights = torch.rand((3, 2), generator=gen)
    out = kernels.moe_experts(x, w13, w2, ids, weights, activation="gelu")
    assert torch.equal(out, ref.fused_moe_ref(x, w13, w2, ids, weights, activation="gelu"))
    # Token 0 by hand: experts 0 and 3.
    h = [w2[e] @ (torch.nn.functional.gelu((w13[e] @ x[0])[:3], approximate="tanh") * (w13[e] @ x[0])[3:])
         for e in (0, 3)]
    torch.testing.assert_close(out[0], weights[0, 0] * h[0] + weights[0, 1] * h[1])
