"""DeepSeek-V3.2's sparse attention on the GPU path (the index top-k and sparse latent Triton kernels, decode CUDA
graphs) against the CPU engine, on a tiny random transformers checkpoint whose index_topk (8) is far below the
contexts, so every step's selection decides what each query sees.

Without a GPU the same path runs under the Triton interpreter (tests/conftest.py): the Triton backend and the fused
forward swapped into a CPU fp32 engine, logit for logit against the torch backend (attention.index_mask). The GPU
tests (marked ``gpu``): fp32 on the GPU against the fp32 CPU engine, eager and with decode CUDA graphs (the same
index scores up to summation order, so the same selections); bf16 with graphs against the torch backend on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.gpu_bench import logits_trace
from services.engine.model_loader import LoadedModel, load_model
from services.kernels._triton_utils import interpret_mode
from services.text.sampling_params import SamplingParams
from tests.engine.test_deepseek_gpu import (
    _assert_rows_close,
    _engine,
    _prompt,
    agreeing_tokens,
    assert_tokens_track,
    assert_triton_path_matches,
    on_gpu,
)
from tests.moe_checkpoints import write_tiny_moe

pytestmark = pytest.mark.slow

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
FP32_NEAR_TIE = 1e-3
"""Greedy tokens of the fp32 GPU engine must equal the fp32 CPU engine's while its top-2 logit margin is above this."""


@pytest.fixture(scope="module")
def tiny_v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return write_tiny_moe(tmp_path_factory.mktemp("deepseek_v32"), "deepseek_v32")


# -- the GPU path on CPU tensors (Triton interpreter) ------------------------------------------------------------


@pytest.mark.skipif(not interpret_mode(), reason="runs the Triton kernels on CPU tensors (interpreter); the GPU "
                                                 "tests below run them on a GPU")
@pytest.mark.parametrize(("graph_bound", "index_codec"), [(0, "native"), (256, "native"), (256, "fp8-e4m3")])
def test_triton_sparse_path_equals_torch_backend_on_cpu(tiny_v32: Path, graph_bound: int, index_codec: str) -> None:
    """fp32: a 40-token prompt in 13-token chunks (causal selection over a cached prefix), decode steps, then a batch
    whose steps mix decode rows and prompt chunks. ``graph_bound``: decode scored against a fixed maximum context,
    as under CUDA-graph capture (-inf columns past every context). ``index_codec``: the index keys' region codec
    (fp8-e4m3: the kernel dequantizes them with their per-token scales, as the torch path does)."""
    ref = _engine(str(tiny_v32), load_model(str(tiny_v32), torch.float32, "cpu"), "cpu", "float32",
                  max_prefill_chunk=13, index_kv_codec=index_codec)
    tri = _engine(str(tiny_v32), load_model(str(tiny_v32), torch.float32, "cpu"), "cpu", "float32",
                  max_prefill_chunk=13, index_kv_codec=index_codec)
    assert tri.runner.model.arch.mla.index_topk == 8
    assert_triton_path_matches(ref, tri, graph_bound)


# -- the GPU ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_fp32(tiny_v32: Path) -> LoadedModel:
    return load_model(str(tiny_v32), torch.float32, "cpu")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(("cuda_graphs", "index_codec"), [(False, "native"), (True, "native"), (False, "fp8-e4m3"),
                                                         (True, "fp8-e4m3")])
def test_gpu_fp32_matches_cpu_fp32(tiny_v32: Path, cpu_fp32: LoadedModel, cuda_graphs: bool, index_codec: str) -> None:
    """150-token prompt in 64-token chunks (sparse prefill over a cached prefix), then 16 decode steps, eager or
    replayed from the CUDA graphs: logits within fp32 tolerance of the CPU engine on the same token history (same
    index-key codec), greedy tokens equal wherever the CPU's choice is not a near-tie."""
    cpu = _engine(str(tiny_v32), cpu_fp32, "cpu", "float32", index_kv_codec=index_codec)
    gpu = _engine(str(tiny_v32), on_gpu(cpu_fp32, torch.float32), "cuda", "float32", cuda_graphs=cuda_graphs,
                  index_kv_codec=index_codec)
    assert (gpu.runner.graphs is not None and bool(gpu.runner.graphs.graphs)) == cuda_graphs
    prompt = _prompt(150, 1)
    gpu_tokens, got = logits_trace(gpu, prompt, 16)
    _, ref = logits_trace(cpu, prompt, 16, forced=gpu_tokens)
    rel = _assert_rows_close(got, ref, 1e-2)
    assert_tokens_track(gpu_tokens, ref, rel, FP32_NEAR_TIE, 1e-2)
    prompts = [_prompt(n, 10 + n) for n in (5, 40, 77, 130, 16)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a, b = gpu.generate(prompts, sp), cpu.generate(prompts, sp)
    agree = agreeing_tokens(a, b)
    assert agree >= 0.9 * 12 * len(prompts), f"only {agree} of {12 * len(prompts)} greedy tokens agree"


@pytest.mark.gpu
@requires_gpu
def test_gpu_bf16_with_graphs_matches_torch_backend(tiny_v32: Path, cpu_fp32: LoadedModel) -> None:
    """Same bf16 weights on the GPU: the sparse Triton kernels (+ CUDA graphs) against the torch backend's
    index_mask + SDPA, one prompt teacher-forced, a batch whose steps mix decode rows and prompt chunks."""
    loaded = on_gpu(cpu_fp32, torch.bfloat16)
    tri = _engine(str(tiny_v32), loaded, "cuda", "bfloat16")
    ref = _engine(str(tiny_v32), loaded, "cuda", "bfloat16", attention_backend="torch", cuda_graphs=False)
    assert tri.runner.graphs is not None and tri.runner.graphs.graphs, "decode CUDA graphs were not captured"
    prompt = _prompt(97, 3)
    ref_tokens, want = logits_trace(ref, prompt, 16)
    _, got = logits_trace(tri, prompt, 16, forced=ref_tokens)
    _assert_rows_close(got, want, 5e-2)
    prompts = [_prompt(n, 10 + n) for n in (5, 40, 77, 130, 16)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a, b = tri.generate(prompts, sp), ref.generate(prompts, sp)
    assert all(len(x) == 12 for x in a)
    agree = agreeing_tokens(a, b)
    assert agree >= 0.6 * 12 * len(prompts), f"only {agree} of {12 * len(prompts)} greedy tokens agree"
