"""CPU decode steps of small batches through ONE torch.compile'd forward (``--cpu-compile-decode N``).

A CPU decode step of a small model is bound by per-op dispatch and Python (about 1,500 aten calls per
step for a 30-layer model, a quarter of the step outside any op), not by arithmetic. Inductor fuses each
layer's elementwise ops (RMSNorm, RoPE, SiLU*mul, residual adds) into a few C++ kernels and calls the int4
GEMMs and SDPA as extern kernels from one generated wrapper.

The compiled forward is pure: it reads the paged KV cache and never writes it. Each layer attends over
the sequence's gathered pages (old keys, masked to ``position`` keys) with the new token's K/V appended
as the last key column; the new K/V of all layers come back stacked and are stored with one
``index_copy_`` per K and V afterwards. That is the same set of keys the eager path attends to (it stores
first, then gathers), so only the rounding of fused elementwise ops differs.

Shapes: the batch size is static (one compiled variant per size 1..N, all compiled at engine start);
the gathered length is dynamic (one variant covers every context length), and at least two pages are
gathered so that dimension never is 0 or 1 (torch specializes those sizes).
"""

from __future__ import annotations

import logging
import time

import torch
import torch._dynamo.exc
import torch._inductor.exc
import torch.nn.functional as F

from services.engine.models.rope import rotate_half
from services.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

_COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError,
                   torch._inductor.exc.InvalidCxxCompiler, torch._inductor.exc.CppCompileError)
"""What a failed torch.compile raises (tracing, lowering, or the C++ toolchain)."""
MIN_PAGES = 2
"""Pages gathered per sequence at least (padding pages are masked out)."""


class CompiledDecode:
    """Pure-decode CPU steps of at most ``max_batch`` sequences through a compiled model forward."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, max_batch: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.max_batch = max_batch
        layers, two, blocks, self.block_size, self.kv_heads, self.head_dim = kv_cache.shape
        # [layers, 2, slots, KVH, D]: the store target (one index_copy_ over all layers for K, one for V).
        self._slots = kv_cache.view(layers, two, blocks * self.block_size, self.kv_heads, self.head_dim)
        self._forward = torch.compile(self._eager_forward, fullgraph=True)
        self.compile_seconds = 0.0

    @staticmethod
    def supported(model: torch.nn.Module) -> bool:
        """Llama-family decoder at TP=1 with the plain (non-Triton) forward."""
        split = getattr(model, "tp_split", None)
        return (split is not None and split.tp_size == 1 and hasattr(model, "rotary")
                and hasattr(getattr(model, "model", None), "layers"))

    def _eager_forward(self, ids: torch.Tensor, pos: torch.Tensor, gather: torch.Tensor, mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids/pos int64 [B]; gather int64 [B * pages] page ids; mask bool [B, 1, 1, pages * block_size + 1]
        (old keys < position, and the appended new key) -> (fp32 logits [B, vocab], new K and new V
        [layers, B, KVH, D])."""
        model, kv = self.model, self.kv_cache
        b = ids.shape[0]
        h = model.model.embed_tokens(ids)
        cos = model.rotary.cos_cache[pos][:, None, :].to(h.dtype)  # [B, 1, D]
        sin = model.rotary.sin_cache[pos][:, None, :].to(h.dtype)
        new_k, new_v = [], []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            q, k, v = attn._qkv(layer.input_layernorm(h))
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            new_k.append(k)
            new_v.append(v)
            old_k = kv[i, 0].flatten(1).index_select(0, gather).view(b, -1, self.kv_heads, self.head_dim)
            old_v = kv[i, 1].flatten(1).index_select(0, gather).view(b, -1, self.kv_heads, self.head_dim)
            keys = torch.cat([old_k, k[:, None]], 1).transpose(1, 2)
            values = torch.cat([old_v, v[:, None]], 1).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask,
                                               scale=self.head_dim ** -0.5, enable_gqa=q.shape[1] != self.kv_heads)
            h = h + attn.o_proj(o.reshape(b, attn.q_size))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.compute_logits(model.model.norm(h)), torch.stack(new_k), torch.stack(new_v)

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        return 0 < len(chunks) <= self.max_batch and all(c.num_new_tokens == 1 and not c.spec_tokens for c in chunks)

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, gather: torch.Tensor, mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch._dynamo.maybe_mark_dynamic(gather, 0)
        torch._dynamo.maybe_mark_dynamic(mask, 3)
        return self._forward(ids, pos, gather, mask)

    def inputs(self, rows: list[tuple[int, int, list[int]]]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows (token, position, block table) -> ids, positions, slots, gather, mask."""
        bs = self.block_size
        pages = max(MIN_PAGES, max((p + bs) // bs for _, p, _ in rows))  # covers keys 0..position
        gather = torch.zeros(len(rows), pages, dtype=torch.int64)
        slots = []
        for i, (_, p, table) in enumerate(rows):
            n = min(len(table), pages)
            gather[i, :n] = torch.tensor(table[:n], dtype=torch.int64)
            slots.append(table[p // bs] * bs + p % bs)
        pos = torch.tensor([p for _, p, _ in rows], dtype=torch.int64)
        old = torch.arange(pages * bs)[None, :] < pos[:, None]
        mask = torch.cat([old, torch.ones(len(rows), 1, dtype=torch.bool)], 1)[:, None, None, :]
        ids = torch.tensor([t for t, _, _ in rows], dtype=torch.int64)
        return ids, pos, torch.tensor(slots, dtype=torch.int64), gather.view(-1), mask

    def forward(self, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """One decode step of rows (token, position, block table): stores the new K/V, returns fp32 logits."""
        ids, pos, slots, gather, mask = self.inputs(rows)
        logits, k, v = self._run(ids, pos, gather, mask)
        self._slots[:, 0].index_copy_(1, slots, k)
        self._slots[:, 1].index_copy_(1, slots, v)
        return logits

    def step(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """fp32 logits [len(chunks), vocab] of one pure-decode step (K/V stored)."""
        rows = []
        for ch in chunks:
            p = ch.seq.num_computed_tokens
            rows.append((ch.seq.token_ids[p], p, ch.seq.block_table))
        return self.forward(rows)

    @torch.inference_mode()
    def warm_up(self) -> bool:
        """Compile every batch size now (reads page 0 only, writes nothing), so no request waits for it.
        False (logged) when compiling fails, e.g. no working C++ compiler: the engine then stays eager."""
        t0 = time.monotonic()
        try:
            for b in range(1, self.max_batch + 1):
                ids = torch.zeros(b, dtype=torch.int64)
                mask = torch.zeros(b, 1, 1, MIN_PAGES * self.block_size + 1, dtype=torch.bool)
                mask[..., -1] = True
                self._run(ids, ids.clone(), torch.zeros(b * MIN_PAGES, dtype=torch.int64), mask)
        except _COMPILE_ERRORS as e:
            log.warning("engine: --cpu-compile-decode %d: compiling the decode step failed after %.1f s, decode "
                        "steps stay eager: %s", self.max_batch, time.monotonic() - t0, str(e).splitlines()[0])
            return False
        self.compile_seconds = time.monotonic() - t0
        log.info("engine: decode steps of 1..%d sequences compiled (torch.compile, inductor) in %.1f s",
                 self.max_batch, self.compile_seconds)
        return True
