"""FP8 block-scaled linears that stay fp8 on CUDA (the DeepSeek-V3 checkpoint format, weights/fp8_block.py).

Planned before any weight is allocated: ``load_model`` reads the checkpoint's tensor headers, and on the
meta model every plain ``nn.Linear`` under ``model.layers.`` whose every source weight (its HF tensor, or the
q/k/v resp. gate/up tensors of a fused one) is fp8 with its ``weight_scale_inv`` becomes an
:class:`Fp8BlockLinear` (:meth:`KeptFp8.swap_in`); ``to_empty`` then allocates the fp8 weight and the fp32
scales, never a dense copy. The fp8 weights flow through the model's own ``load_weights`` (fused rows filled
as for any weight, fp8 copied into fp8); the scales never reach it: :meth:`KeptFp8.placed_scales` takes them
out of the stream and writes each into its module's grid at its part's rows.

Fused parts stack their rows, each part with its own [cdiv(rows_i, bn), cdiv(K, bk)] grid. When every part
after the first starts at a multiple of bn (real checkpoints: q 4096 and k/v 1024 rows in 128-row blocks)
the grids stack as they are; otherwise the module's grid has one row per g = gcd(bn, part starts) weight
rows (each block row repeated bn / g times; g = 1: a scale per weight row), which the kernel reads as
g x bk blocks. Modules a model loads itself (``_self_loaded``: MoE experts, routers, shared experts, latent
attention) and the LM head keep the dequantized path, and so does a tensor-parallel build (:func:`keep_fp8`).

Random models whose shape declares FP8 blocks (``random:deepseek-v3-cut``) take the same decision
(:func:`keep_fp8`) and modules without a checkpoint: :func:`swap_in_random_fp8` makes every plain linear of the
decoder layers an :class:`Fp8BlockLinear` (one grid, no fused parts) but those whose weight the model reads as a
tensor (``_weight_read_linears``: latent attention's kv_b_proj); weights/random_weights.py fills them.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from services.engine.models.llama import _STACKED
from services.engine.parallel.group import building_group
from services.engine.weights.fp8_block import SAFETENSORS_FP8, SCALE_SUFFIX, scale_grid
from services.kernels import HAS_TRITON, fp8_block_matmul

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
KEEP_DTYPES = (torch.bfloat16, torch.float16)
"""Compute dtypes for which FP8 weights stay fp8 by default (an fp32 model dequantizes: a reference run)."""


class Fp8BlockLinear(nn.Module):
    """y = x @ (W * S[n // gn, k // bk])^T + b with W float8_e4m3fn [out, in] (``weight``), S fp32
    [cdiv(out, gn), cdiv(in, bk)] (``weight_scale_inv``, a buffer) and b in the compute dtype. The Triton FP8
    block GEMM on CUDA (kernels/fp8_block_gemm.py), dequantize-then-matmul elsewhere."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: nn.Parameter | None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = block
        """(gn, bk): rows and columns of weight per scale, as the kernel reads the grid."""
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.empty(scale_grid((out_features, in_features), block),
                                                             dtype=torch.float32, device=device))
        self.register_parameter("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = fp8_block_matmul(x2, self.weight, self.weight_scale_inv, self.block)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"bias={self.bias is not None}")


def keep_fp8(device: str | torch.device, dtype: torch.dtype, requested: bool | None) -> bool:
    """Whether a load keeps FP8 block-scaled linears in fp8. requested None: on CUDA with triton, in bf16/fp16,
    outside a tensor-parallel build (whose shards dequantize: the row-parallel column cuts of the weights
    would cut the scale grids too, which is not implemented). Raises ValueError for True under tensor
    parallelism."""
    tp = building_group()
    if requested is None:
        on_gpu = torch.device(device).type == "cuda" and HAS_TRITON and dtype in KEEP_DTYPES
        if on_gpu and tp is not None:
            log.info("engine: FP8 block-scaled weights are dequantized at load under tensor parallelism (size %d)",
                     tp.size)
        return on_gpu and tp is None
    if requested and tp is not None:
        raise ValueError(f"FP8 weights kept as fp8 under tensor parallelism (size {tp.size}) are not implemented: "
                         "load them dequantized (keep_fp8 None/False) or at tensor-parallel size 1")
    return requested


def _sources(module_name: str) -> list[str]:
    """HF weight names whose rows make up a (possibly fused) linear's weight, in row order."""
    name = f"{module_name}.weight"
    parts = sorted((idx, name.replace(fused, frag)) for frag, (fused, idx) in _STACKED.items() if fused in name)
    return [n for _, n in parts] or [name]


@dataclass(frozen=True)
class Fp8LinearPlan:
    """One linear kept fp8: its source weights (HF name, rows) in row order and its grid's rows per scale."""

    module: str
    sources: tuple[tuple[str, int], ...]
    group_n: int


def plan_fp8_linears(model: nn.Module, headers: dict[str, tuple[str, tuple[int, ...]]], block: tuple[int, int]
                     ) -> list[Fp8LinearPlan]:
    """The plain ``nn.Linear`` modules of the decoder layers whose every source is an fp8 weight of the
    module's shape with its scales in the checkpoint (``headers``: tensor_headers), minus those the model
    loads itself."""
    self_loaded: tuple[str, ...] = getattr(model, "_self_loaded", ())
    plans = []
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear or not name.startswith("model.layers."):
            continue
        if any(f in f"{name}.weight" for f in self_loaded):
            continue
        srcs = _sources(name)
        infos = [headers.get(s) for s in srcs]
        if any(i is None or i[0] != SAFETENSORS_FP8 or len(i[1]) != 2 or i[1][1] != mod.in_features
               for i in infos) or any(s + SCALE_SUFFIX not in headers for s in srcs):
            continue
        rows = [i[1][0] for i in infos if i is not None]
        if sum(rows) != mod.out_features:
            continue
        starts = list(itertools.accumulate(rows[:-1]))
        plans.append(Fp8LinearPlan(name, tuple(zip(srcs, rows, strict=True)), math.gcd(block[0], *starts)))
    return plans


def swap_fp8_linears(model: nn.Module, plans: Iterable[Fp8LinearPlan], block: tuple[int, int]) -> None:
    """Replace each planned linear of ``model`` (on the meta device, in its compute dtype) with an
    :class:`Fp8BlockLinear` of the same shape and bias, its grid in (group_n, block[1]) blocks."""
    for p in plans:
        parent_name, _, child = p.module.rpartition(".")
        parent = model.get_submodule(parent_name)
        dense = getattr(parent, child)
        setattr(parent, child, Fp8BlockLinear(dense.in_features, dense.out_features, (p.group_n, block[1]),
                                              dense.bias, device=dense.weight.device))


def plan_random_fp8(model: nn.Module, block: tuple[int, int]) -> list[Fp8LinearPlan]:
    """The linears an FP8 block-scaled checkpoint of this model would ship in fp8, for a random model: every plain
    ``nn.Linear`` of the decoder layers (attention projections, dense and shared-expert MLPs; not the router, a
    subclass, nor the 3-D experts, embedding or LM head) but the ``_weight_read_linears`` the model multiplies
    by their weight tensor directly. One grid in ``block`` blocks each (a random weight has no fused parts)."""
    skip: tuple[str, ...] = getattr(model, "_weight_read_linears", ())
    return [Fp8LinearPlan(name, ((f"{name}.weight", mod.out_features),), block[0])
            for name, mod in model.named_modules()
            if type(mod) is nn.Linear and name.startswith("model.layers.") and not name.endswith(skip)]


def swap_in_random_fp8(model: nn.Module, block: tuple[int, int]) -> int:
    """Make the :func:`plan_random_fp8` linears of ``model`` (on the meta device) Fp8BlockLinear modules; returns
    how many."""
    plans = plan_random_fp8(model, block)
    swap_fp8_linears(model, plans, block)
    return len(plans)


class KeptFp8:
    """One load's FP8 linears kept fp8: planned and swapped in on the meta model, then their scales placed."""

    def __init__(self, headers: dict[str, tuple[str, tuple[int, ...]]], block: tuple[int, int]) -> None:
        self.headers, self.block = headers, block
        self.plans: list[Fp8LinearPlan] = []

    @property
    def names(self) -> frozenset[str]:
        """The HF weight names that stay fp8 (their scales beside them)."""
        return frozenset(src for p in self.plans for src, _ in p.sources)

    def swap_in(self, model: nn.Module) -> None:
        """Replace each planned linear of ``model`` (on the meta device, in its compute dtype) with an
        :class:`Fp8BlockLinear` of the same shape and bias."""
        self.plans = plan_fp8_linears(model, self.headers, self.block)
        swap_fp8_linears(model, self.plans, self.block)
        fp8 = sum(1 for dtype, _ in self.headers.values() if dtype == SAFETENSORS_FP8)
        log.info("engine: %d linears keep their FP8 block-scaled weights (%d of the checkpoint's %d fp8 tensors) "
                 "and run the FP8 block GEMM; the other fp8 tensors are dequantized at load",
                 len(self.plans), len(self.names), fp8)

    def placed_scales(self, weights: Iterable[tuple[str, torch.Tensor]], model: nn.Module
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream without the kept weights' scales, each written into its module's grid as it passes.
        Raises ValueError for a scale of the wrong shape, or planned scales missing when the stream ends."""
        targets: dict[str, tuple[torch.Tensor, int, int, int]] = {}  # scale name -> (grid, first row, repeat, rows)
        for p in self.plans:
            grid = model.get_submodule(p.module).weight_scale_inv
            start = 0
            for src, rows in p.sources:
                targets[src + SCALE_SUFFIX] = (grid, start // p.group_n, self.block[0] // p.group_n,
                                               -(-rows // p.group_n))
                start += rows
        for name, t in weights:
            target = targets.pop(name, None)
            if target is None:
                yield name, t
                continue
            grid, first, repeat, rows = target
            part = t.repeat_interleave(repeat, dim=0)[:rows] if repeat > 1 else t
            dst = grid[first:first + rows]
            if tuple(part.shape) != tuple(dst.shape):
                raise ValueError(f"weight {name!r}: scale grid {tuple(t.shape)} does not fit the model's "
                                 f"{tuple(dst.shape)} rows of {self.block[0] // repeat}")
            dst.copy_(part)
        if targets:
            raise ValueError(f"{len(targets)} FP8 scale grids not found in the checkpoint, e.g. {sorted(targets)[:4]}")
