"""Mixture-of-experts models vs transformers, fp32 on CPU (tiny random checkpoints built in the test).

Greedy tokens must equal transformers' argmax up to the first near-tie of its logits (top-2 margin below
NEAR_TIE: fp32 summation order may then pick either), and every compared logit within TINY_TOL (measured
~1.5e-6 for mixtral / qwen2_moe / qwen3_moe).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.model_loader import load_model
from services.engine.models.moe import SparseMoeBlock, grouped_experts, route
from services.engine.models.moe_model import MoEForCausalLM
from services.engine.weights.mxfp4 import dequantize_mxfp4
from services.text.model.config import ModelArchConfig, ModelConfigError
from services.text.model.errors import ModelLoadError
from services.text.model.moe_config import MoEConfig, MoEConfigError, moe_from_hf_config
from tests.moe_checkpoints import hf_config, random_mxfp4_experts, write_tiny_moe

pytestmark = pytest.mark.slow

TINY_TOL = 1e-4
NEAR_TIE = 1e-3
HF_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe")


def _ref_logits(ref: Any, prompt: list[int], gen: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = ref(torch.tensor([prompt + gen])).logits[0].float()
    return out[len(prompt) - 1:len(prompt) - 1 + len(gen)]


def assert_tokens_match_until_near_tie(gen: list[int], ours: torch.Tensor, ref: torch.Tensor, what: str) -> int:
    """Tokens and logits agree step by step until transformers' top-2 margin falls below NEAR_TIE; returns
    how many steps were compared."""
    for i, tok in enumerate(gen):
        top2 = ref[i].topk(2).values
        diff = (ref[i] - ours[i]).abs().max().item()
        assert diff < TINY_TOL, f"{what}: step {i}: max |logit diff| {diff:.2e}"
        if (top2[0] - top2[1]).item() < NEAR_TIE:
            return i
        assert tok == int(ref[i].argmax()), f"{what}: step {i}: token {tok} != {int(ref[i].argmax())}"
    return len(gen)


@pytest.fixture(scope="module", params=HF_MOE)
def tiny_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    pytest.importorskip("transformers")
    return request.param, write_tiny_moe(tmp_path_factory.mktemp(request.param), request.param)


def test_moe_checkpoint_matches_transformers(tiny_moe: tuple[str, Path], greedy: Any) -> None:
    import transformers

    model_type, model_dir = tiny_moe
    ours = load_model(str(model_dir), torch.float32, "cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert ours.arch.architecture == model_type and ours.arch.moe is not None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 5)]
    gen, logits = greedy(ours.model, prompts, 24, chunk=16)
    compared = [assert_tokens_match_until_near_tie(toks, lg, _ref_logits(ref, p, toks), f"{model_type} prompt {i}")
                for i, (p, toks, lg) in enumerate(zip(prompts, gen, logits, strict=True))]
    assert sum(compared) >= 36, f"{model_type}: only {compared} steps before a near-tie"


def test_qwen2_moe_layers_follow_sparse_step_and_mlp_only(tiny_moe: tuple[str, Path]) -> None:
    model_type, model_dir = tiny_moe
    ours = load_model(str(model_dir), torch.float32, "cpu")
    kinds = [type(layer.mlp).__name__ for layer in ours.model.model.layers]
    if model_type == "qwen2_moe":  # mlp_only_layers=[1]
        assert kinds == ["SparseMoeBlock", "MLP"]
        assert ours.model.model.layers[0].mlp.shared_expert_gate is not None
    elif model_type == "glm4_moe":  # first_k_dense_replace=1, a shared expert without a gate
        assert kinds == ["MLP", "SparseMoeBlock"]
        assert ours.model.model.layers[1].mlp.shared_expert_gate is None
    else:
        assert kinds == ["SparseMoeBlock", "SparseMoeBlock"]


def test_bf16_moe_tracks_fp32(tiny_moe: tuple[str, Path], greedy: Any) -> None:
    _, model_dir = tiny_moe
    f32 = load_model(str(model_dir), torch.float32, "cpu")
    bf16 = load_model(str(model_dir), torch.bfloat16, "cpu")
    sparse = next(layer.mlp for layer in bf16.model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert sparse.experts.w13.dtype == torch.bfloat16
    prompt = list(range(10, 50))
    _, l32 = greedy(f32.model, [prompt], 1)
    _, l16 = greedy(bf16.model, [prompt], 1)
    assert torch.isfinite(l16[0]).all()
    assert (l32[0] - l16[0]).abs().max() < 0.1 * l32[0].abs().max()


def test_missing_expert_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = write_tiny_moe(tmp_path / "m", "mixtral")
    f = next(d.glob("*.safetensors"))
    tensors = load_file(str(f))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"experts\.w13"):
        load_model(str(d), torch.float32, "cpu")


def test_unsupported_expert_activation_is_refused_in_one_line() -> None:
    cfg = hf_config("mixtral", hidden_act="gelu").to_dict()
    with pytest.raises(ModelConfigError, match=r"^config.json field hidden_act='gelu' is not supported for model_type='mixtral': 'silu' \(SwiGLU\) only$"):
        ModelArchConfig.from_hf_config(cfg)


def test_moe_config_validates() -> None:
    with pytest.raises(MoEConfigError, match="top_k=5 exceeds"):
        MoEConfig(num_experts=4, top_k=5, intermediate_size=8)
    with pytest.raises(MoEConfigError, match="scoring"):
        MoEConfig(num_experts=4, top_k=2, intermediate_size=8, scoring="argmax")
    with pytest.raises(ModelConfigError, match="experts are set exactly"):
        ModelArchConfig(architecture="mixtral", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                        num_heads=2, num_kv_heads=2, head_dim=4)
    moe = moe_from_hf_config(hf_config("qwen2_moe").to_dict())
    assert moe is not None and moe.shared_expert_gate and moe.mlp_only_layers == [1]
    assert [moe.is_sparse(i) for i in range(3)] == [True, False, True]


def test_route_variants_match_their_definitions() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 6, generator=g)
    soft = MoEConfig(num_experts=6, top_k=2, intermediate_size=4, scoring="softmax", norm_topk_prob=False)
    w, ids = route(logits, soft)
    p = logits.softmax(-1)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), p.topk(2).indices)
    assert torch.allclose(w, p.topk(2).values)
    w, _ = route(logits, MoEConfig(num_experts=6, top_k=2, intermediate_size=4, norm_topk_prob=True))
    assert torch.allclose(w.sum(-1), torch.ones(7))
    w, ids = route(logits, MoEConfig(num_experts=6, top_k=3, intermediate_size=4, scoring="softmax_topk"))
    assert torch.allclose(w, logits.topk(3).values.softmax(-1)) and torch.allclose(w.sum(-1), torch.ones(7))
    w, ids = route(logits, MoEConfig(num_experts=6, top_k=2, intermediate_size=4, scoring="sigmoid",
                                     norm_topk_prob=True))
    s = logits.sigmoid().topk(2)
    assert torch.equal(ids.long(), s.indices) and torch.allclose(w, s.values / s.values.sum(-1, keepdim=True))


def test_grouped_experts_equals_per_token_loop() -> None:
    g = torch.Generator().manual_seed(0)
    e, h, inter, t, k = 5, 16, 12, 9, 2
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=g), torch.randn(e, h, inter, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    ids[:, 0] = 3  # one expert gets every token, some get none
    weights = torch.rand(t, k, generator=g)
    out = grouped_experts(x, w13, w2, ids, weights)
    ref = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            ex = int(ids[i, j])
            gate, up = (w13[ex] @ x[i]).split(inter)
            ref[i] += weights[i, j] * (w2[ex] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-5)


# -- gpt-oss -----------------------------------------------------------------------------------------------------


class _GptOssMoEOnly(MoEForCausalLM):
    """The gpt-oss loader's MoE half (stacked, interleaved layouts) without its attention (sinks)."""

    _GATE_UP_INTERLEAVED = True


