"""Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm before RoPE): the Llama code behind config flags."""

from __future__ import annotations

from services.engine.models.llama import LlamaForCausalLM
from services.text.model.config import ModelArchConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArchConfig) -> None:
        if not arch.attention_bias or arch.qk_norm:
            raise ValueError("Qwen2 needs attention_bias=True and qk_norm=False")
        super().__init__(arch)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArchConfig) -> None:
        if not arch.qk_norm:
            raise ValueError("Qwen3 needs qk_norm=True")
        super().__init__(arch)
