"""The launcher as a supervisor: a killed service comes back on the same ports and the router takes it
back; one that keeps dying is given up; `pdserve up` binds loopback, tells the truth about it, and on
SIGTERM stops everything and exits 0. Fast tests first: the restart policy and process handling on
stand-in processes (no model)."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.common.config import ConfigError
from services.launcher import LocalCluster, RestartPolicy, pick_port, served_model
from services.process import ServiceProc, exit_text, parse_ready
from services.up import UpConfig
from tests.e2e.cluster_util import metric_sum, post_json
from tests.process_util import alive, launched_by, live_processes

KV = ["--kv-cache-bytes", str(96 << 20)]
# 127.0.0.1 in /proc/net/tcp, and as an IPv4-mapped address in /proc/net/tcp6 (gRPC's dual-stack sockets).
LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F"}


def _wait_for(what: str, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.2)


def _sessions_alive(sids: set[int]) -> list[int]:
    """pids of live processes in any of the sessions ``sids`` (each service runs in its own)."""
    return [pid for pid, fields in live_processes() if int(fields[3]) in sids]  # fields[3]: session id


# --- fast: policy and process handling -------------------------------------------------------------

def test_restart_backoff_doubles_up_to_its_cap_and_counts_only_the_window() -> None:
    policy = RestartPolicy(max_restarts=5, window_s=60, backoff_s=1, max_backoff_s=5)
    assert [policy.delay(k) for k in range(5)] == [1, 2, 4, 5, 5]
    assert policy.recent([10.0, 50.0, 69.0], now=111.0) == [69.0]  # 10 and 50 are more than 60 s old
    with pytest.raises(ValueError):
        RestartPolicy(max_backoff_s=0.5, backoff_s=1)


def test_exit_text_and_ready_line() -> None:
    assert exit_text(-9) == "signal SIGKILL" and exit_text(3) == "exit code 3"
    assert parse_ready("PDSERVE_READY service=decode grpc=127.0.0.1:1 pid=7") == {
        "service": "decode", "grpc": "127.0.0.1:1", "pid": "7"}
    assert parse_ready("PDSERVE_READYX service=decode") is None


def test_picked_ports_are_distinct_and_free() -> None:
    taken: set[int] = set()
    ports = [pick_port("127.0.0.1", taken) for _ in range(20)]
    assert len(set(ports)) == 20 and taken == set(ports)


def test_up_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--insecure-internal"):
        UpConfig(insecure_internal=True, tls_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="--api-key"):
        UpConfig(api_key="a", api_key_file=str(tmp_path / "k"))
    keys = tmp_path / "keys"
    keys.write_text("# rotated monthly\n\n  first-key  \nsecond-key\n")
    assert UpConfig(api_key_file=str(keys)).key() == "first-key"
    assert UpConfig(api_key="k").key() == "k" and UpConfig().key() is None


READY_THEN = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])  # a child in our group\n"
    "print('PDSERVE_READY service=stub grpc=127.0.0.1:9 pid=1', flush=True)\n"
    "{then}\n")


def _stub(then: str) -> ServiceProc:
    return ServiceProc("stub", "stub", [sys.executable, "-c", READY_THEN.format(then=then)], dict(os.environ),
                       echo=False)


def test_service_proc_stop_ends_its_whole_process_group() -> None:
    p = _stub("time.sleep(60)")
    p.launch()
    assert p.wait_ready(30) and p.ready["service"] == "stub"
    assert p.popen is not None
    pgid = p.popen.pid
    assert len(_sessions_alive({pgid})) == 2  # the service and its child
    assert p.terminate(10) == -signal.SIGTERM
    _wait_for("the child to be killed", lambda: _sessions_alive({pgid}) == [], 10)


def test_a_service_with_a_log_file_writes_its_lines_there_and_the_launcher_reads_only_to_ready(tmp_path: Path
                                                                                                ) -> None:
    """--log-dir: the service writes its own file; the launcher finds the ready line there, relays nothing, and
    after an exit reads the last lines (what a failed start reports) from the file, across launches."""
    log = tmp_path / "stub.log"
    code = ("import sys, time\nprint('starting', flush=True)\n"
            "print('PDSERVE_READY service=stub grpc=127.0.0.1:9 pid=1', flush=True)\n"
            "for i in range(3):\n    print(f'after ready {i}', flush=True)\n    time.sleep(0.2)\n"
            "sys.exit(4)\n")
    p = ServiceProc("stub", "stub", [sys.executable, "-c", code], dict(os.environ), echo=True, log_path=log)
    p.launch()
    assert p.wait_ready(30) and p.ready["service"] == "stub"
    assert p.reap(30) == 4
    p.join_output(5)
    assert p.lines == []  # nothing came through the launcher
    assert log.read_text().splitlines()[-3:] == ["after ready 0", "after ready 1", "after ready 2"]
    assert p.tail(2) == "after ready 1\nafter ready 2"
    failing = ServiceProc("stub", "stub", [sys.executable, "-c", "print('cannot bind 127.0.0.1:9'); raise SystemExit(1)"],
                          dict(os.environ), echo=False, log_path=log)
    failing.launch()
    assert not failing.wait_ready(30)  # it exited without a ready line: the wait ends, not times out
    assert failing.reap(10) == 1 and failing.bind_failed()
    assert "starting" in log.read_text()  # appended across launches


def test_supervisor_restarts_with_backoff_then_gives_up() -> None:
    """LocalCluster._supervise on a stand-in that exits at once: restart 1 after 1 s, restart 2 after
    2 s, then (max_restarts=2 within the window) given up; `now` is passed in, so no sleeping."""
    c = LocalCluster(supervise=True, restart_policy=RestartPolicy(max_restarts=2, window_s=100))
    p = _stub("sys.exit(3)")
    c.procs.append(p)
    p.launch()
    launches = [p.popen]
    t = 1000.0
    for expected_delay in (1.0, 2.0):
        assert p.popen is not None
        p.popen.wait(30)
        c._supervise(p, t)  # notices the exit: schedules a restart, kills what the stub left behind
        assert p.restart_due == t + expected_delay and p.popen is launches[-1]
        _wait_for("the exited stub's child to be killed", lambda: _sessions_alive({launches[-1].pid}) == [], 10)
        c._supervise(p, t + expected_delay - 0.01)  # not yet
        assert p.popen is launches[-1]
        t += expected_delay
        c._supervise(p, t)  # due: relaunched with the same command
        assert p.popen is not launches[-1] and p.popen.args == launches[0].args
        launches.append(p.popen)
    p.popen.wait(30)
    c._supervise(p, t + 1)
    assert c.failed == [p] and p.restart_due is None
    c._supervise(p, t + 1000)
    assert p.popen is launches[-1]  # given up: never started again
    c.stop(grace=5)


# --- e2e: real clusters --------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.slow
def test_supervised_cluster_restarts_a_killed_decode_on_its_ports() -> None:
    policy = RestartPolicy(max_restarts=1, window_s=300, backoff_s=0.5, max_backoff_s=1.0)
    extra = {"prefill": KV, "decode": KV, "router": ["--health-interval-s", "0.5"]}
    with LocalCluster(prefill=1, decode=1, kvstore="embedded", kv_transport="grpc", extra=extra, quiet=True,
                      supervise=True, restart_policy=policy) as c:
        http, rmetrics = c.router["http"], c.router["metrics"]
        model = served_model(http)
        before = dict(c.get("decode-0").ready)
        old_pid = c.kill("decode-0", signal.SIGKILL)
        _wait_for("decode-0 to come back", lambda: c.get("decode-0").ready.get("pid", str(old_pid)) != str(old_pid),
                  60)
        after = c.get("decode-0").ready
        assert (after["grpc"], after["metrics"]) == (before["grpc"], before["metrics"])
        assert not alive(old_pid)
        _wait_for("the router to see decode-0 healthy again", lambda: metric_sum(
            rmetrics, "pdserve_router_instance_healthy", role="decode", endpoint=after["grpc"]) == 1, 30)
        status, body = post_json(http, "/v1/completions", {"model": model, "prompt": "One, two, three,",
                                                           "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4

        # kvstore: restarted once (policy: 1 restart per window), then given up and left down.
        kv_pid = c.kill("kvstore")
        _wait_for("kvstore to come back", lambda: c.get("kvstore").ready.get("pid", str(kv_pid)) != str(kv_pid), 30)
        assert c.failed == []
        c.kill("kvstore")
        _wait_for("the supervisor to give up on kvstore", lambda: c.failed == [c.get("kvstore")], 10)
        time.sleep(1.5)  # more than the longest backoff: it stays down
        assert c.get("kvstore").popen.poll() is not None
        assert [p.name for p in c.dead()] == ["kvstore"]


def _read_lines(stream, out: queue.Queue[str]) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of LISTEN sockets on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            addr, hex_port = cols[1].split(":")
            if int(hex_port, 16) == port and cols[3] == "0A":  # 0A: LISTEN
                found.add(addr)
    return found


@pytest.mark.e2e
@pytest.mark.slow
def test_pdserve_up_binds_loopback_and_sigterm_stops_everything() -> None:
    # No compile child: this test is about binding and stopping, not compiling (up defaults to compiling).
    env = {**os.environ, "PDSERVE_KV_CACHE_BYTES": str(96 << 20), "PDSERVE_CPU_COMPILE_DECODE": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--kvstore", "none", "--kv-transport",
                             "grpc", "--http-port", "0", "--grpc-port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 150
        while not any("pdserve up: serving." in ln for ln in seen):
            assert proc.poll() is None, "\n".join(seen[-40:])
            assert time.monotonic() < deadline, "\n".join(seen[-40:])
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        endpoints = [ln for ln in seen if re.match(r"  \S+ +grpc=", ln)]
        assert {ln.split()[0] for ln in endpoints} == {"prefill-0", "decode-0", "router"}, seen
        pids = {int(m) for ln in endpoints for m in re.findall(r"pid=(\d+)", ln)}
        assert len(pids) == 3 and all(alive(p) for p in pids)
        addresses = [a for ln in endpoints for a in re.findall(r"(?:grpc|http|metrics)=(\S+)", ln)]
        assert len(addresses) == 7  # router: grpc, http, metrics; workers: grpc, metrics
        for a in addresses:  # printed as loopback, and really bound only there
            host, port = a.rsplit(":", 1)
            assert host == "127.0.0.1", a
            assert _listening(int(port)) <= LOOPBACK_HEX and _listening(int(port)), a  # 127.0.0.1, nothing else

        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(90) == 0, "\n".join(seen[-40:])
        assert [p for p in pids if alive(p)] == []
        assert _sessions_alive(pids) == []  # nothing the services started either
    finally:
        for pid in [proc.pid, *pids]:  # a failed run leaves nothing behind either
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.e2e
@pytest.mark.slow
def test_pdserve_up_two_sigints_at_once_drain_like_one() -> None:
    """GNU timeout and terminals signal the whole process group: up gets SIGINT twice within
    microseconds. That is one stop request: the services drain (no kill), nothing is left running."""
    env = {**os.environ, "PDSERVE_KV_CACHE_BYTES": str(96 << 20), "PDSERVE_CPU_COMPILE_DECODE": "0"}
    # A tiny random model: this test is about stopping, and loads in seconds even on a busy host.
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--kvstore", "none", "--kv-transport",
                             "grpc", "--http-port", "0", "--grpc-port", "0", "--model", "random:tiny-llama"],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 400  # imports alone take minutes on a loaded 2-core host
        while not any("pdserve up: serving." in ln for ln in seen):
            assert proc.poll() is None, "\n".join(seen[-40:])
            assert time.monotonic() < deadline, "\n".join(seen[-40:])
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        pids = {int(m) for ln in seen if re.match(r"  \S+ +grpc=", ln) for m in re.findall(r"pid=(\d+)", ln)}
        assert len(pids) == 3 and all(alive(p) for p in pids)

        os.killpg(proc.pid, signal.SIGINT)  # the group, twice, as timeout does
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(90) == 0, "\n".join(seen[-40:])
        while True:
            try:
                seen.append(lines.get(timeout=5))
            except queue.Empty:
                break
        assert not any("killing every service" in ln for ln in seen), "\n".join(seen[-40:])
        assert any("pdserve up: stopped" in ln for ln in seen), "\n".join(seen[-40:])
        assert [p for p in pids if alive(p)] == []
        assert _sessions_alive(pids) == [] and launched_by(proc.pid) == []
    finally:
        for pid in [proc.pid, *pids]:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        proc.wait()
