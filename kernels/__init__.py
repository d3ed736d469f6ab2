"""Triton kernels for pdserve and their torch references.

`kernels.reference` and `kernels.fp8_layout` are importable everywhere (torch only). The Triton
kernel modules (`paged_decode_attention`, `prefill_attention`, `store_kv`, `page_pack`, `fp8_kv`)
need triton; import them only when `HAS_TRITON` is true. On a machine without CUDA they run under the
Triton interpreter when `TRITON_INTERPRET=1` is set before those modules are first imported.
"""

from __future__ import annotations

import importlib.util

from kernels.fp8_layout import (
    FP8_E4M3_MAX,
    fp8_layout_codec_name,
    fp8_page_nbytes,
    fp8_page_regions,
    plain_page_nbytes,
)

HAS_TRITON: bool = importlib.util.find_spec("triton") is not None


def has_cuda() -> bool:
    """True when torch sees at least one CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def triton_usable() -> bool:
    """True when Triton kernels can run here: triton present and a GPU (or the interpreter) available."""
    if not HAS_TRITON:
        return False
    import os

    return has_cuda() or os.environ.get("TRITON_INTERPRET", "0") == "1"


__all__ = [
    "FP8_E4M3_MAX",
    "HAS_TRITON",
    "fp8_layout_codec_name",
    "fp8_page_nbytes",
    "fp8_page_regions",
    "has_cuda",
    "plain_page_nbytes",
    "triton_usable",
]
