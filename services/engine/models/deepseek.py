"""DeepSeek-V2/V3: multi-head latent attention (MLA) over a paged latent cache, and the MoE decoder.

Attention (``MLAAttention``, HF parameter names): the query is ``q_proj(x)`` or, with ``q_lora_rank``,
``q_b_proj(q_a_layernorm(q_a_proj(x)))``, per head ``q_nope`` [nope] and ``q_pe`` [rope]; the layer caches
``latent = [kv_a_layernorm(c_kv), rope(k_pe)]`` from ``kv_a_proj_with_mqa(x)``. ``kv_b_proj`` [H * (nope + v),
kv_lora] holds each head's key up-projection W_UK [nope, kv_lora] and value up-projection W_UV [v, kv_lora];
the layer never expands the cache into per-head K/V. It attends in the latent space (the "absorbed" form, the
same sums as transformers' expanded form in another order): the query ``[q_nope @ W_UK, q_pe]`` [H, latent]
meets every cached latent (one shared key: multi-query attention), the softmax-weighted sum of the c_kv parts
[H, kv_lora] goes through W_UV per head and then o_proj. Prefill chunks and decode rows take the same path.

The page holds the latent as the K plane (its first half) and the V plane (its second half) of one KV head of
``latent // 2`` values (``ModelArchConfig.head_dim``); ``AttentionSpec.latent_value_dim`` tells the backend to
join the planes into the key and read the value as the key's first ``kv_lora_rank`` values: the torch backend on
CPU, the Triton latent kernels on a GPU (``services/kernels/mla_decode_attention.py``, ``mla_prefill_attention.py``),
where the model takes the fused path of the Llama decoder (Triton norms, the fused MoE) around the same attention.

DeepSeek-V3.2 adds an indexer per layer (``Indexer``): its index key goes with the step's query to the backend
(``AttentionSpec.index``), which caches it in the index-key pool, a page region of its own in its own codec
(engine/index_keys.py), and each query attends only to its ``index_topk`` keys of highest index score.

RoPE on the rope dims is DeepSeek's interleaved pairs (``rope_interleave``, always for V2), with YaRN's
cos/sin factor; the softmax scale carries YaRN's ``mscale_all_dim`` (mla_config.py). MoE layers (from
``first_k_dense_replace``, every ``moe_layer_freq``-th) route with DeepSeek's scoring (moe.py ``route``) and
add the shared experts; the others are the dense SwiGLU MLP.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from services.engine.attention import AttentionSpec, ForwardContext, IndexQuery
from services.engine.models.llama import RMSNorm
from services.engine.models.moe_model import LAYER_RE, MoEForCausalLM
from services.engine.models.rope import RotaryEmbedding
from services.engine.parallel.layers import column_linear, head_split, row_linear
from services.text.model.config import ModelArchConfig, ModelConfigError

LATENT_NORM_EPS = 1e-6
"""Epsilon of q_a_layernorm and kv_a_layernorm (transformers builds them with its RMSNorm default, not
rms_norm_eps)."""


class LatentRotary(nn.Module):
    """RoPE on the rope dims of q [T, H, R] and k [T, 1, R]: interleaved pairs (x0, x1), (x2, x3), ... as
    DeepSeek lays them out (output de-interleaved: all first members, then all second members, for q and k
    alike, so q . k is unchanged), or rotate_half pairs. cos/sin tables as RotaryEmbedding builds them."""

    def __init__(self, rope: RotaryEmbedding, interleave: bool) -> None:
        super().__init__()
        self.rope = rope
        self.interleave = interleave

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.interleave:
            return self.rope(positions, q, k)
        half = q.shape[-1] // 2
        cos = self.rope.cos_cache[positions][:, None, :half]
        sin = self.rope.sin_cache[positions][:, None, :half]

        def rot(x: torch.Tensor) -> torch.Tensor:
            c, s = cos.to(x.dtype), sin.to(x.dtype)
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

        return rot(q), rot(k)

    def forward_fused(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CUDA path: the same rotation of q and k into new tensors in one Triton launch (`rotary_out`; the
        torch form takes about twenty)."""
        # deferred: a Triton kernel module, on the CUDA path only (triton is optional)
        from services.kernels.rotary import rotary_out

        return rotary_out(q, k, positions, self.rope.cos_cache, self.rope.sin_cache, self.interleave)

    def ensure(self, max_positions: int) -> None:
        """Grow the cos/sin tables to cover positions [0, max_positions) (RotaryEmbedding.ensure)."""
        self.rope.ensure(max_positions)


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer (HF names ``self_attn.indexer.*``): an index query per token from the
    compressed query (``wq_b``), one index key per token (``k_norm(wk(x))``, LayerNorm with bias), per-head weights
    (``weights_proj``); both rotated on their first qk_rope_head_dim values with rotate_half pairs (not the
    interleaved pairs of the main attention)."""

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        mla = arch.mla
        assert mla is not None
        self.heads, self.dim, self.rope_dim = mla.index_n_heads, mla.index_head_dim, mla.qk_rope_head_dim
        self.wq_b = nn.Linear(mla.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(arch.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=LATENT_NORM_EPS)
        self.weights_proj = nn.Linear(arch.hidden_size, self.heads, bias=False)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor, rotary: LatentRotary
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index queries [T, Hi, Di], index keys [T, Di], fp32 head weights [T, Hi])."""
        t, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(t, self.heads, self.dim)
        k = self.k_norm(self.wk(x)).view(t, 1, self.dim)
        q_rot, k_rot = rotary.rope(positions, q[..., :r], k[..., :r])
        q = torch.cat([q_rot, q[..., r:]], dim=-1)
        k = torch.cat([k_rot, k[..., r:]], dim=-1).view(t, self.dim)
        return q, k, self.weights_proj(x).float() * self.heads ** -0.5


