"""Every ``pdserve bench KIND`` has its own help: usage names ``pdserve bench KIND`` and the text points
at the command, not at a script path or a module name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.cli import BENCHES


@pytest.mark.parametrize("kind", sorted(BENCHES))
def test_each_benchmark_has_its_own_help(kind: str) -> None:
    out = subprocess.run([sys.executable, "-m", "services.cli", "bench", kind, "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: pdserve bench {kind} "), out.stdout[:200]
    for stale in ("python benchmarks/", "python -m benchmarks.", f"usage: {kind}_bench", "usage: pdserve ["):
        assert stale not in out.stdout, (stale, out.stdout[:400])


def test_bench_without_a_kind_lists_them_all() -> None:
    out = subprocess.run([sys.executable, "-m", "services.cli", "bench", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert all(f"  {kind} " in out.stdout for kind in BENCHES)
