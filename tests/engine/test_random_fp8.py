"""Random shapes with FP8 block-scaled linears: ``random:deepseek-v3-cut`` is DeepSeek-V3's config cut to three
layers and fits one 80 GB GPU; ``random:tiny-deepseek-v3-fp8`` runs the same code at small widths.

Where the engine keeps a checkpoint's FP8 linears fp8 (CUDA in bf16/fp16 at tensor-parallel size 1, or forced
with keep_fp8=True) the decoder's linears are Fp8BlockLinear modules holding random e4m3 weights and positive
block scales; elsewhere they are plain linears. Forced on the CPU they compute the dequantized model (the torch
reference), the Triton FP8 GEMM under the interpreter computes the same, and on a GPU (marked gpu) greedy decode
gives the same tokens with and without CUDA graphs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import services.engine.models.fp8_linear as fp8_linear
from benchmarks.gpu_bench import logits_trace
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_loader import FP8_MODEL_ID_SUFFIX, LoadedModel, build_empty_model, load_model
from services.engine.models.fp8_linear import Fp8BlockLinear, swap_in_random_fp8
from services.engine.parallel.group import TPGroup, building
from services.engine.weights.fp8_block import dequantize_block_fp8
from services.engine.weights.random_weights import INIT_STD
from services.kernels._triton_utils import interpret_mode
from services.text.model.config import ModelArchConfig
from services.text.model.errors import ModelLoadError
from services.text.model.random_shapes import random_arch
from services.text.sampling_params import SamplingParams

TINY = "random:tiny-deepseek-v3-fp8"
TINY_FP8 = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_a_proj", "q_b_proj",
                                                                        "kv_a_proj_with_mqa", "o_proj")]
TINY_FP8 += ["model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
             "model.layers.1.mlp.shared_expert.gate_up_proj", "model.layers.1.mlp.shared_expert.down_proj"]
"""The linears a V3 checkpoint ships in fp8 that the tiny model builds fp8: attention projections but kv_b_proj
(read as W_UK / W_UV), layer 0's dense MLP, layer 1's shared expert."""

DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
"""deepseek-ai/DeepSeek-V3's config.json (the keys that describe the model)."""


def _fp8_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear)]


