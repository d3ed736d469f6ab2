"""A real Prometheus server for tests: scrapes given targets, answers PromQL over its HTTP API.

    with PrometheusHarness(["127.0.0.1:40124"]) as prom:
        prom.wait_for_scrapes(2)
        result = prom.query('sum(rate(pdserve_router_requests_total{namespace="pdserve-test"}[15s]))')

Or, for series with known values at known times, start it on a TSDB backfilled from OpenMetrics text
(`promtool tsdb create-blocks-from openmetrics`) and query at those times:

    with PrometheusHarness([], backfill=openmetrics_text) as prom:
        prom.query("sum(rate(pdserve_router_requests_total[1m]))", at=last_sample_time)

Targets get `job="pdserve"`, `namespace="pdserve-test"` (so dashboards' `$namespace` filter matches)
and the usual `instance="host:port"`. Storage lives in a temp dir removed on exit; the process is
always stopped. Tests skip with `require_prometheus()` where no binary is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

DEFAULT_BINARY = "/usr/bin/prometheus"
TEST_NAMESPACE = "pdserve-test"
JOB = "pdserve"


def prometheus_binary() -> str | None:
    """Path of the Prometheus server binary ($PDSERVE_TEST_PROMETHEUS, /usr/bin/prometheus, $PATH)."""
    for candidate in (os.environ.get("PDSERVE_TEST_PROMETHEUS"), DEFAULT_BINARY, shutil.which("prometheus")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def promtool_binary() -> str | None:
    """Path of promtool (next to the server binary, or on $PATH)."""
    binary = prometheus_binary()
    for candidate in (binary and str(Path(binary).with_name("promtool")), shutil.which("promtool")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def require_prometheus() -> str:
    """The binary, or skip the calling test."""
    import pytest

    binary = prometheus_binary()
    if binary is None:
        pytest.skip("no Prometheus server binary (apt-get install prometheus, or set PDSERVE_TEST_PROMETHEUS)")
    return binary


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class PrometheusError(RuntimeError):
    pass


class PrometheusHarness:
    """Context manager around one Prometheus process scraping `targets` ("host:port") every second."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        namespace: str = TEST_NAMESPACE,
        labels: Mapping[str, str] | None = None,
        scrape_interval: str = "1s",
        metrics_path: str = "/metrics",
        binary: str | None = None,
        ready_timeout_s: float = 20.0,
        backfill: str | None = None,
    ) -> None:
        self.targets = list(targets)
        self.labels = {"namespace": namespace, **(labels or {})}
        self.scrape_interval = scrape_interval
        self.metrics_path = metrics_path
        self.binary = binary or prometheus_binary()
        self.ready_timeout_s = ready_timeout_s
        self.backfill = backfill
        """OpenMetrics text (ending in `# EOF`, sample timestamps in seconds) loaded into the TSDB before start."""
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config_yaml(self) -> str:
        """The prometheus.yml written for the run (JSON is valid YAML)."""
        config = {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": [{
                "job_name": JOB,
                "scrape_interval": self.scrape_interval,
                "scrape_timeout": self.scrape_interval,
                "metrics_path": self.metrics_path,
                "static_configs": [{"targets": self.targets, "labels": self.labels}],
            }],
        }
        return json.dumps(config, indent=2)

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> PrometheusHarness:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        if self.binary is None:
            raise PrometheusError("no Prometheus binary found (apt-get install prometheus)")
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-prom-")
        tmp = Path(self._tmp.name)
        (tmp / "prometheus.yml").write_text(self.config_yaml())
        last_error = ""
        try:
            if self.backfill is not None:
                self._create_blocks(tmp)
            for _ in range(3):  # the free port can be taken between probing and binding: retry
                self.port = free_port()
                self._log = open(tmp / "prometheus.log", "wb")  # closed in _kill()
                self._proc = subprocess.Popen(
                    [self.binary, f"--config.file={tmp / 'prometheus.yml'}",
                     f"--storage.tsdb.path={tmp / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}",
                     "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                    stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )
                if self._wait_ready():
                    return
                last_error = self.log_tail()
                self._kill()
            raise PrometheusError(f"Prometheus did not become ready:\n{last_error}")
        except BaseException:
            self.stop()
            raise

    def _create_blocks(self, tmp: Path) -> None:
        promtool = promtool_binary()
        if promtool is None:
            raise PrometheusError("no promtool found to backfill the TSDB (apt-get install prometheus)")
        source = tmp / "backfill.om"
        source.write_text(self.backfill or "")
        proc = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(source), str(tmp / "data")],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise PrometheusError(f"promtool could not backfill:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")

    def stop(self) -> None:
        self._kill()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=10)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        return False

    def log_tail(self, chars: int = 4000) -> str:
        if self._tmp is None:
            return ""
        path = Path(self._tmp.name) / "prometheus.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    # -- HTTP API --------------------------------------------------------------------------------

    def api(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        """GET /api/v1/<path>; returns `data`, raises PrometheusError with Prometheus' message on error."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {dict(params or {})}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; returns the result list (`[{"metric": {...}, "value": [t, "v"]}, ...]`)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = str(at)
        data = self.api("query", params)
        result = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return list(result)

    def targets_health(self) -> dict[str, str]:
        """instance -> health ("up", "down", "unknown") of the active targets."""
        data = self.api("targets", {"state": "active"})
        return {t["labels"]["instance"]: t["health"] for t in data["activeTargets"]}

    def wait_for_scrapes(self, n: int = 2, timeout_s: float = 20.0) -> None:
        """Block until every target has been scraped successfully at least `n` times."""
        deadline = time.monotonic() + timeout_s
        expr = f'sum_over_time(up{{job="{JOB}"}}[5m])'
        counts: dict[str, float] = {}
        while time.monotonic() < deadline:
            counts = {r["metric"]["instance"]: float(r["value"][1]) for r in self.query(expr)}
            if len(counts) >= len(self.targets) and all(c >= n for c in counts.values()):
                return
            time.sleep(0.2)
        raise PrometheusError(f"targets not scraped {n} times in {timeout_s}s: {counts} "
                              f"health={self.targets_health()}\n{self.log_tail()}")
