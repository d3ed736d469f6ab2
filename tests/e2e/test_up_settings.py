"""pdserve up's settings without starting a cluster: the serving settings are the services' own
declarations, flags given to up are handed on, a config file reaches every service, --help is grouped,
and --metrics-port-base fixes every metrics port."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import ConfigError, ContextConfig, add_dataclass_args, env_name, from_args
from services.common.config_file import ConfigFile, add_config_arg
from services.common.lease import LeaseConfig
from services.common.logging import LoggingConfig
from services.engine.model_settings import DtypeConfig
from services.launcher import LocalCluster
from services.router.config import RouterConfig
from services.text.model.settings import ModelConfig
from services.up import UpConfig, _forwarded, check_file


def _parse(argv: list[str]) -> tuple[argparse.Namespace, UpConfig]:
    p = argparse.ArgumentParser()
    add_config_arg(p)
    add_dataclass_args(p, UpConfig)
    ns = p.parse_args(argv)
    return ns, from_args(UpConfig, ns, environ={})


def test_serving_settings_are_the_services_declarations() -> None:
    up = {f.name: f for f in dataclasses.fields(UpConfig)}
    for cls, name in ((RouterConfig, "policy"), (RouterConfig, "served_model_name"), (LeaseConfig, "lease_ms"),
                      (RouterConfig, "access_log"), (ContextConfig, "max_model_len"), (LoggingConfig, "log_level"),
                      (ModelConfig, "model"), (DtypeConfig, "dtype"), (RouterConfig, "http_port"),
                      (RouterConfig, "api_key"), (RouterConfig, "api_key_file")):
        theirs = next(f for f in dataclasses.fields(cls) if f.name == name)
        assert up[name].default == theirs.default and up[name].metadata["help"] == theirs.metadata["help"]
        assert up[name].metadata["choices"] == theirs.metadata["choices"]
        assert env_name(up[name]) == env_name(theirs)


def test_flags_given_to_up_are_handed_on(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("log_level: INFO\n")
    ns, cfg = _parse(["--policy", "round_robin", "--max-model-len", "2048", "--no-access-log", "--log-level",
                      "debug", "--served-model-name", "smol", "--lease-ms", "20000", "--config", str(cfg_file)])
    out = _forwarded(ns, cfg, ns.config)
    conf = ["--config", str(cfg_file.resolve())]
    assert out["router"] == ["--served-model-name", "smol", "--policy", "round_robin", "--lease-ms", "20000",
                             "--no-access-log", "--max-model-len", "2048", "--log-level", "DEBUG", *conf]
    assert out["prefill"] == ["--max-model-len", "2048", "--log-level", "DEBUG", *conf]
    assert out["decode"] == ["--lease-ms", "20000", "--max-model-len", "2048", "--log-level", "DEBUG", *conf]
    assert out["kvstore"] == ["--log-level", "DEBUG", *conf]
    ns, cfg = _parse([])
    assert _forwarded(ns, cfg, None) == {}  # defaults stay with the services (their env, their file)


def test_config_file_keys_are_checked_against_every_service(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("max_model_len: 1024\nmax_queued: 8\nrouter:\n  policy: least_loaded\ndecode:\n  max_pending: 9\n"
                    "up:\n  prefill: 2\nkvstore:\n  memory_bytes: 1048576\n")
    check_file(ConfigFile.load(str(good)))
    for text, words in (("max_modle_len: 5\n", "max_modle_len: no such setting (did you mean max_model_len?)"),
                        ("prefill:\n  max_pending: 3\n", "prefill.max_pending: no such setting")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
            check_file(ConfigFile.load(str(bad)))
    up = ConfigFile.load(str(good))
    assert from_args(UpConfig, {}, environ={}, file=up, section="up").prefill == 2


def test_up_help_is_grouped() -> None:
    out = subprocess.run([sys.executable, "-m", "services.cli", "up", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    headings = [ln for ln in out.stdout.splitlines() if ln and not ln.startswith(" ") and ln.endswith(":")]
    assert [h.split(" (")[0].rstrip(":") for h in headings] == [
        "options", "cluster", "serving", "network and ports", "security", "supervision"]
    for flag in ("--config FILE", "--served-model-name", "--max-model-len", "--policy", "--lease-ms", "--log-level",
                 "--api-key", "--metrics-port-base"):
        assert flag in out.stdout


def test_metrics_port_base_fixes_every_metrics_port() -> None:
    c = LocalCluster(prefill=2, decode=2, metrics_port_base=9400)
    assert [c.metrics_port(n) for n in ("router", "kvstore", "mooncake-master", "prefill-0", "prefill-1",
                                        "decode-0", "decode-1")] == [9400, 9401, 9402, 9403, 9404, 9405, 9406]
    assert c._port("decode-1", "metrics") == 9406 and c._picked("grpc", "metrics") == ("grpc",)
    colocated = LocalCluster(prefill=0, decode=2, colocated=True, metrics_port_base=9400)
    assert colocated.metrics_port("worker-1") == 9404
    assert LocalCluster().metrics_port("router") == 0  # no base: picked free at start


def test_readme_config_example_is_valid(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("```yaml\n# pdserve.yaml") + len("```yaml\n")
    example = tmp_path / "pdserve.yaml"
    example.write_text(readme[start:readme.index("```", start)])
    file = ConfigFile.load(str(example))
    check_file(file)
    cfg = from_args(UpConfig, {}, environ={}, file=file, section="up")
    assert (cfg.prefill, cfg.decode, cfg.max_model_len) == (2, 2, 4096)
    router = from_args(RouterConfig, {"decode": "127.0.0.1:1"}, environ={}, file=file, section="router")
    assert (router.served_model_name, router.policy, router.max_model_len) == ("smol", "least_loaded", 4096)
