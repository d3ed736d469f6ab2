"""Named random model shapes (``random:NAME``), readable without torch: the router resolves ``random:NAME``
specs (their context length), the engine builds the model (engine/weights/random_weights.py fills its weights).

Random models pair with the byte-level tokenizer (ids 0..255 = bytes, 256 = eos), so every shape's vocab
covers at least 257 ids. A shape with ``fp8_weight_block`` has FP8 block-scaled linears (random e4m3 weights and
block scales) wherever the engine keeps a checkpoint's FP8 linears fp8, plain ones elsewhere
(engine/weights/random_weights.py).
"""

from __future__ import annotations

import dataclasses

from services.text.model.config import ModelArchConfig
from services.text.model.errors import ModelLoadError
from services.text.model.mla_config import MLAConfig, yarn_softmax_scale
from services.text.model.moe_config import MoEConfig

BYTE_EOS_ID = 256
"""End-of-sequence id of the byte-level tokenizer that random models use."""

_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

_DSV2_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
              "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}

_DSV3_YARN = {**_DSV2_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}
"""DeepSeek-V3's rope_scaling: V2's YaRN with mscale = mscale_all_dim = 1 (the rotary tables unscaled, the softmax
scale times (0.1 ln 40 + 1)^2)."""

_DSV3_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536)

