"""Llama-family decoder over the paged-attention contract (`ctx.attend`), with HF parameter names.

Parameters follow HF names (``model.layers.N.self_attn.o_proj.weight`` ...) except two fusions:
``self_attn.qkv_proj`` = rows [q_proj; k_proj; v_proj] and ``mlp.gate_up_proj`` = rows
[gate_proj; up_proj]. :meth:`LlamaForCausalLM.load_weights` takes HF names and fills the fused slices.
Qwen2 (qkv bias) and Qwen3 (q/k norm) are the same code behind ``ModelArchConfig`` flags, and so are
sliding-window layers (``arch.layer_window(i)``) and attention sinks (``self_attn.sinks`` [num_heads], kept
fp32): each layer hands its ``AttentionSpec`` to ``ctx.attend``.

On CUDA with triton, the forward takes a fused path (``*_fused`` methods): residual-add + RMSNorm,
SiLU*mul and in-place RoPE as single Triton kernels (``services/kernels/rms_norm.py``, ``activation.py``,
``rotary.py``), the residual carried beside the hidden state. It computes the same bf16 sums; norms and
RoPE round once in fp32 instead of per torch op. On CPU, where the engine built its C kernels
(``cpu/native.py``), RMSNorm, SiLU*mul and RoPE run as one C loop each, rounding where the torch ops do, and
each residual add is done in the same pass as the norm after it (the residual carried beside the layer's last
delta, ``_forward_residual``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention import AttentionSpec, ForwardContext
from services.engine.cpu import native
from services.engine.models.gpu_linear import logits_linear
from services.engine.models.rope import RotaryEmbedding
from services.engine.parallel.layers import (
    LogitsGather,
    column_linear,
    head_split,
    lm_head,
    local_intermediate,
    row_linear,
    vocab_embedding,
)
from services.engine.parallel.weights import shard_weights
from services.kernels import HAS_TRITON
from services.text.model.config import ModelArchConfig, ModelConfigError


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back before the weight (as HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (k := native.active(x)) is not None and (y := k.rms_norm(x, self.weight, self.eps)) is not None:
            return y
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The CUDA path: one Triton launch (the torch form takes eight)."""
        # deferred: a Triton kernel module, on the CUDA path only (triton is optional)
        from services.kernels.rms_norm import rms_norm

        return rms_norm(x, self.weight, self.eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)): one C pass where the CPU kernels apply, else torch's two ops."""
    if (k := native.active(x)) is not None and (r := k.add_rms_norm(x, delta, norm.weight, norm.eps)) is not None:
        return r
    x = x + delta
    return x, norm(x)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        split = head_split(arch)  # this rank's heads under tensor parallelism; all of them at TP=1
        self.num_heads, self.num_kv_heads, self.head_dim = split.local_heads, split.local_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = column_linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = row_linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.window = arch.layer_window(layer_idx)
        """Keys a query sees (tokens), 0: full attention."""
        self.sinks: nn.Parameter | None = None
        if arch.attention_sinks:
            if split.tp_size > 1:
                raise ModelConfigError("attention_sinks under tensor parallelism is not implemented (tp_size="
                                       f"{split.tp_size})")
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self._spec = AttentionSpec(self.window) if self.window else None

    def spec(self) -> AttentionSpec | None:
        """This layer's window and sinks for ``ctx.attend``; None: plain causal attention."""
        if self.sinks is None:
            return self._spec
        return AttentionSpec(self.window, self.sinks if self.sinks.dtype == torch.float32 else self.sinks.float())

    def _qkv(self, x: torch.Tensor, norm: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D]: views of the qkv projection (q and k normed when the model has it and
        ``norm``)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if norm and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self._qkv(x)
        q, k = rotary(positions, q, k)
        out = ctx.attend(self.layer_idx, q, k, v, self.spec())  # [T, H, D]
        return self.o_proj(out.reshape(x.shape[0], self.q_size))

    def forward_fused(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      ctx: ForwardContext) -> torch.Tensor:
        """`forward` with RoPE (after Qwen3's per-head q/k norms, where the model has them) applied in place by one
        Triton kernel (q/k stay views of the qkv output), which also writes the new K/V into the layer's pages
        where the backend lets it (`ForwardContext.store_target`)."""
        # deferred: a Triton kernel module, on the CUDA path only (triton is optional)
        from services.kernels.rotary import apply_rotary_

        if (rot := rotary.head_dim) != self.head_dim:  # partial RoPE: the first rot values of each head rotated in
            q, k, v = self._qkv(x)                     # place (views), the norms and the K/V store the plain way
            apply_rotary_(q[..., :rot], k[..., :rot], positions, rotary.cos_cache, rotary.sin_cache)
            out = ctx.attend(self.layer_idx, q, k, v, self.spec())
            return self.o_proj(out.reshape(x.shape[0], self.q_size))
        q, k, v = self._qkv(x, norm=False)
        norms = {}
        if self.q_norm is not None and self.k_norm is not None:
            norms = {"q_norm": (self.q_norm.weight, self.q_norm.eps), "k_norm": (self.k_norm.weight, self.k_norm.eps)}
        target = ctx.store_target(self.layer_idx)
        apply_rotary_(q, k, positions, rotary.cos_cache, rotary.sin_cache, **norms,
                      store=None if target is None else (v, *target))
        out = ctx.attend(self.layer_idx, q, k, v, self.spec(), stored=target is not None)  # [T, H, D]
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = local_intermediate(inter)
        self.gate_up_proj = column_linear(hidden, 2 * self.inter, bias=False)
        self.down_proj = row_linear(self.inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if (k := native.active(gu)) is not None and (y := k.silu_mul(gu, self.inter)) is not None:
            return self.down_proj(y)
        gate, up = gu.split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        # deferred: a Triton kernel module, on the CUDA path only (triton is optional)
        from services.kernels.activation import silu_and_mul

        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_residual(self, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                         rotary: RotaryEmbedding, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, delta) -> (x', mlp delta) with ``x + delta`` the layer's input (delta None: x is): ``forward``'s
        numbers with each residual add done in one pass with the norm after it (CPU C kernels)."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = add_rms_norm(x, delta, self.input_layernorm)
        x, h = add_rms_norm(x, self.self_attn(h, positions, rotary, ctx), self.post_attention_layernorm)
        return x, self.mlp(h)

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      rotary: RotaryEmbedding, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(delta, residual) -> (mlp delta, new residual); the layer's output is their sum.

        residual None marks the first layer (h is then the embedding). Each add is fused into the next
        RMSNorm, so a layer launches two norm kernels instead of ~12 elementwise ones.
        """
        # deferred: a Triton kernel module, on the CUDA path only (triton is optional)
        from services.kernels.rms_norm import fused_add_rms_norm

        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, x = h, ln1.forward_fused(h)
        else:
            x, residual = fused_add_rms_norm(h, residual, ln1.weight, ln1.eps)
        a = self.self_attn.forward_fused(x, positions, rotary, ctx)
        x, residual = fused_add_rms_norm(a, residual, ln2.weight, ln2.eps)
        return self.mlp.forward_fused(x), residual


class DecoderModel(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


# HF name fragment -> (fused parameter fragment, shard index in the fused row order).
_STACKED: dict[str, tuple[str, int]] = {
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]; compute_logits -> fp32 logits."""

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch)
        self.rotary = RotaryEmbedding(arch.rotary_dim or arch.head_dim, arch.rope_theta, arch.rope_scaling,
                                      arch.max_position_embeddings)
        self.lm_head = None if arch.tie_word_embeddings else lm_head(arch.hidden_size, arch.vocab_size)
        self.tp_split = head_split(arch)
        self.gather_logits = LogitsGather(arch.vocab_size)  # identity at TP=1
        #: Fused Triton path: None = automatic (CUDA tensors and triton installed); True/False forces it
        #: (True on CPU needs TRITON_INTERPRET=1; tests use it to run the GPU path at tiny shapes).
        self.fused_kernels: bool | None = None
        #: hidden -> logits in place of F.linear with the head's weight, set after loading (quant_linear.py).
        self.logits_head: nn.Module | None = None
        #: Called with each layer's index right after the layer ran (queued on GPU); set for one forward by
        #: services/engine/layer_groups.py (a chunk's KV leaving group by group), None otherwise.
        self.layer_hook: Callable[[int], None] | None = None

    #: Parameter-name fragments a subclass loads itself (its load_weights takes those tensors out of the
    #: stream before this one runs and checks them itself).
    _self_loaded: tuple[str, ...] = ()

    def _use_fused(self, h: torch.Tensor) -> bool:
        if self.fused_kernels is not None:
            return self.fused_kernels
        return h.is_cuda and HAS_TRITON and self.model.norm.weight.dtype == h.dtype

    def init_buffers(self) -> None:
        """(Re)build the fp32 RoPE tables on the model's device; needed after `to_empty` / dtype casts."""
        device = self.model.norm.weight.device
        self.rotary = RotaryEmbedding(self.arch.rotary_dim or self.arch.head_dim, self.arch.rope_theta,
                                      self.arch.rope_scaling, self.arch.max_position_embeddings).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        if self._use_fused(h):
            return self._forward_fused(h, positions, ctx)
        if native.active(h) is not None and self._plain_layers():
            return self._forward_residual(h, positions, ctx)
        hook = self.layer_hook
        for i, layer in enumerate(self.model.layers):
            h = layer(h, positions, self.rotary, ctx)
            if hook is not None:
                hook(i)
        return self.model.norm(h)

    def _plain_layers(self) -> bool:
        layers = self.model.layers
        return len(layers) > 0 and all(type(layer) is DecoderLayer for layer in layers)

    def _carried(self, h: torch.Tensor, step: Callable[[DecoderLayer, torch.Tensor, torch.Tensor | None],
                                                    tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer in turn as ``step(layer, h, carry) -> (h, carry)``, carry None before the first; the layer
        hook after each."""
        carry: torch.Tensor | None = None
        hook = self.layer_hook
        for i, layer in enumerate(self.model.layers):
            h, carry = step(layer, h, carry)
            if hook is not None:
                hook(i)
        return h, carry

    def _forward_residual(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """CPU with the C kernels: the residual carried beside each layer's last delta, so every add is done
        in one pass with the norm that follows it (same numbers as ``layer(h)`` in turn)."""
        h, delta = self._carried(h, lambda layer, x, d: layer.forward_residual(x, d, positions, self.rotary, ctx))
        assert delta is not None  # _plain_layers: at least one layer
        return add_rms_norm(h, delta, self.model.norm)[1]

    def _forward_fused(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # deferred: a Triton kernel module, on the CUDA path only (triton is optional)
        from services.kernels.rms_norm import fused_add_rms_norm

        h, residual = self._carried(h, lambda layer, x, r: layer.forward_fused(x, r, positions, self.rotary, ctx))
        norm = self.model.norm
        if residual is None:  # no layers
            return norm(h)
        return fused_add_rms_norm(h, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        if self.logits_head is not None:  # a post-load replacement (models/quant_linear.py: Q8_0 head)
            return self.gather_logits(self.logits_head(hidden).float())
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.gather_logits(logits_linear(hidden, weight).float())

    def _shard_rows(self, fused: str, shard: int) -> tuple[int, int]:
        """Row range [start, end) of shard `shard` inside fused parameter kind `fused`."""
        a, split = self.arch, self.tp_split
        if fused == ".qkv_proj.":
            q, kv = split.local_heads * a.head_dim, split.local_kv_heads * a.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        inter = a.intermediate_size // split.tp_size
        return (shard * inter, (shard + 1) * inter)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters, casting to the parameter dtype/device.

        Raises ValueError for an unknown name, a shape mismatch, or parameters left unset.
        Returns the set of HF names loaded.
        """
        weights = shard_weights(weights, self.arch, self.tp_split)  # this rank's slices (all at TP=1)
        params = dict(self.named_parameters())
        expected: set[tuple[str, int]] = set()
        for name in params:
            if any(f in name for f in self._self_loaded):
                continue
            frag = next((f for f, _ in _STACKED.values() if f in name), None)
            shards = 3 if frag == ".qkv_proj." else 2 if frag else 1
            expected.update((name, s) for s in range(shards))
        done: set[tuple[str, int]] = set()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints may still carry a copy of the embedding
            target, shard, rows = hf_name, 0, None
            for frag, (fused, idx) in _STACKED.items():
                if frag in hf_name:
                    target, shard = hf_name.replace(frag, fused), idx
                    rows = self._shard_rows(fused, idx)
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {hf_name!r} for a {self.arch.architecture} model")
            dst = param.data if rows is None else param.data[rows[0]:rows[1]]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name!r}: shape {tuple(tensor.shape)}, model expects "
                                 f"{tuple(dst.shape)}")
            dst.copy_(tensor)
            done.add((target, shard))
            loaded.add(hf_name)
        missing = sorted({n for n, _ in expected - done})
        if missing:
            raise ValueError(f"{len(missing)} parameters not found in the checkpoint, e.g. {missing[:4]}")
        return loaded
