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

Shapes: the batch size is static (one compiled variant per size 1..N); the gathered length and the
pool's page count are dynamic (one variant covers every context length, and a variant compiled against a
small private scratch pool serves the engine's pool unchanged), and at least two pages are gathered so that
dimension never is 0 or 1 (torch specializes those sizes).

Threads: each variant is its own copy of the forward's code object, so each has its own Dynamo cache. The
background compiler (decode_compiler.py) compiles variant b (``compile``) while the engine thread runs the
variants already switched on (``on``: batch size and torch thread count; a size compiled at two counts holds
two cache entries) through ``torch._dynamo.run``, which never compiles: a guard miss
would run the same forward uncompiled, never trace on the engine thread. Only the engine thread touches the
engine's KV pool; compiling and checking use the scratch pool.
"""

from __future__ import annotations

import logging
import math
import time
import types
from collections.abc import Callable

import torch
import torch._dynamo.exc
import torch._inductor.exc
import torch.nn.functional as F

from services.engine.attention import VIEWS_MIN_KEYS_BATCHED, consecutive_starts
from services.engine.cpu.native import NativeKernels
from services.engine.models.rope import rotate_half
from services.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

_COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError,
                   torch._inductor.exc.InvalidCxxCompiler, torch._inductor.exc.CppCompileError)
"""What a failed torch.compile raises (tracing, lowering, or the C++ toolchain)."""
MIN_PAGES = 2
"""Pages gathered per sequence at least (padding pages are masked out)."""


def _own_code(fn: Callable, tag: str) -> Callable:
    """``fn`` (a function) with a code object of its own: Dynamo keeps its cache on the code object."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledDecode:
    """Pure-decode CPU steps of at most ``max_batch`` sequences through a compiled model forward."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, max_batch: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.max_batch = max_batch
        _, _, _, self.block_size, self.kv_heads, self.head_dim = kv_cache.shape
        self._compiled: dict[int, Callable] = {}
        """batch size -> torch.compile wrapper (traces on a cache miss: compiling thread only)."""
        self._run_only: dict[int, Callable] = {}
        """batch size -> the same variant, never compiling (the engine thread's calls)."""
        self._codes: dict[int, types.CodeType] = {}
        """batch size -> the variant's code object (Dynamo's cache hangs on it)."""
        for b in range(1, max_batch + 1):
            own = _own_code(type(self)._eager_forward, f"b{b}")
            self._codes[b] = own.__code__
            fn = types.MethodType(own, self)
            self._compiled[b] = torch.compile(fn, fullgraph=True)
            self._run_only[b] = torch._dynamo.run(fn)
        self.on: frozenset[tuple[int, int]] = frozenset()
        """(batch size, torch threads) of the variants the engine thread runs compiled (replaced whole, never
        mutated: one reference read). Dynamo guards on the thread count (its global state guard), so each
        variant is compiled at a count (the code object holds one cache entry per count compiled) and a step
        at a count without a variant of its size runs eager."""
        self.eager_kernels: NativeKernels | None = None
        """The C kernels the engine's eager steps attend through (set by the model runner where they serve this
        model's decode rows): they read every key in place, so past a variant's ``max_keys`` the eager step
        is taken whatever the block layout, and the decode compiler times its eager steps with them."""
        self.max_keys: dict[tuple[int, int], float] = {}
        """(batch size, torch threads) -> the longest context (keys) at which that variant is preferred to an eager
        step that reads its keys as views of the pool (every sequence's blocks consecutive): past it, the compiled
        step's gather of the keys costs more than its fused ops save. Measured per variant by the decode compiler
        (decode_check.crossover_keys); a variant without an entry runs at any context. Replaced whole."""
        self.threads = torch.get_num_threads()
        """The engine's own share of torch threads (``active`` counts the sizes switched on at it)."""
        self.steps_by_threads: dict[int, int] = {}
        """torch threads -> compiled steps run at that count (engine thread; tests and logs read it)."""
        self.compile_seconds = 0.0
        """Seconds spent compiling the variants (all of them, checked or not)."""

    @staticmethod
    def supported(model: torch.nn.Module) -> bool:
        """Llama-family decoder at TP=1 with the plain (non-Triton) forward, dense MLPs (an MoE layer's experts
        depend on the routing, which one full graph cannot hold), full attention without sinks on every layer
        (the compiled forward attends over every cached key) and RoPE over whole heads."""
        split = getattr(model, "tp_split", None)
        arch = getattr(model, "arch", None)
        return (split is not None and split.tp_size == 1 and hasattr(model, "rotary")
                and hasattr(getattr(model, "model", None), "layers")
                and arch is not None and getattr(arch, "moe", None) is None and getattr(arch, "mla", None) is None
                and not arch.layer_windows and not arch.attention_sinks and arch.rotary_dim is None)

    def _eager_forward(self, ids: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, gather: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids/pos int64 [B]; kv the pool (read only); gather int64 [B * pages] page ids; mask bool
        [B, 1, 1, pages * block_size + 1] (old keys < position, and the appended new key) -> (fp32 logits
        [B, vocab], new K and new V [layers, B, KVH, D])."""
        model = self.model
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

    @property
    def active(self) -> frozenset[int]:
        """Batch sizes switched on at the engine's own share of threads (the compiled-sizes gauge)."""
        return frozenset(b for b, t in self.on if t == self.threads)

    def sizes_at(self, threads: int) -> frozenset[int]:
        """Batch sizes switched on at ``threads`` torch threads (a lent count: core lending)."""
        return frozenset(b for b, t in self.on if t == threads)

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        """A pure-decode step of a batch size whose variant is switched on at the calling thread's torch
        thread count (engine thread, once per step), unless its context is past the variant's ``max_keys``
        and the eager step reads the keys in place (the C kernels, or TorchPagedAttention's views)."""
        key = (len(chunks), torch.get_num_threads())
        if key not in self.on or not all(c.num_new_tokens == 1 and not c.spec_tokens for c in chunks):
            return False
        limit = self.max_keys.get(key)
        if limit is None:
            return True
        keys = max(c.seq.num_computed_tokens + 1 for c in chunks)
        return keys <= limit or (self.eager_kernels is None and not self._eager_reads_views(chunks, keys))

    def _eager_reads_views(self, chunks: list[ScheduledChunk], keys: int) -> bool:
        """Whether the eager step (TorchPagedAttention's decode plan) reads these sequences' keys as views."""
        if len(chunks) > 1 and keys < VIEWS_MIN_KEYS_BATCHED:
            return False
        bs = self.block_size
        tables = [c.seq.block_table[: (c.seq.num_computed_tokens + bs) // bs] for c in chunks]
        return consecutive_starts(tables, bs) is not None

    def activate(self, batch: int, threads: int | None = None, max_keys: float = math.inf) -> None:
        """Switch variant ``batch`` compiled at ``threads`` (default: the engine's share) on: the engine
        thread's next step of that size at that thread count runs it (up to ``max_keys`` keys where the eager
        step reads views)."""
        key = (batch, self.threads if threads is None else threads)
        if max_keys != math.inf:
            self.max_keys = {**self.max_keys, key: max_keys}  # before ``on``: the engine thread reads on first
        self.on = self.on | {key}

    def compile(self, batch: int, kv: torch.Tensor) -> float:
        """Trace and compile variant ``batch`` now, running it once on ``kv`` (a scratch pool of the
        engine pool's dtype and page shape); seconds taken. Raises what a failed compile raises
        (_COMPILE_ERRORS). Never on the engine thread while the engine serves: it may take minutes.
        ``compile_seconds`` adds the time spent, a failed or cut compile's too."""
        t0 = time.monotonic()
        try:
            ids = torch.zeros(batch, dtype=torch.int64)
            mask = torch.zeros(batch, 1, 1, MIN_PAGES * self.block_size + 1, dtype=torch.bool)
            mask[..., -1] = True
            gather = torch.zeros(batch * MIN_PAGES, dtype=torch.int64)
            for t, dim in ((kv, 2), (gather, 0), (mask, 3)):
                torch._dynamo.maybe_mark_dynamic(t, dim)
            self._compiled[batch](ids, ids.clone(), kv, gather, mask)
        finally:
            seconds = time.monotonic() - t0
            self.compile_seconds += seconds
        return seconds

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

    def forward(self, rows: list[tuple[int, int, list[int]]], kv: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of rows (token, position, block table) through the compiled variant of that batch
        size (compiled before: this never compiles): stores the new K/V into ``kv`` (default: the engine's
        pool), returns fp32 logits."""
        kv = self.kv_cache if kv is None else kv
        if kv is self.kv_cache:
            n = torch.get_num_threads()
            self.steps_by_threads[n] = self.steps_by_threads.get(n, 0) + 1
        ids, pos, slots, gather, mask = self.inputs(rows)
        logits, k, v = self._run_only[len(rows)](ids, pos, kv, gather, mask)
        flat = kv.view(kv.shape[0], 2, -1, self.kv_heads, self.head_dim)  # [layers, 2, slots, KVH, D]
        flat[:, 0].index_copy_(1, slots, k)  # one store over all layers for K, one for V
        flat[:, 1].index_copy_(1, slots, v)
        return logits

    def step(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """fp32 logits [len(chunks), vocab] of one pure-decode step (K/V stored)."""
        rows = []
        for ch in chunks:
            p = ch.seq.num_computed_tokens
            rows.append((ch.seq.token_ids[p], p, ch.seq.block_table))
        return self.forward(rows)

    def scratch_pool(self, pages: int) -> torch.Tensor:
        """A private pool of ``pages`` pages shaped like the engine's (what compiling and checking write)."""
        shape = (self.kv_cache.shape[0], 2, max(pages, MIN_PAGES), self.block_size, self.kv_heads, self.head_dim)
        # An inference tensor lacks a dispatch key a normal one has, and Dynamo guards on the key set: the
        # scratch pool is made like the engine's, so what is compiled against it accepts the engine's pool.
        with torch.inference_mode(self.kv_cache.is_inference()):
            return torch.zeros(shape, dtype=self.kv_cache.dtype, device=self.kv_cache.device)

    def serves_engine_pool(self, batch: int, rows: list[tuple[int, int, list[int]]],
                           kv: torch.Tensor | None = None) -> bool | None:
        """Whether variant ``batch`` would run compiled on the engine's pool (or ``kv``) with inputs like
        ``rows``': its guards are evaluated on the pool's metadata (no tensor data is read, nothing runs). None
        when this torch does not expose its guards (then the check is skipped)."""
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            entries = _debug_get_cache_entry_list(self._codes[batch])
            ids, pos, _, gather, mask = self.inputs(rows)
            local = {"self": self, "ids": ids, "pos": pos, "kv": self.kv_cache if kv is None else kv, "gather": gather,
                     "mask": mask}
            return any(e.guard_manager.check(local) for e in entries)
        except (ImportError, AttributeError, TypeError):
            return None

    @torch.inference_mode()
    def warm_up(self) -> bool:
        """Compile every batch size now on the calling thread and switch them all on, unchecked (tests and
        benchmarks; the engine compiles in the background, decode_compiler.py). False (logged) when
        compiling fails, e.g. no working C++ compiler."""
        scratch = self.scratch_pool(MIN_PAGES)
        self.threads = torch.get_num_threads()
        try:
            for b in range(1, self.max_batch + 1):
                self.compile(b, scratch)
        except _COMPILE_ERRORS as e:
            log.warning("engine: --cpu-compile-decode %d: compiling the decode step failed after %.1f s, decode "
                        "steps stay eager: %s", self.max_batch, self.compile_seconds, str(e).splitlines()[0])
            return False
        self.on = frozenset((b, self.threads) for b in range(1, self.max_batch + 1))
        log.info("engine: decode steps of 1..%d sequences compiled (torch.compile, inductor) in %.1f s",
                 self.max_batch, self.compile_seconds)
        return True

