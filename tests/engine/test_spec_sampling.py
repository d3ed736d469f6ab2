"""Rejection sampling keeps the target distribution (statistical, fixed seeds, small vocabulary).

Model: position j's target distribution p[j] and draft distribution q[j] do not depend on earlier
tokens (a context-free model), so every token the sampler emits at position j must be distributed as
p[j], whatever q is. Tolerance: with N draws over V=6 tokens, each test asserts
  * total-variation distance to p[j] below 0.025 (the sampling noise is ~ sqrt(V / N) / 2 ~ 0.009 at
    N=20000 for position 0), and
  * Pearson chi-square below the 0.999 quantile of chi2(V-1) (a false failure rate of 1e-3 per check;
    the seeds are fixed, so the test is deterministic).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from services.engine.spec.verify import greedy_accept, probs_for, rejection_sample, synthetic_count
from services.text.sampling_params import SamplingParams

V = 6
N = 20_000


def _dists(seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, dim=-1)
    q[:, 0] = 0.0  # the draft never proposes token 0: only the residual can produce it
    return p, q / q.sum(dim=-1, keepdim=True)


def _check(counts: torch.Tensor, p: torch.Tensor) -> None:
    n = float(counts.sum())
    freq = counts / n
    tv = 0.5 * float((freq - p).abs().sum())
    stat = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert tv < 0.025, f"total variation {tv:.4f} (freq {freq.tolist()}, target {p.tolist()})"
    assert stat < chi2.ppf(0.999, V - 1), f"chi-square {stat:.1f} over {n:.0f} draws"


@pytest.mark.parametrize("k", [1, 3])
def test_emitted_tokens_follow_the_target(k: int) -> None:
    p, q = _dists(100 + k, k)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(k + 1, V)
    accepted = 0
    for _ in range(N):
        draft = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
        tokens, m = rejection_sample(p, q, draft, gen)
        assert len(tokens) == m + 1 and tokens[:m] == draft[:m]
        accepted += m
        for j, t in enumerate(tokens):
            counts[j, t] += 1
    for j in range(k + 1):
        if counts[j].sum() > 2000:  # positions reached often enough to judge
            _check(counts[j], p[j])
    # Acceptance at position 0 is sum_x min(p, q) (the overlap); the sampler must not accept more.
    overlap = float(torch.minimum(p[0], q[0]).sum())
    assert accepted / N >= 0.8 * overlap


def test_identical_distributions_accept_everything() -> None:
    p, _ = _dists(5, 2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        draft = torch.multinomial(p[:2], 1, generator=gen).squeeze(1).tolist()
        tokens, m = rejection_sample(p, p[:2].clone(), draft, gen)
        assert m == 2 and tokens[:2] == draft


def test_greedy_accepts_the_agreeing_prefix() -> None:
    assert greedy_accept([4, 5, 6, 7], [4, 5, 9]) == ([4, 5, 6], 2)
    assert greedy_accept([4, 5, 6, 7], [4, 5, 6]) == ([4, 5, 6, 7], 3)
    assert greedy_accept([1, 2], [3]) == ([1], 0)


def test_synthetic_count_has_the_configured_mean() -> None:
    gen = torch.Generator().manual_seed(3)
    draws = [synthetic_count(2.3, 7, gen) for _ in range(5000)]
    assert set(draws) == {2, 3}
    assert abs(sum(draws) / len(draws) - 2.3) < 0.03
    assert synthetic_count(6.0, 3, gen) == 3  # capped at k


def test_probs_apply_temperature_and_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = probs_for(logits, SamplingParams(temperature=0.5, top_k=2))
    assert p[0, 2:].sum() == 0
    want = torch.softmax(torch.tensor([4.0, 2.0]), dim=0)
    torch.testing.assert_close(p[0, :2], want)
