"""The host-side sampler the engine used before sampling moved onto the logits' device, kept verbatim as
the reference the device sampler must equal on CPU (tests/engine/test_device_sampling.py).

Token sampling for a batch whose rows carry their own parameters.

Greedy rows take the argmax. Other rows apply temperature, then top-k, then top-p to the
distribution and draw with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which needs
no cumulative sum and lets a seeded row draw its noise from its own generator: a request with a
seed gets the same tokens whatever batch it lands in.

Logprobs (the chosen token's, and a row's ``top_logprobs`` most likely alternatives) come from the
model's raw distribution, log_softmax of the logits before temperature, top-k and top-p, as vLLM and
OpenAI report them.
"""

from __future__ import annotations

import torch

from services.engine.sampler import SamplingRow
from services.text.sampling_params import Sampled, TopLogprobs

__all__ = ["HostSampler"]


class HostSampler:
    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def _noise(self, rows: list[SamplingRow], vocab: int) -> torch.Tensor:
        out = torch.empty(len(rows), vocab)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                g = torch.Generator().manual_seed((row.params.seed * 1_000_003 + row.step) & (2**63 - 1))
                out[i].exponential_(generator=g)
            else:
                out[i].exponential_(generator=self._generator)
        return out

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[float | None]]:
        """logits [N, V] -> (token per row, logprob of the chosen token per row or None); see :meth:`sample`."""
        out = self.sample(logits, rows)
        return [s.token for s in out], [s.logprob for s in out]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[Sampled]:
        """logits [N, V] -> one Sampled per row (token; logprob if asked; top alternatives if asked)."""
        logits = logits.float().cpu()
        vocab = logits.shape[1]
        tokens = logits.argmax(dim=-1)
        sample_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sample_idx:
            idx = torch.tensor(sample_idx)
            sub = logits[idx]
            temps = torch.tensor([rows[i].params.temperature for i in sample_idx]).unsqueeze(1)
            sub = sub / temps
            top_ks = [rows[i].params.top_k for i in sample_idx]
            top_ps = [rows[i].params.top_p for i in sample_idx]
            if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
                sub = _apply_top_k_top_p(sub, top_ks, top_ps)
            probs = torch.softmax(sub, dim=-1)
            noise = self._noise([rows[i] for i in sample_idx], vocab)
            tokens[idx] = (probs / noise).argmax(dim=-1)
        token_list: list[int] = tokens.tolist()
        out = [Sampled(t) for t in token_list]
        want = [i for i, r in enumerate(rows) if r.params.logprobs]
        if not want:
            return out
        w = torch.tensor(want)
        lps = torch.log_softmax(logits[w], dim=-1)
        chosen = lps.gather(1, tokens[w].unsqueeze(1)).squeeze(1).tolist()
        k_max = min(vocab, max(rows[i].params.top_logprobs for i in want))
        top_v, top_i = lps.topk(k_max, dim=-1) if k_max else (lps[:, :0], lps[:, :0].long())
        top_v_l, top_i_l = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want):
            k = min(rows[i].params.top_logprobs, vocab)
            top = TopLogprobs(tuple(top_i_l[j][:k]), tuple(top_v_l[j][:k])) if k else None
            out[i] = Sampled(token_list[i], chosen[j], top)
        return out


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. Keeps at least one token."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks]).unsqueeze(1)
    ranks = torch.arange(vocab).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
    ps = torch.tensor(top_ps).unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Mass before each token; a token is kept while the mass before it is < p (the first always is).
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before >= ps, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
