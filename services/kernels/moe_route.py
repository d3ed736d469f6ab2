"""Mixture-of-experts routing in one launch: router logits [T, E] -> (weights fp32 [T, K], expert ids int32 [T, K]).

The torch form of ``models/moe.py: route`` is five to seven small launches per layer (softmax or sigmoid, top-k,
the sum and division of the normalisation, the scaling, the casts); at decode batch sizes each costs about as much
as the work itself, and a decode step runs one per MoE layer. Here one program per token holds the row's E scores
in registers and picks its K experts by K rounds of arg-max (the largest id losing ties, as a stable descending
sort of the ids would not: ties between distinct router logits are measure-zero, and the tests use distinct ones).

Scoring as `route` does it, for routers without expert groups (``n_group`` 1):
- ``softmax``: weights are softmax(logits) at the chosen experts; ``sigmoid``: sigmoid(logits);
- ``score_bias`` (DeepSeek-V3's choice bias) is added to the scores for choosing only;
- ``softmax_topk`` (gpt-oss): the K largest logits, softmax over those K;
- then ``norm_topk_prob`` divides by the chosen weights' sum (+ 1e-20 with a choice bias) and
  ``routed_scaling_factor`` multiplies.
Group-limited routing (DeepSeek-V2/V3 ``n_group`` > 1) stays with the torch form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: scoring name -> the kernel's SCORING constexpr.
SCORINGS = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}


@triton.jit
def _route_kernel(
    Logits_ptr,
    Bias_ptr,
    W_ptr,
    Ids_ptr,
    stride_lt,
    num_experts,
    scaling,
    norm_eps,
    TOP_K: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Row t = program 0: scores of the E experts, K arg-max rounds over score (+ bias), weights as the module
    docstring says, written to W[t, :K] (fp32) and Ids[t, :K] (int32)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    logits = tl.load(Logits_ptr + row * stride_lt + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if SCORING == 0:
        shifted = tl.exp(logits - tl.max(logits, axis=0))
        scores = shifted / tl.sum(shifted, axis=0)
    elif SCORING == 1:
        scores = tl.sigmoid(logits)
    else:
        scores = logits
    choice = tl.where(valid, scores, float("-inf"))
    if HAS_BIAS:
        choice += tl.load(Bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    slots = tl.arange(0, TOP_K)
    picked_w = tl.zeros([TOP_K], dtype=tl.float32)
    picked_id = tl.zeros([TOP_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        idx = tl.max(tl.where(choice == best, offs, -1), axis=0)
        w = tl.sum(tl.where(offs == idx, scores, 0.0), axis=0)
        picked_w = tl.where(slots == k, w, picked_w)
        picked_id = tl.where(slots == k, idx, picked_id)
        choice = tl.where(offs == idx, float("-inf"), choice)
    if SCORING == 2:  # softmax over the K chosen logits (picked in descending order: slot 0 is the max)
        e = tl.exp(picked_w - tl.max(picked_w, axis=0))
        picked_w = e / tl.sum(e, axis=0)
    if NORMALIZE:
        picked_w = picked_w / (tl.sum(picked_w, axis=0) + norm_eps)
    picked_w = picked_w * scaling
    tl.store(W_ptr + row * TOP_K + slots, picked_w)
    tl.store(Ids_ptr + row * TOP_K + slots, picked_id)


def route_topk(logits: torch.Tensor, top_k: int, scoring: str, *, score_bias: torch.Tensor | None = None,
               normalize: bool = False, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, K], ids int32 [T, K]) of router logits [T, E] in one launch (module docstring).
    top_k must be a power of two (the kernel's slot vector; 1, 2, 4, 8 cover the supported models)."""
    if scoring not in SCORINGS:
        raise ValueError(f"route_topk: scoring {scoring!r} is not one of {sorted(SCORINGS)}")
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1] or top_k & (top_k - 1):
        raise ValueError(f"route_topk: logits [T, E] with 0 < top_k <= E and top_k a power of two; got "
                         f"{tuple(logits.shape)}, top_k {top_k}")
    if score_bias is not None and scoring == "softmax_topk":
        raise ValueError("route_topk: a choice bias does not apply to 'softmax_topk' scoring")
    t, e = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    bias = score_bias.contiguous() if score_bias is not None else logits  # placeholder when HAS_BIAS is false
    _route_kernel[(t,)](
        logits, bias, weights, ids, logits.stride(0), e, float(scaling), 1e-20 if score_bias is not None else 0.0,
        TOP_K=top_k, SCORING=SCORINGS[scoring], HAS_BIAS=score_bias is not None, NORMALIZE=normalize,
        BLOCK_E=triton.next_power_of_2(e), num_warps=4 if e > 256 else 1,
    )  # fmt: skip
    return weights, ids
