"""The LM head on the CUDA path: the skinny GEMM (kernels/skinny_gemm.py) for decode row counts where it measured
faster than the library GEMM, F.linear everywhere else (the other linears measured faster in cuBLAS and call it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_HALF = (torch.bfloat16, torch.float16)


def logits_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight.T for the LM head (tied or not), on the skinny GEMM where ``use_skinny`` says it wins."""
    if hidden.is_cuda and hidden.dim() == 2 and hidden.shape[0] <= 16 and weight.dtype in _HALF \
            and hidden.dtype == weight.dtype:
        # deferred: a Triton kernel module, on the CUDA path only (triton is optional)
        from services.kernels.skinny_gemm import skinny_gemm, use_skinny

        if use_skinny(hidden.shape[0], weight.shape[0], weight.shape[1]):
            return skinny_gemm(hidden if hidden.stride(-1) == 1 else hidden.contiguous(), weight)
    return F.linear(hidden, weight)
