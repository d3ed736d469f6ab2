"""A local P/D cluster as real processes: what ``pdserve up``, the e2e tests and the benchmarks run.

:class:`LocalCluster` starts kvstore, N prefill and M decode services, then the router pointed at them,
and waits until each reports ready (its ``PDSERVE_READY`` line, printed once health is SERVING). Every
service gets fixed ports picked up front (gRPC, metrics, the router's HTTP), so a service restarted by
the supervisor (``supervise=True``) comes back on the same address: the router keeps its targets and a
Prometheus config stays valid. Everything binds ``host`` (loopback by default); with ``tls_dir`` every
service runs mTLS with its role's certificate (docs/SECURITY.md).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.config import env_name
from services.common.kv_kinds import TRANSPORT_NAMES, transport_kind
from services.common.server import is_loopback
from services.engine.cpu.core_share import CoreShareError, create_group, remove_group
from services.engine.cpu.cpu_features import engine_cpu_args, quiet_openmp_env
from services.process import RestartPolicy, ServiceProc, emit, exit_text, parse_ready

__all__ = ["LocalCluster", "Proc", "RestartPolicy", "StartCancelled", "parse_ready", "served_model"]

Proc = ServiceProc
# Stop order: routers first (no new work arrives while the workers drain), then the workers, then the
# stores they read from.
_STOP_TIER = {"router": 0, "prefill": 1, "decode": 1, "kvstore": 2, "kvstore.mooncake_master": 3}
# The certificate each service module presents (a colocated worker is a decode).
_ROLE = {"router": "router", "prefill": "prefill", "decode": "decode", "kvstore": "kvstore"}
# Settings only the router may see (the others never get the API key in their environment).
_ROUTER_ONLY_ENV = ("PDSERVE_API_KEY", "PDSERVE_API_KEY_FILE")
# The engines' --cpu-share-group: given by the launcher alone, so an exported one never joins engines to a
# group the launcher did not make (--no-lend-cores, pinned, one engine, group file refused).
_SHARE_GROUP_ENV = env_name("cpu_share_group")
_WILDCARD = {"", "0.0.0.0", "::", "[::]"}


def pick_port(host: str, taken: set[int]) -> int:
    """A port nothing listens on at ``host`` right now (bind port 0, read it, close), not in ``taken``."""
    for _ in range(64):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host.strip("[]") or "0.0.0.0", 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            taken.add(port)
            return port
    raise OSError(f"no free port on {host}")


def dial_host(host: str) -> str:
    """The host a local client dials for a bind address (wildcards: loopback)."""
    return "127.0.0.1" if host in _WILDCARD else host


def kv_transport_args(transport: str, host: str) -> tuple[list[str], list[str]]:
    """(prefill flags, decode flags) for one ``--kv-transport`` (PrefillConfig's choices): grpc sends page
    bytes in the stream; shm / cuda-ipc / auto share decode's pool on this host (auto: shm on CPU, cuda-ipc
    on GPU); mooncake registers decode's pool with the Mooncake Transfer Engine at ``host`` (loopback TCP
    here), and each prefill's engine binds ``host`` too."""
    kind = transport_kind(transport)
    if kind is None:
        raise ValueError(f"unknown KV transport {transport!r} ({', '.join(TRANSPORT_NAMES)})")
    return kind.launch_args(host)


class StartCancelled(RuntimeError):
    """start() gave up because request_stop() was called."""


@dataclass(frozen=True)
class _Spec:
    """How to (re)start one service: module, its own args (ports included), and which ports were picked."""

    name: str
    module: str
    args: Callable[[], list[str]]
    picked: tuple[str, ...] = ()


