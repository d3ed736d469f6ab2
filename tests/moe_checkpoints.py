"""Tiny random mixture-of-experts checkpoints built by transformers (engine, parallel and e2e tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_MOE: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                      shared_expert_intermediate_size=40, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                      norm_topk_prob=True, head_dim=32),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, head_dim=16,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # MLA (kv_lora 32 + rope 8 = a 40-value latent per token), a dense first layer, shared experts; V2 without a
    # query LoRA and group-limited softmax routing, V3 with a query LoRA, sigmoid + bias routing in groups, YaRN.
    "deepseek_v2": dict(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=1.5, intermediate_size=96, num_key_value_heads=4),
    "deepseek_v3": dict(kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5, intermediate_size=96, num_key_value_heads=4,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}),
    # DeepSeek-V3.2: V3 plus an indexer; index_topk 8 < the prompts, so the top-k selection decides what is
    # seen; 16 index heads make an exact tie of index scores (every head's relu 0: 2**-16 per key) rare.
    "deepseek_v32": dict(kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
                         routed_scaling_factor=2.5, intermediate_size=96, num_key_value_heads=4,
                         index_n_heads=16, index_head_dim=16, index_topk=8),
    # GLM-4.5: q/k/v biases, per-head q/k norms, RoPE over half of each 32-wide head, DeepSeek-V3 routing (sigmoid
    # + choice bias in groups) with a shared expert and a dense first layer.
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                     intermediate_size=96, head_dim=32, attention_bias=True, use_qk_norm=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}
"""Per model_type: the MoE fields of its tiny config (several layouts: shared expert + a dense layer in
qwen2_moe, normalised top-k in qwen3_moe, sliding + sink attention in gpt_oss)."""

_BASE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, tie_word_embeddings=False)


def hf_config(model_type: str, **overrides: Any) -> Any:
    import transformers

    return transformers.AutoConfig.for_model(model_type, **{**_BASE, **TINY_MOE[model_type], **overrides})


def write_tiny_moe(root: Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random ``model_type`` checkpoint (weights ~N(0, 0.08), norms U(0.5, 1.5): HF's 0.02 init
    gives near-uniform logits) under root; returns root."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(model_type, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's choice bias: nonzero, so it counts
                b.normal_(0.0, 0.3)
    model.save_pretrained(str(root), safe_serialization=True)
    return root


def random_mxfp4_experts(experts: int, hidden: int, inter: int, seed: int = 0
                         ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """gpt-oss's MXFP4 expert tensors as its HF checkpoints store them, random: ``gate_up_proj`` (rows gate/up
    interleaved) and ``down_proj`` -> (blocks uint8 [E, out, in / 32, 16], scales uint8 [E, out, in / 32]), the
    scales near 2^-5 (weights of a few tenths)."""
    g = torch.Generator().manual_seed(seed)

    def pair(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, 256, (experts, out, inp // 32, 16), generator=g, dtype=torch.uint8),
                torch.randint(118, 126, (experts, out, inp // 32), generator=g, dtype=torch.uint8))

    return {"gate_up_proj": pair(2 * inter, hidden), "down_proj": pair(hidden, inter)}


FP8_BLOCK = [24, 24]
"""Blocks that do not divide the tiny shapes (64, 96, 40...): edge blocks are partial, as kv_a_proj_with_mqa's
576 rows are in 128-row blocks."""


def fp8_block_quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (fp8 e4m3 [out, in], fp32 inverse scales per block): each block's max maps to 448."""
    out, inp = w.shape
    bo, bi = block
    grid = (-(-out // bo), -(-inp // bi))
    scale = torch.empty(grid)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def write_fp8_copy(src: Path, dst: Path, block: list[int] = FP8_BLOCK) -> Path:
    """``src`` with every 2-D projection weight (not the embedding, head, norms or router) as FP8 block-scaled
    in ``block`` blocks, and the dequantized fp32 twin of it under dst / "ref"."""
    import json

    from safetensors.torch import load_file, save_file

    from services.engine.weights.fp8_block import dequantize_block_fp8

    (dst / "ref").mkdir(parents=True)
    tensors = load_file(str(next(src.glob("*.safetensors"))))
    fp8: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith("proj.weight"):
            q, s = fp8_block_quantize(t.float(), block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            ref[name] = dequantize_block_fp8(q, s, (block[0], block[1]))
        else:
            fp8[name] = ref[name] = t
    cfg = json.loads((src / "config.json").read_text())
    (dst / "ref" / "config.json").write_text(json.dumps(cfg))
    save_file(ref, str(dst / "ref" / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": block}
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(fp8, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
