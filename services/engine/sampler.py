"""Token sampling for a batch whose rows carry their own parameters.

Greedy rows take the argmax. Other rows apply temperature, then top-k, then top-p to the
distribution and draw with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which needs
no cumulative sum and lets a seeded row draw its noise from its own generator: a request with a
seed gets the same tokens whatever batch it lands in.

Logprobs (the chosen token's, and a row's ``top_logprobs`` most likely alternatives) come from the
model's raw distribution, log_softmax of the logits before temperature, top-k and top-p, as vLLM and
OpenAI report them.

Everything runs on the logits' device (a GPU's logits never cross to the host whole): the host gets the
tokens, or one [rows, 2 + 2k] table of tokens, their logprobs and the top-k alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.text.sampling_params import Sampled, SamplingParams, TopLogprobs

__all__ = ["Sampled", "Sampler", "SamplingRow", "device_index", "logprob_table"]


@dataclass
class SamplingRow:
    params: SamplingParams
    step: int
    """Tokens this request has sampled so far; with params.seed it keys the row's noise."""


class Sampler:
    """Samples on the logits' device: only [rows] tokens and, for rows asking for logprobs, [rows, 2 + 2k]
    values come back to the host, in one copy (`logprob_table`)."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        """The shared generator of unseeded rows, one per device (seeded with ``seed``), made at first use."""

    def _shared(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device).manual_seed(self._seed)
        return g

    def _noise(self, rows: list[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor:
        out = torch.empty(len(rows), vocab, device=device)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                g = torch.Generator(device).manual_seed((row.params.seed * 1_000_003 + row.step) & (2**63 - 1))
                out[i].exponential_(generator=g)
            else:
                out[i].exponential_(generator=self._shared(device))
        return out

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[float | None]]:
        """logits [N, V] -> (token per row, logprob of the chosen token per row or None); see :meth:`sample`."""
        out = self.sample(logits, rows)
        return [s.token for s in out], [s.logprob for s in out]

    @torch.inference_mode()
    def tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits [N, V] (fp32, any device) -> int64 [N] tokens on that device (nothing copied to the host but
        the rows' parameters)."""
        logits = logits.float()
        vocab, device = logits.shape[1], logits.device
        tokens = logits.argmax(dim=-1)
        sample_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sample_idx:
            idx = device_index(sample_idx, device)
            sub = logits[idx]
            temps = device_values([rows[i].params.temperature for i in sample_idx], torch.float32, device).unsqueeze(1)
            sub = sub / temps
            top_ks = [rows[i].params.top_k for i in sample_idx]
            top_ps = [rows[i].params.top_p for i in sample_idx]
            if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
                sub = _apply_top_k_top_p(sub, top_ks, top_ps)
            probs = torch.softmax(sub, dim=-1)
            noise = self._noise([rows[i] for i in sample_idx], vocab, device)
            tokens[idx] = (probs / noise).argmax(dim=-1)
        return tokens

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[Sampled]:
        """logits [N, V] -> one Sampled per row (token; logprob if asked; top alternatives if asked)."""
        tokens = self.tokens(logits, rows)
        return self.results(logits, tokens, rows)

    @torch.inference_mode()
    def results(self, logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
                table: torch.Tensor | None = None) -> list[Sampled]:
        """Sampled per row from device ``tokens`` [N]: one host copy (of `pack`'s tensor)."""
        return self.unpack(self.pack(logits, tokens, rows, table).cpu(), rows, logits.shape[1])

    @staticmethod
    def pack(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
             table: torch.Tensor | None = None) -> torch.Tensor:
        """What a step's host needs, in one fp32 tensor on the device: the N tokens, then the `logprob_table`
        rows (k = the widest row's top_logprobs) of the rows asking for logprobs. ``table``: that table of every
        row already computed (e.g. by a CUDA graph) with at least k alternatives."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs]
        if not want:
            return tokens.float()
        vocab = logits.shape[1]
        k_max = min(vocab, max(rows[i].params.top_logprobs for i in want))
        w = device_index(want, tokens.device) if len(want) < len(rows) else slice(None)
        if table is None:
            part = logprob_table(logits[w].float(), tokens[w], k_max)
        else:
            k_all = (table.shape[1] - 2) // 2
            t = table[w]
            part = torch.cat([t[:, :2 + k_max], t[:, 2 + k_all:2 + k_all + k_max]], dim=1)
        return torch.cat([tokens.float(), part.flatten()])

    @staticmethod
    def unpack(host: torch.Tensor, rows: list[SamplingRow], vocab: int) -> list[Sampled]:
        """`pack`'s tensor, on the host -> one Sampled per row."""
        n = len(rows)
        ids = host[:n].long().tolist()
        want = [i for i, r in enumerate(rows) if r.params.logprobs]
        out = [Sampled(t) for t in ids]
        if not want:
            return out
        k_max = min(vocab, max(rows[i].params.top_logprobs for i in want))
        part = host[n:].view(len(want), 2 + 2 * k_max)
        chosen = part[:, 1].tolist()
        top_v = part[:, 2:2 + k_max].tolist()
        top_i = part[:, 2 + k_max:].long().tolist()
        for j, i in enumerate(want):
            k = min(rows[i].params.top_logprobs, vocab)
            top = TopLogprobs(tuple(top_i[j][:k]), tuple(top_v[j][:k])) if k else None
            out[i] = Sampled(ids[i], chosen[j], top)
        return out


def device_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor on ``device``; on CUDA through pinned memory without waiting (a pageable copy would wait
    for the stream: an async step would stall on it)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index tensor on ``device`` (see `device_values`)."""
    return device_values(values, torch.int64, device)


def logprob_table(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [N, 2 + 2k] on the logits' device: per row the token, its logprob under the raw distribution
    (log_softmax of ``logits``), the k largest logprobs (most likely first), then their token ids. Token ids
    travel as fp32, exact below 2**24 (every vocabulary here). Fixed shapes: a CUDA graph captures it."""
    assert logits.shape[1] < 1 << 24, "token ids travel as fp32"
    lps = torch.log_softmax(logits, dim=-1)
    chosen = lps.gather(1, tokens.unsqueeze(1))
    top_v, top_i = lps.topk(k, dim=-1)
    return torch.cat([tokens.unsqueeze(1).float(), chosen, top_v, top_i.float()], dim=1)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. Keeps at least one token."""
    vocab, device = logits.shape[1], logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = device_values([k if 0 < k < vocab else vocab for k in top_ks], torch.int64, device).unsqueeze(1)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
    ps = device_values(top_ps, torch.float32, device).unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Mass before each token; a token is kept while the mass before it is < p (the first always is).
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before >= ps, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
