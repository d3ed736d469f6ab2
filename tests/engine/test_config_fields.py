"""Never silently wrong: every config.json key of each architecture is read, declared math-free, or refused
unless inert; unsupported values of read keys are refused in one line naming the key, value and model_type."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.text.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelArchConfig, ModelConfigError
from services.text.model.config_fields import (
    ARCH_SPECS,
    DENSE_READS,
    KNOWN_UNIMPLEMENTED,
    NO_MATH,
    gguf_unimplemented_field,
)
from services.text.model.errors import ModelLoadError
from services.text.model.hf_config import read_hf_config

transformers = pytest.importorskip("transformers")


def _default(model_type: str, **kw: Any) -> dict[str, Any]:
    return transformers.AutoConfig.for_model(model_type, **kw).to_dict()


@pytest.mark.parametrize("model_type", sorted(ARCH_SPECS))
def test_every_transformers_config_field_is_decided(model_type: str) -> None:
    """A key transformers' config of this model_type has that nobody decided about fails here."""
    reads = ARCH_SPECS[model_type].reads | DENSE_READS
    undecided = sorted(k for k in _default(model_type) if k not in reads | NO_MATH | KNOWN_UNIMPLEMENTED)
    assert not undecided, f"{model_type}: config keys neither read, nor NO_MATH, nor KNOWN_UNIMPLEMENTED: {undecided}"
    assert not (reads & NO_MATH), sorted(reads & NO_MATH)


_DEFAULT_KW: dict[str, dict[str, Any]] = {"deepseek_v2": {"num_experts_per_tok": 6}, "glm4_moe": {"head_dim": 128}}
"""transformers' DeepseekV2Config leaves num_experts_per_tok None (a config.json without it is refused); its
Glm4MoeConfig's head_dim defaults to 4096 // 96 = 42, whose half (the rotary width) is odd (GLM-4.5's configs
say 128)."""


@pytest.mark.parametrize("model_type", sorted(ARCH_SPECS))
def test_default_config_loads(model_type: str) -> None:
    arch = ModelArchConfig.from_hf_config(_default(model_type, **_DEFAULT_KW.get(model_type, {})))
    assert arch.architecture == ARCH_SPECS[model_type].family


@pytest.mark.parametrize(("model_type", "key", "value"), [
    ("llama", "mlp_bias", True),
    ("llama", "quantization_config", {"quant_method": "fp8"}),
    ("llama", "sliding_window", 16),
    ("mistral", "layer_types", ["sliding_attention", "full_attention"]),
    ("mistral", "attention_bias", True),
    ("qwen2", "final_logit_softcapping", 30.0),
    ("qwen3", "is_encoder_decoder", True),
    ("deepseek_v3", "quantization_config", {"quant_method": "fp8", "activation_scheme": "static",
                                            "weight_block_size": [128, 128]}),
    ("qwen3", "quantization_config", {"quant_method": "awq", "bits": 4}),
    ("deepseek_v3", "mlp_bias", True),
])
def test_unimplemented_math_field_is_refused_in_one_line(model_type: str, key: str, value: Any) -> None:
    cfg = {**_default(model_type), key: value}
    with pytest.raises(ModelConfigError) as e:
        ModelArchConfig.from_hf_config(cfg)
    msg = str(e.value)
    assert "\n" not in msg and f"{key}=" in msg and repr(model_type) in msg, msg


@pytest.mark.parametrize(("model_type", "key", "value", "named"), [
    ("llama", "hidden_act", "gelu", "hidden_act='gelu'"),
    ("llama", "rope_parameters", {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}, "rope_type='longrope'"),
    ("llama", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                  "mscale": 0.7, "rope_theta": 1e4}, "rope_scaling.mscale=0.7"),
    ("qwen2", "layer_types", ["sliding_attention"] * 32, "layer_types="),  # no window: use_sliding_window off
    ("qwen3", "layer_types", ["chunked_attention"] * 32, "layer_types="),
    ("deepseek_v3", "topk_method", "greedy", "topk_method='greedy'"),
    ("deepseek_v2", "scoring_func", "sigmoid", "scoring_func='sigmoid'"),
    ("deepseek_v3", "head_dim", 128, "head_dim=128"),
    # RoPE keys nested in rope_parameters are read or refused like top-level ones, never dropped
    ("llama", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "partial_rotary_factor=0.5"),
    ("qwen3", "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "low_freq_factor": 1.0},
     "rope_scaling.low_freq_factor=1.0"),
    ("mistral", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "factor": 8.0}, "rope_scaling.factor=8.0"),
    ("glm4_moe", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5},
     "rotary_dim=192"),
])
def test_unsupported_value_of_a_read_field_is_refused(model_type: str, key: str, value: Any, named: str) -> None:
    with pytest.raises(ModelConfigError) as e:
        ModelArchConfig.from_hf_config({**_default(model_type, **_DEFAULT_KW.get(model_type, {})), key: value})
    assert named in str(e.value) and "\n" not in str(e.value)


