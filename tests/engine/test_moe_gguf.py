"""MoE GGUF files (written here with the gguf package's writer from a tiny transformers checkpoint, in
llama.cpp's tensor names and layouts) load into the same model as the HF directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.engine.model_loader import build_empty_model, load_model
from services.engine.weights.gguf_loader import GGUFFile
from services.engine.weights.hf_loader import iter_safetensors
from tests.moe_checkpoints import write_tiny_moe

pytestmark = pytest.mark.slow

_GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
          "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
          "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
          "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
          "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}
_EXPERT = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of llama q/k rows (halves RoPE -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(hf_dir: Path, model_type: str, out: Path, expert_type: Any = None) -> Path:
    """The tiny checkpoint as llama.cpp's converter would write it (F32, or ``expert_type`` for the experts)."""
    import gguf
    from gguf.quants import quantize

    from services.text.model.hf_config import read_hf_config

    arch = read_hf_config(hf_dir)
    moe = arch.moe
    assert moe is not None
    name = _GGUF_ARCH[model_type]
    w = gguf.GGUFWriter(str(out), name)
    w.add_block_count(arch.num_layers)
    w.add_context_length(arch.max_position_embeddings)
    w.add_embedding_length(arch.hidden_size)
    w.add_feed_forward_length(arch.intermediate_size)
    w.add_head_count(arch.num_heads)
    w.add_head_count_kv(arch.num_kv_heads)
    w.add_key_length(arch.head_dim)
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    w.add_rope_freq_base(arch.rope_theta)
    w.add_vocab_size(arch.vocab_size)
    w.add_expert_count(moe.num_experts)
    w.add_expert_used_count(moe.top_k)
    if model_type != "mixtral":
        w.add_expert_feed_forward_length(moe.intermediate_size)
    if moe.shared_expert_intermediate_size:
        w.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)
    if arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "yarn":  # as llama.cpp's converter
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(arch.rope_scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(arch.rope_scaling["original_max_position_embeddings"])
        if "beta_fast" in arch.rope_scaling:
            w.add_rope_scaling_yarn_beta_fast(arch.rope_scaling["beta_fast"])
    tensors = {n: t.float().numpy() for n, t in iter_safetensors(hf_dir)}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    out_tensors: dict[str, np.ndarray] = {"token_embd.weight": tensors.pop("model.embed_tokens.weight"),
                                          "output_norm.weight": tensors.pop("model.norm.weight"),
                                          "output.weight": tensors.pop("lm_head.weight")}
    for hf, t in tensors.items():
        parts = hf.split(".")
        layer, rest = int(parts[2]), ".".join(parts[3:])
        if ".experts." in hf:
            e, kind = int(parts[-3]), _EXPERT[parts[-2]]
            experts.setdefault((layer, kind), {})[e] = t
            continue
        if rest == "mlp.shared_expert_gate.weight":
            out_tensors[f"blk.{layer}.ffn_gate_inp_shexp.weight"] = t.reshape(-1)
            continue
        if name == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            t = _permute(t, arch.num_heads if "q_proj" in rest else arch.num_kv_heads)
        out_tensors[f"blk.{layer}.{_LAYER[rest]}"] = t
    for (layer, kind), by_e in experts.items():
        out_tensors[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack([by_e[e] for e in sorted(by_e)])
    for n, t in out_tensors.items():
        if expert_type is not None and n.endswith("_exps.weight"):
            w.add_tensor(n, quantize(t, expert_type), raw_dtype=expert_type)
        else:
            w.add_tensor(n, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("model_type", sorted(_GGUF_ARCH))
def test_moe_gguf_loads_the_same_model_as_the_hf_directory(model_type: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    hf_dir = write_tiny_moe(tmp_path / "hf", model_type)
    path = write_moe_gguf(hf_dir, model_type, tmp_path / f"{model_type}.gguf")
    gguf = GGUFFile(path)
    want = load_model(str(hf_dir), torch.float32, "cpu")
    assert gguf.arch.architecture == want.arch.architecture
    assert gguf.arch.moe == want.arch.moe
    model = build_empty_model(gguf.arch, torch.float32, "cpu")
    model.load_weights(gguf.tensors())
    ours = dict(model.named_parameters())
    for n, p in want.model.named_parameters():
        assert torch.equal(ours[n], p), n


def test_quantized_expert_tensors_dequantize_per_expert(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from gguf import GGMLQuantizationType

    hf_dir = write_tiny_moe(tmp_path / "hf", "qwen3_moe")
    path = write_moe_gguf(hf_dir, "qwen3_moe", tmp_path / "q8.gguf", expert_type=GGMLQuantizationType.Q8_0)
    model = build_empty_model(GGUFFile(path).arch, torch.float32, "cpu")
    model.load_weights(GGUFFile(path).tensors())
    want = load_model(str(hf_dir), torch.float32, "cpu").model
    got, ref = model.model.layers[1].mlp.experts, want.model.layers[1].mlp.experts
    # Q8_0: 8-bit steps of max|w| / 127 per block of 32 (weights ~N(0, 0.08): error <= ~0.002).
    assert (got.w13 - ref.w13).abs().max() < 5e-3 and (got.w2 - ref.w2).abs().max() < 5e-3
    assert not torch.equal(got.w13, ref.w13)


def test_yarn_in_a_gguf_is_the_yarn_of_the_hf_config(tmp_path: Path) -> None:
    """A Qwen3-MoE with YaRN (llama.cpp writes type, factor, original context and the betas it was given): the
    same inverse frequencies and cos/sin factor as the HF directory, and the same parameters."""
    pytest.importorskip("transformers")
    from services.engine.models.rope import attention_factor, compute_inv_freq

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 16.0}
    hf_dir = write_tiny_moe(tmp_path / "hf", "qwen3_moe", rope_parameters=yarn)
    want = load_model(str(hf_dir), torch.float32, "cpu")
    got = GGUFFile(write_moe_gguf(hf_dir, "qwen3_moe", tmp_path / "yarn.gguf")).arch
    assert want.arch.rope_scaling is not None and got.rope_scaling is not None
    head, theta = want.arch.head_dim, want.arch.rope_theta
    assert got.rope_theta == theta
    assert torch.equal(compute_inv_freq(head, theta, got.rope_scaling),
                       compute_inv_freq(head, theta, want.arch.rope_scaling))
    assert attention_factor(got.rope_scaling) == attention_factor(want.arch.rope_scaling) > 1.0
    assert not torch.equal(compute_inv_freq(head, theta, got.rope_scaling), compute_inv_freq(head, theta, None))
