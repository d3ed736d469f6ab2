"""Random MoE shapes: real configs' sizes, allocated directly on the target device in the target dtype."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from services.engine.model_loader import load_model
from services.engine.models.registry import get_model_class
from services.text.model.errors import ModelLoadError
from services.text.model.random_shapes import random_arch


@pytest.mark.parametrize(("name", "params", "active"), [
    ("qwen3-30b-a3b", 30.53e9, 3.35e9),  # Qwen3-30B-A3B: 30.5B total, 3.3B active
    ("mixtral-8x7b", 46.70e9, 12.88e9),  # Mixtral-8x7B: 46.7B total, 12.9B active
])
def test_random_moe_shapes_have_the_real_sizes(name: str, params: float, active: float) -> None:
    arch = random_arch(name)
    moe = arch.moe
    assert moe is not None
    with torch.device("meta"):
        model = get_model_class(arch.architecture)(arch)
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * moe.intermediate_size * arch.hidden_size
    idle = arch.num_layers * (moe.num_experts - moe.top_k) * per_expert
    assert total == pytest.approx(params, rel=2e-3)
    assert total - idle == pytest.approx(active, rel=2e-2)


def test_random_gpt_oss_names_the_fields_it_needs() -> None:
    try:
        arch = random_arch("gpt-oss-20b")
    except ModelLoadError as e:  # an engine whose attention has no sinks / sliding layers
        assert "attention_sinks" in str(e)
        return
    assert arch.moe is not None and arch.moe.activation == "gpt_oss" and arch.moe.num_experts == 32


def test_random_tiny_mixtral_runs_and_is_deterministic(greedy: Any) -> None:
    a = load_model("random:tiny-mixtral", torch.float32, "cpu", seed=3)
    b = load_model("random:tiny-mixtral", torch.float32, "cpu", seed=3)
    prompt = a.tokenizer.encode("hello random experts")
    gen_a, lg_a = greedy(a.model, [prompt], 8)
    gen_b, lg_b = greedy(b.model, [prompt], 8)
    assert gen_a == gen_b and torch.equal(lg_a[0], lg_b[0]) and torch.isfinite(lg_a[0]).all()


@pytest.mark.gpu
def test_random_qwen3_30b_a3b_allocates_directly_in_bf16_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    gc.collect()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    m = load_model("random:qwen3-30b-a3b", torch.bfloat16, "cuda")
    peak = torch.cuda.max_memory_allocated() - base
    assert m.model.model.layers[0].mlp.experts.w13.dtype == torch.bfloat16
    assert peak < 62e9  # 30.53e9 params * 2 bytes (+ RoPE tables); an fp32 staging copy would be 122 GB
    del m
    gc.collect()
    torch.cuda.empty_cache()
