"""Triton kernels for pdserve and their torch references.

`services.kernels.reference` and `services.kernels.fp8_layout` are importable everywhere (torch only), and so are the
device-dispatching page/fp8 helpers below (Triton for CUDA tensors, the torch reference otherwise). The Triton
kernel modules (`paged_decode_attention`, `prefill_attention`, `mla_decode_attention`, `mla_prefill_attention`,
`index_topk`, `sparse_mla_attention`, `store_kv`, `page_pack`, `fp8_kv`, `fused_moe`, `fp8_block_gemm`) need triton; import them only when `HAS_TRITON` is true. On a machine without CUDA
they run under the Triton interpreter when `TRITON_INTERPRET=1` is set before those modules are first imported.
"""

from __future__ import annotations

import importlib.util

import torch

from services.kernels.fp8_layout import (
    FP8_E4M3_MAX,
    fp8_layout_codec_name,
    fp8_page_nbytes,
    fp8_page_regions,
    plain_page_nbytes,
)
from services.kernels.reference import (
    fused_moe_ref,
    ref_fp8_block_gemm,
    ref_fp8_dequantize,
    ref_fp8_quantize,
    ref_pack_pages,
    ref_pack_pages_fp8,
    ref_unpack_pages,
    ref_unpack_pages_fp8,
)

HAS_TRITON: bool = importlib.util.find_spec("triton") is not None


def has_cuda() -> bool:
    """True when torch sees at least one CUDA device."""
    return bool(torch.cuda.is_available())


def triton_usable() -> bool:
    """True when Triton kernels can run here: triton present and a GPU (or the interpreter) available."""
    if not HAS_TRITON:
        return False
    import os

    return has_cuda() or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _on_triton(t: torch.Tensor) -> bool:
    """Dispatch rule: Triton kernels for CUDA tensors, torch references otherwise (CPU engine path)."""
    return t.is_cuda and HAS_TRITON


def pack_pages(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[P, L, 2, bs, kvh, hd] pages of block_ids (see kernels.page_pack); Triton on CUDA, torch elsewhere.
    ``out``: a contiguous tensor of the pages' size and the cache's dtype to gather into (CPU)."""
    if _on_triton(kv_cache):
        from services.kernels.page_pack import pack_pages as impl  # Triton: CUDA tensors only

        pages = impl(kv_cache, block_ids)
        return pages if out is None else out.view(pages.shape).copy_(pages)
    return ref_pack_pages(kv_cache, block_ids, out)


def unpack_pages(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Scatter [P, L, 2, bs, kvh, hd] pages into kv_cache at block_ids; Triton on CUDA, torch elsewhere."""
    if _on_triton(kv_cache):
        from services.kernels.page_pack import unpack_pages as impl  # Triton: CUDA tensors only
    else:
        impl = ref_unpack_pages
    impl(buffer, kv_cache, block_ids)


def pack_pages_fp8(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """uint8 [P, fp8_page_nbytes] fp8-e4m3 pages of block_ids; Triton on CUDA, torch elsewhere."""
    if _on_triton(kv_cache):
        from services.kernels.fp8_kv import pack_pages_fp8 as impl  # Triton: CUDA tensors only
    else:
        impl = ref_pack_pages_fp8
    return impl(kv_cache, block_ids)


def unpack_pages_fp8(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Dequantize fp8 pages into kv_cache at block_ids; Triton on CUDA, torch elsewhere."""
    if _on_triton(kv_cache):
        from services.kernels.fp8_kv import unpack_pages_fp8 as impl  # Triton: CUDA tensors only
    else:
        impl = ref_unpack_pages_fp8
    impl(buffer, kv_cache, block_ids)


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, kvh, hd] -> (fp8 values, fp32 scales [T, kvh]); Triton on CUDA, torch elsewhere."""
    if _on_triton(x):
        from services.kernels.fp8_kv import fp8_quantize as impl  # Triton: CUDA tensors only
    else:
        impl = ref_fp8_quantize
    return impl(x)


def fp8_dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [T, kvh, hd] with fp32 scales [T, kvh] -> dtype; Triton on CUDA, torch elsewhere."""
    if _on_triton(q):
        from services.kernels.fp8_kv import fp8_dequantize as impl  # Triton: CUDA tensors only
    else:
        impl = ref_fp8_dequantize
    return impl(q.contiguous(), scales.contiguous(), dtype)


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    **options: object,
) -> torch.Tensor:
    """The routed experts of an MoE layer (see kernels.fused_moe.fused_moe for the formula and options);
    Triton on CUDA, the per-expert torch reference elsewhere. Named apart from the `fused_moe` module so
    that importing the module never shadows this function on the package."""
    if _on_triton(x):
        from services.kernels.fused_moe import fused_moe as impl  # Triton: CUDA tensors only
    else:
        impl = fused_moe_ref
    return impl(x, w13, w2, topk_ids, topk_weights, **options)


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]
                     ) -> torch.Tensor:
    """x [M, K] @ (fp8 weight [N, K] * fp32 block scales)^T in x's dtype (see kernels.fp8_block_gemm);
    Triton on CUDA, the dequantize-then-matmul torch reference elsewhere."""
    if _on_triton(x):
        from services.kernels.fp8_block_gemm import fp8_block_gemm  # Triton: CUDA tensors only

        return fp8_block_gemm(x, weight, weight_scale, block)
    return ref_fp8_block_gemm(x, weight, weight_scale, block)


__all__ = [
    "FP8_E4M3_MAX",
    "HAS_TRITON",
    "fp8_block_matmul",
    "fp8_dequantize",
    "fp8_layout_codec_name",
    "fp8_page_nbytes",
    "fp8_page_regions",
    "fp8_quantize",
    "has_cuda",
    "moe_experts",
    "pack_pages",
    "pack_pages_fp8",
    "plain_page_nbytes",
    "triton_usable",
    "unpack_pages",
    "unpack_pages_fp8",
]
