"""Weight sources: GGUF metadata/tensors vs transformers, error messages, random shapes."""

from __future__ import annotations

import gc
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.engine.model_loader import build_empty_model, load_model
from services.engine.weights.gguf_loader import GGUFFile, unpermute_qk
from services.text.model.errors import ModelLoadError
from services.text.model.hf_config import read_hf_config
from services.text.model.random_shapes import RANDOM_SHAPES, random_arch


def test_gguf_config_equals_transformers(gguf_path: Path) -> None:
    from transformers import AutoConfig

    ref = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    arch = GGUFFile(gguf_path).arch
    assert arch.architecture == ref.model_type == "llama"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers) == (49152, 576, 1536, 30)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim) == (9, 3, 64)
    assert arch.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert arch.rope_theta == ref.rope_parameters["rope_theta"] == 100000.0
    assert arch.rope_scaling is None and ref.rope_parameters["rope_type"] == "default"
    assert arch.max_position_embeddings == ref.max_position_embeddings == 8192
    assert arch.tie_word_embeddings is True  # the file has no output.weight
    assert (arch.bos_token_id, arch.eos_token_ids) == (ref.bos_token_id, [ref.eos_token_id])


@pytest.mark.slow
def test_gguf_weights_equal_transformers(our_gguf_model: Any, hf_gguf_model: Any) -> None:
    """Our dequantized and un-permuted q/k rows equal transformers' GGUF loading (layers 0 and 29)."""
    ours = our_gguf_model.model
    ref = dict(hf_gguf_model.named_parameters())
    q, kv = 9 * 64, 3 * 64
    for i in (0, 29):
        qkv = ours.model.layers[i].self_attn.qkv_proj.weight
        pre = f"model.layers.{i}."
        torch.testing.assert_close(qkv[:q], ref[pre + "self_attn.q_proj.weight"], rtol=0, atol=1e-6)
        torch.testing.assert_close(qkv[q:q + kv], ref[pre + "self_attn.k_proj.weight"], rtol=0, atol=1e-6)
        torch.testing.assert_close(qkv[q + kv:], ref[pre + "self_attn.v_proj.weight"], rtol=0, atol=1e-6)
        gate_up = ours.model.layers[i].mlp.gate_up_proj.weight
        torch.testing.assert_close(gate_up[:1536], ref[pre + "mlp.gate_proj.weight"], rtol=0, atol=1e-6)
        torch.testing.assert_close(gate_up[1536:], ref[pre + "mlp.up_proj.weight"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.model.embed_tokens.weight, ref["model.embed_tokens.weight"], rtol=0, atol=1e-6)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(unpermute_qk(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_truncated_gguf_is_a_clear_error(gguf_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    with gguf_path.open("rb") as src, bad.open("wb") as dst:
        dst.write(src.read(1 << 20))
    with pytest.raises(ModelLoadError, match="truncated") as e:
        GGUFFile(bad)
    assert str(bad) in str(e.value)
    with pytest.raises(ModelLoadError, match=re.escape(str(bad))):
        load_model(str(bad), torch.float32, "cpu")


def test_garbage_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match=re.escape(str(bad))):
        GGUFFile(bad)


def test_missing_files_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        GGUFFile(missing)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(missing), torch.float32, "cpu")
    assert str(missing) in str(e.value) and "random:tiny-llama" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(tmp_path / "empty"), torch.float32, "cpu")


def test_unknown_random_name_lists_valid_names() -> None:
    with pytest.raises(ModelLoadError) as e:
        load_model("random:gpt-5", torch.float32, "cpu")
    msg = str(e.value)
    assert "random:gpt-5" in msg
    assert all(f"random:{n}" in msg for n in RANDOM_SHAPES)


def test_unsupported_dtype() -> None:
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model("random:tiny-llama", torch.int8, "cpu")


@pytest.mark.parametrize(("name", "params"), [
    ("llama-3-8b", 8_030_261_248),      # Meta-Llama-3-8B
    ("qwen3-8b", 8_190_735_360),        # Qwen3-8B
    ("smollm2-135m", 134_515_008),      # SmolLM2-135M (tied head)
])
def test_random_shapes_param_counts(name: str, params: int) -> None:
    model = build_empty_model(random_arch(name), torch.bfloat16, "meta")  # no memory is allocated
    assert sum(p.numel() for p in model.parameters()) == params
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_random_smollm_shape_matches_gguf(gguf_path: Path) -> None:
    assert random_arch("smollm2-135m").to_dict() | {"eos_token_ids": [], "bos_token_id": None,
                                                    "rms_norm_eps": 0} == \
        GGUFFile(gguf_path).arch.to_dict() | {"eos_token_ids": [], "bos_token_id": None, "rms_norm_eps": 0}


def test_random_seed_determinism() -> None:
    a = load_model("random:tiny-qwen3", torch.float32, "cpu", seed=1).model.state_dict()
    b = load_model("random:tiny-qwen3", torch.float32, "cpu", seed=1).model.state_dict()
    c = load_model("random:tiny-qwen3", torch.float32, "cpu", seed=2).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    std = a["model.layers.0.mlp.down_proj.weight"].std().item()
    assert 0.015 < std < 0.025


@pytest.mark.gpu
def test_random_8b_allocates_directly_in_bf16_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    gc.collect()
    base = torch.cuda.memory_allocated()  # what earlier tests of this process still hold
    torch.cuda.reset_peak_memory_stats()
    m = load_model("random:llama-3-8b", torch.bfloat16, "cuda")
    peak = torch.cuda.max_memory_allocated() - base
    assert next(m.model.parameters()).device.type == "cuda"
    assert peak < 17.5e9  # 8.03e9 params * 2 bytes (+ RoPE tables); an fp32 staging copy would be 32 GB


def test_hf_dir_errors_name_missing_files(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(tiny_qwen3_dir / "config.json", d / "config.json")
    with pytest.raises(ModelLoadError, match=r"\*\.safetensors"):
        load_model(str(d), torch.float32, "cpu")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match=r"model-00001-of-00002\.safetensors"):
        load_model(str(d), torch.float32, "cpu")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match=r"config\.json lacks 'num_attention_heads'"):
        read_hf_config(d)


def test_sharded_hf_dir_loads_like_single_file(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir)).save_pretrained(str(sharded), max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_model(str(sharded), torch.float32, "cpu")
    b = load_model(str(tiny_qwen3_dir), torch.float32, "cpu")
    assert a.model_id == "sharded"
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sb)


def test_load_tokenizer_without_weights(gguf_path: Path) -> None:
    from services.text.model.source import load_tokenizer

    tok, model_id, max_len = load_tokenizer(None)
    assert (model_id, max_len) == ("SmolLM2-135M-Instruct.Q4_1", 8192)
    assert tok.encode("<|im_start|>") == [1]
    tok, model_id, max_len = load_tokenizer("random:tiny-qwen3")
    assert (model_id, max_len, tok.eos_token_ids) == ("random:tiny-qwen3", 1024, {256})
    with pytest.raises(ModelLoadError, match="random:nope"):
        load_tokenizer("random:nope")
