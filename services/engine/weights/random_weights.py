"""A deterministic in-place initializer for the weights of random models (``random:NAME``; their shapes:
services/text/model/random_shapes.py, readable without torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

INIT_STD = 0.02
"""Std of every random matrix/bias; norms are 1. Keeps logits O(1) at any width."""


def init_random_(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place, on its own device and dtype (no CPU/fp32 staging copy).

    Norm weights = 1, everything else ~ N(0, INIT_STD). Deterministic for a given seed, device type
    and parameter order (CPU and CUDA generators give different, each reproducible, streams).
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
            p.normal_(0.0, INIT_STD, generator=g)
