"""SwiGLU activation over the fused gate_up projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    X_ptr,
    Y_ptr,
    stride_x,
    stride_y,
    N,
    BLOCK: tl.constexpr,
):
    """y[t, j] = silu(x[t, j]) * x[t, N + j],  silu(g) = g * sigmoid(g); silu rounded to the dtype
    before the product (as torch's `F.silu(gate) * up`)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(X_ptr + t * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(X_ptr + t * stride_x + N + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf * tl.sigmoid(gf)).to(g.dtype).to(tl.float32)
    tl.store(Y_ptr + t * stride_y + offs, (s * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] = [gate | up] -> silu(gate) * up [T, N]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2N], got {tuple(x.shape)}"
    assert x.stride(-1) == 1, "rows must be contiguous"
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4 if block >= 512 else 2,
    )
    return out
