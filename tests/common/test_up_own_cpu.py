"""pdserve up gives each engine its share of the host's cores (--cpu-threads, lending) unless the user set the
engine's CPU settings (cpu_threads / cpu_affinity in a config file or a PDSERVE_* variable): those stand, for the
modules they were given to, instead of being overridden by up's own flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config_file import ConfigFile
from services.launcher import LocalCluster
from services.up import own_cpu_modules


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_CPU_THREADS", raising=False)
    monkeypatch.delenv("PDSERVE_CPU_AFFINITY", raising=False)


def _file(tmp_path: Path, text: str) -> ConfigFile:
    path = tmp_path / "pdserve.yaml"
    path.write_text(text)
    return ConfigFile.load(str(path))


def test_the_modules_whose_cpu_settings_the_user_gave(tmp_path: Path) -> None:
    assert own_cpu_modules(None, {}) == frozenset()
    assert own_cpu_modules(_file(tmp_path, "decode:\n  max_num_seqs: 8\n"), {}) == frozenset()
    assert own_cpu_modules(_file(tmp_path, "decode:\n  cpu_threads: 1\n"), {}) == {"decode"}
    assert own_cpu_modules(_file(tmp_path, "prefill:\n  cpu_affinity: '0'\n"), {}) == {"prefill"}
    assert own_cpu_modules(_file(tmp_path, "cpu_threads: 1\n"), {}) == {"prefill", "decode"}
    assert own_cpu_modules(None, {"PDSERVE_CPU_THREADS": "1"}) == {"prefill", "decode"}


def test_engines_of_those_modules_get_no_share_or_lending_flags() -> None:
    both = LocalCluster(prefill=1, decode=1, lend_cores=False)
    assert all(flags[0] == "--cpu-threads" for flags in both.engine_cpu_flags())
    mine = LocalCluster(prefill=1, decode=2, lend_cores=False, own_cpu=frozenset({"decode"}))
    prefill, *decodes = mine.engine_cpu_flags()
    assert prefill[0] == "--cpu-threads" and decodes == [[], []]
    colocated = LocalCluster(decode=1, colocated=True, lend_cores=False, own_cpu=frozenset({"decode"}))
    assert colocated.engine_cpu_flags() == [[]]
