"""`pdserve bench spec` runs end to end at a tiny shape and labels what it measured."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import spec_bench


def test_tiny_run_reports_every_mode(tmp_path: Path, capsys) -> None:
    out = tmp_path / "spec.json"
    assert spec_bench.main(["--model", "random:tiny-llama", "--draft", "layers:1", "--dtype", "float32",
                            "--batch", "2", "--prompt-len", "8", "--max-tokens", "12", "--spec-tokens", "3",
                            "--synthetic-acceptance", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    modes = {m["mode"]: m for m in r["modes"]}
    assert list(modes) == ["plain", "real", "synthetic"]
    assert all(m["decode_tokens"] == 2 * 11 for m in modes.values())  # every token after the first
    assert modes["plain"]["mean_acceptance_length"] is None
    assert 1.0 <= modes["real"]["mean_acceptance_length"] <= 4.0
    assert 2.5 <= modes["synthetic"]["mean_acceptance_length"] <= 3.0  # 2 accepted + 1, fewer near the end
    printed = capsys.readouterr().out
    assert "SYNTHETIC acceptance" in printed and r["cpu_model"] in printed
