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
from torch import nn

from services.engine.attention import ForwardContext
from services.engine.models.config import ModelArchConfig, ModelConfigError
from services.engine.models.llama import Attention
from services.engine.models.moe_model import MoEForCausalLM, Piece
from services.engine.models.rope import RotaryEmbedding
from services.engine.parallel.layers import row_linear


class GptOssAttention(Attention):
    def __init__(self, arch: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(arch, layer_idx)
        self.o_proj = row_linear(self.q_size, arch.hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self._qkv(x)
        q, k = rotary(positions, q, k)
        out = ctx.attend(self.layer_idx, q, k, v, sinks=self.sinks)  # [T, H, D]
        return self.o_proj(out.reshape(x.shape[0], self.q_size))

    forward_fused = forward


class GptOssForCausalLM(MoEForCausalLM):
    _self_loaded = (*MoEForCausalLM._self_loaded, ".self_attn.sinks", ".self_attn.o_proj.bias")
    _GATE_UP_INTERLEAVED = True

    def __init__(self, arch: ModelArchConfig) -> None:
        if not arch.attention_bias or arch.qk_norm:
            raise ValueError("gpt-oss needs attention_bias=True and qk_norm=False")
        # The sink and sliding-window fields come with the attention that runs them; an engine without them
        # refuses gpt-oss here rather than run its attention without sinks.
        if not getattr(arch, "attention_sinks", False):
            raise ModelConfigError("gpt_oss: attention sinks (ModelArchConfig.attention_sinks) are not "
                                   "supported by this engine's attention")
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
