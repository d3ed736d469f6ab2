"""EngineConfig: --dtype auto resolved for the host, --cpu-threads/--cpu-affinity, the engine info gauge."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.common import metrics as m
from services.engine import config as config_mod
from services.engine.config import EngineConfig, EngineConfigError
from services.engine.cpu.cpu_features import CpuInfo, host_cpu
from services.engine.engine import LLMEngine

AVX2_ONLY = CpuInfo(model="AMD EPYC 7B13", flags=frozenset({"avx", "avx2", "fma"}), cpus=(0, 1))
AMX = CpuInfo(model="Intel(R) Xeon(R) Platinum 8481C",
              flags=frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}), cpus=(0, 1))


PoseAs = Callable[[CpuInfo], None]
"""Makes EngineConfig see another CPU (for the rest of the test)."""


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> PoseAs:
    def pose_as(info: CpuInfo) -> None:
        monkeypatch.setattr(config_mod, "host_cpu", lambda: info)

    return pose_as


def test_default_is_auto() -> None:
    assert EngineConfig().dtype == "auto"


def test_auto_on_avx2_only_cpu_is_fp32(cpu: PoseAs) -> None:
    cpu(AVX2_ONLY)
    cfg = EngineConfig()
    assert (cfg.resolved_dtype, cfg.dtype_reason, cfg.torch_dtype) == ("float32", "cpu_no_native_bf16",
                                                                       torch.float32)


def test_auto_on_amx_cpu_is_bf16(cpu: PoseAs) -> None:
    cpu(AMX)
    cfg = EngineConfig()
    assert (cfg.resolved_dtype, cfg.dtype_reason, cfg.torch_dtype) == ("bfloat16", "cpu_amx_bf16", torch.bfloat16)


@pytest.mark.parametrize("host", [AVX2_ONLY, AMX])
def test_explicit_dtype_wins(cpu: PoseAs, host: CpuInfo) -> None:
    cpu(host)
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        cfg = EngineConfig(dtype=name)
        assert (cfg.resolved_dtype, cfg.dtype_reason, cfg.torch_dtype) == (name, "explicit", dt)


def test_auto_on_gpu_is_bf16(cpu: PoseAs) -> None:
    cpu(AVX2_ONLY)
    cfg = EngineConfig(device="cuda")  # resolving touches no GPU
    assert (cfg.resolved_dtype, cfg.dtype_reason) == ("bfloat16", "gpu")


def test_this_machine_resolves_by_its_flags() -> None:
    cfg = EngineConfig()
    native = {"amx_bf16", "avx512_bf16"} & host_cpu().flags
    assert cfg.resolved_dtype == ("bfloat16" if native else "float32")


def test_bad_values_are_refused() -> None:
    with pytest.raises(EngineConfigError, match="dtype"):
        EngineConfig(dtype="int8")
    with pytest.raises(EngineConfigError, match="--cpu-threads"):
        EngineConfig(cpu_threads=-1)
    with pytest.raises(EngineConfigError, match="--cpu-affinity"):
        EngineConfig(cpu_affinity="3-1")


def test_engine_runs_in_the_resolved_dtype(cpu: PoseAs) -> None:
    cpu(AVX2_ONLY)
    engine = LLMEngine(EngineConfig(model="random:tiny-llama", num_kv_blocks=16, cpu_threads=1))
    try:
        assert all(p.dtype == torch.float32 for p in engine.loaded.model.parameters())
        assert engine.runner.kv_cache.dtype == torch.float32
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(len(os.sched_getaffinity(0)))


def test_apply_host_pins_and_sets_threads() -> None:
    before = os.sched_getaffinity(0)
    one = min(before)
    try:
        cfg = EngineConfig(cpu_affinity=str(one))
        assert cfg.resolved_cpu_threads == 1
        cfg.apply_host()
        assert os.sched_getaffinity(0) == {one}
        assert torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(len(before))
    assert EngineConfig(cpu_threads=3).resolved_cpu_threads == 3
    assert EngineConfig().resolved_cpu_threads == len(before)


@pytest.mark.parametrize(("group", "name"), [(m.PrefillMetrics, m.PREFILL_ENGINE_INFO),
                                             (m.DecodeMetrics, m.DECODE_ENGINE_INFO)])
def test_engine_info_gauge_carries_the_resolved_dtype(cpu: PoseAs, group: type, name: str) -> None:
    cpu(AVX2_ONLY)
    registry = CollectorRegistry()
    metrics = group(registry)
    cfg = EngineConfig(cpu_threads=2)
    metrics.engine_info.labels(**cfg.info_labels()).set(1)
    labels = {"dtype": "float32", "dtype_reason": "cpu_no_native_bf16", "device": "cpu",
              "cpu_model": "AMD EPYC 7B13", "cpu_threads": "2",
              "weight_format": "pending", "weight_format_reason": "pending"}
    assert registry.get_sample_value(name, labels) == 1
    assert registry.get_sample_value(name, {**labels, "dtype": "bfloat16"}) is None
