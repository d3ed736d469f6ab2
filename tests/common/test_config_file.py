"""YAML config files (--config / PDSERVE_CONFIG): precedence flag > env > file > default, sections,
typed values, and one-line errors that name the file and key."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.config import ConfigError, add_dataclass_args, from_args, opt
from services.common.config_file import ConfigFile, add_config_arg, config_file, parse_settings


@dataclass
class Svc:
    port: int = opt(100, "Port.")
    policy: str = opt("a", "Policy.", choices=("a", "b", "c"))
    ratio: float = opt(0.5, "Ratio.")
    verbose: bool = opt(False, "Verbose.")
    model: str | None = opt(None, "Model.")
    hosts: tuple[str, ...] = opt(("x",), "Hosts.")


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pdserve.yaml"
    path.write_text(text)
    return str(path)


def _build(argv: list[str], env: dict[str, str], file: ConfigFile | None, section: str = "router") -> Svc:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, Svc)
    return from_args(Svc, p.parse_args(argv), environ=env, file=file, section=section)


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    f = ConfigFile.load(_file(tmp_path, "port: 1\npolicy: b\nratio: 2\nrouter:\n  port: 2\n"))
    assert _build([], {}, None).port == 100                                   # default
    assert _build([], {}, f).port == 2                                        # section beats top level
    assert _build([], {}, f, section="decode").port == 1                      # top level
    assert _build([], {"PDSERVE_PORT": "3"}, f).port == 3                     # env beats file
    assert _build(["--port", "4"], {"PDSERVE_PORT": "3"}, f).port == 4        # flag beats env
    cfg = _build([], {}, f)
    assert cfg.policy == "b" and cfg.ratio == 2.0 and isinstance(cfg.ratio, float)


def test_typed_values_lists_nulls_and_flag_syntax(tmp_path: Path) -> None:
    f = ConfigFile.load(_file(tmp_path, "verbose: yes\nmodel: null\nhosts: [a, b]\nrouter:\n  verbose: 'off'\n"
                                       "  hosts: c,d\n  max-model-len: 5\n"))
    cfg = _build([], {}, f, section="decode")
    assert cfg.verbose is True and cfg.model is None and cfg.hosts == ("a", "b")
    cfg = _build([], {}, f)
    assert cfg.verbose is False and cfg.hosts == ("c", "d")  # strings use the flag syntax
    assert f.values("router")["max_model_len"] == 5  # dashes and underscores name the same setting


@pytest.mark.parametrize(("text", "words"), [
    ("port: eighty\n", ["--port / PDSERVE_PORT", "pdserve.yaml: port", "integer"]),
    ("router:\n  port: 1.5\n", ["--port", "router.port", "int"]),
    ("policy: z\n", ["--policy", "one of a, b, c"]),
    ("verbose: 3\n", ["--verbose", "bool"]),
])
def test_bad_values_name_flag_env_file_and_key(tmp_path: Path, text: str, words: list[str]) -> None:
    f = ConfigFile.load(_file(tmp_path, text))
    with pytest.raises(ConfigError) as e:
        _build([], {}, f)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("text", "words"), [
    ("- a\n- b\n", ["top level must be a mapping"]),
    ("port: [1\n", ["not valid YAML", "line"]),
    ("router: 5\n", ["section router must be a mapping"]),
    ("routr:\n  port: 1\n", ["routr is a mapping but not a section"]),
    ("!!python/object/apply:os.system ['true']\n", ["not valid YAML"]),  # safe_load: no code
])
def test_malformed_files_are_one_line_errors(tmp_path: Path, text: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        ConfigFile.load(_file(tmp_path, text))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_missing_file_and_unknown_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        ConfigFile.load(str(tmp_path / "nope.yaml"))
    f = ConfigFile.load(_file(tmp_path, "polcy: b\nrouter:\n  polcy: b\n"))
    with pytest.raises(ConfigError, match=r"router\.polcy: no such setting \(did you mean policy\?\)"):
        f.check("router", [Svc])
    f.check("decode", [Svc])  # the top level may hold other services' settings
    with pytest.raises(ConfigError, match="polcy"):
        f.check("decode", [Svc], shared=True)


def test_config_flag_env_and_parse_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, "port: 7\nrouter:\n  policy: c\n")
    p = argparse.ArgumentParser()
    add_config_arg(p)
    assert config_file(p.parse_args([]), environ={}) is None
    assert config_file(p.parse_args([]), environ={"PDSERVE_CONFIG": path}).shared == {"port": 7}
    assert config_file(p.parse_args(["--config", path]), environ={}).sections == {"router": {"policy": "c"}}
    monkeypatch.delenv("PDSERVE_PORT", raising=False)
    monkeypatch.delenv("PDSERVE_POLICY", raising=False)
    cfg, = parse_settings([Svc], ["--config", path], prog="t", section="router")
    assert (cfg.port, cfg.policy) == (7, "c")
    bad = _file(tmp_path, "router:\n  prot: 1\n")
    with pytest.raises(ConfigError, match="did you mean port"):
        parse_settings([Svc], ["--config", bad], prog="t", section="router")
