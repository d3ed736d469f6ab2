"""gpt-oss: the MoE decoder with biased attention projections, per-head attention sinks and alternating
sliding/full attention layers (``ModelArchConfig.layer_types``, ``sliding_window``, ``attention_sinks``).

Each layer's MLP is a :class:`SparseMoeBlock` with a biased router, softmax over the top-k logits, biased
experts and the clamped ``(up + 1) * gate * sigmoid(alpha * gate)`` activation. Checkpoint layouts
(interleaved gate/up columns, MXFP4 ``*_blocks``/``*_scales``) are converted at load (moe_model.py).
``self_attn.sinks`` [heads] is one learned logit per head that joins every softmax denominator; under tensor
parallelism each rank holds its own heads' sinks.
"""

from __future__ import annotations

import torch

from services.engine.models.llama import Attention
from services.engine.models.moe_model import MoEForCausalLM, Piece
from services.engine.parallel.layers import row_linear
from services.text.model.config import ModelArchConfig, ModelConfigError


class GptOssAttention(Attention):
    """The shared attention (its window and sinks come from ModelArchConfig) with a biased o_proj."""

    def __init__(self, arch: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(arch, layer_idx)
        self.o_proj = row_linear(self.q_size, arch.hidden_size, bias=True)

    # YaRN scales cos/sin by its attention factor inside RotaryEmbedding; the fused Triton RoPE reads the same
    # caches, but the unfused path is the one checked against transformers.
    forward_fused = Attention.forward


class GptOssForCausalLM(MoEForCausalLM):
    _self_loaded = (*MoEForCausalLM._self_loaded, ".self_attn.sinks", ".self_attn.o_proj.bias")
    _GATE_UP_INTERLEAVED = True

    def __init__(self, arch: ModelArchConfig) -> None:
        if not arch.attention_bias or arch.qk_norm:
            raise ValueError("gpt-oss needs attention_bias=True and qk_norm=False")
        if not arch.attention_sinks:
            raise ModelConfigError("gpt_oss needs attention_sinks=True (every layer has a sink logit per head)")
        super().__init__(arch)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = GptOssAttention(arch, i)

    def _pieces(self, name: str, t: torch.Tensor) -> list[Piece] | None:
        if name.endswith(".self_attn.sinks"):
            a, b = self.tp_split.q_range  # this rank's heads
            return [Piece(name, -1, -1, t[a:b])]
        if name.endswith(".self_attn.o_proj.bias"):  # whole on every rank: added once, after the all-reduce
            return [Piece(name, -1, -1, t)]
        return super()._pieces(name, t)