EXPANDED_PREFIX_BYTES = 1 << 30
"""Most bytes of per-head K/V one prompt's cached prefix may be expanded into (per layer, transient): a longer prefix
keeps its step in the latent form."""


def expanded_prompts(ctx: ForwardContext, min_chunk: int, prefix_token_bytes: int) -> list[tuple[int, int]] | None:
    """(new tokens, cached prefix tokens) of each prompt of the step when the expanded form applies to all of them:
    a prompt that starts at position 0, or a chunk of at least ``min_chunk`` tokens after a prefix whose per-head K/V
    (``prefix_token_bytes`` a token) fits EXPANDED_PREFIX_BYTES, read from a backend whose pool the model can gather.
    None otherwise (no prompt in the step, a chunk after a prefix shorter than ``min_chunk``, such as a speculative
    verify step's rows on a GPU, a CUDA graph being captured)."""
    meta = ctx.meta
    nd = meta.num_decode
    lens = meta.query_lens[nd:]
    if not lens:
        return None
    rows = [(n, c - n) for c, n in zip(meta.context_lens_host[nd:], lens, strict=True)]
    if any(p and (n < min_chunk or (p + n) * prefix_token_bytes > EXPANDED_PREFIX_BYTES) for n, p in rows):
        return None
    if any(p for _, p in rows) and latent_pool(ctx) is None:
        return None
    if meta.slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return rows


def latent_pool(ctx: ForwardContext) -> torch.Tensor | None:
    """The step backend's paged pool [layers, 2, blocks, block_size, 1, latent / 2] (every backend's ``kv_cache``),
    or None."""
    pool = getattr(ctx.backend, "kv_cache", None)
    return pool if isinstance(pool, torch.Tensor) and pool.dim() == 6 and pool.shape[4] == 1 else None


