"""gpt-oss GGUF files, written here as llama.cpp's converter writes them (architecture "gpt-oss": gate and up
de-interleaved and stacked apart or fused, down transposed, the post-attention norm under its own name, sinks as
``attn_sinks.weight``, YaRN and the sliding window as metadata; experts in F32 or MXFP4), load into the same model
as the HF directory."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.engine.model_loader import build_empty_model, load_model
from services.engine.weights.gguf_loader import GGUFFile
from services.engine.weights.hf_loader import iter_safetensors
from services.engine.weights.mxfp4 import dequantize_mxfp4
from services.text.model.errors import ModelLoadError
from tests.engine.test_moe_gguf import _LAYER
from tests.moe_checkpoints import random_mxfp4_experts, write_tiny_moe

pytestmark = pytest.mark.slow

_ATTN = {**_LAYER, "post_attention_layernorm.weight": "post_attention_norm.weight",
         "self_attn.o_proj.bias": "attn_output.bias", "self_attn.sinks": "attn_sinks.weight",
         "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias"}
"""HF -> GGUF layer names of gpt-oss: the MoE test's, with gpt-oss's own norm name, sinks and biases."""


def _mxfp4_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF MXFP4 (blocks [..., G, 16] with element 2j / 2j+1 in byte j's low / high nibble, scales [..., G]) as
    ggml stores it: per block the scale byte, then 16 bytes whose low nibbles are elements 0-15 and high nibbles
    16-31. Returns uint8 [..., G * 17]."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    out = np.concatenate([scales[..., None], packed], axis=-1)
    return out.reshape(*blocks.shape[:-2], -1)


def _add_byte_tokenizer(w: Any, vocab: int) -> None:
    """A byte-level BPE vocabulary without merges (ids 0-255 the bytes, then fillers, the last id a control
    end-of-text) and gpt-oss's pre-tokenizer name."""
    from services.text.tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)] + [f"<|filler_{i}|>" for i in range(256, vocab - 1)] + ["<|return|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_eos_token_id(vocab - 1)


def write_gpt_oss_gguf(hf_dir: Path, out: Path, *, fused_gate_up: bool = False,
                       mxfp4: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                       extra_kv: dict[str, Any] | None = None, tokenizer: bool = False) -> Path:
    """The tiny HF checkpoint as llama.cpp's converter writes it. ``mxfp4`` (layer-0 HF ``gate_up_proj`` /
    ``down_proj`` blocks and scales, gate/up rows interleaved) replaces layer 0's expert weights; ``tokenizer``
    adds a byte-level vocabulary (the engine needs one to load a file)."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if tokenizer:
        _add_byte_tokenizer(w, cfg["vocab_size"])
    for key, value in (extra_kv or {}).items():
        w.add_float32(key, value)
    t = {n: v.float().numpy() for n, v in iter_safetensors(hf_dir)}
    tensors: dict[str, np.ndarray] = {"token_embd.weight": t.pop("model.embed_tokens.weight"),
                                      "output_norm.weight": t.pop("model.norm.weight"),
                                      "output.weight": t.pop("lm_head.weight")}
    raw: dict[str, np.ndarray] = {}
    for n, v in t.items():
        parts = n.split(".")
        layer, rest, blk = int(parts[2]), ".".join(parts[3:]), f"blk.{parts[2]}"
        if rest in _ATTN:
            tensors[f"{blk}.{_ATTN[rest]}"] = v
        elif rest == "mlp.experts.gate_up_proj":
            if mxfp4 is not None and layer == 0:
                blocks, scales = mxfp4["gate_up_proj"]  # [E, 2I (interleaved), H / 32, ...]
                halves = [_mxfp4_ggml(blocks[:, h::2], scales[:, h::2]) for h in (0, 1)]
                if fused_gate_up:
                    raw[f"{blk}.ffn_gate_up_exps.weight"] = np.concatenate(halves, axis=1)
                else:
                    raw[f"{blk}.ffn_gate_exps.weight"], raw[f"{blk}.ffn_up_exps.weight"] = halves
                continue
            v = v.swapaxes(-1, -2)  # [E, 2I, H], rows interleaved
            if fused_gate_up:
                tensors[f"{blk}.ffn_gate_up_exps.weight"] = np.concatenate([v[:, 0::2], v[:, 1::2]], axis=1)
            else:
                tensors[f"{blk}.ffn_gate_exps.weight"], tensors[f"{blk}.ffn_up_exps.weight"] = v[:, 0::2], v[:, 1::2]
        elif rest == "mlp.experts.gate_up_proj_bias":
            if fused_gate_up:
                tensors[f"{blk}.ffn_gate_up_exps.bias"] = np.concatenate([v[..., 0::2], v[..., 1::2]], axis=-1)
            else:
                tensors[f"{blk}.ffn_gate_exps.bias"], tensors[f"{blk}.ffn_up_exps.bias"] = v[..., 0::2], v[..., 1::2]
        elif rest == "mlp.experts.down_proj":
            if mxfp4 is not None and layer == 0:
                raw[f"{blk}.ffn_down_exps.weight"] = _mxfp4_ggml(*mxfp4["down_proj"])
                continue
            tensors[f"{blk}.ffn_down_exps.weight"] = v.swapaxes(-1, -2)  # [E, H, I]
        elif rest == "mlp.experts.down_proj_bias":
            tensors[f"{blk}.ffn_down_exps.bias"] = v
        else:
            raise AssertionError(f"unexpected tensor {n}")
    for n, v in tensors.items():
        w.add_tensor(n, np.ascontiguousarray(v, dtype=np.float32))
    for n, v in raw.items():
        w.add_tensor(n, np.ascontiguousarray(v), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _load(path: Path) -> Any:
    gguf = GGUFFile(path)
    model = build_empty_model(gguf.arch, torch.float32, "cpu")
    model.load_weights(gguf.tensors())
    return gguf, model


@pytest.mark.parametrize("fused_gate_up", [False, True], ids=["gate-up-apart", "gate-up-fused"])
def test_gpt_oss_gguf_loads_the_same_model_as_the_hf_directory(fused_gate_up: bool, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    hf_dir = write_tiny_moe(tmp_path / "hf", "gpt_oss")
    gguf, model = _load(write_gpt_oss_gguf(hf_dir, tmp_path / "gpt-oss.gguf", fused_gate_up=fused_gate_up))
    want = load_model(str(hf_dir), torch.float32, "cpu")
    # Sinks, windows per layer, YaRN (untruncated), the experts' routing; the file's eps is a float32, and the
    # end-of-sequence ids come from a tokenizer (this file has none).
    assert gguf.arch.rms_norm_eps == pytest.approx(want.arch.rms_norm_eps, rel=1e-6)
    assert replace(gguf.arch, rms_norm_eps=want.arch.rms_norm_eps, eos_token_ids=want.arch.eos_token_ids) == want.arch
    ours = dict(model.named_parameters())
    for n, p in want.model.named_parameters():
        assert torch.equal(ours[n], p), n


def test_gpt_oss_gguf_mxfp4_experts_equal_the_hf_mxfp4_dequantization(tmp_path: Path) -> None:
    """MXFP4 expert tensors in ggml's block layout (scale byte first, nibbles split low/high) give the values
    the HF ``*_blocks`` / ``*_scales`` of the same experts give."""
    pytest.importorskip("transformers")
    hf_dir = write_tiny_moe(tmp_path / "hf", "gpt_oss", intermediate_size=64)  # MXFP4 blocks: multiples of 32
    cfg = json.loads((hf_dir / "config.json").read_text())
    packed = random_mxfp4_experts(cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"])
    as_np = {k: (b.numpy(), s.numpy()) for k, (b, s) in packed.items()}
    for fused in (False, True):
        gguf, model = _load(write_gpt_oss_gguf(hf_dir, tmp_path / f"mx-{fused}.gguf", fused_gate_up=fused,
                                               mxfp4=as_np))
        assert {v for k, v in gguf.tensor_types().items() if ".layers.0.mlp.experts." in k
                and not k.endswith("_bias")} == {"MXFP4"}
        experts = model.model.layers[0].mlp.experts
        gate_up = dequantize_mxfp4(*packed["gate_up_proj"], torch.float32)  # [E, 2I interleaved, H]
        want_w13 = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        assert torch.equal(experts.w13, want_w13)
        assert torch.equal(experts.w2, dequantize_mxfp4(*packed["down_proj"], torch.float32))


def test_gpt_oss_gguf_refuses_what_it_does_not_read(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    hf_dir = write_tiny_moe(tmp_path / "hf", "gpt_oss")
    path = write_gpt_oss_gguf(hf_dir, tmp_path / "scaled.gguf", extra_kv={"gpt-oss.expert_weights_scale": 2.5})
    with pytest.raises(ModelLoadError, match=r"gpt-oss\.expert_weights_scale=2\.5 is not implemented"):
        GGUFFile(path)
    path = write_gpt_oss_gguf(hf_dir, tmp_path / "logmul.gguf",
                              extra_kv={"gpt-oss.rope.scaling.yarn_log_multiplier": 0.5})
    with pytest.raises(ModelLoadError, match=r"yarn_log_multiplier=0\.5 is not implemented"):
        GGUFFile(path)


def test_the_engine_serves_a_gpt_oss_gguf_as_it_serves_the_hf_directory(tmp_path: Path) -> None:
    """The whole load path (tokenizer, architecture, weights) into the engine: the same greedy tokens, with
    contexts past the sliding window (8)."""
    pytest.importorskip("transformers")
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.text.sampling_params import SamplingParams

    hf_dir = write_tiny_moe(tmp_path / "hf", "gpt_oss")
    path = write_gpt_oss_gguf(hf_dir, tmp_path / "gpt-oss.gguf", tokenizer=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 9)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = {}
    for name, spec in (("gguf", path), ("hf", hf_dir)):
        engine = LLMEngine(EngineConfig(model=str(spec), dtype="float32"))
        got[name] = engine.generate(prompts, params)
        engine.runner.release()
    assert got["gguf"] == got["hf"] and all(len(t) == 12 for t in got["gguf"])
