"""``pdserve trace`` on a real 1 prefill x 1 decode cluster: both services write a Chrome trace of the
same window; a target that cannot capture is named and the exit status is non-zero."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from services import trace_capture
from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, common_pb2_grpc
from services.launcher import LocalCluster, served_model
from tests.e2e.cluster_util import post_json

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
KV = ["--kv-cache-bytes", str(64 << 20)]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(prefill=1, decode=1, kvstore=None, extra={"prefill": KV, "decode": KV}, quiet=True) as c:
        yield c


def _dead_address() -> str:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _addresses(c: LocalCluster) -> tuple[str, str]:
    return c.get("prefill-0").ready["grpc"], c.get("decode-0").ready["grpc"]


def test_trace_command_writes_both_services_traces(cluster: LocalCluster, tmp_path: Path) -> None:
    prefill, decode = _addresses(cluster)
    out = tmp_path / "traces"
    served = served_model(cluster.router["http"])
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "trace", "--after", "1", "--duration", "1",
                             "--out", str(out), "--targets", f"{prefill},{decode}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def requests_in_window() -> None:  # work for the profiler to see, on both sides of the handoff
        for i in range(4):
            post_json(cluster.router["http"], "/v1/completions",
                      {"model": served, "prompt": f"Count to {i + 5}:", "max_tokens": 8, "temperature": 0})

    t = threading.Thread(target=requests_in_window)
    t.start()
    stdout, stderr = proc.communicate(timeout=120)
    t.join(60)
    assert proc.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    lines = [line.split(" ", 2) for line in stdout.splitlines() if line.strip()]
    assert sorted(line[0] for line in lines) == ["decode", "prefill"], stdout
    by_service = {service: (instance, path) for service, instance, path in lines}
    assert by_service["prefill"][0] == prefill and by_service["decode"][0] == decode  # bound address, not :0
    for service, (_, path) in by_service.items():
        p = Path(path)
        assert p.parent == out and p.is_file() and p.stat().st_size > 0, (service, path)
        trace = json.loads(p.read_text())
        assert isinstance(trace.get("traceEvents"), list) and trace["traceEvents"], (service, path)


def test_trace_command_names_targets_that_fail(cluster: LocalCluster, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    prefill, decode = _addresses(cluster)
    dead = _dead_address()
    rc = trace_capture.main(["--after", "0.5", "--duration", "0.5", "--out", str(tmp_path),
                             "--prefill", prefill, "--decode", f"{decode},{dead}"])
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    assert f"FAILED {dead} (decode)" in err and "UNAVAILABLE" in err, err
    assert prefill not in err and f"FAILED {decode}" not in err, err
    assert sorted(line.split()[0] for line in out.splitlines()) == ["decode", "prefill"], out  # the others still did



@pytest.mark.parametrize("session", ["../../../tmp/pdserve-escape", "/etc", "a/b", "..", ""])
def test_capture_trace_takes_no_path_from_the_wire(cluster: LocalCluster, session: str) -> None:
    """Admin.CaptureTrace names a session under the service's own --trace-dir; a path is refused and
    nothing is written outside that root."""
    prefill, _ = _addresses(cluster)
    escape = Path("/tmp/pdserve-escape")

    async def call() -> grpc.aio.AioRpcError:
        async with create_channel(prefill) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await common_pb2_grpc.AdminStub(ch).CaptureTrace(
                    common_pb2.CaptureTraceRequest(duration_s=0.1, out_dir=session), timeout=10)
            return e.value

    err = asyncio.run(call())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "out_dir" in (err.details() or ""), err
    assert not escape.exists()


def test_trace_command_wrong_role_is_a_failure(cluster: LocalCluster, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    prefill, _ = _addresses(cluster)
    rc = trace_capture.main(["--after", "0", "--duration", "0.2", "--out", str(tmp_path), "--decode", prefill])
    _, err = capsys.readouterr()
    assert rc == 1 and f"FAILED {prefill} (decode): given as a decode but answered as prefill" in err, err


@pytest.mark.parametrize(("args", "message"), [
    (["--duration", "0", "--out", "d", "--targets", "h:1"], "--duration must be in (0, 600]"),
    (["--duration", "1", "--after", "-1", "--out", "d", "--targets", "h:1"], "--after must be in [0, 3600]"),
    (["--duration", "1", "--out", "d", "--targets", "nohost"], "expected host:port"),
    (["--duration", "1", "--out", "d", "--targets", "h:99999"], "port must be an integer in [1, 65535]"),
    (["--duration", "1", "--out", "d", "--targets", "h:1", "--decode", "h:1"], "given twice"),
    (["--duration", "1", "--out", "d"], "no targets"),
    (["--duration", "1", "--out", " ", "--targets", "h:1"], "--out must not be empty"),
])
def test_trace_command_validates_its_arguments(args: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert trace_capture.main(args) == 2
    assert message in capsys.readouterr().err