def _dequantized_twin(loaded: LoadedModel) -> nn.Module:
    """A plain fp32 model with the FP8 model's weights, each fp8 linear's dequantized."""
    state = {}
    for name, t in loaded.model.state_dict().items():
        if name.endswith(".weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            mod = loaded.model.get_submodule(name.rpartition(".")[0])
            t = dequantize_block_fp8(t, mod.weight_scale_inv, mod.block)
        state[name] = t.float()
    twin = build_empty_model(loaded.arch, torch.float32, "cpu")
    twin.load_state_dict(state, strict=False)  # RoPE tables are the twin's own
    return twin.eval().requires_grad_(False)


def test_deepseek_v3_cut_is_v3s_config_with_three_layers() -> None:
    cut = {**DEEPSEEK_V3_CONFIG, "num_hidden_layers": 3, "first_k_dense_replace": 1}
    ref = ModelArchConfig.from_hf_config(cut).to_dict()
    ours = random_arch("deepseek-v3-cut").to_dict()
    for key in ("bos_token_id", "eos_token_ids"):  # random models use the byte-level tokenizer's
        ref.pop(key), ours.pop(key)
    assert ours == ref
    assert ours["fp8_weight_block"] == [128, 128] and ours["moe"]["mlp_only_layers"] == [0]


def test_deepseek_v3_cut_fits_one_80gb_gpu() -> None:
    """Built on the meta device as CUDA builds it (linears fp8, experts bf16): ~50 GB of weights, each MoE layer's
    experts 22.5 GB."""
    arch = random_arch("deepseek-v3-cut")
    model = build_empty_model(arch, torch.bfloat16, "meta", lambda m: swap_in_random_fp8(m, (128, 128)))
    assert len(_fp8_names(model)) == 3 * 4 + 2 + 2 * 2  # attention x 3 layers, dense MLP, 2 shared experts
    nbytes = {n: t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
              if "rotary" not in n}
    experts = sum(b for n, b in nbytes.items() if ".mlp.experts." in n)
    assert experts == 2 * 256 * 3 * 7168 * 2048 * 2
    assert model.model.layers[1].mlp.experts.w13.dtype == torch.bfloat16
    assert 49e9 < sum(nbytes.values()) < 51e9
    assert type(model.model.layers[1].self_attn.kv_b_proj) is nn.Linear


def test_tiny_v3_fp8_on_the_cpu_is_plain_and_deterministic(greedy: Any) -> None:
    a = load_model(TINY, torch.float32, "cpu", seed=3)
    b = load_model(TINY, torch.float32, "cpu", seed=3)
    c = load_model(TINY, torch.float32, "cpu", seed=4)
    assert not _fp8_names(a.model) and a.model_id == TINY and a.arch.fp8_weight_block == [128, 128]
    prompt = a.tokenizer.encode("latent attention, fp8 blocks")
    gen_a, lg_a = greedy(a.model, [prompt], 6)
    gen_b, lg_b = greedy(b.model, [prompt], 6)
    _, lg_c = greedy(c.model, [prompt], 6)
    assert len(gen_a[0]) == 6 and gen_a == gen_b and torch.equal(lg_a[0], lg_b[0])
    assert torch.isfinite(lg_a[0]).all() and not torch.equal(lg_a[0], lg_c[0])


def test_tiny_v3_fp8_kept_on_the_cpu_computes_its_dequantized_weights(greedy: Any) -> None:
    ours = load_model(TINY, torch.float32, "cpu", seed=3, keep_fp8=True)
    again = load_model(TINY, torch.float32, "cpu", seed=3, keep_fp8=True)
    assert sorted(_fp8_names(ours.model)) == sorted(TINY_FP8)
    assert ours.model_id == TINY + FP8_MODEL_ID_SUFFIX
    layer = ours.model.model.layers[1]
    assert type(layer.self_attn.kv_b_proj) is nn.Linear and not isinstance(layer.mlp.gate, Fp8BlockLinear)
    for name, t in ours.model.state_dict().items():  # the same bytes and scales from the same seed
        assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           again.model.state_dict()[name].view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                           else again.model.state_dict()[name]), name
    dense = torch.cat([dequantize_block_fp8(m.weight, m.weight_scale_inv, m.block).flatten()
                       for m in ours.model.modules() if isinstance(m, Fp8BlockLinear)])
    assert (layer.self_attn.o_proj.weight_scale_inv > 0).all()
    assert 0.8 * INIT_STD < float(dense.std()) < 1.3 * INIT_STD  # activations as sane as the bf16 init's
    twin = _dequantized_twin(ours)
    prompt = ours.tokenizer.encode("latent attention, fp8 blocks")
    gen_a, lg_a = greedy(ours.model, [prompt], 6)
    gen_b, lg_b = greedy(twin, [prompt], 6)
    assert gen_a == gen_b
    torch.testing.assert_close(lg_a[0], lg_b[0], atol=1e-4, rtol=1e-4)


def test_kept_random_fp8_under_tensor_parallelism_is_refused_in_one_line() -> None:
    with building(TPGroup(0, 2)), pytest.raises(ModelLoadError, match=r"under tensor parallelism .* not implemented"):
        load_model(TINY, torch.float32, "cpu", keep_fp8=True)


# -- the Triton FP8 GEMM on CPU tensors (interpreter) --------------------------------------------------------------


@pytest.mark.skipif(not interpret_mode(), reason="runs the Triton kernels on CPU tensors (interpreter); the GPU "
                                                 "test below runs them on a GPU")
