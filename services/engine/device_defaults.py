"""Per-device batch defaults and the default KV pool size: arithmetic and /proc reads, no torch.

An engine left without batch settings gets its device's row of ``BATCH_DEFAULTS``. An engine left without
a KV size (neither ``--num-kv-blocks`` nor ``--kv-cache-bytes``) sizes its pool: on CUDA from the device
memory that is left after its weights, its CUDA graphs and one step's activations, capped at
``--gpu-memory-utilization`` of the device (``kv_pool_pages``); on CPU from the memory the host (or the
container's cgroup) has available at start (``cpu_kv_pool_bytes``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BATCH_DEFAULTS", "CPU_KV_CACHE_BYTES", "CPU_KV_SHARE", "BatchDefaults", "HostMemory", "KVSizing",
           "batch_defaults", "cpu_kv_pool_bytes", "host_memory", "kv_pool_pages", "step_activation_bytes"]


@dataclass(frozen=True)
class BatchDefaults:
    max_num_seqs: int
    """Most sequences in one batch."""
    max_num_batched_tokens: int
    """Token budget of one step."""
    max_prefill_chunk: int
    """Most prompt tokens of one sequence per step."""
    prefill_queue: int
    """Most requests a prefill service admits and has not finished (its --max-queued)."""
    decode_pending: int
    """Most requests a decode service admits and is not yet running (its --max-pending)."""


BATCH_DEFAULTS: dict[str, BatchDefaults] = {
    # CPU: the values every CPU test and CPU benchmark figure was measured with (unchanged).
    "cpu": BatchDefaults(max_num_seqs=64, max_num_batched_tokens=2048, max_prefill_chunk=512, prefill_queue=64,
                         decode_pending=256),
    # CUDA: the settings of a first serving run on one H200 (random Llama-3-8B shape, bf16, 1024/256 at up to
    # C256): 256 sequences fill the decode graphs' largest useful bucket, a 16K-token step holds two 8K
    # prompt chunks, an 8K chunk computes an 8K prompt in one step. The queues hold a C512 burst whole (two
    # full batches): with the CPU's 64 queued prefills, 190 of 256 requests of a C256 1P1D burst got 429 on the
    # H200 though both pools had room. benchmarks/h200_served.py measures serving with them (colocated and
    # 1P1D, C1-C512); change them here only with such figures.
    "cuda": BatchDefaults(max_num_seqs=256, max_num_batched_tokens=16384, max_prefill_chunk=8192,
                          prefill_queue=1024, decode_pending=1024),
}

CPU_KV_CACHE_BYTES = 1 << 30
"""The largest KV pool an engine given no KV size takes on CPU, and the pool at tensor-parallel size > 1
(whose ranks size their pools independently and must agree, so never from memory each one reads)."""

CPU_KV_SHARE = 0.25
"""The share of the memory available at start that a CPU engine given no KV size takes for its pool: the
pool is zeroed, so it is resident from the start, and the prefill, decode and kvstore of one host (or the
pod's cgroup) must all fit beside it."""

CPU_KV_FLOOR_BYTES = 32 << 20
"""No default pool smaller than this: below it even short chats would wait on pages; a host that has not
even this free gets a clear error naming --kv-cache-bytes instead."""


@dataclass(frozen=True)
class HostMemory:
    available_bytes: int
    """Memory this process may still take: the least of the kernel's MemAvailable and the cgroup's limit less
    its current use."""
    bound: str
    """Which decided: "MemAvailable" or "cgroup memory.max" (v2) / "cgroup memory.limit_in_bytes" (v1)."""


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None   # "max" (v2) / absent: no limit


def _cgroup_left(root: Path, self_cgroup: Path) -> tuple[int, str] | None:
    """(bytes left under this process's memory cgroup limit, which file), None without a limit."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":   # cgroup v2 unified hierarchy
            d = root / rel.lstrip("/")
            limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
            if limit is not None and used is not None:
                return max(limit - used, 0), "cgroup memory.max"
        elif "memory" in controllers.split(","):
            d = root / "memory" / rel.lstrip("/")
            limit, used = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            if limit is not None and used is not None and limit < 1 << 60:   # v1's "no limit" is ~2^63
                return max(limit - used, 0), "cgroup memory.limit_in_bytes"
    return None


def host_memory(meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = Path("/sys/fs/cgroup"),
                self_cgroup: Path = Path("/proc/self/cgroup")) -> HostMemory | None:
    """What this process may still allocate, or None where /proc/meminfo cannot be read (not Linux)."""
    available = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        return None
    if available is None:
        return None
    left = _cgroup_left(cgroup_root, self_cgroup) if os.path.isdir(cgroup_root) else None
    if left is not None and left[0] < available:
        return HostMemory(left[0], left[1])
    return HostMemory(available, "MemAvailable")


def cpu_kv_pool_bytes(available_bytes: int, share: float = CPU_KV_SHARE, cap: int = CPU_KV_CACHE_BYTES,
                      floor: int = CPU_KV_FLOOR_BYTES) -> int:
    """The default KV pool of a CPU engine: ``share`` of the memory available, at most ``cap``. ValueError
    when that is under ``floor`` (the host is out of memory for a pool; give --kv-cache-bytes)."""
    size = min(int(available_bytes * share), cap)
    if size < floor:
        raise ValueError(f"only {available_bytes / 2**20:.0f} MiB of memory is available: {share:g} of it is "
                         f"{size / 2**20:.0f} MiB, under the {floor >> 20} MiB a default KV pool needs; "
                         "give --kv-cache-bytes or --num-kv-blocks")
    return size


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
