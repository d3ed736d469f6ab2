"""Paged attention behind one interface: the model calls ``ctx.attend(layer, q, k, v)``.

The model runner owns the KV tensor ``kv_cache[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
and builds one :class:`AttentionMetadata` per step. A step's flat token batch holds the decode
sequences first (one query token each), then prefill chunks (any number of query tokens each).
The CPU path is plain torch; the GPU path swaps in the Triton kernels behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


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
    """What every layer's decode attention shares within a step; the CPU backend fills it at layer 0."""


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


class AttentionBackend(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the new tokens -> out [T, H, D]; also stores k/v in the cache."""
        ...


@dataclass
class ForwardContext:
    """What a model's forward needs besides token ids and positions."""

    backend: AttentionBackend
    meta: AttentionMetadata

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, self.meta)


class TorchPagedAttention:
    """Torch path over the paged cache (CPU default, and the reference on GPU)."""

    def __init__(self, kv_cache: torch.Tensor, scale: float) -> None:
        self.kv_cache = kv_cache
        self.scale = scale
        _, _, _, self.block_size, self.num_kv_heads, self.head_dim = kv_cache.shape
        # Per layer: K and V as [slots, KVH, D] views (store) and [blocks, block_size * KVH * D] (gather), made
        # once so a step's ~30 layers slice nothing per call.
        self._slots = [(kv_cache[i, 0].view(-1, self.num_kv_heads, self.head_dim),
                        kv_cache[i, 1].view(-1, self.num_kv_heads, self.head_dim)) for i in range(kv_cache.shape[0])]
        self._pages = [(kv_cache[i, 0].flatten(1), kv_cache[i, 1].flatten(1)) for i in range(kv_cache.shape[0])]

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        kc, vc = self._slots[layer]
        kc.index_copy_(0, slots, k if k.dtype == kc.dtype else k.to(kc.dtype))
        vc.index_copy_(0, slots, v if v.dtype == vc.dtype else v.to(vc.dtype))

    def _decode_plan(self, meta: AttentionMetadata) -> DecodePlan:
        if meta.decode_plan is None:
            nd = meta.num_decode
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

    def _decode(self, layer: int, q: torch.Tensor, plan: DecodePlan, gqa: bool) -> torch.Tensor:
        """q [nd, H, D] -> out [nd, H, D] over each sequence's cached keys (its new K/V already stored)."""
        step_threads = torch.get_num_threads()
        if not plan.threads or plan.threads == step_threads:
            return self._decode_keys(layer, q, plan, gqa)
        torch.set_num_threads(plan.threads)
        try:
            return self._decode_keys(layer, q, plan, gqa)
        finally:
            torch.set_num_threads(step_threads)  # core lending set the step's count: the GEMMs keep it

    def _decode_keys(self, layer: int, q: torch.Tensor, plan: DecodePlan, gqa: bool) -> torch.Tensor:
        if plan.starts is not None:
            assert plan.lens is not None
            kc, vc = self._slots[layer]
            outs = []
            for i, (s, n) in enumerate(zip(plan.starts, plan.lens, strict=True)):
                k, v = kc[s:s + n].unsqueeze(0).transpose(1, 2), vc[s:s + n].unsqueeze(0).transpose(1, 2)
                if k.dtype != q.dtype:
                    k, v = k.to(q.dtype), v.to(q.dtype)
                outs.append(F.scaled_dot_product_attention(q[i:i + 1].unsqueeze(2), k, v, scale=self.scale,
                                                           enable_gqa=gqa))
            return (outs[0] if len(outs) == 1 else torch.cat(outs)).squeeze(2)
        assert plan.gather is not None
        nd = q.shape[0]
        kp, vp = self._pages[layer]
        shape = (nd, plan.blocks * self.block_size, self.num_kv_heads, self.head_dim)
        k = kp.index_select(0, plan.gather).view(shape)[:, : plan.max_len].transpose(1, 2)
        v = vp.index_select(0, plan.gather).view(shape)[:, : plan.max_len].transpose(1, 2)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=plan.mask, scale=self.scale,
                                           enable_gqa=gqa)
        return o.squeeze(2)

    def _gather(self, layer: int, block_tables: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, max_blocks] -> K, V each [B, KVH, max_len, D]."""
        nb = (max_len + self.block_size - 1) // self.block_size
        bt = block_tables[:, :nb]
        b = bt.shape[0]
        # index_select with int64 ids: on CPU, advanced indexing with the int32 table is 10-100x slower.
        idx = bt.reshape(-1).to(torch.int64)
        k = self.kv_cache[layer, 0].index_select(0, idx).view(b, nb * self.block_size, self.num_kv_heads, self.head_dim)
        v = self.kv_cache[layer, 1].index_select(0, idx).view(b, nb * self.block_size, self.num_kv_heads, self.head_dim)
        return k[:, :max_len].transpose(1, 2), v[:, :max_len].transpose(1, 2)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        self._store(layer, k, v, meta.slot_mapping)
        nd = meta.num_decode
        gqa = q.shape[1] != self.num_kv_heads
        if nd == len(meta.query_lens):  # a pure decode step
            return self._decode(layer, q, self._decode_plan(meta), gqa)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(layer, q[:nd], self._decode_plan(meta), gqa)
        start = nd
        for i in range(nd, len(meta.query_lens)):
            qlen, clen = meta.query_lens[i], meta.context_lens_host[i]
            qs = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if clen == qlen:  # no cached prefix: attend to the new tokens directly
                ks = k[start:start + qlen].transpose(0, 1).unsqueeze(0)
                vs = v[start:start + qlen].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks.to(q.dtype), vs.to(q.dtype), is_causal=True,
                                                   scale=self.scale, enable_gqa=gqa)
            else:
                ks, vs = self._gather(layer, meta.block_tables[i:i + 1], clen)
                qpos = torch.arange(clen - qlen, clen, device=q.device)
                kpos = torch.arange(clen, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qs, ks.to(q.dtype), vs.to(q.dtype), attn_mask=mask,
                                                   scale=self.scale, enable_gqa=gqa)
            out[start:start + qlen] = o[0].transpose(0, 1)
            start += qlen
        return out
