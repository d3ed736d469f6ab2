"""pdserve up's --cpu-compile-decode (services/up.py): decode and colocated engines get its value (default 2:
batch sizes 1-2 compiled in the background), prefills 0; a bare engine's default stays 0 (eager)."""

from __future__ import annotations

from pathlib import Path

from services.common.config import parse_config
from services.up import UpConfig, _add_compile_flags


def _flags(argv: list[str]) -> dict[str, list[str]]:
    extra: dict[str, list[str]] = {"decode": ["--lease-ms", "5"]}
    _add_compile_flags(extra, parse_config(UpConfig, argv))
    return extra


def test_up_compiles_decode_steps_of_its_decode_engines_by_default() -> None:
    extra = _flags([])
    assert extra["decode"] == ["--lease-ms", "5", "--cpu-compile-decode", "2"]
    assert extra["prefill"] == ["--cpu-compile-decode", "0"]


def test_up_passes_an_explicit_value_on_and_a_bare_engine_stays_eager() -> None:
    assert _flags(["--cpu-compile-decode", "0"])["decode"][-2:] == ["--cpu-compile-decode", "0"]
    assert _flags(["--cpu-compile-decode", "1"])["prefill"] == ["--cpu-compile-decode", "0"]
    from services.engine.config import EngineConfig

    assert EngineConfig().cpu_compile_decode == 0


def test_a_config_files_decode_section_keeps_its_value_unless_up_is_given_one(tmp_path: Path) -> None:
    from services.common.config_file import ConfigFile

    path = tmp_path / "pdserve.yaml"
    path.write_text("decode:\n  cpu_compile_decode: 1\n")
    file = ConfigFile.load(str(path))
    extra: dict[str, list[str]] = {}
    _add_compile_flags(extra, parse_config(UpConfig, []), file)
    assert "decode" not in extra and extra["prefill"] == ["--cpu-compile-decode", "0"]  # the file's 1 stands
    extra = {}
    _add_compile_flags(extra, parse_config(UpConfig, ["--cpu-compile-decode", "0"]), file, given=True)
    assert extra["decode"] == ["--cpu-compile-decode", "0"]  # up's own flag wins over the file
    path.write_text("prefill:\n  max_pending: 3\n")
    extra = {}
    _add_compile_flags(extra, parse_config(UpConfig, []), ConfigFile.load(str(path)))
    assert extra["decode"] == ["--cpu-compile-decode", "2"]