def _gpt_oss_arch(cfg: Any) -> ModelArchConfig:
    d = cfg.to_dict()
    return ModelArchConfig(architecture="gpt_oss", vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                           intermediate_size=d["intermediate_size"], num_layers=1,
                           num_heads=d["num_attention_heads"], num_kv_heads=d["num_key_value_heads"],
                           head_dim=d["head_dim"], attention_bias=True, moe=moe_from_hf_config(d))


def _load_gpt_oss_block(cfg: Any, state: dict[str, torch.Tensor]) -> SparseMoeBlock:
    model = _GptOssMoEOnly(_gpt_oss_arch(cfg))
    params = dict(model.named_parameters())
    done: set[tuple[str, int, int]] = set()
    rest = list(model._take_moe(((f"model.layers.0.mlp.{n}", t) for n, t in state.items()), params, done, set()))
    assert rest == [] and not model._mxfp4_pending
    assert {n for n, _, _ in model._expected_pieces()} == {n for n, _, _ in done}
    assert model._expected_pieces() == done
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    return block


def test_gpt_oss_moe_block_matches_transformers_gpt_oss_mlp() -> None:
    pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = hf_config("gpt_oss", swiglu_limit=0.5)  # a low limit so the clamps bite at this scale
    torch.manual_seed(0)
    ref = GptOssMLP(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    ours = _load_gpt_oss_block(cfg, dict(ref.state_dict()))
    x = torch.randn(1, 13, cfg.hidden_size)
    with torch.no_grad():
        want, _ = ref(x)
        got = ours(x[0])
    assert torch.allclose(got, want[0], atol=1e-5, rtol=1e-5), (got - want[0]).abs().max()


def test_mxfp4_dequantization_matches_transformers() -> None:
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 10, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    got = torch.stack([dequantize_mxfp4(blocks[e], scales[e], torch.float32) for e in range(3)])
    assert torch.equal(got, want.transpose(1, 2))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1], torch.float32)


