"""Verification of draft tokens against the target: greedy, rejection sampling, synthetic acceptance.

Every function here works on one sequence's rows and host fp32 tensors; no model, no cache.

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft token ``d_j`` was drawn from the
draft's distribution ``q_j``; it is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first
rejection the token is drawn from ``norm(max(p_j - q_j, 0))`` and the step ends; when all K are
accepted a bonus token is drawn from ``p_K``. Each emitted token is then distributed exactly as the
target's ``p`` (tests/engine/test_spec_sampling.py checks it statistically).
"""

from __future__ import annotations

import torch

from services.engine.sampler import SamplingRow, _apply_top_k_top_p
from services.text.sampling_params import Sampled, SamplingParams, TopLogprobs

_MIN_RESIDUAL = 1e-12
"""Below this total residual mass (p == q up to rounding) the resample falls back to p itself."""


def probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] fp32 probabilities after the request's temperature, top-k and top-p
    (the distribution the plain sampler draws from). Not for greedy rows."""
    x = logits.float() / params.temperature
    vocab = x.shape[1]
    if 0 < params.top_k < vocab or params.top_p < 1.0:
        n = x.shape[0]
        x = _apply_top_k_top_p(x, [params.top_k] * n, [params.top_p] * n)
    return torch.softmax(x, dim=-1)


def row_generator(row: SamplingRow, shared: torch.Generator) -> torch.Generator:
    """The generator a row draws from: its own, keyed by (seed, step), when the request has a seed."""
    if row.params.seed is None:
        return shared
    return torch.Generator().manual_seed((row.params.seed * 1_000_003 + row.step + 7_919) & (2**63 - 1))


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=gen).item())


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: list[int], gen: torch.Generator
                     ) -> tuple[list[int], int]:
    """p [k+1, V] target probabilities, q [k, V] draft probabilities, draft k tokens drawn from q.

    Returns (emitted tokens: the accepted drafts then one resampled or bonus token, accepted count)."""
    k = len(draft)
    u = torch.rand(k, generator=gen) if k else torch.empty(0)
    for j, d in enumerate(draft):
        pd, qd = float(p[j, d]), float(q[j, d])
        if qd > 0 and float(u[j]) * qd < pd:  # u < p/q without dividing (q(d) > 0: d was drawn from q)
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        total = float(residual.sum())
        tok = draw(residual / total if total > _MIN_RESIDUAL else p[j], gen)
        return [*draft[:j], tok], j
    return [*draft, draw(p[k], gen)], k


def greedy_accept(target_argmax: list[int], draft: list[int]) -> tuple[list[int], int]:
    """target_argmax [k+1]: the target's argmax after each prefix. Accept while the draft agrees."""
    m = 0
    while m < len(draft) and draft[m] == target_argmax[m]:
        m += 1
    return [*draft[:m], target_argmax[m]], m


def synthetic_count(mean: float, k: int, gen: torch.Generator) -> int:
    """Accepted drafts in synthetic mode: floor(mean) plus one with probability frac(mean), at most k."""
    whole = int(mean)
    extra = 1 if float(torch.rand(1, generator=gen)) < mean - whole else 0
    return min(k, whole + extra)


def with_logprobs(tokens: list[int], logits: torch.Tensor, params: SamplingParams) -> list[Sampled]:
    """Sampled entries for tokens emitted at consecutive rows of raw target logits [>= len(tokens), V]
    (logprobs from log_softmax of the raw logits, as the plain sampler reports them)."""
    if not params.logprobs:
        return [Sampled(t) for t in tokens]
    lps = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = lps.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
    k = min(params.top_logprobs, lps.shape[1])
    if not k:
        return [Sampled(t, lp) for t, lp in zip(tokens, chosen, strict=True)]
    top_v, top_i = lps.topk(k, dim=-1)
    return [Sampled(t, lp, TopLogprobs(tuple(i), tuple(v)))
            for t, lp, i, v in zip(tokens, chosen, top_i.tolist(), top_v.tolist(), strict=True)]
