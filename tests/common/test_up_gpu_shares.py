"""pdserve up on one GPU: engines that share it get --gpu-memory-utilization shares (services/up.py), so the first
engine to start does not take the whole device; a user's own setting, a lone engine and CPU get none."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import parse_config
from services.common.config_file import ConfigFile
from services.up import UpConfig, _add_gpu_memory_shares, gpu_memory_shares, one_gpu_pd_note


def _shares(argv: list[str], file: ConfigFile | None = None) -> dict[str, float]:
    return gpu_memory_shares(parse_config(UpConfig, argv), file)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_GPU_MEMORY_UTILIZATION", raising=False)


def test_prefill_and_decode_on_one_gpu_split_it() -> None:
    assert _shares(["--device", "cuda"]) == {"prefill": 0.3, "decode": 0.6}
    assert _shares(["--device", "cuda:1", "--decode", "2"]) == {"prefill": 0.3, "decode": 0.3}
    assert _shares(["--device", "cuda", "--colocated", "--decode", "2"]) == {"decode": 0.45}


def test_the_flags_reach_each_role_and_stay_under_the_engine_default() -> None:
    extra: dict[str, list[str]] = {"decode": ["--lease-ms", "5"]}
    _add_gpu_memory_shares(extra, parse_config(UpConfig, ["--device", "cuda", "--prefill", "2"]), None)
    assert extra["prefill"] == ["--gpu-memory-utilization", "0.15"]
    assert extra["decode"] == ["--lease-ms", "5", "--gpu-memory-utilization", "0.6"]
    assert 0.15 * 2 + 0.6 <= 0.9


def test_no_shares_on_cpu_for_one_engine_or_where_the_user_set_one(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert _shares([]) == {}
    assert _shares(["--device", "cuda", "--colocated"]) == {}
    path = tmp_path / "pdserve.yaml"
    path.write_text("decode:\n  gpu_memory_utilization: 0.5\n")
    assert _shares(["--device", "cuda"], ConfigFile.load(str(path))) == {}
    monkeypatch.setenv("PDSERVE_GPU_MEMORY_UTILIZATION", "0.4")
    assert _shares(["--device", "cuda"]) == {}


def test_prefill_and_decode_on_one_gpu_are_told_they_take_turns() -> None:
    def note(argv: list[str]) -> str:
        return one_gpu_pd_note(parse_config(UpConfig, argv))

    assert "take turns on cuda:1" in note(["--device", "cuda:1"]) and "--colocated" in note(["--device", "cuda"])
    assert note(["--device", "cuda", "--colocated"]) == note([]) == ""
