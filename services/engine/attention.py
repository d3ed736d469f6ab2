"""Paged attention behind one interface: the model calls ``ctx.attend(layer, q, k, v, spec)``.

``spec`` is the layer's :class:`AttentionSpec` (window, sinks), None for plain causal attention: the model
classes build one per layer from ``arch.layer_window(i)`` and their ``self_attn.sinks`` parameter
(``models/llama.py``: ``Attention.spec()``), so any model class gets sliding-window and sink attention by
passing its layer's spec; the backend's ``forward`` takes them as ``window=`` / ``sinks=``. A query at position p of a
layer with ``window > 0`` sees key k iff ``0 <= p - k < window`` (0: every earlier key). ``sinks`` (fp32
[num_heads]) adds exp(sinks[h]) to head h's softmax denominator; that column has no value (gpt-oss).

The model runner owns the KV tensor ``kv_cache[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
and builds one :class:`AttentionMetadata` per step. A step's flat token batch holds the decode
sequences first (one query token each), then prefill chunks (any number of query tokens each).
The CPU path is plain torch; the GPU path swaps in the Triton kernels behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from services.engine.cpu.native import NativeKernels
from services.engine.index_keys import IndexKeys


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """int64 [T]: cache slot (block_id * block_size + offset) each new token's K/V is written to."""
    block_tables: torch.Tensor
    """int32 [B, max_blocks]: each sequence's blocks, padded with 0."""
    context_lens: torch.Tensor
    """int32 [B]: tokens with KV after this step (cached prefix + new tokens)."""
    query_lens: list[int]
    """Host list [B]: new tokens of each sequence in this step."""
    context_lens_host: list[int]
    """Host copy of context_lens."""
    num_decode: int
    """The first num_decode sequences have exactly one query token."""
    cu_seqlens_q: torch.Tensor | None = None
    """int32 [B+1] prefix sums of query_lens (GPU kernels)."""
    decode_plan: DecodePlan | None = None
    """What every full-attention layer's decode attention shares within a step; the CPU backend fills it at
    the first such layer."""
    window_plans: dict[int, DecodePlan] = field(default_factory=dict)
    """The same per sliding window (tokens) of the step's sliding layers; filled by the CPU backend."""
    native_first: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per sliding window: int32 [num_decode] first key each decode row sees (the C decode kernel's input)."""


@dataclass(frozen=True)
class IndexQuery:
    """DeepSeek-V3.2's sparse attention for one layer and step: each query attends only to the ``topk`` cached keys
    with the highest index score sum_h weights[t, h] * relu(scale * q[t, h] . index_key[k]) (all of them while fewer
    are cached). The backend caches the step's index keys in its index-key pool (index_keys.py, a page region of
    their own) and scores the keys read back from there (fp8 ones dequantized with their scales)."""

    q: torch.Tensor
    """[T, index heads, index dim] of the step's tokens (rotated)."""
    weights: torch.Tensor
    """fp32 [T, index heads]: each head's weight per token."""
    key: torch.Tensor
    """[T, index dim] index keys of the step's tokens (rotated), stored at the step's slots."""
    topk: int
    scale: float


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes besides causal softmax attention."""

    window: int = 0
    """Keys a query sees, itself included (tokens); 0: all earlier keys."""
    sinks: torch.Tensor | None = None
    """fp32 [num_heads] learned sink logits of this rank's query heads; None: no sink."""
    scale: float = 0.0
    """Softmax scale of this layer's logits; 0: the backend's head_dim ** -0.5."""
    latent_value_dim: int = 0
    """Latent attention (MLA, models/deepseek.py): k and v are the two halves of one cached latent per token; the
    backend attends with key = [k, v] (the whole latent) and value = its first ``latent_value_dim`` values, and
    returns [T, H, latent_value_dim]. 0: plain K/V."""
    index: IndexQuery | None = None
    """Latent attention with an indexer (DeepSeek-V3.2): each query sees only its top-k keys by index score."""
    decode_only: bool = False
    """Latent attention: store every row's k/v but attend the decode rows (the first meta.num_decode) only; the
    prefill rows of the output are left unset for the caller, which computes them itself (MLA's expanded form)."""


@dataclass
class DecodePlan:
    """Per-step constants of the decode part (the first num_decode sequences), shared by all layers."""

    gather: torch.Tensor | None
    """int64 [nd * blocks]: the block ids to gather (index_select with int64 is the fast CPU path); None when
    ``starts`` reads views instead."""
    blocks: int
    """Blocks gathered per sequence (covering the longest context)."""
    max_len: int
    mask: torch.Tensor | None
    """bool [nd, 1, 1, max_len] of valid keys; None when every sequence has max_len keys (no padding) or views."""
    starts: list[int] | None = None
    """First cache slot of each decode sequence when every one's blocks are consecutive pool blocks: its keys are
    then slots [start, start + context) of the layer's pool, read as a view (no copy, no mask). None: gather."""
    lens: list[int] | None = None
    """Keys of each decode sequence (its context length) when ``starts`` is set."""
    threads: int = 0
    """torch threads decode attention runs at, the step's own count restored after each layer; 0: the step's."""


ONE_THREAD_MAX_BATCH = 4
ONE_THREAD_MAX_KEYS = 512
"""CPU decode attention that GATHERS at most ONE_THREAD_MAX_BATCH sequences of at most ONE_THREAD_MAX_KEYS keys
runs on one torch thread: the gather crosses torch's parallel grain, and waking the OpenMP helper for it and SDPA
cost more than the split saves (whole step at 512 keys on a quiet box: 17.74 -> 16.69 ms per token; at 2048 keys
2 threads won, 25.67 vs 27.24). Views keep the step's threads (at 2048 keys 21.85 ms at 2 threads vs 25.46 at 1;
docs/reports/performance-history-2026-12-01.md, "CPU decode attention")."""
VIEWS_MIN_KEYS_BATCHED = 512
"""A decode batch of several sequences reads views (one SDPA per sequence) when its longest context has at least
this many keys, else one gather + one batched SDPA: at 128 keys, batches 2 and 4, the gather measured faster (the
per-sequence calls cost more than the copy), from 512 keys on the views (same section)."""


def consecutive_starts(tables: list[list[int]], block_size: int) -> list[int] | None:
    """First slot of each block table whose blocks are consecutive pool blocks; None if any table is not."""
    starts = []
    for t in tables:
        if t[-1] - t[0] != len(t) - 1 or any(b != t[0] + i for i, b in enumerate(t)):
            return None
        starts.append(t[0] * block_size)
    return starts


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, gqa: bool,
         sinks: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, KVH, Lk, D], mask bool broadcastable to [B, H, Lq, Lk] (True: attend) -> [B, H, Lq, D].

    Without sinks: torch's SDPA. With sinks (fp32 [H]): the scores in fp32, one extra column of logit sinks[h]
    per row (transformers' eager gpt-oss attention: max-subtracted softmax over [scores, sink], sink column
    dropped), the grouped query heads of one KV head multiplied against it without copying K/V per head."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa,
                                              is_causal=is_causal)
    b, h, lq, d = q.shape
    kvh, lk = k.shape[1], k.shape[2]
    qg = q.reshape(b, kvh, (h // kvh) * lq, d).float()  # head h = kv_head * group + g (as repeat_interleave)
    scores = (qg @ k.float().transpose(-1, -2) * scale).view(b, h, lq, lk)
    if is_causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, h, 1, 1).expand(b, h, lq, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :lk]
    out = probs.reshape(b, kvh, (h // kvh) * lq, lk) @ v.float()
    return out.view(b, h, lq, d).to(q.dtype)


def latent_kv(k: torch.Tensor, v: torch.Tensor, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value of latent attention from the two planes [B, 1, L, D] of the cached latents: key = [k, v]
    [..., 2D], value = its first ``value_dim`` values. (k, v) when value_dim is 0."""
    if not value_dim:
        return k, v
    joined = torch.cat([k, v], dim=-1)
    return joined, joined[..., :value_dim]


def index_mask(index: IndexQuery, rows: slice, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, Lq, Lk]: the keys each query of ``rows`` (B * Lq tokens of the step, sequence-major) attends
    to: ``valid`` [B, Lq, Lk] (causal, present) and among its top ``index.topk`` by index score."""
    b, lq, lk = valid.shape
    q = index.q[rows].reshape(b, lq, *index.q.shape[1:]).float()  # [B, Lq, Hi, Di]
    w = index.weights[rows].reshape(b, lq, -1).float()
    scores = torch.relu(torch.einsum("bqhd,bkd->bqhk", q, keys.float()) * index.scale)
    total = torch.einsum("bqh,bqhk->bqk", w, scores).masked_fill(~valid, float("-inf"))
    top = total.topk(min(index.topk, lk), dim=-1).indices
    return (valid & torch.zeros_like(valid).scatter_(-1, top, True))[:, None]


class AttentionBackend(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the new tokens -> out [T, H, D]; also stores k/v in the cache.
        ``window`` / ``sinks``: the layer's AttentionSpec. A backend with a ``store_target(layer, meta)`` method
        (the Triton one) also takes ``stored=True``: the caller's kernel wrote k/v into that target already."""
        ...


@dataclass
class ForwardContext:
    """What a model's forward needs besides token ids and positions."""

    backend: AttentionBackend
    meta: AttentionMetadata

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec | None = None, stored: bool = False) -> torch.Tensor:
        """``stored``: the caller already wrote k/v at the step's slots (into `store_target`'s caches)."""
        kw: dict[str, Any] = {"stored": True} if stored else {}
        if spec is None:
            return self.backend.forward(layer, q, k, v, self.meta, **kw)
        if spec.scale or spec.latent_value_dim:  # backends that take a layer's scale and latent attention
            kw.update(scale=spec.scale, value_dim=spec.latent_value_dim, index=spec.index)
        if spec.decode_only:
            kw["decode_only"] = True
        return self.backend.forward(layer, q, k, v, self.meta, window=spec.window, sinks=spec.sinks, **kw)

    def store_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache, slot_mapping) of ``layer`` where the backend lets a kernel before it write the step's
        new K/V itself (then `attend(..., stored=True)`); None where the backend stores them."""
        target = getattr(self.backend, "store_target", None)
        return None if target is None else target(layer, self.meta)


class TorchPagedAttention:
    """Torch path over the paged cache (CPU default, and the reference on GPU). ``native``: the host's C kernels
    (cpu/native.py); given, the decode rows of plain and sliding-window layers read the pages in place through
    them (one call per layer for all decode rows), the rest stays on torch."""

    def __init__(self, kv_cache: torch.Tensor, scale: float, native: NativeKernels | None = None,
                 index_keys: IndexKeys | None = None) -> None:
        self.kv_cache = kv_cache
        self.scale = scale
        self.index_keys = index_keys
        """DeepSeek-V3.2's index-key pool (same block ids as kv_cache); None without an indexer."""
        self.native = native if native is not None and kv_cache.device.type == "cpu" else None
        _, _, _, self.block_size, self.num_kv_heads, self.head_dim = kv_cache.shape
        # Per layer: K and V as [slots, KVH, D] views (store) and [blocks, block_size * KVH * D] (gather), made
        # once so a step's ~30 layers slice nothing per call.
        self._slots = [(kv_cache[i, 0].view(-1, self.num_kv_heads, self.head_dim),
                        kv_cache[i, 1].view(-1, self.num_kv_heads, self.head_dim)) for i in range(kv_cache.shape[0])]
        self._pages = [(kv_cache[i, 0].flatten(1), kv_cache[i, 1].flatten(1)) for i in range(kv_cache.shape[0])]

    def _index_pool(self) -> IndexKeys:
        """The index-key pool a layer with an indexer reads (the runner gives one to a model with an indexer)."""
        assert self.index_keys is not None, "sparse attention (AttentionSpec.index) needs the backend's index_keys"
        return self.index_keys

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        kc, vc = self._slots[layer]
        kc.index_copy_(0, slots, k if k.dtype == kc.dtype else k.to(kc.dtype))
        vc.index_copy_(0, slots, v if v.dtype == vc.dtype else v.to(vc.dtype))

    def _decode_plan(self, meta: AttentionMetadata, window: int = 0) -> DecodePlan:
        nd = meta.num_decode
        if window and max(meta.context_lens_host[:nd]) > window:
            if window not in meta.window_plans:
                meta.window_plans[window] = self._window_plan(meta, window)
            return meta.window_plans[window]
        if meta.decode_plan is None:  # full attention, or a window no sequence's context exceeds yet
            ctx = meta.context_lens_host[:nd]
            max_len = max(ctx)
            nb = (max_len + self.block_size - 1) // self.block_size
            cpu = meta.block_tables.device.type == "cpu"  # reading the tables on the host: no device sync
            if cpu and (nd == 1 or max_len >= VIEWS_MIN_KEYS_BATCHED):
                bs = self.block_size
                tables = meta.block_tables[:nd, :nb].tolist()
                starts = consecutive_starts([t[: (c + bs - 1) // bs] for t, c in zip(tables, ctx, strict=True)], bs)
                if starts is not None:
                    meta.decode_plan = DecodePlan(None, nb, max_len, None, starts, ctx)
                    return meta.decode_plan
            gather = meta.block_tables[:nd, :nb].reshape(-1).to(torch.int64)
            mask = None
            if min(ctx) != max_len:
                pos = torch.arange(max_len, device=meta.block_tables.device)
                lens = torch.tensor(ctx, dtype=torch.int64, device=pos.device)
                mask = (pos[None, :] < lens[:, None])[:, None, None, :]
            one = cpu and nd <= ONE_THREAD_MAX_BATCH and max_len <= ONE_THREAD_MAX_KEYS
            meta.decode_plan = DecodePlan(gather, nb, max_len, mask, threads=1 if one else 0)
        return meta.decode_plan

    def _window_plan(self, meta: AttentionMetadata, window: int) -> DecodePlan:
        """Decode plan of a sliding layer: each sequence's keys [context - window, context) only, so the blocks
        before its window are never read (views: a narrower slice; gather: only the window's blocks)."""
        nd, bs = meta.num_decode, self.block_size
        ctx = meta.context_lens_host[:nd]
        first = [max(0, c - window) for c in ctx]
        lens = [c - f for c, f in zip(ctx, first, strict=True)]
        fb = [f // bs for f in first]
        ends = [(c + bs - 1) // bs for c in ctx]
        tables = meta.block_tables[:nd, : max(ends)].tolist()
        rows = [t[a:e] for t, a, e in zip(tables, fb, ends, strict=True)]
        cpu = meta.block_tables.device.type == "cpu"
        if cpu and (nd == 1 or max(lens) >= VIEWS_MIN_KEYS_BATCHED):
            starts = consecutive_starts(rows, bs)
            if starts is not None:
                starts = [s + f % bs for s, f in zip(starts, first, strict=True)]
                return DecodePlan(None, max(map(len, rows)), max(lens), None, starts, lens)
        nb = max(map(len, rows))
        dev = meta.block_tables.device
        gather = torch.tensor([(r + [0] * nb)[:nb] for r in rows], dtype=torch.int64, device=dev).reshape(-1)
        pos = torch.arange(nb * bs, device=dev)[None, :] + torch.tensor([a * bs for a in fb], device=dev)[:, None]
        lo = torch.tensor(first, device=dev)[:, None]
        hi = torch.tensor(ctx, device=dev)[:, None]
        mask = ((pos >= lo) & (pos < hi))[:, None, None, :]
        one = cpu and nd <= ONE_THREAD_MAX_BATCH and nb * bs <= ONE_THREAD_MAX_KEYS
        return DecodePlan(gather, nb, nb * bs, mask, threads=1 if one else 0)

    def native_for(self, dtype: torch.dtype, heads: int, prefill: bool = False) -> NativeKernels | None:
        """The C kernels where they serve this pool's decode rows (``prefill``: prefill rows) for queries of
        ``dtype`` with ``heads`` heads, else None (torch's path)."""
        native = self.native
        if native is None or dtype != self.kv_cache.dtype:
            return None
        supports = native.supports_prefill if prefill else native.supports_decode
        return native if supports(dtype, heads, self.num_kv_heads, self.head_dim, self.block_size) else None

    def _native_decode(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, window: int,
                       scale: float) -> torch.Tensor | None:
        """The decode rows through the C kernel, or None where it does not apply (then torch's path runs)."""
        native = self.native_for(q.dtype, q.shape[1])
        if native is None or meta.block_tables.dtype != torch.int32:
            return None
        nd = meta.num_decode
        ctx = meta.context_lens[:nd]
        first = None
        if window:
            first = meta.native_first.get(window)
            if first is None:
                first = meta.native_first[window] = (ctx - window).clamp_(min=0).to(torch.int32)
        return native.paged_decode_attention(q, self.kv_cache[layer, 0], self.kv_cache[layer, 1],
                                             meta.block_tables[:nd], first, ctx, scale or self.scale)

    def _native_prefill(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, i: int, first_position: int,
                        window: int, scale: float) -> torch.Tensor | None:
        """Sequence ``i``'s new tokens (q [N, H, D]) through the C prefill kernel over its pages (its new K/V stored
        already), or None where it does not apply (then torch's path runs)."""
        native = self.native_for(q.dtype, q.shape[1], prefill=True)
        if native is None or meta.block_tables.dtype != torch.int32:
            return None
        return native.paged_prefill_attention(q, self.kv_cache[layer, 0], self.kv_cache[layer, 1],
                                              meta.block_tables[i], first_position, window, scale)

    def _decode(self, layer: int, q: torch.Tensor, plan: DecodePlan, gqa: bool,
                sinks: torch.Tensor | None = None, scale: float = 0.0, value_dim: int = 0,
                index: IndexQuery | None = None) -> torch.Tensor:
        """q [nd, H, D] -> out [nd, H, D (value_dim)] over each sequence's cached keys (its new K/V already
        stored)."""
        step_threads = torch.get_num_threads()
        if not plan.threads or plan.threads == step_threads:
            return self._decode_keys(layer, q, plan, gqa, sinks, scale, value_dim, index)
        torch.set_num_threads(plan.threads)
        try:
            return self._decode_keys(layer, q, plan, gqa, sinks, scale, value_dim, index)
        finally:
            torch.set_num_threads(step_threads)  # core lending set the step's count: the GEMMs keep it

    def _decode_keys(self, layer: int, q: torch.Tensor, plan: DecodePlan, gqa: bool,
                     sinks: torch.Tensor | None, scale: float = 0.0, value_dim: int = 0,
                     index: IndexQuery | None = None) -> torch.Tensor:
        scale = scale or self.scale
        if plan.starts is not None:
            assert plan.lens is not None
            kc, vc = self._slots[layer]
            outs = []
            for i, (s, n) in enumerate(zip(plan.starts, plan.lens, strict=True)):
                k, v = kc[s:s + n].unsqueeze(0).transpose(1, 2), vc[s:s + n].unsqueeze(0).transpose(1, 2)
                if k.dtype != q.dtype:
                    k, v = k.to(q.dtype), v.to(q.dtype)
                k, v = latent_kv(k, v, value_dim)
                mask = None if index is None else index_mask(
                    index, slice(i, i + 1), self._index_pool().read_range(layer, s, n)[None],
                    torch.ones(1, 1, n, dtype=torch.bool, device=q.device))
                outs.append(sdpa(q[i:i + 1].unsqueeze(2), k, v, mask, scale, gqa, sinks))
            return (outs[0] if len(outs) == 1 else torch.cat(outs)).squeeze(2)
        assert plan.gather is not None
        nd = q.shape[0]
        kp, vp = self._pages[layer]
        shape = (nd, plan.blocks * self.block_size, self.num_kv_heads, self.head_dim)
        k = kp.index_select(0, plan.gather).view(shape)[:, : plan.max_len].transpose(1, 2)
        v = vp.index_select(0, plan.gather).view(shape)[:, : plan.max_len].transpose(1, 2)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        k, v = latent_kv(k, v, value_dim)
        mask = plan.mask
        if index is not None:
            valid = (plan.mask[:, 0] if plan.mask is not None
                     else torch.ones(nd, 1, plan.max_len, dtype=torch.bool, device=q.device))
            ik = self._index_pool().read_blocks(layer, plan.gather).view(nd, -1, index.q.shape[-1])
            mask = index_mask(index, slice(0, nd), ik[:, :plan.max_len], valid)
        return sdpa(q.unsqueeze(2), k, v, mask, scale, gqa, sinks).squeeze(2)

    def _gather(self, layer: int, block_tables: torch.Tensor, max_len: int, first_block: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, max_blocks] -> K, V each [B, KVH, max_len - first_block * block_size, D]: the keys from block
        ``first_block`` of each table on."""
        nb = (max_len + self.block_size - 1) // self.block_size
        bt = block_tables[:, first_block:nb]
        b, n = bt.shape
        # index_select with int64 ids: on CPU, advanced indexing with the int32 table is 10-100x slower.
        idx = bt.reshape(-1).to(torch.int64)
        shape = (b, n * self.block_size, self.num_kv_heads, self.head_dim)
        k = self.kv_cache[layer, 0].index_select(0, idx).view(shape)
        v = self.kv_cache[layer, 1].index_select(0, idx).view(shape)
        keys = max_len - first_block * self.block_size
        return k[:, :keys].transpose(1, 2), v[:, :keys].transpose(1, 2)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, window: int = 0, sinks: torch.Tensor | None = None, scale: float = 0.0,
                value_dim: int = 0, index: IndexQuery | None = None, decode_only: bool = False) -> torch.Tensor:
        """``scale``: the layer's softmax scale (0: this backend's); ``value_dim``: latent attention (k/v halves of
        one latent, AttentionSpec.latent_value_dim); ``index``: its sparse top-k selection (AttentionSpec.index);
        ``decode_only``: AttentionSpec.decode_only."""
        self._store(layer, k, v, meta.slot_mapping)
        if index is not None:
            self._index_pool().store(layer, index.key, meta.slot_mapping)
        nd = meta.num_decode
        gqa = q.shape[1] != self.num_kv_heads
        plain = sinks is None and not value_dim and index is None
        if decode_only and nd < len(meta.query_lens):
            out = q.new_empty(*q.shape[:2], value_dim) if value_dim else torch.empty_like(q)
            if nd:
                out[:nd] = self._decode(layer, q[:nd], self._decode_plan(meta, window), gqa, sinks, scale or self.scale,
                                        value_dim, index)
            return out
        if nd == len(meta.query_lens):  # a pure decode step
            if plain and (o := self._native_decode(layer, q, meta, window, scale)) is not None:
                return o
            return self._decode(layer, q, self._decode_plan(meta, window), gqa, sinks, scale, value_dim, index)
        scale = scale or self.scale
        out = q.new_empty(*q.shape[:2], value_dim) if value_dim else torch.empty_like(q)
        if nd:
            o = self._native_decode(layer, q[:nd], meta, window, scale) if plain else None
            out[:nd] = o if o is not None else self._decode(layer, q[:nd], self._decode_plan(meta, window), gqa,
                                                            sinks, scale, value_dim, index)
        start = nd
        for i in range(nd, len(meta.query_lens)):
            qlen, clen = meta.query_lens[i], meta.context_lens_host[i]
            if plain and (o := self._native_prefill(layer, q[start:start + qlen], meta, i, clen - qlen, window,
                                                     scale)) is not None:
                out[start:start + qlen] = o
                start += qlen
                continue
            qs = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            qpos = torch.arange(clen - qlen, clen, device=q.device)
            ik = None
            if clen == qlen:  # no cached prefix: attend to the new tokens directly
                ks = k[start:start + qlen].transpose(0, 1).unsqueeze(0).to(q.dtype)
                vs = v[start:start + qlen].transpose(0, 1).unsqueeze(0).to(q.dtype)
                kpos = qpos
                if index is not None:  # as stored (an fp8 codec's rounding included), like every later read
                    ik = self._index_pool().read(layer, meta.slot_mapping[start:start + qlen])[None]
            else:  # from the first block any query's window reaches (block 0 under full attention)
                first = max(0, clen - qlen - window + 1) // self.block_size if window else 0
                ks, vs = self._gather(layer, meta.block_tables[i:i + 1], clen, first)
                ks, vs = ks.to(q.dtype), vs.to(q.dtype)
                kpos = torch.arange(first * self.block_size, clen, device=q.device)
                if index is not None:
                    nb = (clen + self.block_size - 1) // self.block_size
                    blocks = meta.block_tables[i, first:nb].to(torch.int64)
                    ik = self._index_pool().read_blocks(layer, blocks)[None, :clen - first * self.block_size]
            ks, vs = latent_kv(ks, vs, value_dim)
            if clen == qlen and (not window or qlen <= window) and ik is None:
                o = sdpa(qs, ks, vs, None, scale, gqa, sinks, is_causal=True)
            else:
                mask = kpos[None, :] <= qpos[:, None]
                if window:
                    mask &= qpos[:, None] - kpos[None, :] < window
                if ik is not None and index is not None:
                    mask = index_mask(index, slice(start, start + qlen), ik, mask[None])
                o = sdpa(qs, ks, vs, mask, scale, gqa, sinks)
            out[start:start + qlen] = o[0].transpose(0, 1)
            start += qlen
        return out
