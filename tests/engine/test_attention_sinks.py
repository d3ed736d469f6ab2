"""The CPU paged attention with sliding windows and attention sinks vs transformers' eager gpt-oss attention
(``GptOssAttention``'s ``eager_attention_forward``: sink logit per head in the softmax denominator, sink column
dropped), over every path: whole-prompt prefill, chunked prefill over cached pages, batched decode gathers,
one sequence's decode views, batched views past VIEWS_MIN_KEYS_BATCHED keys."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.engine.attention import VIEWS_MIN_KEYS_BATCHED, AttentionMetadata, TorchPagedAttention, sdpa

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

H, KVH, D, BS = 4, 2, 16, 4
SCALE = D ** -0.5
TOL = 2e-5


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               window: int) -> torch.Tensor:
    """q [S, H, D], k/v [S, KVH, D] of one sequence -> [S, H, D] by transformers' eager gpt-oss attention
    (sinks zero-weight = -inf logit when None), causal and windowed mask as transformers builds it."""
    s = q.shape[0]
    pos = torch.arange(s)
    allowed = pos[None, :] <= pos[:, None]
    if window:
        allowed &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(s, s).masked_fill(~allowed, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=H // KVH, training=False,
                             sinks=sinks if sinks is not None else torch.full((H,), float("-inf")))
    out, _ = gpt_oss.eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], mask, SCALE)
    return out[0]  # [S, H, D]


class Paged:
    """Sequences over one layer's paged cache; steps feed (seq, number of new tokens) pairs, decode rows first."""

    def __init__(self, seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], tables: list[list[int]],
                 window: int, sinks: torch.Tensor | None, device: str = "cpu") -> None:
        self.seqs, self.tables, self.window, self.sinks, self.device = seqs, tables, window, sinks, device
        blocks = max(max(t) for t in tables) + 1
        kv = torch.zeros(1, 2, blocks, BS, KVH, D, device=device)
        if device == "cpu":
            self.backend = TorchPagedAttention(kv, SCALE)
        else:
            from services.engine.cuda.gpu_attention import TritonPagedAttention  # needs triton: GPU runs only

            self.backend = TritonPagedAttention(kv, SCALE)
        self.lens = [0] * len(seqs)
        self.out = [torch.full_like(q, float("nan")) for q, _, _ in seqs]

    def step(self, new: list[tuple[int, int]]) -> None:
        q, k, v, slots, qlens, ctx = [], [], [], [], [], []
        for s, n in new:
            a, b = self.lens[s], self.lens[s] + n
            sq, sk, sv = self.seqs[s]
            q.append(sq[a:b])
            k.append(sk[a:b])
            v.append(sv[a:b])
            slots += [self.tables[s][p // BS] * BS + p % BS for p in range(a, b)]
            qlens.append(n)
            ctx.append(b)
        width = max(len(self.tables[s]) for s, _ in new)
        dev = self.device
        cu = torch.tensor([0, *qlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev), query_lens=qlens, context_lens_host=ctx,
            block_tables=torch.tensor([(self.tables[s] + [0] * width)[:width] for s, _ in new], dtype=torch.int32,
                                      device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev), num_decode=sum(1 for n in qlens if n == 1),
            cu_seqlens_q=cu.to(dev))
        sinks = None if self.sinks is None else self.sinks.to(dev)
        o = self.backend.forward(0, torch.cat(q).to(dev), torch.cat(k).to(dev), torch.cat(v).to(dev), meta,
                                 window=self.window, sinks=sinks).float().cpu()
        start = 0
        for s, n in new:
            self.out[s][self.lens[s]:self.lens[s] + n] = o[start:start + n]
            self.lens[s] += n
            start += n
        self.last_plan = meta.window_plans.get(self.window) or meta.decode_plan


def _seq(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(n, H, D, generator=g), torch.randn(n, KVH, D, generator=g),
            torch.randn(n, KVH, D, generator=g))


def _check(p: Paged) -> None:
    for i, (q, k, v) in enumerate(p.seqs):
        n = p.lens[i]
        ref = _reference(q[:n], k[:n], v[:n], p.sinks, p.window)
        diff = (p.out[i][:n] - ref).abs().max().item()
        assert diff < TOL, f"sequence {i}: max |diff| {diff:.2e} (window {p.window}, sinks {p.sinks is not None})"


@pytest.mark.parametrize("window", [0, 6, 9])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_prefill_chunks_and_batched_decode_gathers(window: int, with_sinks: bool) -> None:
    g = torch.Generator().manual_seed(window)
    sinks = torch.randn(H, generator=g) * 2 if with_sinks else None
    seqs = [_seq(40, g), _seq(40, g), _seq(40, g)]
    # Non-consecutive, interleaved pages: the decode rows gather.
    tables = [list(range(0, 30, 3)), list(range(1, 30, 3)), list(range(2, 30, 3))]
    p = Paged(seqs, tables, window, sinks)
    p.step([(0, 17)])                        # whole prompt, no cache: causal (+ window) mask
    p.step([(1, 5)])
    p.step([(0, 1), (1, 11), (2, 3)])        # a decode row beside chunks over cached pages
    p.step([(2, 12)])
    for _ in range(12):
        p.step([(0, 1), (1, 1), (2, 1)])     # batched decode: gather plan
    assert p.last_plan is not None and p.last_plan.gather is not None
    _check(p)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_single_sequence_decode_reads_views(window: int, with_sinks: bool) -> None:
    g = torch.Generator().manual_seed(3)
    sinks = torch.randn(H, generator=g) if with_sinks else None
    p = Paged([_seq(30, g)], [list(range(8))], window, sinks)
    p.step([(0, 13)])
    for _ in range(15):
        p.step([(0, 1)])
    assert p.last_plan is not None and p.last_plan.starts is not None  # consecutive pages: views, no gather
    _check(p)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_batched_views_past_the_views_threshold(with_sinks: bool) -> None:
    g = torch.Generator().manual_seed(4)
    n = VIEWS_MIN_KEYS_BATCHED + 20
    sinks = torch.randn(H, generator=g) if with_sinks else None
    pages = (n + BS - 1) // BS
    p = Paged([_seq(n, g), _seq(n, g)], [list(range(pages)), list(range(pages, 2 * pages))],
              VIEWS_MIN_KEYS_BATCHED + 8, sinks)
    p.step([(0, n - 3)])
    p.step([(1, n - 3)])
    for _ in range(3):
        p.step([(0, 1), (1, 1)])
    assert p.last_plan is not None and p.last_plan.starts is not None
    _check(p)


def test_sdpa_with_sinks_equals_transformers_and_sinks_change_it() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = _seq(11, g)
    sinks = torch.randn(H, generator=g)
    ref = _reference(q, k, v, sinks, 0)
    ours = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, SCALE, True,
                sinks, is_causal=True)[0].transpose(0, 1)
    assert (ours - ref).abs().max().item() < TOL
    plain = _reference(q, k, v, None, 0)
    assert (plain - ref).abs().max().item() > 1e-2  # the sink really takes probability mass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_triton_backend_honours_window_and_sinks(window: int, with_sinks: bool) -> None:
    """The GPU backend passes each layer's window and sinks to the Triton kernels (fp32 cache)."""
    g = torch.Generator().manual_seed(7)
    sinks = torch.randn(H, generator=g) if with_sinks else None
    tables = [list(range(0, 30, 3)), list(range(1, 30, 3)), list(range(2, 30, 3))]
    p = Paged([_seq(40, g), _seq(40, g), _seq(40, g)], tables, window, sinks, device="cuda")
    p.step([(0, 17)])
    p.step([(1, 5)])
    p.step([(0, 1), (1, 11), (2, 3)])
    for _ in range(12):
        p.step([(0, 1), (1, 1), (2, 1)])
    _check(p)
