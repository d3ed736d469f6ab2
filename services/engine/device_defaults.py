"""Per-device batch defaults and the KV pool size of a CUDA engine: pure arithmetic, no torch.

An engine left without batch settings gets its device's row of ``BATCH_DEFAULTS``; an engine on CUDA
left without a KV size (neither ``--num-kv-blocks`` nor ``--kv-cache-bytes``) sizes its pool from the
device memory that is left after its weights, its CUDA graphs and one step's activations, capped at
``--gpu-memory-utilization`` of the device (``kv_pool_pages``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BATCH_DEFAULTS", "CPU_KV_CACHE_BYTES", "BatchDefaults", "KVSizing", "batch_defaults",
           "kv_pool_pages", "step_activation_bytes"]


@dataclass(frozen=True)
class BatchDefaults:
    max_num_seqs: int
    """Most sequences in one batch."""
    max_num_batched_tokens: int
    """Token budget of one step."""
    max_prefill_chunk: int
    """Most prompt tokens of one sequence per step."""


BATCH_DEFAULTS: dict[str, BatchDefaults] = {
    # CPU: the values every CPU test and CPU benchmark figure was measured with (unchanged).
    "cpu": BatchDefaults(max_num_seqs=64, max_num_batched_tokens=2048, max_prefill_chunk=512),
    # CUDA: the settings of a first serving run on one H200 (random Llama-3-8B shape, bf16, 1024/256 at up to
    # C256): 256 sequences fill the decode graphs' largest useful bucket, a 16K-token step holds two 8K
    # prompt chunks, an 8K chunk computes an 8K prompt in one step. benchmarks/h200_served.py measures
    # serving with them (colocated and 1P1D, C1-C512); change them here only with such figures.
    "cuda": BatchDefaults(max_num_seqs=256, max_num_batched_tokens=16384, max_prefill_chunk=8192),
}

CPU_KV_CACHE_BYTES = 1 << 30
"""KV pool of an engine given no KV size on CPU (and at tensor-parallel size > 1 on CUDA, whose ranks size
their pools independently and must agree)."""


def batch_defaults(device: str) -> BatchDefaults:
    """The row of ``device`` ("cpu", "cuda", "cuda:N")."""
    return BATCH_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]


def step_activation_bytes(tokens: int, rows: int, hidden: int, intermediate: int, q_heads: int, kv_heads: int,
                          head_dim: int, vocab: int, elem_bytes: int) -> int:
    """An upper estimate (bytes) of what one step allocates beyond weights and KV: ``tokens`` tokens through a
    layer (residual, normed input, q/k/v, attention output, gate+up, the activated product: each live at
    once in the worst case, twice for the allocator's rounding and fragmentation), plus the fp32 logits of
    ``rows`` sampled rows and the sampler's work on them (softmax, sort, noise: four more [rows, vocab])."""
    per_token = (3 * hidden + (q_heads + 2 * kv_heads) * head_dim + q_heads * head_dim + 3 * intermediate) * elem_bytes
    return 2 * tokens * per_token + 5 * rows * vocab * 4


@dataclass(frozen=True)
class KVSizing:
    pages: int
    """KV pages the pool gets."""
    pool_bytes: int
    """pages x page bytes."""
    budget_bytes: int
    """What was left for the pool before rounding down to whole pages."""
    limit: str
    """Which bound decided: "utilization" (the share of the device) or "free" (memory actually free)."""


def kv_pool_pages(free_bytes: int, total_bytes: int, utilization: float, own_bytes: int, reserve_bytes: int,
                  page_bytes: int, margin_bytes: int = 256 << 20) -> KVSizing:
    """Pages of a KV pool on one device.

    ``own_bytes``: what this process already holds there (weights); ``reserve_bytes``: what it will still
    allocate besides the pool (graphs, activations; `step_activation_bytes`). The pool may take
    ``utilization * total - own - reserve`` (this engine's share of the device, as several engines on one GPU
    each take their own fraction) but never more than ``free - reserve - margin`` (memory other processes
    hold is not there to take; the margin covers the CUDA context's later growth). ValueError when that is
    less than two pages, naming what to change.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    share = int(utilization * total_bytes) - own_bytes - reserve_bytes
    actual = free_bytes - reserve_bytes - margin_bytes
    budget, limit = (share, "utilization") if share <= actual else (actual, "free")
    pages = max(budget, 0) // page_bytes
    if pages < 2:
        raise ValueError(
            f"no room for a KV pool: {utilization:g} of {total_bytes / 2**30:.1f} GiB minus {own_bytes / 2**30:.2f} GiB "
            f"of weights and {reserve_bytes / 2**30:.2f} GiB for graphs and activations leaves "
            f"{share / 2**30:.2f} GiB, {free_bytes / 2**30:.2f} GiB is free; raise --gpu-memory-utilization, "
            "lower --max-num-batched-tokens, or give --kv-cache-bytes")
    return KVSizing(pages=int(pages), pool_bytes=int(pages * page_bytes), budget_bytes=int(budget), limit=limit)
