"""DeepSeek-V2 latent attention on the GPU path (Triton latent kernels, fused norms, decode CUDA graphs) against the
CPU engine, on a tiny random transformers checkpoint.

Without a GPU the same path runs under the Triton interpreter (tests/conftest.py): the Triton backend and the fused
forward swapped into a CPU fp32 engine, token for token and logit for logit against the torch backend. The GPU tests
(marked ``gpu``) run bf16 with CUDA graphs against the CPU fp32 engine, and against the torch backend on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.gpu_bench import logits_trace
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_loader import LoadedModel, build_empty_model, load_model
from services.kernels._triton_utils import interpret_mode
from services.text.sampling_params import SamplingParams
from tests.moe_checkpoints import write_tiny_moe

pytestmark = pytest.mark.slow

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16_NEAR_TIE = 0.1
"""Greedy tokens of the bf16 GPU engine must equal the fp32 CPU engine's while its top-2 logit margin is above this."""
ROUTING_FLIPS = 2
"""Steps whose logits may leave the bf16 tolerance: the tiny model's last layer routes each token to 2 of 8 experts,
and bf16 rounding can flip a near-tied choice, which changes that one position's logits (no later layer reads it).
An attention error is in every step."""


def _assert_rows_close(got: torch.Tensor, ref: torch.Tensor, rel_tol: float) -> torch.Tensor:
    """Each step's logits within rel_tol (relative L2) of the reference, but for ROUTING_FLIPS steps at most;
    returns the steps' relative L2."""
    assert got.shape == ref.shape and torch.isfinite(got).all()
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    bad = [(i, round(float(r), 4)) for i, r in enumerate(rel) if r >= rel_tol]
    assert len(bad) <= ROUTING_FLIPS, f"steps past relative L2 {rel_tol}: {bad} (median {float(rel.median()):.4f})"
    assert float(rel.median()) < rel_tol / 2, f"median relative L2 {float(rel.median()):.4f}"
    return rel


