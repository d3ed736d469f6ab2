"""A deterministic in-place initializer for the weights of random models (``random:NAME``; their shapes:
services/text/model/random_shapes.py, readable without torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

INIT_STD = 0.02
"""Std of every random matrix/bias; norms are 1. Keeps logits O(1) at any width."""

FP8_INIT_STD = 64.0
"""Std of the random e4m3 values of an FP8 block-scaled weight before they are clamped to +-448: spread over the
format's range as a real checkpoint's are (each block's largest value maps to 448 there)."""


def init_random_(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place, on its own device and dtype (no CPU/fp32 staging copy; an fp8 weight goes
    through one bf16 copy of itself on its device).

    Norm weights = 1, everything else ~ N(0, INIT_STD); an fp8 weight (an FP8 block-scaled linear's) and its
    block scales by :func:`fill_fp8_block_`. Deterministic for a given seed, device type and parameter order
    (CPU and CUDA generators give different, each reproducible, streams).
    """
    import torch

    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            g = generators.get(p.device)
            if g is None:
                g = generators[p.device] = torch.Generator(device=p.device)
                g.manual_seed(seed)
            if p.dtype == torch.float8_e4m3fn:
                fill_fp8_block_(p, model.get_submodule(name.rpartition(".")[0]).weight_scale_inv, g)
            else:
                p.normal_(0.0, INIT_STD, generator=g)


def fill_fp8_block_(weight: torch.Tensor, scale_inv: torch.Tensor, g: torch.Generator) -> None:
    """An FP8 block-scaled weight with the statistics of a bf16 random one: e4m3 values ~ N(0, FP8_INIT_STD)
    clamped to +-448 and positive fp32 block scales ~ U[0.5, 1.5) x INIT_STD / FP8_INIT_STD, so the dequantized
    weight has std ~ INIT_STD (x sqrt(13 / 12) for the spread of the scales). The values are drawn in bf16 (half
    the staging memory of fp32; e4m3 keeps 3 of its 7 mantissa bits) one weight at a time."""
    import torch

    staged = torch.empty(weight.shape, dtype=torch.bfloat16, device=weight.device)
    staged.normal_(0.0, FP8_INIT_STD, generator=g).clamp_(-448.0, 448.0)
    weight.copy_(staged)
    del staged
    scale_inv.uniform_(0.5, 1.5, generator=g).mul_(INIT_STD / FP8_INIT_STD)
