"""The device sampler equals the host sampler it replaced, value for value, on CPU: greedy and sampled
rows, per-request seeds, top-k/top-p, logprobs with up to 20 alternatives, rows with and without logprobs
in one batch; and `logprob_table` (what the CUDA graph computes) gives the same values."""

from __future__ import annotations

import pytest
import torch

from services.engine.sampler import Sampler, SamplingRow, logprob_table
from services.text.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from tests.engine.reference_sampler import HostSampler

VOCAB = 3000


def _batch(n: int, seed: int) -> tuple[torch.Tensor, list[SamplingRow]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g) * 3
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS),
        SamplingParams(temperature=0.8, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=1.0, top_k=50, seed=7),
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=True, top_logprobs=1, seed=11),
        SamplingParams(temperature=1.3, top_k=20, top_p=0.5),
        SamplingParams(temperature=1.0, logprobs=True),
    ]
    rows = [SamplingRow(kinds[i % len(kinds)].validate(), step=i // len(kinds)) for i in range(n)]
    return logits, rows


@pytest.mark.parametrize("seed", [0, 1])
def test_device_sampler_equals_the_host_sampler(seed: int) -> None:
    device, host = Sampler(seed=5), HostSampler(seed=5)
    for step in range(3):  # the shared generator advances the same way over steps
        logits, rows = _batch(24, seed * 10 + step)
        assert device.sample(logits, rows) == host.sample(logits, rows)


def test_only_some_rows_or_none_want_logprobs() -> None:
    logits, rows = _batch(8, 3)
    plain = [SamplingRow(SamplingParams(temperature=0.0).validate(), 0) for _ in rows]
    got = Sampler().sample(logits, plain)
    assert got == HostSampler().sample(logits, plain) and all(s.logprob is None for s in got)
    mixed = plain[:4] + rows[4:]
    assert Sampler(seed=2).sample(logits, mixed) == HostSampler(seed=2).sample(logits, mixed)


def test_a_precomputed_table_gives_the_same_results() -> None:
    """The graph path hands `results` a table of every row with MAX_TOP_LOGPROBS alternatives."""
    logits, rows = _batch(16, 4)
    sampler = Sampler(seed=9)
    tokens = sampler.tokens(logits, rows)
    table = logprob_table(logits, tokens, MAX_TOP_LOGPROBS)
    assert table.shape == (16, 2 + 2 * MAX_TOP_LOGPROBS)
    assert sampler.results(logits, tokens, rows, table) == sampler.results(logits, tokens, rows)
    lps = torch.log_softmax(logits, -1)
    assert torch.equal(table[:, 1], lps.gather(1, tokens.unsqueeze(1)).squeeze(1))
    assert torch.equal(table[:, 0].long(), tokens)
    assert torch.equal(table[:, 2 + MAX_TOP_LOGPROBS:].long(), lps.topk(MAX_TOP_LOGPROBS, -1).indices)
