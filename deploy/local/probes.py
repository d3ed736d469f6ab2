"""The kubelet's probes, run from the host against a pod IP (as a node's kubelet does).

grpc: grpc.health.v1 Health/Check with the probe's service name (Kubernetes' default ""), SERVING
passes; http: GET http://<pod ip>:<port><path>, a status in [200, 400) passes; tcp: a connection
opens; exec: `<cli> exec <container> <command>` exits 0. Each attempt is bounded by timeoutSeconds.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from podspec import Probe


def check(probe: Probe, ip: str, container: str, cli: str) -> tuple[bool, str]:
    """One attempt: (passed, what was seen)."""
    try:
        if probe.kind == "grpc":
            return _grpc(ip, probe)
        if probe.kind == "http":
            url = f"http://{ip}:{probe.port}{probe.path}"
            try:
                with urllib.request.urlopen(url, timeout=probe.timeout_s) as r:
                    return 200 <= r.status < 400, f"HTTP {r.status}"
            except urllib.error.HTTPError as e:
                return False, f"HTTP {e.code}"
        if probe.kind == "tcp":
            with socket.create_connection((ip, probe.port or 0), timeout=probe.timeout_s):
                return True, "connected"
        proc = subprocess.run([cli, "exec", container, *probe.command], capture_output=True, text=True,
                              timeout=probe.timeout_s + 5)
        return proc.returncode == 0, f"exit {proc.returncode} {proc.stdout.strip()[-200:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{type(e).__name__}: {e}"


def _grpc(ip: str, probe: Probe) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{ip}:{probe.port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=probe.service), timeout=probe.timeout_s)
        except grpc.RpcError as e:
            return False, f"{e.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def wait(probe: Probe, ip: str, container: str, cli: str, *,
         alive: Callable[[], bool]) -> tuple[bool, float, str]:
    """Probe every periodSeconds after initialDelaySeconds, like the kubelet's startup probe: passes on the
    first success; fails after failureThreshold consecutive failures or when `alive()` turns false.
    Returns (passed, seconds waited, last result)."""
    start = time.monotonic()
    time.sleep(probe.initial_delay_s)
    failures = 0
    seen = ""
    while True:
        t0 = time.monotonic()
        ok, seen = check(probe, ip, container, cli)
        if ok:
            return True, time.monotonic() - start, seen
        failures += 1
        if failures >= probe.failure_threshold:
            return False, time.monotonic() - start, seen
        if not alive():
            return False, time.monotonic() - start, f"container exited ({seen})"
        time.sleep(max(0.0, probe.period_s - (time.monotonic() - t0)))
