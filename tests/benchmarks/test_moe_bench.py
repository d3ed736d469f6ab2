"""`pdserve bench moe --device cpu` runs end to end on tiny shapes (Triton interpreter) and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_moe_bench_cpu_plumbing(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "moe", "--device", "cpu", "--skip-ref", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "of ceil" in proc.stdout and "engine section: needs CUDA" in proc.stdout
    res = json.loads(out.read_text())
    assert res["ceilings"]["copy_gbps"] > 0 and res["ceilings"]["matmul_tflops"] > 0
    rows = res["rows"]
    assert [(r["phase"], r["tokens"]) for r in rows] == [("decode", 1), ("decode", 5), ("prefill", 40)]
    for r in rows:
        assert r["error"] is None
        assert 1 <= r["experts_hit"] <= 6 and r["bytes_read"] > 0 and r["fraction_of_ceiling"] > 0
        assert r["max_abs_err"] < 0.05 * max(1.0, r["extra"]["ref_abs_max"])  # bf16 kernel vs reference
    assert res["goals"]["decode T=1"] == 0.6 and res["goals"]["prefill"] == 0.5
