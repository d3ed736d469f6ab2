"""Linear layers on the CUDA path: the skinny GEMM (kernels/skinny_gemm.py) where it measured faster than the
library GEMM (decode row counts, plain bf16/fp16 weights), the layer itself everywhere else."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_HALF = (torch.bfloat16, torch.float16)


def _plain(layer: nn.Module) -> bool:
    """An nn.Linear computing x @ W.T + b itself (not a tensor-parallel, quantized or replaced one)."""
    return isinstance(layer, nn.Linear) and type(layer).forward is nn.Linear.forward


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; on the skinny GEMM for a CUDA x of few rows where ``use_skinny`` says it wins."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= 16 and _plain(layer):
        w = layer.weight
        if w.dtype in _HALF and x.dtype == w.dtype:
            # deferred: a Triton kernel module, on the CUDA path only (triton is optional)
            from services.kernels.skinny_gemm import skinny_gemm, use_skinny

            if use_skinny(x.shape[0], w.shape[0], w.shape[1]):
                return skinny_gemm(x if x.stride(-1) == 1 else x.contiguous(), w, layer.bias)
    return layer(x)


def logits_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight.T for the LM head (tied or not), on the skinny GEMM where it wins (as ``linear``)."""
    if hidden.is_cuda and hidden.dim() == 2 and hidden.shape[0] <= 16 and weight.dtype in _HALF \
            and hidden.dtype == weight.dtype:
        # deferred: a Triton kernel module, on the CUDA path only (triton is optional)
        from services.kernels.skinny_gemm import skinny_gemm, use_skinny

        if use_skinny(hidden.shape[0], weight.shape[0], weight.shape[1]):
            return skinny_gemm(hidden if hidden.stride(-1) == 1 else hidden.contiguous(), weight)
    return F.linear(hidden, weight)
