"""What the background decode compile (decode_compiler.py) checks and times each compiled variant against: the
eager CPU step on a private scratch pool (:class:`EagerStep`), the tolerance a variant's logits must keep, the
reports it fills, and the context past which the eager step wins (:func:`crossover_keys`)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from services.engine.attention import ForwardContext, TorchPagedAttention
from services.engine.cpu.native import NativeKernels
from services.engine.step_inputs import prepare_rows

CONTEXT_TOKENS = 96
"""Prompt tokens of each scratch sequence the checks and timings decode after (6 pages of 16)."""


def tolerance(dtype: torch.dtype) -> float:
    """Largest |compiled - eager| logit allowed, relative to the largest |eager logit| (at least 1)."""
    return 1e-3 if dtype == torch.float32 else 5e-2


@dataclass
class VariantReport:
    """What the background compile found for one batch size."""

    batch: int
    threads: int = 0
    """torch threads it was compiled and timed at."""
    child_s: float = 0.0
    """Seconds the compile child took to put it in the on-disk cache."""
    compile_s: float = 0.0
    """Seconds this process took to build it (from the cache)."""
    cache_misses: int = 0
    """Inductor FX-graph cache misses while building it here (0: all from the child's cache)."""
    max_logit_diff: float = 0.0
    same_argmax: bool = False
    eager_ms: float = 0.0
    compiled_ms: float = 0.0
    long_keys: int = 0
    """Keys per sequence of the long timing (0: not timed)."""
    long_eager_ms: float = 0.0
    long_compiled_ms: float = 0.0
    max_keys: float = math.inf
    """Longest context at which the variant runs where the eager step reads views (crossover_keys)."""
    active: bool = False
    decided: float = 0.0
    """monotonic time the check and timing ended (the switch, when ``active``)."""


@dataclass
class CompileReport:
    status: str = "pending"
    """pending -> compiling -> done (every size tried) | failed (compiling raised: eager) | stopped."""
    started: float = 0.0
    """monotonic time the thread began compiling (0.0 before)."""
    finished: float = 0.0
    variants: list[VariantReport] = field(default_factory=list)


def crossover_keys(short_keys: int, short_eager_ms: float, short_compiled_ms: float, long_keys: int,
                   long_eager_ms: float, long_compiled_ms: float) -> float:
    """The context (keys) past which the eager step beats the compiled one, each step's time taken as linear in
    the context through its two timings; inf when the compiled step is no slower at ``long_keys`` (or its
    lead does not shrink)."""
    lead_short = short_eager_ms - short_compiled_ms
    lead_long = long_eager_ms - long_compiled_ms
    if lead_long >= 0 or lead_short <= lead_long:
        return math.inf
    if lead_short <= 0:
        return float(short_keys)
    return short_keys + (long_keys - short_keys) * lead_short / (lead_short - lead_long)


class EagerStep:
    """The model runner's eager CPU step (paged attention, the model's forward) on the scratch pool, with a
    private rotary module; it rewrites the same slots at every call (positions do not advance). ``kernels``: the
    C kernels the engine's own eager steps attend through, so the timings compare the compiled variant with the
    step the engine would otherwise take (torch's attention costs several times more per key)."""

    def __init__(self, model: torch.nn.Module, pool: torch.Tensor, block_size: int,
                 kernels: NativeKernels | None = None) -> None:
        self.model, self.block_size = model, block_size
        self.rotary = copy.copy(model.rotary)  # own per-step cache attributes, shared (read-only) tables
        self.backend = TorchPagedAttention(pool, pool.shape[-1] ** -0.5, kernels)

    def _run(self, rows: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:

        ids, pos, meta = prepare_rows(rows, self.block_size, torch.device("cpu"))
        ctx = ForwardContext(self.backend, meta)
        m = self.model
        h = m.model.embed_tokens(ids)
        for layer in m.model.layers:  # LlamaForCausalLM.forward on CPU, with this rotary module
            h = layer(h, pos, self.rotary, ctx)
        return m.compute_logits(m.model.norm(h)[torch.tensor(list(_row_ends(rows)))])

    def prefill(self, prompt: list[int], table: list[int]) -> None:
        self._run([(prompt, 0, table)])

    def decode(self, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """fp32 logits [len(rows), vocab] of one decode step of rows (token, position, block table)."""
        return self._run([([t], p, table) for t, p, table in rows])


def scratch_pages(max_batch: int, block_size: int) -> int:
    """Pages of the scratch pool (the child builds its graphs against one of the same size: the page count
    is a dynamic dimension, but equal sizes of dynamic dimensions are unified, so it must match)."""
    return max_batch * ((CONTEXT_TOKENS + block_size) // block_size + 1)  # prompt, decoded token, one spare


def _row_ends(rows: list[tuple[list[int], int, list[int]]]) -> Iterator[int]:
    n = 0
    for tokens, _, _ in rows:
        n += len(tokens)
        yield n - 1