def test_gpt_oss_mxfp4_experts_load_like_their_dequantized_weights() -> None:
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = hf_config("gpt_oss", intermediate_size=64)  # MXFP4 blocks need multiples of 32
    packed = random_mxfp4_experts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size)
    ref = GptOssMLP(cfg)
    state = {k: v for k, v in ref.state_dict().items() if not k.startswith("experts.") or k.endswith("_bias")}
    mx = dict(state)
    dense = dict(state)
    for proj, (blocks, scales) in packed.items():
        mx[f"experts.{proj}_blocks"], mx[f"experts.{proj}_scales"] = blocks, scales
        dense[f"experts.{proj}"] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    a, b = _load_gpt_oss_block(cfg, mx), _load_gpt_oss_block(cfg, dense)
    assert torch.equal(a.experts.w13, b.experts.w13) and torch.equal(a.experts.w2, b.experts.w2)


def test_gpt_oss_matches_transformers(tmp_path: Path, greedy: Any) -> None:
    """The whole model, with contexts longer than its sliding window (8)."""
    import transformers

    model_dir = write_tiny_moe(tmp_path / "gpt-oss", "gpt_oss")
    ours = load_model(str(model_dir), torch.float32, "cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23, 5)]
    gen, logits = greedy(ours.model, prompts, 24, chunk=16)
    compared = [assert_tokens_match_until_near_tie(toks, lg, _ref_logits(ref, p, toks), f"gpt_oss prompt {i}")
                for i, (p, toks, lg) in enumerate(zip(prompts, gen, logits, strict=True))]
    assert sum(compared) >= 36, f"gpt_oss: only {compared} steps before a near-tie"


@pytest.mark.parametrize("params", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 32768, "attention_factor": 1.25},
])
def test_yarn_rope_equals_transformers(params: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from services.engine.models.rope import RotaryEmbedding, attention_factor, compute_inv_freq

    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=64, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **params})
    ref, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    scaling = {"rope_type": "yarn", **params}
    assert torch.equal(compute_inv_freq(64, 150000.0, scaling), ref)
    assert attention_factor(scaling) == pytest.approx(ref_factor, rel=1e-12)
    rope = RotaryEmbedding(64, 150000.0, scaling, 16)
    assert torch.allclose(rope.cos_cache[0], torch.full((64,), ref_factor))  # cos(0) * factor


# Every key of each MoE model_type's transformers config is decided: tests/engine/test_config_fields.py.


def test_gpt_oss_refuses_a_quantization_it_does_not_read() -> None:
    cfg = hf_config("gpt_oss").to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8"}
    with pytest.raises(ModelConfigError, match=r"^quantization_config.quant_method='fp8': gpt_oss supports"):
        ModelArchConfig.from_hf_config(cfg)
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    assert ModelArchConfig.from_hf_config(cfg).moe is not None


def test_glm4_moe_multi_token_prediction_layers_are_skipped(tmp_path: Path) -> None:
    """GLM-4.5 checkpoints carry num_nextn_predict_layers MTP layers after the last decoder layer (model.layers.N):
    not part of the forward, skipped at load; the model loads the same weights as without them."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    d = write_tiny_moe(tmp_path / "m", "glm4_moe")
    plain = load_model(str(d), torch.float32, "cpu")
    f = next(d.glob("*.safetensors"))
    tensors = load_file(str(f))
    tensors["model.layers.2.eh_proj.weight"] = torch.ones(64, 128)
    tensors["model.layers.2.mlp.experts.0.gate_proj.weight"] = torch.ones(32, 64)
    save_file(tensors, str(f), metadata={"format": "pt"})
    with_mtp = load_model(str(d), torch.float32, "cpu")
    for (name, a), (_, b) in zip(plain.model.named_parameters(), with_mtp.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
