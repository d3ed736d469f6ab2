"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs, mixed rows in one batch.

Distribution checks draw many rows at once (the sampler treats each row independently) and compare
empirical frequencies with the exact probabilities: with N = 20000 draws the standard error of a
frequency is <= 0.0036, so the 0.02 tolerance is > 5 sigma.
"""

from __future__ import annotations

import torch

from services.engine.sampler import Sampler, SamplingRow
from services.text.sampling_params import SamplingParams

N = 20000
FREQ_TOL = 0.02
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def _rows(params: SamplingParams, n: int, step: int = 0) -> list[SamplingRow]:
    params.validate()
    return [SamplingRow(params, step) for _ in range(n)]


def _freqs(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def test_greedy_is_argmax_and_ignores_seed() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=g)
    rows = [SamplingRow(SamplingParams(temperature=0.0, seed=i if i % 2 else None).validate(), i)
            for i in range(64)]
    tokens, logprobs = Sampler(seed=123)(logits, rows)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == [None] * 64


def test_temperature_matches_softmax_of_scaled_logits() -> None:
    sampler = Sampler(seed=1)
    for temp in (0.5, 1.0, 2.0):
        tokens, _ = sampler(LOGITS.expand(N, -1), _rows(SamplingParams(temperature=temp), N))
        expected = torch.softmax(LOGITS.double() / temp, -1)
        diff = (_freqs(tokens, len(LOGITS)) - expected).abs().max().item()
        assert diff < FREQ_TOL, f"temperature {temp}: max |freq - p| = {diff:.4f}"


def test_top_k_only_draws_top_k_tokens() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 500, generator=g) * 0.1  # near-uniform: without top-k, all 500 would appear
    k = 5
    tokens, _ = Sampler(seed=2)(logits.expand(N, -1), _rows(SamplingParams(temperature=1.0, top_k=k), N))
    allowed = set(logits[0].topk(k).indices.tolist())
    assert set(tokens) == allowed  # only the top k, and each of them is reachable
    expected = torch.softmax(logits[0].double()[sorted(allowed)], -1)
    got = _freqs(tokens, 500)[sorted(allowed)]
    assert (got - expected).abs().max().item() < FREQ_TOL


def test_top_p_never_draws_outside_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = probs.log()
    # Mass before token 2 is 0.8 >= 0.75: the nucleus is {0, 1}, renormalized to 0.625 / 0.375.
    tokens, _ = Sampler(seed=3)(logits.expand(N, -1), _rows(SamplingParams(temperature=1.0, top_p=0.75), N))
    assert set(tokens) == {0, 1}
    assert abs(_freqs(tokens, 5)[0].item() - 0.625) < FREQ_TOL
    # top_p = 1 keeps everything; a tiny top_p keeps only the most likely token.
    tokens, _ = Sampler(seed=3)(logits.expand(N, -1), _rows(SamplingParams(temperature=1.0, top_p=1.0), N))
    assert set(tokens) == {0, 1, 2, 3, 4}
    tokens, _ = Sampler(seed=3)(logits.expand(N, -1), _rows(SamplingParams(temperature=1.0, top_p=1e-6), N))
    assert set(tokens) == {0}


def test_top_k_and_top_p_combine() -> None:
    probs = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    # top-k 3 leaves [0.3, 0.25, 0.2] -> renormalized [0.4, 0.333, 0.267]; top-p 0.7: mass before token 2
    # is 0.733 >= 0.7, so the nucleus is {0, 1}.
    tokens, _ = Sampler(seed=4)(probs.log().expand(N, -1),
                                _rows(SamplingParams(temperature=1.0, top_k=3, top_p=0.7), N))
    assert set(tokens) == {0, 1}


def test_seed_reproducible_across_batch_compositions() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 300, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234).validate()
    alone = [Sampler(seed=0)(logits[i:i + 1], [SamplingRow(seeded, i)])[0][0] for i in range(40)]
    # Same rows inside batches with other (seeded and unseeded) rows, at different positions,
    # through samplers whose own generators are in other states.
    other = SamplingParams(temperature=0.7, top_k=50).validate()
    for sampler_seed, pos in ((1, 0), (2, 3), (3, 5)):
        sampler = Sampler(seed=sampler_seed)
        got = []
        for i in range(40):
            batch = torch.randn(6, 300, generator=g)
            batch[pos] = logits[i]
            rows = [SamplingRow(other, i)] * 6
            rows[pos] = SamplingRow(seeded, i)
            rows[(pos + 1) % 6] = SamplingRow(SamplingParams(temperature=1.0, seed=99).validate(), i)
            got.append(sampler(batch, rows)[0][pos])
        assert got == alone
    # A different seed gives a different stream (40 draws from ~300 tokens cannot all agree by chance).
    other_seed = SamplingParams(temperature=1.0, seed=4321).validate()
    assert [Sampler()(logits[i:i + 1], [SamplingRow(other_seed, i)])[0][0] for i in range(40)] != alone


def test_unseeded_rows_differ_between_draws() -> None:
    logits = torch.zeros(1, 1000)
    sampler = Sampler(seed=6)
    draws = [sampler(logits, _rows(SamplingParams(temperature=1.0), 1))[0][0] for _ in range(20)]
    assert len(set(draws)) > 10


def test_logprobs_equal_log_softmax_at_chosen_token() -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(8, 200, generator=g) * 3
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=0.8, logprobs=True),
              SamplingParams(temperature=1.3, top_k=10, logprobs=True), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_p=0.5, seed=3, logprobs=True),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, logprobs=True),
              SamplingParams(temperature=0.0, logprobs=True)]
    rows = [SamplingRow(p.validate(), 0) for p in params]
    tokens, logprobs = Sampler(seed=7)(logits, rows)
    ref = torch.log_softmax(logits.double(), -1)
    for i, p in enumerate(params):
        if not p.logprobs:
            assert logprobs[i] is None
            continue
        assert logprobs[i] is not None
        assert abs(logprobs[i] - ref[i, tokens[i]].item()) < 1e-5, f"row {i}"


def test_mixed_params_in_one_batch() -> None:
    g = torch.Generator().manual_seed(8)
    base = torch.randn(1, 400, generator=g) * 2
    logits = base.expand(7, -1).clone()
    params = [
        SamplingParams(temperature=0.0),                        # greedy
        SamplingParams(temperature=1.0, top_k=1),               # top-1: always the argmax
        SamplingParams(temperature=5.0, top_p=1e-6),            # tiny nucleus: always the argmax
        SamplingParams(temperature=1.0, top_k=3),               # one of the top 3
        SamplingParams(temperature=1.0, top_p=0.3),             # inside the 0.3 nucleus
        SamplingParams(temperature=1.0, seed=11),               # its own stream
        SamplingParams(temperature=0.01),                        # near-greedy
    ]
    rows = [SamplingRow(p.validate(), 0) for p in params]
    sampler = Sampler(seed=8)
    argmax = int(base.argmax())
    top3 = set(base[0].topk(3).indices.tolist())
    p_sorted, order = torch.softmax(base[0].double(), -1).sort(descending=True)
    nucleus = set(order[:int(((p_sorted.cumsum(0) - p_sorted) < 0.3).sum())].tolist())
    seeded_alone = Sampler(seed=0)(base, [SamplingRow(params[5], 0)])[0][0]
    for _ in range(200):
        t, _ = sampler(logits, rows)
        assert t[0] == t[1] == t[2] == t[6] == argmax
        assert t[3] in top3
        assert t[4] in nucleus
        assert t[5] == seeded_alone


def test_top_logprobs_are_the_k_most_likely_of_the_raw_distribution() -> None:
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 300, generator=g) * 2
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
              SamplingParams(temperature=1.5, top_k=7, logprobs=True, top_logprobs=20),  # not bent by top-k/T
              SamplingParams(temperature=0.7, logprobs=True),                              # no alternatives
              SamplingParams(temperature=0.0),                                             # nothing asked
              SamplingParams(temperature=1.0, top_p=0.2, seed=1, logprobs=True, top_logprobs=1)]
    rows = [SamplingRow(p.validate(), 0) for p in params]
    out = Sampler(seed=9).sample(logits, rows)
    ref = torch.log_softmax(logits.double(), -1)
    for i, p in enumerate(params):
        s = out[i]
        if not p.top_logprobs:
            assert s.top is None
            assert (s.logprob is None) == (not p.logprobs)
            continue
        assert s.top is not None and len(s.top.token_ids) == len(s.top.logprobs) == p.top_logprobs
        want = ref[i].topk(p.top_logprobs)
        assert list(s.top.token_ids) == want.indices.tolist(), f"row {i}"
        assert all(abs(a - b) < 1e-5 for a, b in zip(s.top.logprobs, want.values.tolist(), strict=True))
        assert list(s.top.logprobs) == sorted(s.top.logprobs, reverse=True)
        assert s.logprob is not None and abs(s.logprob - ref[i, s.token].item()) < 1e-5
    assert out[0].top is not None and out[0].top.token_ids[0] == out[0].token  # greedy: the argmax is first


def test_top_logprobs_validation() -> None:
    import pytest

    from services.text.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        SamplingParams(top_logprobs=3).validate()  # needs logprobs
    with pytest.raises(InvalidRequestError, match="20"):
        SamplingParams(logprobs=True, top_logprobs=21).validate()
    assert SamplingParams(logprobs=True, top_logprobs=20).validate().top_logprobs == 20
