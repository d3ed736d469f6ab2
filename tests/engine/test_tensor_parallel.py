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


def test_graph_plan_round_trips_through_int64() -> None:
    import numpy as np

    from services.engine.parallel.plan import GraphPlan, Op, decode_graph, encode_graph, graph_payload_len

    tables = np.array([[3, 4, 0], [7, 8, 9]], dtype=np.int32)
    plan = GraphPlan(4, np.array([11, 12]), np.array([20, 40]), np.array([61, 137]), np.array([21, 41], dtype=np.int32),
                     tables)
    header, payload = encode_graph(plan)
    assert header[0] == Op.GRAPH and payload.dtype == torch.int64 and len(payload) == graph_payload_len(header)
    back = decode_graph(header, payload)
    assert back.bucket == 4 and back.block_tables.shape == (2, 3)
    for a, b in zip((plan.ids, plan.positions, plan.slots, plan.context_lens, plan.block_tables),
                    (back.ids, back.positions, back.slots, back.context_lens, back.block_tables), strict=True):
        assert np.array_equal(a, b)


def test_an_idle_instance_keeps_its_ranks_listening(monkeypatch) -> None:
    """Between steps rank 0 sends Op.NOOP once KEEPALIVE_S passed without a plan (a rank's pending receive
    would otherwise reach the group's collective timeout); the ranks then still compute in step."""
    import time

    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.parallel import runner as tp_runner
    from services.text.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model="random:tiny-llama", dtype="float32", num_kv_blocks=32, cpu_threads=1,
                                 tensor_parallel_size=2))
    try:
        sent = eng.runner._last_plan
        assert not eng.has_work() and eng.runner._last_plan == sent  # a recent plan: nothing sent
        monkeypatch.setattr(tp_runner, "KEEPALIVE_S", 0.0)
        time.sleep(0.01)
        assert not eng.has_work() and eng.runner._last_plan > sent
        greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        assert len(eng.generate([[5, 9, 200, 31]], greedy)[0]) == 3
    finally:
        eng.runner.release()