class LocalCluster:
    """Processes of one local cluster; usable from tests as a context manager.

    ``supervise``: after start(), a watcher thread restarts any service that exits unexpectedly, with
    the same command and ports, backing off per ``restart_policy``; a service that keeps dying is given
    up (listed in :attr:`failed`). Off by default: tests that kill services expect them to stay dead.
    """

    def __init__(self, *, prefill: int = 1, decode: int = 1, kvstore: str | None = "embedded",
                 model: str | None = None, dtype: str = "auto", host: str = "127.0.0.1",
                 http_port: int = 0, grpc_port: int = 0, extra: dict[str, list[str]] | None = None,
                 colocated: bool = False, env: dict[str, str] | None = None, quiet: bool = False,
                 kv_transport: str = "grpc", tls_dir: str | os.PathLike[str] | None = None,
                 api_key: str | None = None, api_key_file: str | None = None, supervise: bool = False,
                 restart_policy: RestartPolicy | None = None, pin_cores: bool = False,
                 metrics_port_base: int = 0, lend_cores: bool = True,
                 log_dir: str | os.PathLike[str] | None = None, own_cpu: frozenset[str] = frozenset()) -> None:
        self.n_prefill, self.n_decode, self.kvstore = prefill, decode, kvstore
        self.model, self.dtype, self.host = model, dtype, host
        self.http_port, self.grpc_port = http_port, grpc_port
        # Extra flags per module ("prefill") or per instance ("prefill-1"); the instance's come last.
        self.extra = extra or {}
        self.colocated = colocated
        kv_transport_args(kv_transport, host)  # an unknown transport is refused before anything starts
        self.kv_transport = kv_transport
        # OpenMP workers sleep when idle (engines share the host's cores); set before torch loads.
        self.env = {**quiet_openmp_env(os.environ), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.pin_cores = pin_cores
        # Modules ("prefill", "decode") whose engines keep the CPU settings their user gave them (cpu_threads or
        # cpu_affinity in a config file or PDSERVE_* variable): no computed share, no lending for those.
        self.own_cpu = own_cpu
        # Engines lend each other idle cores through one share group (services/engine/cpu/core_share.py):
        # unpinned, more than one engine process; the group file is created at start, removed at stop.
        n_engines = self.n_decode + (0 if colocated else self.n_prefill)
        self.share_group = (f"up{os.getpid()}-{secrets.token_hex(4)}"
                            if lend_cores and not pin_cores and n_engines > 1 else "")
        # 0: metrics ports picked free at start; N: fixed, router N, kvstore N+1, mooncake master N+2,
        # prefill-i N+3+i, decode-j / worker-j after the prefills (metrics_port()).
        self.metrics_port_base = metrics_port_base
        self.quiet = quiet
        # Each service writes its output to <log_dir>/<name>.log itself (nothing relayed through this
        # process once it is ready); None: piped to the launcher (echoed unless quiet).
        self.log_dir = Path(log_dir) if log_dir is not None else None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.tls_dir = Path(tls_dir) if tls_dir is not None else None
        # The router's API key(s): given to the router alone, in its environment (not its argv, which
        # every local user can read).
        self.api_key, self.api_key_file = api_key, api_key_file
        self.supervise = supervise
        self.restart_policy = restart_policy or RestartPolicy()
        self.procs: list[Proc] = []
        # Services the supervisor gave up on (they kept exiting); `pdserve up` stops when one appears.
        self.failed: list[Proc] = []
        self.ports: dict[str, dict[str, int]] = {}
        self._taken: set[int] = set()
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        if self.tls_dir is not None:
            for f in ("ca.pem", *(f"{r}{s}" for r in set(_ROLE.values()) for s in (".pem", "-key.pem"))):
                if not (self.tls_dir / f).is_file():
                    raise FileNotFoundError(f"TLS directory {self.tls_dir} lacks {f} (pdserve certs --out DIR)")

    # -- commands ----------------------------------------------------------------------------------
    def model_args(self) -> list[str]:
        """Flags every model-running service gets (prefill, decode, colocated worker)."""
        args = ["--dtype", self.dtype]
        if self.model:
            args += ["--model", self.model]
        return args

    def tls_args(self, module: str) -> list[str]:
        """The role's certificate flags; without ``tls_dir``, --insecure-internal on a host other than loopback
        (a service refuses to serve plaintext there unless told)."""
        role = _ROLE.get(module)
        if role is None:
            return []
        if self.tls_dir is None:
            return [] if is_loopback(self.host) else ["--insecure-internal"]
        d = self.tls_dir
        return ["--tls-cert", str(d / f"{role}.pem"), "--tls-key", str(d / f"{role}-key.pem"),
                "--tls-ca", str(d / "ca.pem")]

    def _host_args(self, module: str) -> list[str]:
        if module == "kvstore.mooncake_master":
            return ["--host", self.host]
        args = ["--host", self.host, "--metrics-host", self.host]
        return args + (["--http-host", self.host] if module == "router" else [])

    def _env_for(self, module: str) -> dict[str, str]:
        env = {k: v for k, v in self.env.items() if k != _SHARE_GROUP_ENV}
        if module == "router":
            keys = {"PDSERVE_API_KEY": self.api_key, "PDSERVE_API_KEY_FILE": self.api_key_file}
            return {**env, **{k: v for k, v in keys.items() if v}}
        return {k: v for k, v in env.items() if k not in _ROUTER_ONLY_ENV}

    def _command(self, name: str, module: str, args: list[str]) -> list[str]:
        # Services stop (draining) when this launcher dies, even by SIGKILL: they run in their own
        # sessions, so nothing else would stop them.
        return [sys.executable, "-m", f"services.{module}", *self._host_args(module), *self.tls_args(module),
                "--parent-pid", str(os.getpid()), *args, *self.extra.get(module, []), *self.extra.get(name, [])]

    def _spawn(self, name: str, module: str, args: list[str]) -> Proc:
        """Start one service process now (no ports picked: ``args`` say them)."""
        log_path = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        proc = Proc(name, module, self._command(name, module, args), self._env_for(module), echo=not self.quiet,
                    log_path=log_path)
        proc.launch()
        with self._lock:
            self.procs.append(proc)
        return proc

    def _wait(self, procs: list[Proc], timeout: float) -> None:
        """Wait until each of ``procs`` is ready; RuntimeError if one exits or ``timeout`` passes,
        StartCancelled once stop is requested."""
        deadline = time.monotonic() + timeout
        for p in procs:
            while not p.wait_ready(min(0.25, max(0.0, deadline - time.monotonic()))):
                if self._stopping.is_set():
                    raise StartCancelled("stop requested while starting")
                if p.ready:  # the ready line landed just after that wait timed out: the next wait returns at once
                    continue
                if p.event.is_set() or time.monotonic() >= deadline:
                    raise RuntimeError(f"{p.name} did not become ready (exit code {p.popen.poll()}):\n{p.tail(30)}")

    def request_stop(self) -> None:
        """Make a start() in progress give up (it raises StartCancelled and stops what it started);
        safe from a signal handler."""
        self._stopping.set()

    def metrics_port(self, name: str) -> int:
        """The fixed metrics port of service ``name`` under ``metrics_port_base`` (0 when none is set)."""
        if not self.metrics_port_base:
            return 0
        fixed = {"router": 0, "kvstore": 1, "mooncake-master": 2}
        kind, _, index = name.rpartition("-")
        if name in fixed:
            offset = fixed[name]
        elif kind == "prefill":
            offset = 3 + int(index)
        else:  # decode-j, worker-j
            offset = 3 + (0 if self.colocated else self.n_prefill) + int(index)
        return self.metrics_port_base + offset

    def _port(self, name: str, kind: str, given: int = 0) -> int:
        ports = self.ports.setdefault(name, {})
        if kind not in ports:
            fixed = self.metrics_port(name) if kind == "metrics" else 0
            ports[kind] = given or fixed or pick_port(self.host, self._taken)
        return ports[kind]

    def _picked(self, *kinds: str) -> tuple[str, ...]:
        """Of ``kinds``, the ports this cluster picks itself (a fixed metrics port is not re-picked)."""
        return tuple(k for k in kinds if not (k == "metrics" and self.metrics_port_base))

    def _launch_all(self, specs: list[_Spec], timeout: float) -> list[Proc]:
        """Start services in parallel and wait for each; one whose picked port someone took meanwhile
        is started again on new ports (twice at most)."""
        deadline = time.monotonic() + timeout
        procs = [self._spawn(s.name, s.module, s.args()) for s in specs]
        out = []
        for spec, proc in zip(specs, procs, strict=True):
            for retries_left in (2, 1, 0):
                try:
                    self._wait([proc], deadline - time.monotonic())
                    break
                except RuntimeError as e:
                    lost = proc.popen.poll() is not None and proc.bind_failed()
                    if isinstance(e, StartCancelled) or not (lost and spec.picked and retries_left):
                        raise
                    with self._lock:
                        self.procs.remove(proc)
                    for kind in spec.picked:
                        del self.ports[spec.name][kind]
                    proc = self._spawn(spec.name, spec.module, spec.args())
            out.append(proc)
        return out

    def _service(self, name: str, module: str, extra_args: list[str], *, metrics: bool = True) -> _Spec:
        def args() -> list[str]:
            out = ["--port", str(self._port(name, "grpc"))]
            if metrics:
                out += ["--metrics-port", str(self._port(name, "metrics"))]
            return out + extra_args
        return _Spec(name, module, args, self._picked("grpc", "metrics") if metrics else ("grpc",))

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> LocalCluster:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        if self.supervise:
            self._watcher = threading.Thread(target=self._watch, name="pdserve-supervisor", daemon=True)
            self._watcher.start()
        return self

    def engine_cpu_flags(self) -> list[list[str]]:
        """Each engine process's CPU flags, prefills first: its share of this host's cores (--cpu-threads,
        --cpu-affinity if pinned) and the share group it lends through, none for an engine of a module in
        ``own_cpu`` (its user's settings stand). Creates the share group."""
        cpu = self._join_cores(engine_cpu_args(0 if self.colocated else self.n_prefill, self.n_decode,
                                               pin=self.pin_cores))
        roles = ["decode"] * self.n_decode if self.colocated else ["prefill"] * self.n_prefill + ["decode"] * self.n_decode
        return [[] if role in self.own_cpu else flags for role, flags in zip(roles, cpu, strict=True)]

    def _join_cores(self, cpu: list[list[str]]) -> list[list[str]]:
        """Each engine's CPU flags plus its share group, created now; the flags unchanged (lending off, with a
        warning) when the group file is refused (no or read-only /dev/shm): lending is an optimisation."""
        if self.share_group:
            try:
                create_group(self.share_group)
            except CoreShareError as e:
                self._say(f"warning: core lending off: {e}")
                self.share_group = ""
        return [[*a, "--cpu-share-group", self.share_group] for a in cpu] if self.share_group else cpu

    def _start(self, timeout: float) -> None:
        kv_args: list[str] = []
        if self.kvstore:
            kv_flags = ["--backend", self.kvstore]
            if self.kvstore == "mooncake":  # a Mooncake Store master on loopback holds the pages
                def master_args() -> list[str]:
                    return ["--rpc-port", str(self._port("mooncake-master", "grpc")),
                            "--metrics-port", str(self._port("mooncake-master", "metrics"))]
                master, = self._launch_all([_Spec("mooncake-master", "kvstore.mooncake_master", master_args,
                                                  self._picked("grpc", "metrics"))], timeout)
                kv_flags += ["--mooncake-master", master.ready["rpc"]]
            kv, = self._launch_all([self._service("kvstore", "kvstore", kv_flags)], timeout)
            kv_args = ["--kvstore-address", kv.ready["grpc"]]
        prefill_kv, decode_kv = kv_transport_args(self.kv_transport, dial_host(self.host))
        kv_args += prefill_kv
        specs: list[_Spec] = []
        cpu = self.engine_cpu_flags()
        if self.colocated:
            specs += [self._service(f"worker-{j}", "decode", ["--mode", "colocated", *self.model_args(), *cpu[j]])
                      for j in range(self.n_decode)]
        else:
            specs += [self._service(f"prefill-{i}", "prefill", [*kv_args, *self.model_args(), *cpu[i]])
                      for i in range(self.n_prefill)]
            specs += [self._service(f"decode-{j}", "decode", [*decode_kv, *self.model_args(),
                                                             *cpu[self.n_prefill + j]])
                      for j in range(self.n_decode)]
        workers = self._launch_all(specs, timeout)  # they load their models in parallel
        prefills = [p.ready["grpc"] for p in workers if p.module == "prefill"]
        decodes = [p.ready["grpc"] for p in workers if p.module == "decode"]
        picked = tuple(k for k, given in (("grpc", self.grpc_port), ("http", self.http_port)) if not given)

        def router_args() -> list[str]:
            out = ["--port", str(self._port("router", "grpc", self.grpc_port)),
                   "--http-port", str(self._port("router", "http", self.http_port)),
                   "--metrics-port", str(self._port("router", "metrics")), "--decode", ",".join(decodes)]
            out += ["--prefill", ",".join(prefills)] if prefills else []
            return out + (["--model", self.model] if self.model else [])
        self._launch_all([_Spec("router", "router", router_args, (*picked, *self._picked("metrics")))], timeout)

    def get(self, name: str) -> Proc:
        with self._lock:
            return next(p for p in self.procs if p.name == name)

    @property
    def router(self) -> dict[str, str]:
        return self.get("router").ready

    def endpoints(self) -> dict[str, dict[str, str]]:
        return {p.name: p.ready for p in self.procs}

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if p.exited() is not None]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to a service's process group (a fault, not a stop: a supervised cluster restarts
        it). Returns the pid it was sent to."""
        p = self.get(name)
        assert p.popen is not None
        p.signal(sig)
        return p.popen.pid

    def restart(self, name: str, timeout: float = 180.0, grace: float = 10.0) -> Proc:
        """Stop a service (SIGTERM, SIGKILL after ``grace``) and start it again on the same ports; waits
        until it is ready. The supervisor leaves it alone meanwhile."""
        p = self.get(name)
        with self._lock:
            p.held, p.restart_due = True, None
        try:
            p.terminate(grace)
            p.launch()
            if not p.wait_ready(timeout):
                raise RuntimeError(f"{name} did not become ready after restart (exit code {p.popen.poll()}):\n"
                                   f"{p.tail(30)}")
        finally:
            with self._lock:
                p.held = False
        return p

    def stop(self, grace: float = 10.0) -> None:
        """Stop everything, one tier after the other (routers, workers, stores); each tier gets ``grace``
        seconds after SIGTERM before its process groups are killed."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        with self._lock:
            procs = list(self.procs)
            for p in procs:
                p.held = True
        for tier in sorted({_STOP_TIER.get(p.module, 1) for p in procs}):
            group = [p for p in procs if _STOP_TIER.get(p.module, 1) == tier]
            for p in group:
                p.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in group:
                p.reap(max(0.1, deadline - time.monotonic()))
        for p in procs:
            p.join_output(5.0)
        if self.share_group:
            remove_group(self.share_group)

    def kill_all(self) -> None:
        """SIGKILL every service's process group at once (a second Ctrl-C)."""
        for p in list(self.procs):
            p.signal(signal.SIGKILL)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- supervision -------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                for p in self.procs:
                    self._supervise(p, time.monotonic())

    def _supervise(self, p: Proc, now: float) -> None:
        if p.held or p in self.failed:
            return
        if p.announce and p.ready:
            p.announce = False
            self._say(f"{p.name} is back (pid {p.ready.get('pid', p.popen.pid)}): "
                      + " ".join(f"{k}={v}" for k, v in sorted(p.ready.items()) if k != "pid"))
        code = p.exited()
        if code is None:
            return
        policy = self.restart_policy
        if p.restart_due is None:
            recent = policy.recent(p.restart_times, now)
            if len(recent) >= policy.max_restarts:
                self.failed.append(p)
                self._say(f"{p.name} exited with {exit_text(code)} after {len(recent)} restarts within "
                          f"{policy.window_s:g} s; giving up on it")
                return
            delay = policy.delay(len(recent))
            p.restart_due = now + delay
            self._say(f"{p.name} (pid {p.popen.pid}) exited with {exit_text(code)}; restarting it in "
                      f"{delay:g} s on the same ports (restart {len(recent) + 1} of at most "
                      f"{policy.max_restarts} within {policy.window_s:g} s)")
        elif now >= p.restart_due:
            p.restart_due = None
            p.restart_times.append(now)
            p.launch()
            p.announce = True

    def _say(self, msg: str) -> None:
        emit(f"pdserve up: {msg}", err=True)


def served_model(http: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(f"http://{http}/v1/models", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["data"][0]["id"]
