"""Argument checks and activation names of the fused MoE layer, shared by the Triton kernel and the
torch reference (torch only, importable without triton)."""

from __future__ import annotations

import torch

#: activation name -> the kernel's ACTIVATION constexpr.
ACTIVATIONS: dict[str, int] = {"silu": 0, "gelu": 1, "gpt_oss": 2}


def check_moe_args(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    swiglu_alpha: float | None,
    swiglu_limit: float | None,
) -> None:
    """Shape, dtype and option checks shared by the kernel and the reference (ValueError on misuse)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if activation == "gpt_oss":
        if swiglu_alpha is None or swiglu_limit is None:
            raise ValueError("fused_moe: activation 'gpt_oss' needs swiglu_alpha and swiglu_limit")
    elif swiglu_alpha is not None or swiglu_limit is not None:
        raise ValueError(f"fused_moe: swiglu_alpha/swiglu_limit apply only to 'gpt_oss', not {activation!r}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: x [T,H], w13 [E,2I,H], w2 [E,H,I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    t, h = x.shape
    e, two_i, h13 = w13.shape
    inter = two_i // 2
    if h13 != h or two_i % 2 or tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"fused_moe: shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} (want w13 [E,2I,{h}], w2 [E,{h},I])")
    if not x.dtype == w13.dtype == w2.dtype:
        raise ValueError(f"fused_moe: x, w13, w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"fused_moe: topk_ids must be int32 [T={t}, K], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: topk_weights must be float32 {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    if w13_bias is not None and tuple(w13_bias.shape) != (e, two_i):
        raise ValueError(f"fused_moe: w13_bias must be [{e}, {two_i}], got {tuple(w13_bias.shape)}")
    if w2_bias is not None and tuple(w2_bias.shape) != (e, h):
        raise ValueError(f"fused_moe: w2_bias must be [{e}, {h}], got {tuple(w2_bias.shape)}")
