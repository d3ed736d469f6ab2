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
    model.save_pretrained(str(root), safe_serialization=True)
    return root
