"""services/launcher.py and core lending: a refused group file turns lending off instead of failing the
start; an exported PDSERVE_CPU_SHARE_GROUP never reaches the services."""

from __future__ import annotations

import pytest

from services.launcher import LocalCluster


def test_a_refused_group_file_runs_the_engines_without_lending(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = LocalCluster(prefill=1, decode=1, quiet=True)
    assert cluster.share_group
    cpu = [["--cpu-threads", "1"], ["--cpu-threads", "1"]]
    cluster.share_group = "../refused"  # create_group refuses it (CoreShareError), as it would a missing /dev/shm
    assert cluster._join_cores(cpu) == cpu
    assert cluster.share_group == ""
    assert "core lending off" in capsys.readouterr().err
    cluster.stop()  # nothing started: removes no group


def test_the_launcher_gives_a_share_group_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CPU_SHARE_GROUP", "exported")
    for lend in (False, True):
        cluster = LocalCluster(prefill=1, decode=1, quiet=True, lend_cores=lend)
        for module in ("prefill", "decode", "router", "kvstore"):
            assert "PDSERVE_CPU_SHARE_GROUP" not in cluster._env_for(module)
    off = LocalCluster(prefill=1, decode=1, quiet=True, lend_cores=False)
    assert off._join_cores([["--cpu-threads", "1"]]) == [["--cpu-threads", "1"]]  # no group flag either