def test_math_free_and_inert_fields_are_accepted() -> None:
    cfg = {**_default("llama"), "torch_dtype": "bfloat16", "pad_token_id": 0, "initializer_range": 0.5,
           "quantization_config": None, "mlp_bias": False, "temperature": 0.7}
    ModelArchConfig.from_hf_config(cfg)


def test_glm4_moe_partial_rotary_is_read_from_either_place() -> None:
    """GLM-4.5's partial_rotary_factor: in rope_parameters (transformers 5) or at the top (a 4.x config.json)."""
    nested = ModelArchConfig.from_hf_config(_default("glm4_moe", head_dim=128))
    assert (nested.rotary_dim, nested.head_dim, nested.architecture) == (64, 128, "glm4_moe")
    flat = {k: v for k, v in _default("glm4_moe", head_dim=128).items() if k != "rope_parameters"}
    assert ModelArchConfig.from_hf_config({**flat, "rope_theta": 1e4, "partial_rotary_factor": 0.5}).rotary_dim == 64
    assert ModelArchConfig.from_hf_config({**flat, "rope_theta": 1e4}).rotary_dim is None  # the whole head


def test_qwen2_layer_types_follow_transformers() -> None:
    """Qwen2Config: sliding_window counts only with use_sliding_window; layers >= max_window_layers slide."""
    off = ModelArchConfig.from_hf_config(_default("qwen2", sliding_window=4096, use_sliding_window=False))
    assert off.sliding_window is None and off.layer_windows == ()
    cfg = _default("qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    arch = ModelArchConfig.from_hf_config(cfg)
    assert arch.layer_types == cfg["layer_types"] == [FULL_ATTENTION] * 2 + [SLIDING_ATTENTION] * 2
    assert arch.layer_windows == (0, 0, 64, 64)
    raw = {k: v for k, v in cfg.items() if k != "layer_types"}  # a 4.x config.json has no layer_types
    assert ModelArchConfig.from_hf_config(raw).layer_windows == (0, 0, 64, 64)
    mistral = ModelArchConfig.from_hf_config(_default("mistral", num_hidden_layers=3, sliding_window=8))
    assert mistral.layer_windows == (8, 8, 8)
    assert ModelArchConfig.from_hf_config(_default("mistral", sliding_window=None)).layer_windows == ()


def test_gguf_metadata_outside_what_the_loader_reads_is_refused() -> None:
    md = {"general.architecture": "llama", "general.name": "x", "tokenizer.ggml.model": "gpt2",
          "llama.block_count": 2, "llama.expert_count": 0}
    assert gguf_unimplemented_field(md) is None
    msg = gguf_unimplemented_field({**md, "llama.attention.sliding_window": 4096})
    assert msg is not None and "llama.attention.sliding_window=4096" in msg and "\n" not in msg


def _tiny_dir(tmp_path: Path, **extra: Any) -> Path:
    cfg = _default("llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **extra}))
    return tmp_path


def test_hf_loader_names_the_file_and_field(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        read_hf_config(_tiny_dir(tmp_path, mlp_bias=True))
    assert "config.json" in str(e.value) and "mlp_bias=True" in str(e.value)


def test_cli_prints_the_refusal_as_one_line(tmp_path: Path) -> None:
    model = _tiny_dir(tmp_path, attn_logit_softcapping=50.0)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--model", str(model), "--prompt", "hi",
                          "--max-tokens", "1"], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if "attn_logit_softcapping=50.0" in ln]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines[0].startswith("pdserve generate: error: ") and "'llama'" in lines[0]


@pytest.mark.parametrize("name", ["indexed_attention", "deepseek_sparse_attention"])
def test_deepseek_v32_layer_types_under_either_transformers_name(name: str) -> None:
    # transformers releases spell DeepSeek-V3.2's indexed layer differently; both mean the same math.
    cfg = _default("deepseek_v32")
    arch = ModelArchConfig.from_hf_config({**cfg, "layer_types": [name] * cfg["num_hidden_layers"]})
    assert arch.mla is not None and arch.mla.index_topk == cfg["index_topk"]
    with pytest.raises(ModelConfigError, match="layer_types"):
        ModelArchConfig.from_hf_config({**cfg, "layer_types": ["full_attention"] * cfg["num_hidden_layers"]})
