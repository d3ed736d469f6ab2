"""Mixture-of-experts block: router, top-k, routed experts stacked as [E, ...] tensors, shared expert.

Expert weights of a layer are two stacked tensors: ``w13`` [E, 2I, H] (rows 0..I-1 = gate, I..2I-1 = up)
and ``w2`` [E, H, I] (down), with optional biases ``w13_bias`` [E, 2I], ``w2_bias`` [E, H] (gpt-oss).
:func:`moe_experts` computes ``out[t] = sum_k w[t, k] * down_e(act(gate_e(x[t])) * up_e(x[t]))`` for
e = ids[t, k]: on CPU (and on CUDA without the Triton kernel) tokens are sorted by expert and each expert
that got tokens runs one matmul over its rows; on CUDA the Triton fused MoE (``services.kernels.fused_moe``) runs.

Tensor parallelism: every expert (and the shared expert) is split along its intermediate dimension, each
rank holding rows [r*I/N, (r+1)*I/N) of every expert's gate and up and the same columns of down; the router
is replicated, so all ranks route alike, and one all-reduce per layer sums the partial outputs (the dense
MLP's pattern). ``w2_bias`` is held by rank 0 only (the others hold zeros) so the sum adds it once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.parallel.group import building_group
from services.engine.parallel.layers import local_intermediate
from services.text.model.config import ModelArchConfig
from services.text.model.moe_config import MoEConfig


def route(logits: torch.Tensor, moe: MoEConfig, score_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, K], expert ids int32 [T, K]).

    With ``moe.n_group`` > 1 a token chooses among the experts of its ``topk_group`` best groups only;
    ``score_bias`` (fp32 [E], DeepSeek-V3) is added to the scores for choosing, the weights stay the scores.
    CUDA logits of a router without groups take the one-launch Triton form (``kernels/moe_route.py``)."""
    k = moe.top_k
    if logits.is_cuda and moe.n_group == 1 and k & (k - 1) == 0:
        # kernels.moe_route imports triton: only a CUDA engine loads it (as fused_moe below).
        from services.kernels.moe_route import route_topk

        if moe.scoring == "softmax_topk":
            return route_topk(logits, k, moe.scoring)
        return route_topk(logits, k, moe.scoring, score_bias=score_bias, normalize=moe.norm_topk_prob,
                          scaling=moe.routed_scaling_factor)
    if moe.scoring == "softmax_topk":
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1)
        return weights, ids.to(torch.int32)
    scores = torch.softmax(logits.float(), dim=-1) if moe.scoring == "softmax" else torch.sigmoid(logits.float())
    if score_bias is None and moe.n_group == 1:
        weights, ids = torch.topk(scores, k, dim=-1)
    else:
        choice = scores if score_bias is None else scores + score_bias.float()
        if moe.n_group > 1:
            t, e = choice.shape
            grouped = choice.view(t, moe.n_group, e // moe.n_group)
            if moe.group_score == "max":
                group = grouped.amax(dim=-1)
            else:
                group = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(moe.topk_group, dim=-1).indices,
                                                                      True)
            choice = choice.masked_fill(~keep.repeat_interleave(e // moe.n_group, dim=1), float("-inf"))
        ids = torch.topk(choice, k, dim=-1).indices
        weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if moe.score_bias else 0.0))
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids.to(torch.int32)


