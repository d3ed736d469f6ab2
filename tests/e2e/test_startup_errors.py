"""Start-up failures a new user meets first: each service, given a bad model path or a busy port, exits
non-zero within seconds with one actionable line (which setting, what to do) and no traceback, which
only ``--log-level DEBUG`` adds. Also: a config file typo stops ``pdserve up`` before anything starts."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.process_util import launched_by

LIMIT_S = 60.0
"""A failure must be reported within this (it is checked before the model loads; imports take most of
it on a busy CI host)."""
MODEL_SERVICES = ("router", "prefill", "decode")


@pytest.fixture()
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _run(module: str, *args: str) -> tuple[int, str, float]:
    extra = ["--decode", "127.0.0.1:9"] if module == "router" else []
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", f"services.{module}", "--metrics-port", "-1", *extra, *args],
                         capture_output=True, text=True, timeout=LIMIT_S * 3)
    return out.returncode, out.stderr, time.monotonic() - t0


def _error_line(module: str, stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith(f"pdserve {module}: error:")]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("module", MODEL_SERVICES)
def test_bad_model_path_is_one_line_within_seconds(module: str, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    rc, err, took = _run(module, "--port", "0", "--model", str(missing))
    line = _error_line(module, err)
    print(f"\n{module}: exit {rc} after {took:.1f}s: {line}")
    assert rc == 1 and took < LIMIT_S
    assert "--model / PDSERVE_MODEL" in line and str(missing) in line and "valid specs" in line


@pytest.mark.parametrize("module", [*MODEL_SERVICES, "kvstore"])
def test_busy_grpc_port_is_one_line_within_seconds(module: str, busy_port: int) -> None:
    rc, err, took = _run(module, "--port", str(busy_port))
    line = _error_line(module, err)
    print(f"\n{module}: exit {rc} after {took:.1f}s: {line}")
    assert rc == 1 and took < LIMIT_S
    assert f"127.0.0.1:{busy_port}" in line and "--port / PDSERVE_PORT" in line and "in use" in line


def test_busy_router_http_port_is_caught_before_the_tokenizer_loads(busy_port: int) -> None:
    rc, err, took = _run("router", "--port", "0", "--http-port", str(busy_port))
    line = _error_line("router", err)
    assert rc == 1 and took < LIMIT_S
    assert "--http-port / PDSERVE_HTTP_PORT" in line and "in use" in line
    assert "reading the tokenizer" not in err  # checked before the slow part


def test_debug_log_level_adds_the_traceback(busy_port: int) -> None:
    rc, err, _ = _run("router", "--port", str(busy_port), "--log-level", "debug")
    assert rc == 1 and "Traceback" in err and f"pdserve router: error: cannot bind 127.0.0.1:{busy_port}" in err


def test_up_refuses_a_config_file_typo_before_starting(tmp_path: Path) -> None:
    cfg = tmp_path / "pdserve.yaml"
    cfg.write_text("router:\n  polcy: round_robin\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "services.cli", "up", "--config", str(cfg)], capture_output=True,
                         text=True, timeout=LIMIT_S * 3)
    assert out.returncode == 2 and time.monotonic() - t0 < LIMIT_S
    assert out.stderr.strip().splitlines() == [
        f"pdserve up: config file {cfg}: router.polcy: no such setting (did you mean policy?)"]


def test_missing_gpu_is_one_line_before_the_model_loads() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    rc, err, took = _run("decode", "--port", "0", "--device", "cuda")
    line = _error_line("decode", err)
    assert rc == 1 and took < LIMIT_S
    assert "--device / PDSERVE_DEVICE: cuda asked for" in line and "--device cpu" in line
    assert "loading weights" not in err


def test_a_missing_package_is_named(tmp_path: Path) -> None:
    """The import of an optional dependency fails at start: the line names the package to install."""
    from services.common.server import one_line

    try:
        import pdserve_no_such_package  # type: ignore[import-not-found]  # noqa: F401
    except ModuleNotFoundError as e:
        line = one_line(e)
    assert "pdserve_no_such_package" in line and "pip install pdserve-no-such-package" in line


def test_a_missing_tracing_exporter_is_one_line() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
        pytest.skip("the OTLP exporter is installed here")
    except ImportError:
        pass
    rc, err, _ = _run("router", "--port", "0", "--tracing", "otlp")
    assert rc == 2 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("pdserve router: error:")] == [
        "pdserve router: error: tracing exporter 'otlp' needs opentelemetry-exporter-otlp-proto-grpc: "
        "pip install 'pdserve[otlp]'"]


def _up(*args: str) -> tuple[int, str, int]:
    """``pdserve up ARGS`` to its end: (exit status, stderr, pid)."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    out, err = proc.communicate(timeout=LIMIT_S * 3)
    assert "starting" not in out + err, out + err  # refused before anything started
    return proc.returncode, err, proc.pid


