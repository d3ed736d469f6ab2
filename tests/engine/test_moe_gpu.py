"""Mixture-of-experts models on the GPU path (one-launch routing, the fused MoE's pair and sorted paths, decode CUDA
graphs) against the CPU fp32 engine, on tiny random transformers checkpoints of each MoE family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.gpu_bench import logits_trace
from services.engine.model_loader import load_model
from services.text.sampling_params import SamplingParams
from tests.engine.test_deepseek_gpu import (
    BF16_NEAR_TIE,
    _assert_rows_close,
    _engine,
    _prompt,
    agreeing_tokens,
    assert_tokens_track,
    on_gpu,
)
from tests.moe_checkpoints import write_tiny_moe

pytestmark = [pytest.mark.slow, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: mixtral / qwen3_moe: softmax routing, gpt_oss: top-k softmax with biases and sinks (the one-launch routing);
#: qwen2_moe: shared expert; deepseek_v3: grouped sigmoid routing (the torch form) and latent attention.
FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss", "qwen2_moe", "deepseek_v3")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_moe_gpu_bf16_with_graphs_matches_cpu_fp32(tmp_path: Path, model_type: str) -> None:
    """A 100-token prompt in 64-token chunks (the sorted path), then 16 decode steps of one sequence replayed from
    the CUDA graphs (the pair path): logits within bf16 tolerance of the fp32 CPU engine fed the same tokens, greedy
    tokens equal where the CPU's choice is not a near-tie; then a batch of five prompts (decode rows of several
    sequences: the sorted path in the graphs) whose greedy tokens mostly agree with the CPU engine's."""
    pytest.importorskip("transformers")
    path = write_tiny_moe(tmp_path, model_type)
    cpu_loaded = load_model(str(path), torch.float32, "cpu")
    gpu_loaded = on_gpu(cpu_loaded, torch.bfloat16)
    cpu = _engine(str(path), cpu_loaded, "cpu", "float32")
    gpu = _engine(str(path), gpu_loaded, "cuda", "bfloat16")
    assert gpu.runner.graphs is not None and gpu.runner.graphs.graphs, "decode CUDA graphs were not captured"
    prompt = _prompt(100, 1)
    gpu_tokens, got = logits_trace(gpu, prompt, 16)
    _, ref = logits_trace(cpu, prompt, 16, forced=gpu_tokens)
    rel = _assert_rows_close(got, ref, 5e-2)
    assert_tokens_track(gpu_tokens, ref, rel, BF16_NEAR_TIE, 5e-2)
    prompts = [_prompt(n, 10 + n) for n in (5, 40, 77, 30, 16)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    a, b = gpu.generate(prompts, sp), cpu.generate(prompts, sp)
    assert all(len(x) == 10 for x in a)
    agree = agreeing_tokens(a, b)
    assert agree >= 0.6 * 10 * len(prompts), f"only {agree} of {10 * len(prompts)} greedy tokens agree"
