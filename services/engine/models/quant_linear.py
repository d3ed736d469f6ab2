"""GGUF Q4_1 weights used directly for decode: a post-load swap of dense ``nn.Linear`` modules.

torch's CPU int4 weight-only GEMM (``aten._weight_int4pack_mm_for_cpu``, group size 32) computes
``x @ W.T`` with ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` for ``g = k // 32``
(torch's own test quantizer, ``_group_quantize_tensor``, writes ``zero = min + 8 * scale``). A Q4_1
block stores ``w = d * q + m``, so ``scale = d`` and ``zero = m + 8 * d`` give the same grid; scale and
zero are held in the activation dtype (the kernel requires it), so in bf16 they round to 8 bits.

An :class:`Int4Linear` keeps the dense weight too: a call with at most ``max_rows`` rows (decode steps)
reads the packed 4-bit weight (about a quarter of the bytes of bf16), a larger one (prefill) the dense
weight, whose GEMM (AMX/oneDNN) is faster there. ``max_rows`` is measured at start on the host
(:func:`calibrate`). The LM head / embedding (Q8_0 in the default GGUF) stays dense.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.engine.models.fp8_linear import Fp8BlockLinear
from services.engine.models.llama import _STACKED
from services.engine.weights.gguf_loader import Q4_1_GROUP, GGUFFile, Q4_1Blocks, Q8_0Blocks
from services.text.model.source import resolve

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("auto", "dequantized", "int4")
"""``--weight-format`` values."""
WEIGHT_FORMAT_REASONS = {
    "explicit": "set by --weight-format",
    "preloaded": "the engine was handed a loaded model and kept its weights as they were",
    "not_gguf": "the model is not a GGUF file",
    "no_q4_1": "the GGUF has no Q4_1 linear weights",
    "not_cpu": "the int4 kernel is torch's CPU one",
    "unsupported_dtype": "the int4 kernel takes float32/bfloat16/float16 activations",
    "measured_faster": "int4 measured faster than the dense weight at decode batch sizes on this host",
    "measured_slower": "int4 measured slower than the dense weight at one row on this host",
    "fp8_checkpoint": "the checkpoint's FP8 block-scaled linears stay fp8 and run the FP8 block GEMM (CUDA)",
}
"""Why a weight format was chosen (the ``weight_format_reason`` of the engine info metric)."""
_CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32)
_MARGIN = 0.9
"""int4 counts as faster at a row count when it takes under this fraction of the dense time (timings on a
shared host are noisy; near the crossover either choice costs about the same)."""


_PACK_BLOCK_N = 64
"""Rows per tile of the CPU int4 layout as torch 2.13 packs it on AVX-512 hosts (other ISAs pack differently): [N/64, K, 32] bytes, byte
(t, k, j) = q[64t + j, k] | q[64t + 32 + j, k] << 4. :func:`_numpy_pack_matches` checks it on this host."""


def _numpy_pack(q: np.ndarray) -> torch.Tensor:
    n, k = q.shape
    tiles = q.reshape(n // _PACK_BLOCK_N, _PACK_BLOCK_N, k).transpose(0, 2, 1)
    half = _PACK_BLOCK_N // 2
    return torch.from_numpy(np.ascontiguousarray(tiles[..., :half] | (tiles[..., half:] << 4)).reshape(n, k // 2))


_NUMPY_PACK_OK: bool | None = None


def _numpy_pack_matches() -> bool:
    """Whether :func:`_numpy_pack` is byte-identical to torch's packing op here (memoized)."""
    global _NUMPY_PACK_OK
    if _NUMPY_PACK_OK is None:
        q = np.random.default_rng(0).integers(0, 16, (2 * _PACK_BLOCK_N, 64), dtype=np.uint8)
        ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q).to(torch.int32), 1)
        _NUMPY_PACK_OK = ref.shape == (q.shape[0], q.shape[1] // 2) and bool(torch.equal(ref, _numpy_pack(q)))
    return _NUMPY_PACK_OK


def pack_q4_1(blocks: list[Q4_1Blocks], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-concatenated Q4_1 blocks -> (packed uint8 [N, K/2], scale_and_zero [K/32, N, 2] in ``dtype``)."""
    q = np.concatenate([b.q for b in blocks])
    d = np.concatenate([b.d for b in blocks])
    m = np.concatenate([b.m for b in blocks])
    if q.shape[0] % _PACK_BLOCK_N == 0 and _numpy_pack_matches():
        packed = _numpy_pack(q)  # the op converts element by element: seconds for a model at start
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q).to(torch.int32), 1)
    scale_zero = torch.from_numpy(np.ascontiguousarray(np.stack([d, m + 8 * d], axis=-1).transpose(1, 0, 2)))
    return packed, scale_zero.to(dtype)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """x [M, K] (contiguous, scale_zero's dtype) @ dequantized(packed).T -> [M, N]."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, Q4_1_GROUP, scale_zero)


class Int4Linear(nn.Linear):
    """An ``nn.Linear`` whose calls with at most ``max_rows`` rows use the packed Q4_1 weight.

    ``weight``/``bias`` are the dense module's own tensors (state dict and shapes unchanged)."""

    def __init__(self, dense: nn.Linear, packed: torch.Tensor, scale_zero: torch.Tensor, max_rows: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.weight = dense.weight
        self.bias = dense.bias
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale_zero", scale_zero, persistent=False)
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == self.scale_zero.dtype:
            y = int4_mm(x.contiguous(), self.packed, self.scale_zero)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def pack_q8_0(b: Q8_0Blocks, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 as ONE int4 GEMM over 2K inputs: q = 16 * hi + lo (hi in -8..7, lo in 0..15), so
    x @ W.T = [x | x] @ [W_hi | W_lo].T with W_hi groups scale 16d, zero 0 (stored hi + 8) and W_lo groups
    scale d, zero 8d; the kernel sums both halves in one accumulator. Scales exact up to ``dtype`` rounding."""
    q = b.q.astype(np.int16)
    hi = np.floor_divide(q, 16)
    vals = np.concatenate([hi + 8, q - 16 * hi], axis=1).astype(np.uint8)
    d = b.d
    groups = [np.stack([16 * d, np.zeros_like(d)], axis=-1), np.stack([d, 8 * d], axis=-1)]
    scale_zero = torch.from_numpy(np.ascontiguousarray(np.concatenate(groups, axis=1).transpose(1, 0, 2)))
    packed = _numpy_pack(vals) if vals.shape[0] % _PACK_BLOCK_N == 0 and _numpy_pack_matches() else \
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(vals).to(torch.int32), 1)
    return packed, scale_zero.to(dtype)


class Q8_0Head(nn.Module):
    """The LM head over a Q8_0 weight (:func:`pack_q8_0`) for calls of at most ``max_rows`` rows; larger
    ones use the dense ``weight`` (the tied embedding's own tensor)."""

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, max_rows: int) -> None:
        super().__init__()
        self.weight = weight
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale_zero", scale_zero, persistent=False)
        self.max_rows = max_rows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] <= self.max_rows and hidden.dtype == self.scale_zero.dtype:
            return int4_mm(torch.cat([hidden, hidden], dim=1), self.packed, self.scale_zero)
        return F.linear(hidden, self.weight)


def _sources(module_name: str) -> list[str]:
    """HF weight names whose rows make up a (possibly fused) linear's weight, in row order."""
    name = f"{module_name}.weight"
    parts = sorted((idx, name.replace(fused, frag)) for frag, (fused, idx) in _STACKED.items() if fused in name)
    return [n for _, n in parts] or [name]


@dataclass
class SwapPlan:
    """Linears whose every source weight is Q4_1 and whose shape matches: (module name, packed, scale_zero)."""

    modules: list[tuple[str, torch.Tensor, torch.Tensor]]

    @property
    def empty(self) -> bool:
        return not self.modules


def plan_swap(model: nn.Module, gguf: GGUFFile, dtype: torch.dtype) -> SwapPlan:
    """Pack the Q4_1 weights of the model's plain ``nn.Linear`` modules (others, e.g. tensor-parallel
    shards, keep their dense weight)."""
    blocks = dict(gguf.q4_1_weights())
    out = []
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear:
            continue
        srcs = _sources(name)
        if not all(s in blocks for s in srcs):
            continue
        parts = [blocks[s] for s in srcs]
        if (sum(p.q.shape[0] for p in parts), parts[0].q.shape[1]) != tuple(mod.weight.shape):
            continue
        if mod.in_features % Q4_1_GROUP:
            continue
        packed, scale_zero = pack_q4_1(parts, dtype)
        out.append((name, packed, scale_zero))
    return SwapPlan(out)


def plan_head(model: nn.Module, gguf: GGUFFile, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(dense weight, packed, scale_zero) of a Q8_0 LM head (the tied embedding or lm_head), or None."""
    if not hasattr(model, "logits_head"):
        return None
    tied = getattr(model, "lm_head", None) is None
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    weight = model.get_parameter(name)
    blocks = gguf.q8_0_weight(name)
    if blocks is None or tuple(blocks.q.shape) != tuple(weight.shape) or weight.shape[1] % Q4_1_GROUP:
        return None
    return (weight, *pack_q8_0(blocks, dtype))


def apply_swap(model: nn.Module, plan: SwapPlan, max_rows: int) -> int:
    """Replace each planned linear with an :class:`Int4Linear`; returns how many were swapped."""
    for name, packed, scale_zero in plan.modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int4Linear(getattr(parent, child), packed, scale_zero, max_rows))
    return len(plan.modules)


def _time_pair(a: Callable[[], object], b: Callable[[], object], reps: int, inner: int = 3) -> tuple[float, float]:
    """Fastest of ``reps`` timings of each (seconds per call), alternating a and b so that load from other
    processes hits both alike; the minimum is the least disturbed run."""
    a(), b()
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for k, fn in enumerate((a, b)):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            best[k] = min(best[k], (time.perf_counter() - t0) / inner)
    return best[0], best[1]


@torch.inference_mode()
def calibrate(dense_mod: Callable[[torch.Tensor], torch.Tensor], packed_mod: Callable[[torch.Tensor], torch.Tensor],
              in_features: int, dtype: torch.dtype, reps: int = 9
              ) -> tuple[int, dict[int, tuple[float, float]]]:
    """Largest row count r in _CALIBRATION_ROWS such that the packed module beats the dense one at every
    count <= r (0: not even at one row), and the timings {rows: (dense s, int4 s)} it read."""
    timings: dict[int, tuple[float, float]] = {}
    best = 0
    for rows in _CALIBRATION_ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        dense, int4 = _time_pair(lambda x=x: dense_mod(x), lambda x=x: packed_mod(x), reps)
        timings[rows] = (dense, int4)
        if int4 >= dense * _MARGIN:
            break
        best = rows
    return best, timings


def install(model: nn.Module, model_spec: str | None, requested: str, device: str, dtype: torch.dtype,
            preloaded: bool = False) -> tuple[str, str]:
    """Apply ``--weight-format`` to a loaded model; returns (format in use, WEIGHT_FORMAT_REASONS key). A model
    whose FP8 linears were kept fp8 at load reports ``fp8`` whatever was requested.

    A ``preloaded`` model (handed to the engine, maybe shared by several) is left as it is and reported."""
    if any(isinstance(m, Fp8BlockLinear) for m in model.modules()):  # chosen at load (models/fp8_linear.py)
        return "fp8", "fp8_checkpoint"
    if preloaded:
        swapped = any(isinstance(m, Int4Linear) for m in model.modules())
        return ("int4" if swapped else "dequantized"), "preloaded"
    if requested == "dequantized":
        return "dequantized", "explicit"
    if torch.device(device).type != "cpu":
        return "dequantized", "not_cpu"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "dequantized", "unsupported_dtype"
    src = resolve(model_spec)
    if src.kind != "gguf" or src.path is None:
        return "dequantized", "not_gguf"
    gguf = GGUFFile(src.path)
    plan = plan_swap(model, gguf, dtype)
    if plan.empty:
        return "dequantized", "no_q4_1"
    # Calibrate on the largest swapped linear (the MLP's gate_up in Llama): it dominates a step.
    name, packed, scale_zero = max(plan.modules, key=lambda m: m[1].numel())
    dense = model.get_submodule(name)
    probe = Int4Linear(dense, packed, scale_zero, max(_CALIBRATION_ROWS))
    max_rows, timings = calibrate(lambda x: F.linear(x, dense.weight), probe, dense.in_features, dtype)
    _log_timings(name, dtype, timings)
    if requested == "auto" and max_rows == 0:
        return "dequantized", "measured_slower"
    n = apply_swap(model, plan, max(max_rows, 1))
    log.info("engine: %d linears read their Q4_1 weights packed (int4) for steps of <= %d rows; larger steps "
             "use the dense weights", n, max(max_rows, 1))
    head = plan_head(model, gguf, dtype)
    if head is not None:
        weight, packed, scale_zero = head
        probe_head = Q8_0Head(weight, packed, scale_zero, max(_CALIBRATION_ROWS))
        head_rows, timings = calibrate(lambda x: F.linear(x, weight), probe_head, weight.shape[1], dtype, reps=3)
        _log_timings("the Q8_0 LM head", dtype, timings)
        if head_rows or requested == "int4":
            model.logits_head = Q8_0Head(weight, packed, scale_zero, max(head_rows, 1))
            log.info("engine: the LM head reads its Q8_0 weight packed (two int4 halves) for <= %d rows",
                     max(head_rows, 1))
    return "int4", "explicit" if requested == "int4" else "measured_faster"


def _log_timings(what: str, dtype: torch.dtype, timings: dict[int, tuple[float, float]]) -> None:
    shown = ", ".join(f"{r} rows {d * 1e6:.0f}/{i * 1e6:.0f} us" for r, (d, i) in timings.items())
    log.info("engine: dense/int4 time of %s (%s): %s", what, dtype, shown)
