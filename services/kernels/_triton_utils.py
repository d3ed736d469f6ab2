"""Small helpers shared by the Triton kernels (needs triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpret_mode() -> bool:
    """True when kernels run under the Triton CPU interpreter (TRITON_INTERPRET=1)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST, DOT_PRECISION) constexprs for `_mma`.

    fp32 uses exact ("ieee") products, not tf32. The interpreter multiplies bf16 as raw uint16 bits,
    so under it bf16 operands are upcast to fp32 first.
    """
    upcast = interpret_mode() and dtype == torch.bfloat16
    return upcast, "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)
