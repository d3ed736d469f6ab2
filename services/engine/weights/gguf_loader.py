"""GGUF (llama.cpp) files: tensors -> dequantized HF-named torch tensors, on top of the metadata
(services/text/model/gguf_meta.py: metadata -> ModelArchConfig, the part the router reads). torch is imported
by :meth:`GGUFFile.tensors` alone.

Tensor conventions: GGUF lists dims innermost-first (ne0 = input features), so a tensor of GGUF shape
[in, out] is the torch weight [out, in]. llama.cpp's converter permutes the rows of attn_q/attn_k of
`llama` models (`w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)`, interleaved -> halves RoPE);
:func:`unpermute_qk` undoes that exactly so HF's rotate_half RoPE applies unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from services.text.model.errors import ModelLoadError
from services.text.model.gguf_meta import GGUFMetadata

if TYPE_CHECKING:
    import torch

# llama.cpp stores the q/k rows of these architectures permuted for its interleaved RoPE.
_PERMUTED_QK_ARCHS = {"llama"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Mixture of experts (llama with experts = Mixtral, qwen2moe, qwen3moe): the experts stacked [E, ...].
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_ARCH_LAYER_NAMES = {
    # gpt-oss as llama.cpp's converter writes it: the post-attention norm under its own name, a sink logit per
    # head, biased o_proj / router / experts; experts stacked apart (gate and up [E, I, H], down [E, H, I]) or,
    # from newer converters, gate and up fused ([E, 2I, H], gate rows first). Named here in the loader's own
    # stacked layout (``experts.w13`` / ``w2``), which needs no transposition.
    "gpt-oss": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_sinks.weight": "self_attn.sinks",
        "attn_output.bias": "self_attn.o_proj.bias",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
        "ffn_gate_exps.weight": "mlp.experts.gate_proj",
        "ffn_up_exps.weight": "mlp.experts.up_proj",
        "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
        "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
        "ffn_gate_up_exps.weight": "mlp.experts.w13",
        "ffn_gate_up_exps.bias": "mlp.experts.w13_bias",
        "ffn_down_exps.weight": "mlp.experts.w2",
        "ffn_down_exps.bias": "mlp.experts.w2_bias",
    },
}
"""general.architecture -> layer tensor names that differ from (or add to) _LAYER_NAMES."""
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_to_hf_name(name: str, arch: str = "") -> str | None:
    """GGUF tensor name -> HF parameter name for a file of ``general.architecture`` ``arch`` (None for tensors
    we do not use, e.g. rope_freqs)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m is None:
        return None
    hf = _ARCH_LAYER_NAMES.get(arch, {}).get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
    return None if hf is None else f"model.layers.{m.group(1)}.{hf}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows [n_head, head_dim//2, 2] -> [n_head, 2, head_dim//2]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile(GGUFMetadata):
    """An opened GGUF file: its metadata and `arch` (GGUFMetadata), and `tensors()`."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 CPU tensor) per tensor, dequantized one at a time (peak = one tensor)."""
        import torch
        from gguf.quants import dequantize

        arch = self.arch
        permute = self.arch_name in _PERMUTED_QK_ARCHS
        for t in self._reader.tensors:
            hf = gguf_to_hf_name(t.name, self.arch_name)
            if hf is None:
                continue
            try:
                data = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise ModelLoadError(f"{self.path}: cannot dequantize {t.name} "
                                     f"({t.tensor_type.name}): {e}") from e
            data = np.asarray(data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
            if permute and t.name.endswith("attn_q.weight"):
                data = unpermute_qk(data, arch.num_heads)
            elif permute and t.name.endswith("attn_k.weight"):
                data = unpermute_qk(data, arch.num_kv_heads)
            if not data.flags.writeable:  # F32/F16 tensors are read-only views of the memmap
                data = data.copy()
            yield hf, torch.from_numpy(np.ascontiguousarray(data))

    def tensor_types(self) -> dict[str, str]:
        """HF name -> GGUF storage type name (Q4_1, Q8_0, F32 ...) of each tensor the model uses."""
        out = {}
        for t in self._reader.tensors:
            hf = gguf_to_hf_name(t.name, self.arch_name)
            if hf is not None:
                out[hf] = t.tensor_type.name
        return out

    def q8_0_weight(self, hf_name: str) -> Q8_0Blocks | None:
        """The raw blocks of one Q8_0 tensor (e.g. a tied embedding / LM head); None if it is stored otherwise.
        Not for the permuted q/k weights of llama."""
        from gguf import GGMLQuantizationType

        for t in self._reader.tensors:
            if gguf_to_hf_name(t.name, self.arch_name) == hf_name and t.tensor_type == GGMLQuantizationType.Q8_0:
                blocks = np.asarray(t.data, dtype=np.uint8).reshape(int(t.shape[1]), -1, _Q8_0_BLOCK_BYTES)
                d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
                q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(blocks.shape[0], -1)
                return Q8_0Blocks(q=q, d=d)
        return None

    def q4_1_weights(self) -> Iterator[tuple[str, Q4_1Blocks]]:
        """(HF name, raw blocks) of each Q4_1 tensor, rows un-permuted like :meth:`tensors` (q/k of llama)."""
        from gguf import GGMLQuantizationType

        heads = {"attn_q.weight": self.arch.num_heads, "attn_k.weight": self.arch.num_kv_heads}
        permute = self.arch_name in _PERMUTED_QK_ARCHS
        for t in self._reader.tensors:
            hf = gguf_to_hf_name(t.name, self.arch_name)
            if hf is None or t.tensor_type != GGMLQuantizationType.Q4_1:
                continue
            if len(t.shape) != 2:  # stacked experts: no linear reads them packed
                continue
            rows = int(t.shape[1])
            b = _q4_1_blocks(t.data, rows)
            n_head = next((h for suffix, h in heads.items() if t.name.endswith(suffix)), None)
            if permute and n_head is not None:
                b = Q4_1Blocks(*(np.ascontiguousarray(unpermute_qk(a, n_head)) for a in (b.q, b.d, b.m)))
            yield hf, b


@dataclass(frozen=True)
class Q4_1Blocks:
    """A Q4_1 weight as stored, rows in HF order: w[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32]."""

    q: np.ndarray
    """uint8 [out, in], values 0..15."""
    d: np.ndarray
    """float32 [out, in // 32]: each group's step (fp16 in the file, exact in fp32)."""
    m: np.ndarray
    """float32 [out, in // 32]: each group's minimum."""


@dataclass(frozen=True)
class Q8_0Blocks:
    """A Q8_0 weight as stored: w[n, k] = d[n, k // 32] * q[n, k]."""

    q: np.ndarray
    """int8 [out, in]."""
    d: np.ndarray
    """float32 [out, in // 32] (fp16 in the file)."""


_Q8_0_BLOCK_BYTES = 34
"""ggml block_q8_0: fp16 d, 32 int8."""

Q4_1_GROUP = 32
"""Weights per Q4_1 block (ggml QK4_1)."""
_Q4_1_BLOCK_BYTES = 20
"""ggml block_q4_1: fp16 d, fp16 m, 16 bytes of nibbles (low nibble = element j, high = element j + 16)."""


def _q4_1_blocks(raw: np.ndarray, rows: int) -> Q4_1Blocks:
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, _Q4_1_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    nib = blocks[..., 4:]
    q = np.concatenate([nib & 0xF, nib >> 4], axis=-1).reshape(rows, -1)
    return Q4_1Blocks(q=q, d=d, m=m)
