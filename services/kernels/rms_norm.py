"""RMSNorm, optionally fused with the residual add that precedes it (one read, two writes per row).

The added delta may come unreduced: [T, P, N], P partial rows per token (a mixture-of-experts block's K weighted
expert rows), summed in fp32 and rounded once in the same pass, so the block needs no launch of its own to sum
them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X_ptr,
    R_ptr,
    W_ptr,
    Y_ptr,
    RO_ptr,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row t:  x[t] = sum_p X[t * PARTS + p] in fp32, rounded to the input dtype (PARTS 1: X[t] as is)
               s = x[t] (+ r[t], rounded to the input dtype; stored to RO[t])
               y[t] = w * (s * rsqrt(mean(s^2) + eps)).to(dtype)   (fp32 math, two roundings, as HF)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if PARTS == 1:
        x = tl.load(X_ptr + t * stride_x + offs, mask=mask, other=0.0)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(PARTS):
            x = tl.load(X_ptr + (t * PARTS + p) * stride_x + offs, mask=mask, other=0.0)
            acc += x.to(tl.float32)
        x = acc.to(x.dtype)
    if HAS_RESIDUAL:
        r = tl.load(R_ptr + t * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(RO_ptr + t * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y_ptr + t * stride_y + offs, (normed * w).to(x.dtype), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2, f"x must be [T, N], got {tuple(x.shape)}"
    assert weight.shape == (x.shape[1],), f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}"
    assert weight.dtype == x.dtype, f"weight dtype {weight.dtype} must equal x dtype {x.dtype}"
    assert x.stride(-1) == 1 and weight.is_contiguous(), "rows must be contiguous"


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, res_out: torch.Tensor | None, parts: int = 1) -> None:
    t, n = out.shape
    if t == 0:
        return
    block = triton.next_power_of_2(n)
    r = x if residual is None else residual
    ro = out if res_out is None else res_out
    _rms_norm_kernel[(t,)](
        x,
        r,
        weight,
        out,
        ro,
        x.stride(0),
        r.stride(0),
        out.stride(0),
        ro.stride(0),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        PARTS=parts,
        BLOCK=block,
        num_warps=max(1, min(16, block // 512)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y [T, N] = weight * (x * rsqrt(mean(x^2, -1) + eps)) for x [T, N] (fp32 math, x.dtype out)."""
    _check(x, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [T, N]; both outputs are new tensors.

    x may also be [T, P, N]: P partial rows per token, summed first (fp32, rounded once to x's dtype, as
    ``x.sum(1)`` rounds) in the same pass."""
    parts = 1
    if x.dim() == 3:
        parts = x.shape[1]
        assert x.is_contiguous(), "partial rows [T, P, N] must be contiguous"
        x = x.view(-1, x.shape[2])
        assert residual.dim() == 2 and x.shape[0] == parts * residual.shape[0], (
            f"{parts} partial rows per token do not match residual {tuple(residual.shape)}")
    else:
        assert residual.shape == x.shape, f"x {tuple(x.shape)} does not match residual {tuple(residual.shape)}"
    _check(x, weight)
    assert residual.dtype == x.dtype and residual.stride(-1) == 1 and residual.shape[1] == x.shape[1]
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, eps, out, res_out, parts)
    return out, res_out
