"""CPU decode attention (services/engine/attention.py): a decode sequence whose blocks are consecutive pool blocks
attends over a view of the pool instead of a gather, small decode batches attend on one torch thread. Logits equal
a whole-context prefill (the path that reads no cache) for contiguous and fragmented block tables, batch 1, batches
of several sequences and mixed decode + prefill steps, prefix-shared blocks, contexts crossing block boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine import attention
from services.engine.attention import ForwardContext, TorchPagedAttention
from services.engine.model_loader import load_model
from services.engine.step_inputs import prepare_rows

BS = 4
"""Block size: small, so every few tokens a context crosses into the next block."""


class Paged:
    """A model over a paged pool with block tables the test picks (``prepare_rows``, as the model runner)."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 64) -> None:
        a = model.arch
        self.model = model
        self.kv = torch.zeros(a.num_layers, 2, num_blocks, BS, a.num_kv_heads, a.head_dim)
        self.backend = TorchPagedAttention(self.kv, a.head_dim ** -0.5)
        self.plans: list[attention.DecodePlan | None] = []

    def forward(self, rows: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
        """Logits of each row's last new token; one-token rows first."""
        ids, pos, meta = prepare_rows(rows, BS, torch.device("cpu"))
        hidden = self.model(ids, pos, ForwardContext(self.backend, meta))
        self.plans.append(meta.decode_plan)
        ends = torch.tensor([len(r[0]) for r in rows]).cumsum(0) - 1
        return list(self.model.compute_logits(hidden[ends]).float())


def reference(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Last-token logits of one prefill of the whole context in a fresh pool (attends to no cached keys)."""
    return Paged(model, (len(tokens) + BS - 1) // BS).forward([(tokens, 0, list(range((len(tokens) + BS - 1) // BS)))])[0]


@pytest.fixture(scope="module")
def model(tiny_llama3_dir: Path) -> torch.nn.Module:
    return load_model(str(tiny_llama3_dir), torch.float32).model


@pytest.mark.parametrize("batched_views_from", [0, attention.VIEWS_MIN_KEYS_BATCHED])
@torch.inference_mode()
def test_decode_logits_equal_a_whole_prefill_for_contiguous_and_fragmented_tables(
        model: torch.nn.Module, batched_views_from: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "VIEWS_MIN_KEYS_BATCHED", batched_views_from)  # 0: batches read views too
    tables = {"a": list(range(10, 22)), "b": [30, 2, 17, 5, 40, 41, 3, 60, 8, 9, 50, 51],
              "c": list(range(22, 30)), "d": list(range(34, 39)),
              "p": [10, 45, 46, 47, 48, 49, 52, 53, 54, 55, 56, 57]}
    # p shares a's first block (a prefix-cache hit: the same leading 4 tokens), then blocks of its own.
    toks = {"a": list(range(3, 8)), "b": list(range(40, 53)), "c": list(range(60, 69)), "d": [80, 81, 82]}
    toks["p"] = [*toks["a"][:4], 9, 9, 9, 9, 70, 71, 72]
    paged = Paged(model)
    paged.forward([(toks[s], 0, tables[s]) for s in ("a", "b", "c", "d")])
    paged.forward([(toks["p"][4:], 4, tables["p"])])  # prefill after a cached 4-token block: the gather path
    lens = {s: len(t) for s, t in toks.items()}
    steps = [["a"], ["a", "c"], ["b"], ["a", "b"], ["c", "p"], ["p"], ["a", "b", "c", "p"]] * 2
    for n, seqs in enumerate(steps):
        rows = [([toks[s][-1] * 7 % 90 + 3], lens[s], tables[s]) for s in seqs]
        mixed = n % 4 == 3
        if mixed:  # a prefill chunk of d (after its cached tokens) in the same step: a mixed batch
            rows.append(([11, 12], lens["d"], tables["d"]))
            toks["d"] += [11, 12]
            lens["d"] += 2
        got = paged.forward(rows)
        for s, r in zip(seqs, rows, strict=False):
            toks[s].append(r[0][0])
            lens[s] += 1
        if mixed:
            torch.testing.assert_close(got[-1], reference(model, toks["d"]), rtol=1e-4, atol=1e-4)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(got[i], reference(model, toks[s]), rtol=1e-4, atol=1e-4)
        plan = paged.plans[-1]
        assert plan is not None
        # b and p are fragmented: every step with one gathers; these contexts are short of the default threshold
        views = all(s in ("a", "c") for s in seqs) and (len(seqs) == 1 or batched_views_from == 0)
        assert (plan.starts is not None) == views, (seqs, plan.starts)
        if views:
            assert plan.starts == [tables[s][0] * BS for s in seqs] and plan.gather is None


def test_consecutive_starts() -> None:
    assert attention.consecutive_starts([[4, 5, 6], [9]], 16) == [64, 144]
    assert attention.consecutive_starts([[4, 5, 6], [9, 11]], 16) is None
    assert attention.consecutive_starts([[4, 6, 6]], 16) is None  # ends span the right width, middle does not


@torch.inference_mode()
def test_small_gathered_decode_batches_attend_on_one_thread_and_restore_the_steps_count(
        model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    sdpa = attention.F.scaled_dot_product_attention

    def counting(*args: object, **kw: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return sdpa(*args, **kw)

    paged = Paged(model)
    prompts = [list(range(3 + 9 * i, 12 + 9 * i)) for i in range(6)]
    paged.forward([(p, 0, list(range(3 * i, 3 * i + 3))) for i, p in enumerate(prompts)])
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # batch 1 on consecutive blocks reads views at the step's threads; small gathered batches use one thread
        for batch, want in ((1, 2), (4, 1), (6, 2)):
            seen.clear()
            paged.forward([([5], 9, list(range(3 * i, 3 * i + 3))) for i in range(batch)])
            assert set(seen) == {want}, (batch, seen)
            assert torch.get_num_threads() == 2  # the step's count is back for the next layer's GEMMs
        seen.clear()
        paged.forward([([6], 10, [3, 40, 5])])  # a fragmented batch 1 (only threads checked): gathered on one thread
        assert set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