RANDOM_SHAPES: dict[str, dict[str, object]] = {
    "smollm2-135m": dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072),
    "qwen3-8b": dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1e6, max_position_embeddings=40960, qk_norm=True),
    # Mixture of experts at their real sizes (config.json of Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1,
    # openai/gpt-oss-20b).
    "qwen3-30b-a3b": dict(architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
                          rope_theta=1e6, max_position_embeddings=40960, qk_norm=True,
                          moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True)),
    "mixtral-8x7b": dict(architecture="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         rope_theta=1e6, max_position_embeddings=32768,
                         moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=14336, norm_topk_prob=True)),
    "gpt-oss-20b": dict(architecture="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
                        rope_theta=150000.0, max_position_embeddings=131072, attention_bias=True,
                        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4096},
                        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
                        attention_sinks=True,
                        moe=MoEConfig(num_experts=32, top_k=4, intermediate_size=2880, scoring="softmax_topk",
                                      norm_topk_prob=False, activation="gpt_oss", swiglu_alpha=1.702,
                                      swiglu_limit=7.0, router_bias=True, expert_bias=True)),
    # deepseek-ai/DeepSeek-V2-Lite's config.json (15.7B, 2.4B active): MLA with a 576-value latent per token.
    "deepseek-v2-lite": dict(architecture="deepseek", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             num_layers=27, num_heads=16, num_kv_heads=1, head_dim=288, rms_norm_eps=1e-6,
                             rope_theta=10000.0, max_position_embeddings=163840, rope_scaling=_DSV2_YARN,
                             moe=MoEConfig(num_experts=64, top_k=6, intermediate_size=1408, norm_topk_prob=False,
                                           shared_expert_intermediate_size=2 * 1408, mlp_only_layers=[0]),
                             mla=MLAConfig(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                           softmax_scale=yarn_softmax_scale(192, _DSV2_YARN))),
    "tiny-deepseek": dict(architecture="deepseek", vocab_size=512, hidden_size=64, intermediate_size=96,
                          num_layers=2, num_heads=4, num_kv_heads=1, head_dim=20, rms_norm_eps=1e-6,
                          rope_theta=10000.0, max_position_embeddings=1024,
                          moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, scoring="sigmoid",
                                        norm_topk_prob=True, shared_expert_intermediate_size=32, mlp_only_layers=[0],
                                        n_group=2, topk_group=1, group_score="top2_sum", score_bias=True,
                                        routed_scaling_factor=2.5),
                          mla=MLAConfig(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                        q_lora_rank=24)),
    # deepseek-ai/DeepSeek-V3's config.json with num_hidden_layers cut from 61 to 3 (first_k_dense_replace 3 -> 1:
    # layer 0 dense, layers 1-2 MoE) so that it fits one 80 GB GPU. Bytes, with the linears fp8 (1 B per weight)
    # and the experts bf16 (there is no fp8 fused-MoE kernel: the 3-D expert tensors stay bf16 on every device):
    #   routed experts  256 x 3 x 7168 x 2048 x 2 B = 22.55 GB per MoE layer, x 2      = 45.10 GB
    #   embedding + LM head  2 x 129280 x 7168 x 2 B                                     =  3.71 GB
    #   attention  187.1M weights per layer (q_a, q_b, kv_a, o fp8; kv_b 16.8M bf16) x 3 =  0.61 GB
    #   layer 0's dense MLP 3 x 7168 x 18432 fp8 + shared experts and routers            =  0.49 GB
    # = 49.9 GB (50.9 GB with every linear bf16); the latent KV is 3 x 576 x 2 B = 3.5 KB per token (0.57 GB at
    # 163840 tokens). A fourth layer (+22.8 GB = 72.7 GB) would leave no room for the KV cache, the fused MoE's
    # buffers and a prefill's activations on an 80 GB card.
    "deepseek-v3-cut": dict(architecture="deepseek", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                            num_layers=3, num_heads=128, num_kv_heads=1, head_dim=288, rms_norm_eps=1e-6,
                            rope_theta=10000.0, max_position_embeddings=163840, rope_scaling=_DSV3_YARN,
                            moe=MoEConfig(num_experts=256, top_k=8, intermediate_size=2048, scoring="sigmoid",
                                          norm_topk_prob=True, shared_expert_intermediate_size=2048,
                                          mlp_only_layers=[0], n_group=8, topk_group=4, group_score="top2_sum",
                                          score_bias=True, routed_scaling_factor=2.5),
                            mla=MLAConfig(**_DSV3_MLA, softmax_scale=yarn_softmax_scale(192, _DSV3_YARN)),
                            fp8_weight_block=[128, 128]),
    # deepseek-v3-cut's layout at small widths, for tests: FP8 linears in the same 128 x 128 blocks (every width a
    # multiple of 128 but kv_a_proj_with_mqa's 128 + 64 rows, a partial last block row as V3's 576 rows are),
    # layer 0 dense, layer 1 routed through 8 experts in 4 groups.
    "tiny-deepseek-v3-fp8": dict(architecture="deepseek", vocab_size=512, hidden_size=256, intermediate_size=256,
                                 num_layers=2, num_heads=2, num_kv_heads=1, head_dim=96, rms_norm_eps=1e-6,
                                 rope_theta=10000.0, max_position_embeddings=1024,
                                 moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=128, scoring="sigmoid",
                                               norm_topk_prob=True, shared_expert_intermediate_size=128,
                                               mlp_only_layers=[0], n_group=4, topk_group=2, group_score="top2_sum",
                                               score_bias=True, routed_scaling_factor=2.5),
                                 mla=MLAConfig(kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                               v_head_dim=64, q_lora_rank=128),
                                 fp8_weight_block=[128, 128]),
    "tiny-mixtral": dict(architecture="mixtral", vocab_size=512, hidden_size=64, intermediate_size=96,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         rope_theta=1e6, max_position_embeddings=1024,
                         moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=48)),
    "tiny-llama": dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=1024,
                       rope_scaling={**_LLAMA3_SCALING, "original_max_position_embeddings": 64}),
    "tiny-qwen3": dict(architecture="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
                       rope_theta=1e6, max_position_embeddings=1024, qk_norm=True),
}


def random_arch(name: str) -> ModelArchConfig:
    """ModelArchConfig of shape `name` (a key of RANDOM_SHAPES); KeyError if unknown; ModelLoadError naming
    the fields when the shape needs architecture fields this engine does not have."""
    shape = dict(RANDOM_SHAPES[name])
    unknown = sorted(set(shape) - {f.name for f in dataclasses.fields(ModelArchConfig)})
    if unknown:
        raise ModelLoadError(f"random:{name} needs {unknown}, which this engine does not support")
    if isinstance(shape.get("moe"), MoEConfig):  # each model its own copy
        shape["moe"] = dataclasses.replace(shape["moe"], mlp_only_layers=list(shape["moe"].mlp_only_layers))
    if "fp8_weight_block" in shape:
        shape["fp8_weight_block"] = list(shape["fp8_weight_block"])  # type: ignore[call-overload]
    return ModelArchConfig(**shape, eos_token_ids=[BYTE_EOS_ID])  # type: ignore[arg-type]