def test_random_fp8_linears_on_the_triton_gemm_equal_the_dequantized_math(monkeypatch: pytest.MonkeyPatch,
                                                                          greedy: Any) -> None:
    """Each random fp8 linear through both kernel paths against x @ dequantized(W)^T in fp32, bf16 inputs; then
    the model's decode with every fp8 linear on the w8a16 kernel against the torch reference's."""
    from services.kernels.fp8_block_gemm import fp8_block_gemm  # needs triton (the interpreter here)

    loaded = load_model(TINY, torch.float32, "cpu", seed=5, keep_fp8=True)
    gen = torch.Generator().manual_seed(0)
    for name in TINY_FP8[4:8] + TINY_FP8[:2]:  # layer 1's attention, both MLPs, layer 0's q_a / q_b
        mod = loaded.model.get_submodule(name)
        dense = dequantize_block_fp8(mod.weight, mod.weight_scale_inv, mod.block)
        for m, w8a16 in ((3, True), (40, False)):
            x = torch.randn((m, mod.in_features), generator=gen).bfloat16()
            want = x.float() @ dense.T
            got = fp8_block_gemm(x, mod.weight, mod.weight_scale_inv, mod.block, w8a16=w8a16).float()
            rel = float((got - want).norm() / want.norm())
            assert rel < (0.01 if w8a16 else 0.04), (name, m, rel)  # w8a8 rounds x to e4m3 (3 mantissa bits)
    prompt = loaded.tokenizer.encode("fp8 on triton")
    ref_gen, ref_lg = greedy(loaded.model, [prompt], 4)
    monkeypatch.setattr(fp8_linear, "fp8_block_matmul",
                        lambda x, w, s, block: fp8_block_gemm(x, w, s, block, w8a16=True))
    tri_gen, tri_lg = greedy(loaded.model, [prompt], 4)
    assert tri_gen == ref_gen
    torch.testing.assert_close(tri_lg[0], ref_lg[0], atol=1e-3, rtol=1e-3)


# -- the GPU ------------------------------------------------------------------------------------------------------

NEAR_TIE = 0.05
"""Greedy tokens with and without graphs must agree while the eager top-2 logit margin is above this (graph replay
launches the latent decode kernel for the captured maximum context: the same sums in another order)."""


def _gpu_engine(loaded: LoadedModel, **kw: object) -> LLMEngine:
    opts: dict[str, object] = dict(block_size=16, num_kv_blocks=96, max_num_seqs=8, max_model_len=256,
                                   max_num_batched_tokens=256, max_prefill_chunk=128)
    cfg = EngineConfig(model=TINY, dtype="bfloat16", device="cuda", **{**opts, **kw})  # type: ignore[arg-type]
    return LLMEngine(cfg, loaded=loaded)


@pytest.mark.gpu
def test_gpu_random_fp8_decodes_the_same_with_and_without_cuda_graphs() -> None:
    """bf16 on CUDA keeps the linears fp8 by default: a 70-token prefill (the w8a8 GEMM) and 16 decode steps (the
    w8a16 GEMM) replayed from CUDA graphs give the eager engine's tokens and logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    loaded = load_model(TINY, torch.bfloat16, "cuda")
    assert sorted(_fp8_names(loaded.model)) == sorted(TINY_FP8)
    assert loaded.model_id == TINY + FP8_MODEL_ID_SUFFIX
    graphs, eager = _gpu_engine(loaded), _gpu_engine(loaded, cuda_graphs=False)
    assert graphs.runner.graphs is not None and graphs.runner.graphs.graphs and eager.runner.graphs is None
    prompt = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_tokens, ref = logits_trace(eager, prompt, 16)
    tokens, _ = logits_trace(graphs, prompt, 16)
    for i, (got, want) in enumerate(zip(tokens, ref_tokens, strict=True)):
        top2 = ref[i].topk(2).values
        if float(top2[0] - top2[1]) < NEAR_TIE:
            break
        assert got == want, f"step {i}: graph token {got}, eager {want}"
    _, forced = logits_trace(graphs, prompt, 16, forced=ref_tokens)
    rel = float((forced - ref).norm() / ref.norm())
    assert torch.isfinite(forced).all() and rel < 2e-2, f"relative L2 {rel:.5f}"
    batch = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 33, 50)]
    out = graphs.generate(batch, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [len(o) for o in out] == [10, 10, 10]
