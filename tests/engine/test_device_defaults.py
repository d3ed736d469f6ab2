"""Device defaults: the per-device batch table, the KV pool arithmetic of a CUDA engine, the host-sized CPU
pool, `pdserve up --device`."""

from __future__ import annotations

import argparse

import pytest

from services.common.config import add_dataclass_args, from_args
from services.engine import config as engine_config
from services.engine.config import EngineConfig, EngineConfigError
from services.engine.device_defaults import (
    BATCH_DEFAULTS,
    HostMemory,
    cpu_kv_pool_bytes,
    host_memory,
    kv_pool_pages,
    step_activation_bytes,
)
from services.up import UpConfig, _forwarded

GiB = 1 << 30


def test_cpu_defaults_are_unchanged(monkeypatch) -> None:
    monkeypatch.setattr(engine_config, "host_memory", lambda: HostMemory(20 * GiB, "MemAvailable"))
    cfg = EngineConfig()
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_prefill_chunk) == (64, 2048, 512)
    assert not cfg.sizes_kv_from_device and cfg.resolve_num_blocks(1 << 20) == 1024  # 1 GiB of 1 MiB pages


def test_cpu_pool_is_a_quarter_of_what_the_host_has_available_at_most_1_gib(monkeypatch) -> None:
    assert cpu_kv_pool_bytes(20 * GiB) == GiB
    assert cpu_kv_pool_bytes(2 * GiB) == GiB // 2
    assert cpu_kv_pool_bytes(512 << 20) == 128 << 20
    with pytest.raises(ValueError, match="give --kv-cache-bytes"):
        cpu_kv_pool_bytes(64 << 20)  # 16 MiB: under the floor
    monkeypatch.setattr(engine_config, "host_memory", lambda: HostMemory(1 * GiB, "cgroup memory.max"))
    assert EngineConfig().resolve_num_blocks(1 << 20) == 256
    assert EngineConfig(kv_cache_bytes=3 * GiB).resolve_num_blocks(GiB) == 3   # a size given wins
    assert EngineConfig(tensor_parallel_size=2).resolve_num_blocks(1 << 20) == 1024  # ranks agree: fixed
    monkeypatch.setattr(engine_config, "host_memory", lambda: HostMemory(40 << 20, "MemAvailable"))
    with pytest.raises(EngineConfigError, match="--kv-cache-bytes / PDSERVE_KV_CACHE_BYTES: only 40 MiB"):
        EngineConfig().resolve_num_blocks(1 << 20)
    monkeypatch.setattr(engine_config, "host_memory", lambda: None)   # no /proc/meminfo: the cap
    assert EngineConfig().resolve_num_blocks(1 << 20) == 1024


def _proc(tmp_path, available_kib: int, cgroup: str) -> tuple:
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {available_kib} kB\n")
    (tmp_path / "self_cgroup").write_text(cgroup)
    return tmp_path / "meminfo", tmp_path / "cg"