def on_gpu(cpu: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    """The CPU model's weights in ``dtype`` on the GPU (the same weights for both engines of a comparison)."""
    model = build_empty_model(cpu.arch, dtype, "cuda")
    model.load_state_dict(cpu.model.state_dict())
    model.eval().requires_grad_(False)
    return LoadedModel(model, cpu.arch, cpu.tokenizer, cpu.model_id, cpu.max_model_len)


def assert_tokens_track(tokens: list[int], ref: torch.Tensor, rel: torch.Tensor, near_tie: float, rel_tol: float
                        ) -> None:
    """Each step's token equals the reference logits' argmax wherever that choice is no near-tie (top-2 margin
    >= near_tie) and the step's logits are within rel_tol."""
    for i, tok in enumerate(tokens):
        top2 = ref[i].topk(2).values
        if float(top2[0] - top2[1]) >= near_tie and rel[i] < rel_tol:
            assert tok == int(ref[i].argmax()), f"step {i}: GPU token {tok}, reference argmax {int(ref[i].argmax())}"


def agreeing_tokens(a: list[list[int]], b: list[list[int]]) -> int:
    """Greedy tokens at the same position of the same sequence that two engines agree on."""
    return sum(x == y for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


@pytest.fixture(scope="module")
def tiny_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return write_tiny_moe(tmp_path_factory.mktemp("deepseek_v2"), "deepseek_v2")


def _engine(model: str, loaded: LoadedModel, device: str, dtype: str, **kw: object) -> LLMEngine:
    opts: dict[str, object] = dict(block_size=16, num_kv_blocks=96, max_num_seqs=8, max_model_len=256,
                                   max_num_batched_tokens=256, max_prefill_chunk=64, cpu_compile_decode=0)
    cfg = EngineConfig(model=model, dtype=dtype, device=device, **{**opts, **kw})  # type: ignore[arg-type]
    return LLMEngine(cfg, loaded=loaded)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the GPU path on CPU tensors (Triton interpreter) ------------------------------------------------------------


@pytest.mark.skipif(not interpret_mode(), reason="runs the Triton kernels on CPU tensors (interpreter); the GPU "
                                                 "tests below run them on a GPU")
@pytest.mark.parametrize("graph_bound", [0, 256])
def test_triton_path_equals_torch_backend_on_cpu(tiny_v2: Path, graph_bound: int) -> None:
    """The Triton latent kernels behind TritonPagedAttention and the fused forward, fp32: a chunked prompt (prefill
    after a cached prefix), a decode batch with a prompt chunk in the same step. ``graph_bound``: decode launched
    for a fixed maximum context, as under CUDA-graph capture (partitions past a sequence's end)."""
    ref = _engine(str(tiny_v2), load_model(str(tiny_v2), torch.float32, "cpu"), "cpu", "float32", max_prefill_chunk=13)
    tri = _engine(str(tiny_v2), load_model(str(tiny_v2), torch.float32, "cpu"), "cpu", "float32", max_prefill_chunk=13)
    assert_triton_path_matches(ref, tri, graph_bound)


def assert_triton_path_matches(ref: LLMEngine, tri: LLMEngine, graph_bound: int) -> None:
    """``tri`` switched to the CUDA forward (Triton norms, activation and attention backend, on CPU tensors under
    the interpreter) against ``ref``'s torch path: a 40-token prompt teacher-forced (logits within 2e-3), then a batch
    of three prompts (greedy tokens equal). ``graph_bound``: decode launched for a fixed maximum context, as under
    CUDA-graph capture (0: the step's own)."""
    from services.engine.cuda.gpu_attention import TritonPagedAttention  # needs triton (the interpreter here)

    runner = tri.runner
    runner.model.fused_kernels = True  # the CUDA forward: Triton norms and activation around the same attention
    runner.attn_backend = TritonPagedAttention(runner.kv_cache, runner.head_dim ** -0.5, runner.index_keys)
    runner.attn_backend.decode_max_context_len = graph_bound or None
    prompt = _prompt(40, 1)
    ref_tokens, want = logits_trace(ref, prompt, 6)
    _, got = logits_trace(tri, prompt, 6, forced=ref_tokens)
    assert (got - want).abs().max() < 2e-3, f"max |logit diff| {(got - want).abs().max():.2e}"
    prompts = [_prompt(n, 10 + n) for n in (5, 30, 17)]
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert tri.generate(prompts, sp) == ref.generate(prompts, sp)


# -- the GPU ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_and_gpu(tiny_v2: Path) -> tuple[LoadedModel, LoadedModel]:
    """The same weights twice: fp32 on the CPU and bf16 on the GPU."""
    cpu = load_model(str(tiny_v2), torch.float32, "cpu")
    return cpu, on_gpu(cpu, torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("form,chunk", [("absorbed", 64), ("expanded", 64), ("expanded", 256)])
def test_gpu_bf16_with_graphs_matches_cpu_fp32(tiny_v2: Path, cpu_and_gpu: tuple[LoadedModel, LoadedModel],
                                               form: str, chunk: int) -> None:
    """150-token prompt in ``chunk``-token chunks (64: the latent extend kernel over a cached prefix after the first
    chunk; 256: one chunk), then 16 decode steps replayed from the CUDA graphs (the latent decode kernel): logits
    within bf16 tolerance of the fp32 CPU engine on the same token history, greedy tokens equal wherever the CPU's
    choice is not a near-tie. ``form``: --mla-prefill of the GPU engine (expanded: per-head K/V of a prompt that
    starts at position 0, SDPA with V padded to K's width)."""
    cpu_loaded, gpu_loaded = cpu_and_gpu
    cpu = _engine(str(tiny_v2), cpu_loaded, "cpu", "float32")
    gpu = _engine(str(tiny_v2), gpu_loaded, "cuda", "bfloat16", mla_prefill=form, max_prefill_chunk=chunk)
    assert gpu.runner.mla_prefill == form
    assert gpu.runner.graphs is not None and gpu.runner.graphs.graphs, "decode CUDA graphs were not captured"
    prompt = _prompt(150, 1)
    gpu_tokens, got = logits_trace(gpu, prompt, 16)
    _, ref = logits_trace(cpu, prompt, 16, forced=gpu_tokens)
    rel = _assert_rows_close(got, ref, 5e-2)
    # The CPU engine was fed the GPU's tokens: the same history each step.
    assert_tokens_track(gpu_tokens, ref, rel, BF16_NEAR_TIE, 5e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_gpu_triton_backend_matches_torch_backend(tiny_v2: Path, cpu_and_gpu: tuple[LoadedModel, LoadedModel],
                                                  form: str) -> None:
    """Same bf16 weights on the GPU: the Triton latent kernels (+ CUDA graphs) against the torch backend, one prompt
    teacher-forced and a batch of prompts whose steps mix decode rows and prompt chunks. ``form`` expanded: the
    Triton backend's steps whose prompts start at 0 take the expanded form (decode rows of the same step still
    latent); the torch backend stays absorbed."""
    _, gpu_loaded = cpu_and_gpu
    tri = _engine(str(tiny_v2), gpu_loaded, "cuda", "bfloat16", mla_prefill=form)
    ref = _engine(str(tiny_v2), gpu_loaded, "cuda", "bfloat16", attention_backend="torch", cuda_graphs=False,
                  mla_prefill="absorbed")
    # Both engines run the one model object, whose prompt form is the last engine's: set before each engine runs.
    model = gpu_loaded.model
    prompt = _prompt(97, 3)
    model.set_prefill_form("absorbed")
    ref_tokens, want = logits_trace(ref, prompt, 16)
    model.set_prefill_form(form)
    _, got = logits_trace(tri, prompt, 16, forced=ref_tokens)
    _assert_rows_close(got, want, 2e-2)
    prompts = [_prompt(n, 10 + n) for n in (5, 40, 77, 130, 16)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a = tri.generate(prompts, sp)
    model.set_prefill_form("absorbed")
    b = ref.generate(prompts, sp)
    assert all(len(x) == 12 for x in a)
    # Free-running: a flipped routing choice or near-tie makes a sequence diverge for its remaining tokens.
    agree = agreeing_tokens(a, b)
    assert agree >= 0.6 * 12 * len(prompts), f"only {agree} of {12 * len(prompts)} greedy tokens agree"
