"""Tensor parallelism of MoE models on CPU (gloo): every expert split along its intermediate dimension,
the router replicated; TP=2 logits equal TP=1 (prefill in chunks, then decode)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.parallel.loader import check_split
from services.engine.parallel.split import TensorParallelError
from tests.engine import tp_ranks
from tests.engine.test_tensor_parallel import TOL, _spawn
from tests.moe_checkpoints import hf_config, write_tiny_moe

pytestmark = pytest.mark.slow


def test_tp2_moe_logits_equal_tp1(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    qwen2_moe = write_tiny_moe(tmp_path / "qwen2-moe", "qwen2_moe")  # shared expert + gate, one dense layer
    glm = write_tiny_moe(tmp_path / "glm4-moe", "glm4_moe")  # grouped sigmoid routing, partial RoPE, q/k norms
    specs = ["random:tiny-mixtral", str(qwen2_moe), str(glm)]
    got = _spawn(tp_ranks.logits_rank, 2, specs, 3)
    for rank, diffs in got.items():
        assert isinstance(diffs, dict), f"rank {rank}: {diffs}"
        for spec, (kv_heads, per_step) in diffs.items():
            assert kv_heads == 1, (spec, rank)
            assert len(per_step) == 5 and max(per_step) < TOL, (spec, rank, per_step)


def test_split_names_the_expert_width_it_cannot_divide(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cfg = hf_config("qwen2_moe", hidden_size=96, num_attention_heads=6, num_key_value_heads=6,
                    moe_intermediate_size=32, shared_expert_intermediate_size=42)
    cfg.save_pretrained(str(tmp_path))  # config.json is all check_split reads
    check_split(str(tmp_path), 2)
    with pytest.raises(TensorParallelError, match=r"does not divide moe\.intermediate_size 32"):
        check_split(str(tmp_path), 3)


def test_tp2_latent_attention_logits_equal_tp1(tmp_path: Path) -> None:
    """DeepSeek MLA + MoE: the query heads split over the ranks, the latent (the pages) the same on both."""
    pytest.importorskip("transformers")
    v3 = write_tiny_moe(tmp_path / "deepseek-v3", "deepseek_v3")  # query LoRA, grouped sigmoid routing
    got = _spawn(tp_ranks.logits_rank, 2, ["random:tiny-deepseek", str(v3)], 3)
    for rank, diffs in got.items():
        assert isinstance(diffs, dict), f"rank {rank}: {diffs}"
        for spec, (kv_heads, per_step) in diffs.items():
            assert kv_heads == 1, (spec, rank)  # one latent per token on every rank
            assert len(per_step) == 5 and max(per_step) < TOL, (spec, rank, per_step)