class Router(nn.Linear):
    """The router linear (bias for gpt-oss) and, for DeepSeek-V3, its choice bias ``e_score_correction_bias``
    (the HF name, fp32 [E])."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__(hidden, moe.num_experts, bias=moe.router_bias)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.score_bias else None


def _activate(h: torch.Tensor, inter: int, activation: str, alpha: float | None, limit: float | None
              ) -> torch.Tensor:
    """[n, 2I] gate|up -> [n, I]."""
    gate, up = h[:, :inter], h[:, inter:]
    if activation == "silu":
        return F.silu(gate) * up
    assert alpha is not None and limit is not None
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None, swiglu_alpha: float | None = None,
                    swiglu_limit: float | None = None) -> torch.Tensor:
    """The torch path of :func:`moe_experts`: the T*K (token, expert) pairs sorted by expert, one matmul pair
    per expert that has pairs, the outputs scaled by their weights and summed per token in fp32."""
    t, k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host read per layer
    rows = x.index_select(0, order // k)  # [T*K, H], grouped by expert
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        seg = slice(start, start + n)
        h = F.linear(rows[seg], w13[e], None if w13_bias is None else w13_bias[e])
        a = _activate(h, inter, activation, swiglu_alpha, swiglu_limit)
        out[seg] = F.linear(a, w2[e], None if w2_bias is None else w2_bias[e])
        start += n
    scaled = out.float() * topk_weights.reshape(-1)[order].float()[:, None]
    total = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    return total.index_add_(0, order // k, scaled).to(x.dtype)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None, swiglu_alpha: float | None = None,
                swiglu_limit: float | None = None, reduce: bool = True) -> torch.Tensor:
    """x [T, H] through the experts each token chose -> [T, H] (the dispatch point for CUDA kernels).

    topk_ids int32 [T, K], topk_weights fp32 [T, K]. The signature is the Triton fused MoE's: CUDA tensors run
    it (no host sync, so the layer lives inside the decode CUDA graphs); CPU tensors run the grouped torch path.
    reduce=False (CUDA only): each token's K weighted expert rows unsummed, [T, K, H] (fused_moe's)."""
    if x.is_cuda:
        # kernels.fused_moe imports triton: only a CUDA engine loads it (as the other GPU kernels in llama.py).
        from services.kernels.fused_moe import fused_moe

        return fused_moe(x, w13, w2, topk_ids.to(torch.int32), topk_weights.float(), activation=activation,
                         w13_bias=w13_bias, w2_bias=w2_bias, swiglu_alpha=swiglu_alpha,
                         swiglu_limit=swiglu_limit, reduce=reduce)
    assert reduce, "unsummed expert rows are a CUDA path"
    return grouped_experts(x, w13, w2, topk_ids, topk_weights, activation=activation, w13_bias=w13_bias,
                           w2_bias=w2_bias, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)


class Experts(nn.Module):
    """A layer's routed experts: w13 [E, 2I_local, H], w2 [E, H, I_local] (+ biases when the model has them)."""

    def __init__(self, moe: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.inter = local_intermediate(moe.intermediate_size)
        e = moe.num_experts
        self.w13 = nn.Parameter(torch.empty(e, 2 * self.inter, hidden))
        self.w2 = nn.Parameter(torch.empty(e, hidden, self.inter))
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * self.inter)) if moe.expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(e, hidden)) if moe.expert_bias else None


class SharedExpert(nn.Module):
    """An always-on SwiGLU expert; under tensor parallelism it returns this rank's partial sum (the MoE block
    all-reduces once for routed and shared experts together)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = local_intermediate(inter)
        self.gate_up_proj = nn.Linear(hidden, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """x [T, H] -> routed experts' weighted sum (+ the gated shared expert), summed over tensor-parallel ranks."""

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        self.moe = moe
        self.gate = Router(arch.hidden_size, moe)
        self.experts = Experts(moe, arch.hidden_size)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = SharedExpert(arch.hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False) if moe.shared_expert_gate else None
        self.group = building_group()

    def _routed(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] (``reduce``), or each token's K weighted rows [T, K, H]."""
        moe, ex = self.moe, self.experts
        weights, ids = route(self.gate(x), moe, self.gate.e_score_correction_bias)
        return moe_experts(x, ex.w13, ex.w2, ids, weights, activation=moe.activation, w13_bias=ex.w13_bias,
                           w2_bias=ex.w2_bias, swiglu_alpha=moe.swiglu_alpha, swiglu_limit=moe.swiglu_limit,
                           reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._routed(x)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out if self.group is None else self.group.all_reduce(out)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The CUDA path (the decoder layer's forward_fused): without a shared expert or tensor-parallel ranks,
        each token's K weighted expert rows come back unsummed, [T, K, H], and the next fused residual-add +
        RMSNorm sums them in its own pass (one launch fewer per layer); else ``forward``."""
        if self.shared_expert is not None or self.group is not None or not x.is_cuda:
            return self.forward(x)
        return self._routed(x, reduce=False)
