"""Decoders whose MLPs route through experts: Mixtral, Qwen2-MoE, Qwen3-MoE (and gpt-oss, in gpt_oss.py).

The attention, norms, embedding and head are the Llama code (Qwen2-MoE: q/k/v bias; Qwen3-MoE: q/k norm,
both behind ModelArchConfig flags); each layer that ``moe.is_sparse`` holds a :class:`SparseMoeBlock` as
``mlp``, the others keep the dense SwiGLU MLP.

Loading: HF names of expert tensors are read in every layout checkpoints use and stacked into the
[E, ...] parameters (``mlp.experts.w13`` rows [gate; up], ``mlp.experts.w2``):
- one tensor per expert: Mixtral ``block_sparse_moe.experts.E.w1/w3/w2`` (gate/up/down),
  Qwen ``mlp.experts.E.gate_proj/up_proj/down_proj``;
- stacked (transformers 5): ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate then up) and ``down_proj`` [E, H, I];
- stacked apart (the GGUF loader's names for ``ffn_{gate,up,down}_exps``): ``mlp.experts.gate_proj`` and
  ``up_proj`` [E, I, H] (gpt-oss GGUF: with ``gate_proj_bias`` / ``up_proj_bias`` [E, I]), ``down_proj`` [E, H, I];
- gpt-oss (``_GATE_UP_INTERLEAVED``): ``gate_up_proj`` [E, H, 2I] with gate/up columns interleaved,
  ``down_proj`` [E, I, H], their biases, or the MXFP4 ``*_blocks`` + ``*_scales`` pairs.
- ours (``w13``, ``w2`` and biases, as a TP=1 model's parameters: random models sharded for tensor parallelism).
Routers (``gate`` or ``router``, with DeepSeek-V3's ``gate.e_score_correction_bias``) become ``mlp.gate``; the
shared expert (Qwen ``shared_expert``, DeepSeek ``shared_experts``) fills ``mlp.shared_expert``.
Under tensor parallelism each piece is cut to this rank's intermediate slice (see moe.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.moe import SparseMoeBlock
from services.engine.parallel.split import even_range
from services.engine.weights.mxfp4 import dequantize_mxfp4
from services.text.model.config import ModelArchConfig

LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
"""A decoder layer's tensor names; group 1 is the layer index."""
_MOE_RE = re.compile(r"(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.(.+)")
_PER_EXPERT_RE = re.compile(r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_PER_EXPERT_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": -1, "down_proj": -1}
_SHARED_PART = {"gate_proj": 0, "up_proj": 1, "down_proj": -1}


@dataclass(frozen=True)
class Piece:
    """One HF tensor's share of a parameter: expert ``expert`` (-1: the whole parameter), ``half`` 0 = gate rows,
    1 = up rows, -1 = the whole (expert's) tensor."""

    param: str
    expert: int
    half: int
    tensor: torch.Tensor


class MoEForCausalLM(LlamaForCausalLM):
    _self_loaded = (".mlp.gate.", ".mlp.experts.", ".mlp.shared_expert.", ".mlp.shared_expert_gate.")
    _GATE_UP_INTERLEAVED = False
    """Stacked gate_up tensors are [E, H, 2I] with gate/up interleaved (gpt-oss) instead of [E, 2I, H]."""

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__(arch)
        moe = arch.moe
        if moe is None:
            raise ValueError(f"{arch.architecture} needs ModelArchConfig.moe")
        for i, layer in enumerate(self.model.layers):
            if moe.is_sparse(i):
                layer.mlp = SparseMoeBlock(arch)
        self._mxfp4_pending: dict[str, torch.Tensor] = {}

    # -- HF names -> pieces ------------------------------------------------------------------------------

    def _pieces(self, name: str, t: torch.Tensor) -> list[Piece] | None:
        """The pieces of an MoE tensor, [] while half of an MXFP4 pair waits, None for a non-MoE name."""
        m = _MOE_RE.fullmatch(name)
        if m is None:
            return None
        mlp, rest = f"{m.group(1)}.mlp", m.group(2)
        if rest.startswith(("gate.", "router.")):
            return [Piece(f"{mlp}.gate.{rest.split('.', 1)[1]}", -1, -1, t)]
        if rest == "shared_expert_gate.weight":  # GGUF stores it as a vector [H]
            return [Piece(f"{mlp}.shared_expert_gate.weight", -1, -1, t.reshape(1, -1) if t.dim() == 1 else t)]
        if rest.startswith(("shared_expert.", "shared_experts.")):  # Qwen2-MoE / DeepSeek names
            kind = rest.split(".")[1]
            if kind not in _SHARED_PART or not rest.endswith(".weight"):
                return [Piece(f"{mlp}.{rest}", -1, -1, t)]  # refused as unexpected below
            half = _SHARED_PART[kind]
            target = "down_proj" if half < 0 else "gate_up_proj"
            return [Piece(f"{mlp}.shared_expert.{target}.weight", -1, half, t)]
        pe = _PER_EXPERT_RE.fullmatch(rest)
        if pe is not None:
            half = _PER_EXPERT_PART[pe.group(2)]
            return [Piece(f"{mlp}.experts.{'w2' if half < 0 else 'w13'}", int(pe.group(1)), half, t)]
        if rest.endswith(("_blocks", "_scales")):
            return self._mxfp4_pieces(mlp, rest, t)
        if rest == "experts.gate_up_proj":
            if self._GATE_UP_INTERLEAVED:
                return self._gate_up(f"{mlp}.experts.w13", t.transpose(1, 2), interleaved=True)
            return self._gate_up(f"{mlp}.experts.w13", t, interleaved=False)
        if rest in ("experts.w13", "experts.w13_bias"):  # our own stacked layout (a TP=1 model's tensors)
            return self._gate_up(f"{mlp}.{rest}", t, interleaved=False)
        if rest in ("experts.w2", "experts.w2_bias"):
            return [Piece(f"{mlp}.{rest}", e, -1, t[e]) for e in range(t.shape[0])]
        if rest in ("experts.gate_proj", "experts.up_proj"):  # GGUF: gate and up stacked apart, [E, I, H]
            half = 0 if rest == "experts.gate_proj" else 1
            return [Piece(f"{mlp}.experts.w13", e, half, t[e]) for e in range(t.shape[0])]
        if rest in ("experts.gate_proj_bias", "experts.up_proj_bias"):  # their biases (gpt-oss GGUF), [E, I]
            half = 0 if rest == "experts.gate_proj_bias" else 1
            return [Piece(f"{mlp}.experts.w13_bias", e, half, t[e]) for e in range(t.shape[0])]
        if rest == "experts.down_proj":
            w = t.transpose(1, 2) if self._GATE_UP_INTERLEAVED else t
            return [Piece(f"{mlp}.experts.w2", e, -1, w[e]) for e in range(w.shape[0])]
        if rest == "experts.gate_up_proj_bias":
            return self._gate_up(f"{mlp}.experts.w13_bias", t, interleaved=self._GATE_UP_INTERLEAVED)
        if rest == "experts.down_proj_bias":
            return [Piece(f"{mlp}.experts.w2_bias", e, -1, t[e]) for e in range(t.shape[0])]
        if rest.startswith("experts."):
            return [Piece(f"{mlp}.{rest}", -1, -1, t)]  # refused as unexpected below
        return None  # a dense MLP (mlp_only_layers) or attention: the Llama loader's

    @staticmethod
    def _gate_up(param: str, t: torch.Tensor, interleaved: bool) -> list[Piece]:
        """[E, 2I, ...] rows -> per-expert gate and up pieces (rows 0::2 / 1::2 when interleaved)."""
        inter = t.shape[1] // 2
        gate, up = (t[:, 0::2], t[:, 1::2]) if interleaved else (t[:, :inter], t[:, inter:])
        return [Piece(param, e, h, part[e]) for e in range(t.shape[0]) for h, part in ((0, gate), (1, up))]

    def _mxfp4_pieces(self, mlp: str, rest: str, t: torch.Tensor) -> list[Piece]:
        base, kind = rest.rsplit("_", 1)  # experts.gate_up_proj, blocks|scales
        if base not in ("experts.gate_up_proj", "experts.down_proj"):
            return [Piece(f"{mlp}.{rest}", -1, -1, t)]  # refused as unexpected below
        key = f"{mlp}.{base}"
        other = self._mxfp4_pending.pop(f"{key}:{'scales' if kind == 'blocks' else 'blocks'}", None)
        if other is None:
            self._mxfp4_pending[f"{key}:{kind}"] = t
            return []
        blocks, scales = (t, other) if kind == "blocks" else (other, t)
        dtype = self.model.norm.weight.dtype
        # One expert at a time: the fp32 intermediates of a whole layer would be several GB.
        rows = [dequantize_mxfp4(blocks[e], scales[e], dtype) for e in range(blocks.shape[0])]
        w = torch.stack(rows)  # [E, out, in]
        if base == "experts.down_proj":
            return [Piece(f"{mlp}.experts.w2", e, -1, w[e]) for e in range(w.shape[0])]
        return self._gate_up(f"{mlp}.experts.w13", w, interleaved=True)

    # -- pieces -> parameters ------------------------------------------------------------------------------

    def _slices(self, piece: Piece, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(destination view, source cut to this rank) of a piece."""
        split = self.tp_split
        name, t = piece.param, piece.tensor
        moe = self.arch.moe
        assert moe is not None
        full = moe.shared_expert_intermediate_size if ".shared_expert." in name else moe.intermediate_size
        a, b = even_range(full, split.tp_size, split.rank)
        dst = param.data if piece.expert < 0 else param.data[piece.expert]
        if piece.half >= 0:  # gate or up rows (weights or biases) of an expert / the shared expert
            local = b - a
            return dst[piece.half * local:(piece.half + 1) * local], t[a:b]
        if name.endswith((".w2", ".shared_expert.down_proj.weight")):
            return dst, t[:, a:b]
        if name.endswith(".w2_bias") and split.rank:
            return dst, torch.zeros_like(t)  # rank 0 adds the down bias for all ranks (one all-reduce sums them)
        return dst, t

    def _expected_pieces(self) -> set[tuple[str, int, int]]:
        moe = self.arch.moe
        assert moe is not None
        out: set[tuple[str, int, int]] = set()
        for name, _ in self.named_parameters():
            if not any(f in name for f in self._self_loaded):
                continue
            if name.endswith((".w13", ".w13_bias")):
                out.update((name, e, h) for e in range(moe.num_experts) for h in (0, 1))
            elif name.endswith((".w2", ".w2_bias")):
                out.update((name, e, -1) for e in range(moe.num_experts))
            elif name.endswith(".shared_expert.gate_up_proj.weight"):
                out.update({(name, -1, 0), (name, -1, 1)})
            else:
                out.add((name, -1, -1))
        return out

    def _take_moe(self, weights: Iterable[tuple[str, torch.Tensor]], params: dict[str, torch.nn.Parameter],
                  done: set[tuple[str, int, int]], names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Copy MoE tensors into their parameters (recording them in done and names); yield every other tensor."""
        for name, t in weights:
            pieces = self._pieces(name, t)
            if pieces is None:
                yield name, t
                continue
            for p in pieces:
                param = params.get(p.param)
                if param is None:
                    raise ValueError(f"unexpected weight {name!r} for a {self.arch.architecture} model")
                dst, src = self._slices(p, param)
                if tuple(dst.shape) != tuple(src.shape):
                    raise ValueError(f"weight {name!r}: shape {tuple(src.shape)}, model expects {tuple(dst.shape)}")
                dst.copy_(src)
                done.add((p.param, p.expert, p.half))
            names.add(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        done: set[tuple[str, int, int]] = set()
        names: set[str] = set()
        self._mxfp4_pending = {}
        loaded = super().load_weights(self._take_moe(weights, params, done, names))
        if self._mxfp4_pending:
            raise ValueError(f"MXFP4 tensors without their pair: {sorted(self._mxfp4_pending)[:4]}")
        missing = sorted({n for n, _, _ in self._expected_pieces() - done})
        if missing:
            raise ValueError(f"{len(missing)} expert parameters not (fully) found in the checkpoint, "
                             f"e.g. {missing[:4]}")
        return loaded | names


class MixtralForCausalLM(MoEForCausalLM):
    pass


class Qwen2MoeForCausalLM(MoEForCausalLM):
    def __init__(self, arch: ModelArchConfig) -> None:
        if not arch.attention_bias or arch.qk_norm:
            raise ValueError("Qwen2-MoE needs attention_bias=True and qk_norm=False")
        super().__init__(arch)


class Glm4MoeForCausalLM(MoEForCausalLM):
    """GLM-4.5: the Llama attention (q/k/v biases, optional q/k norms, partial RoPE: ModelArchConfig flags) and
    DeepSeek-V3-style experts; the checkpoint's multi-token-prediction layers after the last decoder layer
    (num_nextn_predict_layers) are not part of the forward and are skipped."""

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        n = self.arch.num_layers
        return super().load_weights((name, t) for name, t in weights
                                    if (m := LAYER_RE.match(name)) is None or int(m.group(1)) < n)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    def __init__(self, arch: ModelArchConfig) -> None:
        if not arch.qk_norm:
            raise ValueError("Qwen3-MoE needs qk_norm=True")
        super().__init__(arch)
