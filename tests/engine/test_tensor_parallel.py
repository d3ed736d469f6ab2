"""Tensor parallelism on CPU (gloo): TP=2 and TP=4 equal TP=1 on small random Llama / Qwen3 models."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from services.engine.parallel.group import open_store
from services.engine.parallel.split import HeadSplit, TensorParallelError, padded_range
from tests.engine import tp_ranks

TOL = 1e-4
"""Max |logit difference| allowed, fp32: TP sums the same products in another order (row-parallel
partial sums, then an all-reduce); logits are O(1), the observed differences are ~1e-6."""


def _spawn(target, size: int, *args) -> dict[int, object]:
    ctx = mp.get_context("spawn")
    store = open_store(size)
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, size, store.port, *args, results), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    return got


def test_head_split_shares_and_replication() -> None:
    assert [HeadSplit(32, 8, 4, r).kv_range for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 2 KV heads over 4 ranks: each head on two consecutive ranks, which own its query heads.
    s = [HeadSplit(4, 2, 4, r) for r in range(4)]
    assert [x.kv_range for x in s] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [x.q_range for x in s] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert s[0].kv_owners() == [0, 2]
    assert padded_range(10, 4, 3) == (9, 10, 3)
    for bad in ((4, 2, 3), (6, 4, 3), (4, 3, 2)):
        try:
            HeadSplit(*bad)
        except TensorParallelError as e:
            assert "tensor-parallel size" in str(e)
        else:
            raise AssertionError(f"{bad} accepted")


def _check(size: int) -> None:
    got = _spawn(tp_ranks.logits_rank, size, ["random:tiny-llama", "random:tiny-qwen3"], 3)
    for rank, diffs in got.items():
        assert isinstance(diffs, dict), f"rank {rank}: {diffs}"
        for spec, (kv_heads, per_step) in diffs.items():
            assert kv_heads == max(1, 2 // size), (spec, rank)
            assert len(per_step) == 5 and max(per_step) < TOL, (spec, rank, per_step)


def test_tp2_logits_equal_tp1_prefill_and_decode() -> None:
    _check(2)


def test_tp4_logits_equal_tp1_with_replicated_kv_heads() -> None:
    _check(4)


def test_tp1_model_is_the_plain_model() -> None:
    from torch import nn

    from services.engine.model_loader import load_model

    m = load_model("random:tiny-qwen3", torch.float32).model
    attn = m.model.layers[0].self_attn
    assert type(attn.o_proj) is nn.Linear and type(m.model.embed_tokens) is nn.Embedding
    assert m.tp_split.tp_size == 1 and m.gather_logits(torch.ones(2)) is not None


def test_config_refuses_unsupported_degrees_and_a_draft() -> None:
    import pytest

    from services.engine.config import EngineConfig, EngineConfigError

    with pytest.raises(EngineConfigError, match="must be 1, 2, 4 or 8, got 3"):
        EngineConfig(tensor_parallel_size=3)
    with pytest.raises(EngineConfigError, match="runs no draft model"):
        EngineConfig(tensor_parallel_size=2, draft_model="layers:1")


def test_a_model_the_degree_cannot_split_is_refused_before_any_rank_starts() -> None:
    import pytest

    from services.engine.parallel.loader import check_split

    check_split("random:tiny-qwen3", 4)  # 4 heads, 2 KV heads (replicated), intermediate 128
    with pytest.raises(TensorParallelError, match=r"--tensor-parallel-size.* 2 cannot run random:smollm2-135m: "
                                                  r"tensor-parallel size 2 does not divide the 9 attention heads"):
        check_split("random:smollm2-135m", 2)