def _up_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_up_busy_router_port_is_one_line_before_anything_starts(busy_port: int) -> None:
    rc, err, pid = _up("--http-port", str(busy_port), "--grpc-port", "0")
    line = _up_error(err)
    assert rc == 2 and line.startswith("pdserve up: error: --http-port / PDSERVE_HTTP_PORT: cannot bind ")
    assert f"127.0.0.1:{busy_port}" in line and "in use" in line
    assert launched_by(pid) == []


def test_up_busy_metrics_port_names_the_base_flag(busy_port: int) -> None:
    # Under --metrics-port-base B the first prefill's metrics port is B+3.
    rc, err, pid = _up("--http-port", "0", "--grpc-port", "0", "--metrics-port-base", str(busy_port - 3))
    line = _up_error(err)
    assert rc == 2 and "--metrics-port-base / PDSERVE_UP_METRICS_PORT_BASE: cannot bind" in line
    assert f":{busy_port}:" in line and launched_by(pid) == []


def test_up_missing_model_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    rc, err, pid = _up("--http-port", "0", "--grpc-port", "0", "--model", str(missing))
    line = _up_error(err)
    assert rc == 2 and line.startswith("pdserve up: error: --model / PDSERVE_MODEL: ")
    assert str(missing) in line and "valid specs" in line
    assert launched_by(pid) == []


def test_up_reports_each_problem_once(busy_port: int, tmp_path: Path) -> None:
    rc, err, pid = _up("--http-port", str(busy_port), "--grpc-port", "0", "--model", str(tmp_path / "none"))
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 2, err
    assert "--http-port" in lines[0] and "--model" in lines[1] and launched_by(pid) == []


def test_up_refuses_a_flag_prefix() -> None:
    rc, err, pid = _up("--prefil", "2")
    assert rc == 2 and _up_error(err) == ("pdserve up: error: unrecognized argument --prefil (did you mean "
                                          "--prefill?); --help lists the flags")
    assert launched_by(pid) == []


def test_up_unknown_flag_is_one_line_with_the_closest_flag() -> None:
    rc, err, pid = _up("--prefill", "1", "--max-restart=3")
    assert rc == 2 and _up_error(err) == ("pdserve up: error: unrecognized argument --max-restart (did you "
                                          "mean --max-restarts?); --help lists the flags")
    assert launched_by(pid) == []


@pytest.mark.parametrize("command", ["router", "prefill", "kvstore", "certs", "generate", "trace", "health",
                                     "bench kvstore"])
def test_every_command_refuses_a_flag_prefix_in_one_line(command: str) -> None:
    # --hel is a prefix of --help: argparse's default would print the help and exit 0. Commands with
    # required flags name those first.
    out = subprocess.run([sys.executable, "-m", "services.cli", *command.split(), "--hel"], capture_output=True,
                         text=True, timeout=LIMIT_S * 3)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and out.stdout == "" and len(lines) == 1, out.stdout + out.stderr
    assert lines[0] in (f"pdserve {command}: error: unrecognized argument --hel (did you mean --help?); "
                        "--help lists the flags",) or (
        lines[0].startswith(f"pdserve {command}: error: the following arguments are required: --"))


def test_generate_unsupported_model_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--prompt", "hi", "--model",
                          "random:no-such-shape"], capture_output=True, text=True, timeout=LIMIT_S * 3)
    errors = [ln for ln in out.stderr.splitlines() if "error" in ln.lower()]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert errors == [ln for ln in errors if ln.startswith("pdserve generate: error: unknown random model "
                                                          "'random:no-such-shape'; valid specs: ")] and errors


def test_generate_debug_log_level_adds_the_traceback() -> None:
    out = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--prompt", "hi", "--model",
                          "random:no-such-shape", "--log-level", "debug"], capture_output=True, text=True,
                         timeout=LIMIT_S * 3)
    assert out.returncode == 1 and "Traceback" in out.stderr and "ModelLoadError" in out.stderr
    assert out.stderr.rstrip().splitlines()[-1].startswith("pdserve generate: error: unknown random model")