def test_host_memory_is_the_least_of_memavailable_and_the_cgroup_room(tmp_path) -> None:
    cg = tmp_path / "self_cgroup"
    meminfo, root = _proc(tmp_path, 8 * (GiB >> 10), "0::/kubepods/pod1\n")
    (root / "kubepods/pod1").mkdir(parents=True)
    (root / "kubepods/pod1/memory.max").write_text(f"{4 * GiB}\n")
    (root / "kubepods/pod1/memory.current").write_text(f"{GiB}\n")
    assert host_memory(meminfo, root, cg) == HostMemory(3 * GiB, "cgroup memory.max")
    (root / "kubepods/pod1/memory.max").write_text("max\n")   # v2 without a limit
    assert host_memory(meminfo, root, cg) == HostMemory(8 * GiB, "MemAvailable")
    meminfo, root = _proc(tmp_path, 8 * (GiB >> 10), "5:cpu:/x\n4:memory:/docker/abc\n0::/\n")
    (root / "memory/docker/abc").mkdir(parents=True)
    (root / "memory/docker/abc/memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (root / "memory/docker/abc/memory.usage_in_bytes").write_text(f"{GiB // 2}\n")
    assert host_memory(meminfo, root, cg) == HostMemory(3 * GiB // 2, "cgroup memory.limit_in_bytes")
    (root / "memory/docker/abc/memory.limit_in_bytes").write_text("9223372036854771712\n")   # v1: no limit
    assert host_memory(meminfo, root, cg) == HostMemory(8 * GiB, "MemAvailable")
    assert host_memory(tmp_path / "absent", root, cg) is None


def test_cuda_defaults_come_from_the_table_and_settings_win() -> None:
    cfg = EngineConfig(device="cuda:1")
    row = BATCH_DEFAULTS["cuda"]
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_prefill_chunk) == (
        row.max_num_seqs, row.max_num_batched_tokens, row.max_prefill_chunk) == (256, 16384, 8192)
    assert cfg.sizes_kv_from_device
    given = EngineConfig(device="cuda", max_num_seqs=32, kv_cache_bytes=2 * GiB)
    assert given.max_num_seqs == 32 and given.max_num_batched_tokens == 16384 and not given.sizes_kv_from_device
    assert given.resolve_num_blocks(GiB) == 2
    assert not EngineConfig(device="cuda", num_kv_blocks=10).sizes_kv_from_device
    assert not EngineConfig(device="cuda", tensor_parallel_size=2).sizes_kv_from_device  # ranks must agree: 1 GiB
    with pytest.raises(EngineConfigError, match="--gpu-memory-utilization"):
        EngineConfig(device="cuda", gpu_memory_utilization=1.5)


def test_kv_pool_takes_the_share_left_after_weights_and_activations() -> None:
    # 140 GiB device, 139 free at start, 15 GiB of weights loaded (124 free now), 3 GiB reserved, 2 MiB pages.
    s = kv_pool_pages(free_bytes=124 * GiB, total_bytes=140 * GiB, utilization=0.9, own_bytes=15 * GiB,
                      reserve_bytes=3 * GiB, page_bytes=2 << 20)
    assert s.limit == "utilization" and s.budget_bytes == int(0.9 * 140 * GiB) - 18 * GiB
    assert s.pages == s.budget_bytes // (2 << 20) == 108 * 512 and s.pool_bytes == s.pages * (2 << 20)
    # Another engine holds 100 GiB of the device: what is free bounds the pool, not the share.
    s = kv_pool_pages(free_bytes=24 * GiB, total_bytes=140 * GiB, utilization=0.9, own_bytes=15 * GiB,
                      reserve_bytes=3 * GiB, page_bytes=2 << 20, margin_bytes=GiB)
    assert s.limit == "free" and s.pages == 20 * GiB // (2 << 20)
    # Two engines on one GPU at 0.3 and 0.6: each gets its own share whichever started first.
    first = kv_pool_pages(130 * GiB, 140 * GiB, 0.3, 5 * GiB, GiB, 1 << 20)
    second = kv_pool_pages(130 * GiB - 5 * GiB - first.pool_bytes - GiB, 140 * GiB, 0.6, 5 * GiB, GiB, 1 << 20)
    assert first.limit == second.limit == "utilization"
    assert second.pool_bytes == (int(0.6 * 140 * GiB) - 6 * GiB) // (1 << 20) * (1 << 20)


def test_kv_pool_too_small_names_what_to_change() -> None:
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        kv_pool_pages(free_bytes=20 * GiB, total_bytes=24 * GiB, utilization=0.5, own_bytes=12 * GiB,
                      reserve_bytes=0, page_bytes=1 << 20)
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        kv_pool_pages(GiB, GiB, 0.0, 0, 0, 1)


def test_step_activation_estimate() -> None:
    # Llama-3-8B shape, bf16, 16384 tokens and 256 sampled rows.
    b = step_activation_bytes(16384, 256, 4096, 14336, 32, 8, 128, 128256, 2)
    per_token = (3 * 4096 + 48 * 128 + 32 * 128 + 3 * 14336) * 2
    assert b == 2 * 16384 * per_token + 5 * 256 * 128256 * 4
    assert 4 * GiB < b < 6 * GiB  # a few GiB next to a ~120 GiB pool


def test_up_device_reaches_every_engine() -> None:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, UpConfig)
    ns = p.parse_args(["--device", "cuda"])
    out = _forwarded(ns, from_args(UpConfig, ns, environ={}), None)
    assert out == {"prefill": ["--device", "cuda"], "decode": ["--device", "cuda"]}  # decode: colocated too