def cached_latents(ctx: ForwardContext, layer: int, row: int, tokens: int) -> torch.Tensor:
    """[tokens, latent]: the first ``tokens`` cached latents of the step's sequence ``row`` at ``layer`` (its K
    plane holds each latent's first half, its V plane the second)."""
    pool = latent_pool(ctx)
    assert pool is not None
    bs = pool.shape[3]
    nb = -(-tokens // bs)
    blocks = ctx.meta.block_tables[row, :nb].to(torch.int64)
    planes = pool[layer].index_select(1, blocks).reshape(2, nb * bs, -1)[:, :tokens]
    return torch.cat([planes[0], planes[1]], dim=-1)


class MLAAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        mla = arch.mla
        assert mla is not None
        split = head_split(arch)  # this rank's query heads; the latent (one KV "head") is on every rank
        self.layer_idx = layer_idx
        self.mla = mla
        self.num_heads = split.local_heads
        h, hidden, bias = split.local_heads, arch.hidden_size, arch.attention_bias
        if mla.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = column_linear(mla.q_lora_rank, h * mla.qk_head_dim, bias=False)
        else:
            self.q_proj = column_linear(hidden, h * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = column_linear(mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = row_linear(h * mla.v_head_dim, hidden, bias=bias)
        self.indexer = Indexer(arch) if mla.index_n_heads else None  # replicated under tensor parallelism
        self._spec = AttentionSpec(scale=mla.scale, latent_value_dim=mla.kv_lora_rank)
        self._decode_only = AttentionSpec(scale=mla.scale, latent_value_dim=mla.kv_lora_rank, decode_only=True)
        self.expanded_prefill = False
        """Prompts attend in the expanded form where ``expanded_prompts`` allows (``_expanded``; DeepseekForCausalLM.
        set_prefill_form); False: every row in the latent space."""
        lora, nope, vd = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim
        self.flop_min_expanded_chunk = -(-lora * (nope + vd) // max(1, 2 * lora - nope - vd))
        """Fewest new tokens of a chunk after a prefix for which expanding the prefix saves multiply-adds: expanding
        costs prefix x kv_lora x (nope + v) per head, and each (query, key) pair then saves 2 kv_lora + rope -
        (nope + rope + v) (V2-Lite and V3 widths: 171 tokens)."""
        self.min_expanded_chunk = self.flop_min_expanded_chunk
        """Fewest new tokens of a chunk after a prefix that takes the expanded form (set_prefill_form: the FLOP
        rule above, or a device's measured one)."""
        self.prefix_token_bytes = 2 * h * 2 * mla.qk_head_dim
        """Bytes of one prefix token's per-head K and (padded) V at two bytes a value."""

    def _query(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(query [T, H * qk_head_dim], the compressed query or None without a query LoRA)."""
        if self.mla.q_lora_rank:
            norm = self.q_a_layernorm.forward_fused if fused else self.q_a_layernorm
            resid = norm(self.q_a_proj(x))
            return self.q_b_proj(resid), resid
        return self.q_proj(x), None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: LatentRotary,
                ctx: ForwardContext) -> torch.Tensor:
        return self._forward(x, positions, rotary, ctx, fused=False)

    def forward_fused(self, x: torch.Tensor, positions: torch.Tensor, rotary: LatentRotary,
                      ctx: ForwardContext) -> torch.Tensor:
        """The CUDA path: the same projections, RoPE of q's and k's rope parts in one Triton launch
        (`rotary_out`); ``ctx.attend`` runs the Triton latent kernels there (gpu_attention.py)."""
        return self._forward(x, positions, rotary, ctx, fused=True)

    def _forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: LatentRotary, ctx: ForwardContext,
                 fused: bool) -> torch.Tensor:
        mla, h, t = self.mla, self.num_heads, x.shape[0]
        nope, rope, lora = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        query_flat, q_resid = self._query(x, fused)
        q_nope, q_pe = query_flat.view(t, h, mla.qk_head_dim).split([nope, rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([lora, rope], dim=-1)
        q_pe, k_pe = (rotary.forward_fused if fused else rotary)(positions, q_pe, k_pe.view(t, 1, rope))
        w = self.kv_b_proj.weight.view(h, nope + mla.v_head_dim, lora)
        kv_norm = self.kv_a_layernorm.forward_fused if fused else self.kv_a_layernorm
        latent = torch.cat([kv_norm(c_kv), k_pe.view(t, rope)], dim=-1)
        if self.expanded_prefill and self.indexer is None and (
                rows := expanded_prompts(ctx, self.min_expanded_chunk, self.prefix_token_bytes)) is not None:
            return self._expanded(q_nope, q_pe, latent, w, rows, ctx)
        query = self._absorbed_query(q_nope, q_pe, w)
        spec = self._spec
        if self.indexer is not None:
            assert q_resid is not None
            iq, ik, iw = self.indexer(x, q_resid, positions, rotary)
            spec = AttentionSpec(scale=mla.scale, latent_value_dim=lora, index=IndexQuery(
                iq, iw, ik.to(latent.dtype), mla.index_topk, mla.index_head_dim ** -0.5))
        half = mla.latent_dim // 2
        out = ctx.attend(self.layer_idx, query, latent[:, None, :half], latent[:, None, half:], spec)
        return self.o_proj(self._through_w_uv(out, w).reshape(t, h * mla.v_head_dim))

    def _absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[T, H, latent]: [q_nope @ W_UK, q_pe] per head, the query that meets the cached latent."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :self.mla.qk_nope_head_dim])  # [H, T, kv_lora]
        return torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1)

    def _through_w_uv(self, out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[T, H, v]: a latent-space attention output [T, H, kv_lora] through each head's value up-projection."""
        return torch.bmm(out.transpose(0, 1), w[:, self.mla.qk_nope_head_dim:].transpose(1, 2)).transpose(0, 1)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, w: torch.Tensor,
                  rows: list[tuple[int, int]], ctx: ForwardContext) -> torch.Tensor:
        """Every latent is cached and the decode rows attend in the latent space as in ``forward``; each prompt
        (``rows``: new tokens, cached prefix tokens) attends in the expanded form, per head K = [W_UK c, k_pe] and
        V = W_UV c from its latents (its prefix's read back from the pool, its own from this step): the same sums
        in another order, fewer multiply-adds per (query, key) pair (nope + rope + v against the absorbed form's
        2 * kv_lora + rope), causal from the chunk's first position, one SDPA call per prompt."""
        mla, h, t = self.mla, self.num_heads, latent.shape[0]
        nope, lora, vd = mla.qk_nope_head_dim, mla.kv_lora_rank, mla.v_head_dim
        nd = ctx.meta.num_decode
        query = latent.new_empty(t, h, mla.latent_dim)  # the prefill rows are not read (decode_only)
        if nd:
            query[:nd] = self._absorbed_query(q_nope[:nd], q_pe[:nd], w)
        half = mla.latent_dim // 2
        out = ctx.attend(self.layer_idx, query, latent[:, None, :half], latent[:, None, half:], self._decode_only)
        o = latent.new_empty(t, h, vd)
        if nd:
            o[:nd] = self._through_w_uv(out[:nd], w)
        query_x = torch.cat([q_nope[nd:], q_pe[nd:]], dim=-1)
        w_kv = w.reshape(h * (nope + vd), lora).t()
        start = 0
        for i, (n, prefix) in enumerate(rows):
            own = latent[nd + start:nd + start + n]
            lat = torch.cat([cached_latents(ctx, self.layer_idx, nd + i, prefix), own]) if prefix else own
            key, value = self._expand(lat, w_kv)
            mask = causal_lower_right(n, n + prefix) if prefix else None
            oi = F.scaled_dot_product_attention(query_x[start:start + n].transpose(0, 1)[None], key, value,
                                                attn_mask=mask, is_causal=not prefix, scale=mla.scale)
            o[nd + start:nd + start + n] = oi[0].transpose(0, 1)[..., :vd]
            start += n
        return self.o_proj(o.reshape(t, h * vd))

    def _expand(self, lat: torch.Tensor, w_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head K [1, H, N, nope + rope] and V [1, H, N, v] (on CUDA zero-padded to K's width, for the fused SDPA
        kernels) of N latents [N, kv_lora + rope]."""
        mla, h = self.mla, self.num_heads
        nope, lora, vd = mla.qk_nope_head_dim, mla.kv_lora_rank, mla.v_head_dim
        kv = torch.matmul(lat[:, :lora], w_kv).view(-1, h, nope + vd)
        k_nope, value = kv.split([nope, vd], dim=-1)
        key = torch.cat([k_nope, lat[:, None, lora:].expand(-1, h, -1)], dim=-1)
        if lat.is_cuda and vd != key.shape[-1]:
            value = F.pad(value, (0, key.shape[-1] - vd))
        return key.transpose(0, 1)[None], value.transpose(0, 1)[None]


class DeepseekForCausalLM(MoEForCausalLM):
    """DeepSeek-V2/V3/V3.2 (architecture "deepseek"): MLA attention (V3.2: with its indexer) in every layer, MoE
    layers as ``arch.moe`` says."""

    _self_loaded = (*MoEForCausalLM._self_loaded, ".self_attn.")
    _weight_read_linears = (".self_attn.kv_b_proj",)
    """Linears whose weight the forward multiplies by directly (kv_b_proj: each head's W_UK and W_UV in the
    absorbed form), never through the module: they stay dense in every weight format (models/fp8_linear.py)."""

    def __init__(self, arch: ModelArchConfig) -> None:
        if arch.mla is None:
            raise ModelConfigError(f"{arch.architecture} needs ModelArchConfig.mla")
        super().__init__(arch)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = MLAAttention(arch, i)
        self.rotary = self._latent_rotary()

    def _latent_rotary(self) -> LatentRotary:
        a = self.arch
        assert a.mla is not None
        rope = RotaryEmbedding(a.mla.qk_rope_head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings)
        return LatentRotary(rope, a.mla.rope_interleave)

    def init_buffers(self) -> None:
        self.rotary = self._latent_rotary().to(self.model.norm.weight.device)

    def set_prefill_form(self, form: str, min_chunk: int | None = None) -> None:
        """"expanded": prompts (from position 0, or long chunks after a prefix: ``expanded_prompts``) attend with
        per-head K/V expanded from their latents (``MLAAttention._expanded``); "absorbed": every row in the latent
        space. A model with an indexer (V3.2) keeps
        its sparse latent path either way."""
        if form not in ("expanded", "absorbed"):
            raise ValueError(f"MLA prefill form {form!r}: expected 'expanded' or 'absorbed'")
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.expanded_prefill = form == "expanded"
            attn.min_expanded_chunk = min_chunk or attn.flop_min_expanded_chunk

    def _expected_pieces(self) -> set[tuple[str, int, int]]:
        return {p for p in super()._expected_pieces() if ".self_attn." not in p[0]}  # checked by load_weights

    def _take_attention(self, weights: Iterable[tuple[str, torch.Tensor]], params: dict[str, nn.Parameter],
                        done: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Copy ``self_attn`` tensors into their parameters; skip the multi-token-prediction layers after the
        last decoder layer (num_nextn_predict_layers); yield every other tensor."""
        for name, t in weights:
            m = LAYER_RE.match(name)
            if m is not None and int(m.group(1)) >= self.arch.num_layers:
                continue
            if ".self_attn." not in name:
                yield name, t
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for a {self.arch.architecture} model")
            t = self._head_rows(name, t)
            if tuple(param.shape) != tuple(t.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(t.shape)}, model expects {tuple(param.shape)}")
            param.data.copy_(t)
            done.add(name)

    def _head_rows(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's share of an attention tensor under tensor parallelism: its query heads' rows of q_proj /
        q_b_proj / kv_b_proj and columns of o_proj; the latent's projections and norms whole (replicated)."""
        split, mla = self.tp_split, self.arch.mla
        assert mla is not None
        if split.tp_size == 1 or not name.endswith(".weight"):
            return t  # o_proj's bias is whole on every rank: RowParallelLinear adds it once, after the sum
        a, b = split.q_range
        for frag, width in ((".q_proj.", mla.qk_head_dim), (".q_b_proj.", mla.qk_head_dim),
                            (".kv_b_proj.", mla.qk_nope_head_dim + mla.v_head_dim)):
            if frag in name:
                return t[a * width:b * width]
        if ".o_proj." in name:
            return t[:, a * mla.v_head_dim:b * mla.v_head_dim]
        return t

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        done: set[str] = set()
        loaded = super().load_weights(self._take_attention(weights, params, done))
        missing = sorted(n for n in params if ".self_attn." in n and n not in done)
        if missing:
            raise ValueError(f"{len(missing)} attention parameters not found in the checkpoint, e.g. {missing[:4]}")
        return loaded | done
