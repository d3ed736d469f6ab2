"""``pdserve up``: a local P/D cluster as real processes, supervised.

Starts kvstore, N prefill and M decode services, then the router pointed at them (services.launcher),
each on fixed ports picked up front, and prints the endpoints. A service that exits is restarted with
the same command and ports (backoff 1 s, 2 s, 4 s ... up to --max-restart-backoff-s); one that exits
more than --max-restarts times within --restart-window-s is given up and the cluster stops (exit 1).
Before anything starts, every fixed port (router HTTP and gRPC, the metrics ports under
--metrics-port-base) and the model spec are checked: each problem is one line naming the flag, exit 2.
SIGTERM / Ctrl-C stops everything, router first so in-flight work drains, and exits 0; a second signal
within a second of the first is the same request, a later one kills what is left.

Everything binds --host (127.0.0.1 by default). Every internal RPC runs over mTLS: a fresh CA and
per-role certificates are made at start in a private temporary directory (mode 0700, removed at exit),
or --tls-dir names existing ones; --insecure-internal runs them plaintext (and warns at start);
--api-key (or PDSERVE_API_KEY) makes the router's public API require ``Authorization: Bearer KEY``.
docs/SECURITY.md says what each mode trusts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common.cli_args import ArgParser
from services.common.config import (
    ConfigError,
    ContextConfig,
    add_dataclass_args,
    field_error,
    flag_name,
    from_args,
    opt,
    require,
    reuse,
)
from services.common.config_file import ConfigFile, add_config_arg, config_file
from services.common.lease import LeaseConfig
from services.common.logging import LoggingConfig
from services.common.server import port_problem
from services.common.tls import make_certs
from services.decode.config import DecodeConfig
from services.engine.model_settings import CompileDecodeConfig, DeviceConfig, DtypeConfig
from services.kvstore.config import BACKENDS
from services.launcher import LocalCluster, RestartPolicy, StartCancelled, dial_host, served_model
from services.prefill.config import PrefillConfig
from services.process import emit
from services.router.config import RouterConfig
from services.text.model.errors import ModelLoadError
from services.text.model.settings import ModelConfig
from services.text.model.source import resolve

# Serving settings pdserve up passes on to services, when given as its own flags (env vars and the
# config file reach the services directly).
_FORWARD: dict[str, tuple[str, ...]] = {
    "served_model_name": ("router",), "policy": ("router",), "lease_ms": ("router", "decode"),
    "access_log": ("router",), "engine_core": ("prefill", "decode"),
    "max_model_len": ("router", "prefill", "decode"), "device": ("prefill", "decode"), "log_level": ("router", "prefill", "decode", "kvstore"),
}


def _env(name: str) -> str:
    return "PDSERVE_UP_" + name.upper()


_CLUSTER, _SERVING, _NET, _SECURITY, _SUPERVISION = (
    "cluster", "serving (passed on to the services; PDSERVE_* env vars and --config reach them too)",
    "network and ports", "security", "supervision")


@dataclass
class UpConfig:
    """pdserve up: one local cluster."""

    prefill: int = opt(1, "Prefill instances.", env=_env("prefill"), group=_CLUSTER)
    decode: int = opt(1, "Decode instances (colocated workers with --colocated).", env=_env("decode"),
                      group=_CLUSTER)
    colocated: bool = opt(False, "One service does prefill and decode (A/B).", env=_env("colocated"), group=_CLUSTER)
    kvstore: str = opt("embedded", "kvstore backend; none: no kvstore.", choices=(*BACKENDS, "none"),
                       env=_env("kvstore"), group=_CLUSTER)
    model: str | None = reuse(ModelConfig, "model", group=_CLUSTER)
    dtype: str = reuse(DtypeConfig, "dtype", group=_CLUSTER)
    device: str = reuse(DeviceConfig, "device", group=_CLUSTER)
    """Every engine's --device (prefill, decode, colocated worker; PDSERVE_DEVICE reaches them too)."""
    pin_cores: bool = opt(False, "Pin each engine process to its own share of this host's CPUs (--cpu-affinity).",
                          env=_env("pin_cores"), group=_CLUSTER)
    lend_cores: bool = opt(True, "Engines lend each other the cores of their shares while idle (the prefill "
                                 "computes on all cores while its decode waits for the KV, the decode decodes "
                                 "on all while the prefill is idle): --cpu-share-group. Off under --pin-cores.",
                           env=_env("lend_cores"), group=_CLUSTER)
    kv_transport: str = reuse(PrefillConfig, "kv_transport", default="auto", group=_CLUSTER)
    """Every prefill's --kv-transport; decodes offer what it needs (services.launcher.kv_transport_args). auto:
    decode shares its pool, prefill writes into it (shm on CPU, cuda-ipc on GPU)."""
    cpu_compile_decode: int = reuse(CompileDecodeConfig, "cpu_compile_decode", default=2, group=_CLUSTER)
    """Given to every decode and colocated engine (prefills: 0, they never run a decode step)."""
    demo: bool = opt(False, "Send one chat request once the cluster is up.", env=_env("demo"), group=_CLUSTER)
    served_model_name: str = reuse(RouterConfig, "served_model_name", group=_SERVING)
    max_model_len: int = reuse(ContextConfig, "max_model_len", group=_SERVING)
    policy: str = reuse(RouterConfig, "policy", group=_SERVING)
    lease_ms: int = reuse(LeaseConfig, "lease_ms", group=_SERVING)
    access_log: bool = reuse(RouterConfig, "access_log", group=_SERVING)
    engine_core: str = reuse(DecodeConfig, "engine_core", group=_SERVING)
    """Every prefill's, decode's and colocated worker's --engine-core (a CUDA prefill takes thread or auto)."""
    log_level: str = reuse(LoggingConfig, "log_level", group=_SERVING)
    host: str = opt("127.0.0.1", "Address every service binds (gRPC, metrics, the router's HTTP); 0.0.0.0 "
                                 "exposes internal RPCs to the network (mTLS guards them unless --insecure-internal).",
                  env=_env("host"), group=_NET)
    http_port: int = reuse(RouterConfig, "http_port", group=_NET)
    grpc_port: int = opt(50051, "Router gRPC port; 0 picks a free one.", env=_env("grpc_port"), group=_NET)
    metrics_port_base: int = opt(0, "Fixed metrics ports: router BASE, kvstore BASE+1, mooncake master BASE+2, "
                                    "prefill-i BASE+3+i, then decode-j (or worker-j) after the prefills; 0: free "
                                    "ports picked at start (see --prometheus-sd).", env=_env("metrics_port_base"),
                                 group=_NET)
    prometheus_sd: str = opt("", "Write the services' metrics addresses here as a Prometheus file_sd target "
                                 "list (deploy/prometheus/prometheus-local.yml reads targets/*.json).",
                             env=_env("prometheus_sd"), group=_NET)
    log_dir: str = opt("", "Each service writes its output to DIR/<name>.log itself (the launcher reads a file only "
                           "up to the service's ready line and after an exit, so no log line of a busy cluster "
                           "passes through it); empty: every service's lines are relayed to this terminal, "
                           "prefixed with its name.", env=_env("log_dir"), group=_CLUSTER)
    insecure_internal: bool = opt(False, "Plaintext internal RPCs (Prefill, Reserve, PushKV, kvstore Put/Get): any "
                                         "local process can call them. Default: mTLS with a fresh CA and per-role "
                                         "certificates made at start in a private directory removed at exit.",
                                  env="PDSERVE_INSECURE_INTERNAL", group=_SECURITY)
    tls_dir: str = opt("", "mTLS with existing certificates: DIR holds ca.pem and <role>.pem/<role>-key.pem "
                           "for router, prefill, decode, kvstore (pdserve certs --out DIR).", env=_env("tls_dir"),
                       group=_SECURITY)
    api_key: str = reuse(RouterConfig, "api_key", group=_SECURITY)
    api_key_file: str = reuse(RouterConfig, "api_key_file", group=_SECURITY)
    restart: bool = opt(True, "Restart a service that exits; --no-restart stops the cluster instead.",
                        env=_env("restart"), group=_SUPERVISION)
    max_restarts: int = opt(5, "Restarts of one service within --restart-window-s before giving up.",
                            env=_env("max_restarts"), group=_SUPERVISION)
    restart_window_s: float = opt(60.0, "Window over which restarts are counted (seconds).",
                                  env=_env("restart_window_s"), group=_SUPERVISION)
    max_restart_backoff_s: float = opt(30.0, "Longest wait before a restart (seconds; doubles from 1 s).",
                                       env=_env("max_restart_backoff_s"), group=_SUPERVISION)
    stop_grace_s: float = opt(45.0, "On stop, how long each tier (routers, workers, stores) may drain after "
                                    "SIGTERM before it is killed (seconds).", env=_env("stop_grace_s"),
                              group=_SUPERVISION)
    start_timeout_s: float = opt(300.0, "Longest wait for the cluster to become ready (seconds).",
                                 env=_env("start_timeout_s"), group=_SUPERVISION)

    def __post_init__(self) -> None:
        require(self.prefill >= (0 if self.colocated else 1), self, "prefill", f"must be >= 1, got {self.prefill}")
        require(self.decode >= 1, self, "decode", f"must be >= 1, got {self.decode}")
        require(not (self.insecure_internal and self.tls_dir), self, "insecure_internal",
                "give --insecure-internal or --tls-dir, not both")
        require(not self.tls_dir or Path(self.tls_dir).is_dir(), self, "tls_dir", f"no such directory: {self.tls_dir}")
        require(not (self.api_key and self.api_key_file), self, "api_key", "give --api-key or --api-key-file, not both")
        require(not self.api_key_file or Path(self.api_key_file).is_file(), self, "api_key_file",
                f"no such file: {self.api_key_file}")
        require(self.max_restarts >= 0, self, "max_restarts", f"must be >= 0, got {self.max_restarts}")
        require(self.restart_window_s > 0, self, "restart_window_s", f"must be > 0, got {self.restart_window_s}")
        require(self.max_restart_backoff_s >= 1, self, "max_restart_backoff_s",
                f"must be >= 1, got {self.max_restart_backoff_s}")
        require(self.max_model_len >= 0, self, "max_model_len", f"must be >= 0, got {self.max_model_len}")
        require(self.lease_ms > 0, self, "lease_ms", f"must be > 0, got {self.lease_ms}")
        last = self.metrics_port_base + 3 + self.prefill + self.decode
        require(self.metrics_port_base == 0 or (1 <= self.metrics_port_base and last <= 65535), self,
                "metrics_port_base", f"must be 0 or leave room for every service below 65536, got "
                                     f"{self.metrics_port_base}")

    def key(self) -> str | None:
        """The key the router is given (and the demo sends): --api-key, or the first key in the file
        (one per line, '#' comments, like the router's --api-key-file)."""
        if self.api_key_file:
            lines = (ln.strip() for ln in Path(self.api_key_file).read_text().splitlines())
            return next((ln for ln in lines if ln and not ln.startswith("#")), None)
        return self.api_key or None


def _say(msg: str, *, err: bool = False) -> None:
    emit(f"pdserve up: {msg}", err=err)


def _demo(http: str, api_key: str | None) -> None:
    body = json.dumps({"model": served_model(http, api_key), "max_tokens": 48, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(f"http://{http}/v1/chat/completions", body, headers)
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    dt = time.perf_counter() - t0
    emit(f"demo: Q: What is the capital of France?\ndemo: A: {out['choices'][0]['message']['content']!r}"
         f"  ({out['usage']['completion_tokens']} tokens in {dt:.2f}s)")


def _write_targets(path: str, cluster: LocalCluster) -> None:
    targets = sorted(info["metrics"] for info in cluster.endpoints().values() if "metrics" in info)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")  # Prometheus re-reads the file: replace it whole
    tmp.write_text(json.dumps([{"targets": targets, "labels": {"namespace": "local"}}], indent=2) + "\n")
    tmp.replace(out)


def _print_endpoints(cfg: UpConfig, cluster: LocalCluster, tls_dir: Path | None, key: str | None) -> None:
    for name, info in cluster.endpoints().items():
        emit(f"  {name:16s} " + "  ".join(f"{k}={v}" for k, v in sorted(info.items()) if k != "service"))
    if dial_host(cfg.host) != cfg.host:
        _say(f"every port above is bound on {cfg.host or 'every interface'}: other hosts reach them at this "
             "host's addresses")
    if cluster.log_dir is not None:
        _say(f"service logs: {cluster.log_dir}/<name>.log (not relayed here)")
    if tls_dir is not None:
        _say(f"mTLS between all services; certificates in {tls_dir} (gRPC clients of the router present "
             "client.pem/client-key.pem and trust ca.pem)")
    http = cluster.router["http"]
    auth = " -H \"Authorization: Bearer $PDSERVE_API_KEY\"" if key else ""
    _say(f"serving. OpenAI API at http://{http}/v1{' (API key required)' if key else ''}; "
         "Ctrl-C stops everything\n"
         f"  curl http://{http}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
         f"-d '{{\"model\":\"{served_model(http, key)}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hi\"}}]}}'")


def _forwarded(ns: argparse.Namespace, cfg: UpConfig, config_path: str | None) -> dict[str, list[str]]:
    """Per service module, the flags pdserve up hands on: the serving settings given on its command line,
    and --config FILE (absolute) when given as a flag."""
    out: dict[str, list[str]] = {}
    for name, modules in _FORWARD.items():
        if getattr(ns, name, None) is None:
            continue
        value = getattr(cfg, name)
        flag = (flag_name(name) if value else flag_name("no_" + name)) if isinstance(value, bool) else None
        for module in modules:
            out.setdefault(module, []).extend([flag] if flag else [flag_name(name), str(value)])
    if config_path:
        for module in ("router", "prefill", "decode", "kvstore"):
            out.setdefault(module, []).extend(["--config", str(Path(config_path).resolve())])
    return out


def _add_compile_flags(extra: dict[str, list[str]], cfg: UpConfig, file: ConfigFile | None = None,
                       given: bool = False) -> None:
    """A prefill engine never runs a pure-decode step: no compile there (PDSERVE_CPU_COMPILE_DECODE reaches
    every child's environment: the flags win). Decode and colocated engines (module decode) get up's value,
    unless the config ``file``'s decode section sets cpu_compile_decode and up's flag was not ``given``."""
    extra.setdefault("prefill", []).extend(["--cpu-compile-decode", "0"])
    if not given and file is not None and "cpu_compile_decode" in file.sections.get("decode", {}):
        return
    extra.setdefault("decode", []).extend(["--cpu-compile-decode", str(cfg.cpu_compile_decode)])


CPU_FIELDS = ("cpu_threads", "cpu_affinity")
"""Engine settings of the host's cores that pdserve up otherwise sets itself (each engine's share, lending)."""


def own_cpu_modules(file: ConfigFile | None, env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The service modules whose engines keep the CPU settings the user gave (CPU_FIELDS in the config file's
    shared part or the module's section, or a PDSERVE_CPU_* variable, which reaches every engine): pdserve up
    passes them no --cpu-threads / --cpu-affinity / --cpu-share-group of its own, which would win over them."""
    env = os.environ if env is None else env
    if any(env.get(f"PDSERVE_{f.upper()}") for f in CPU_FIELDS):
        return frozenset({"prefill", "decode"})
    if file is None:
        return frozenset()
    if any(f in file.shared for f in CPU_FIELDS):
        return frozenset({"prefill", "decode"})
    return frozenset(m for m in ("prefill", "decode") if any(f in file.sections.get(m, {}) for f in CPU_FIELDS))


GPU_SHARES = {"prefill": 0.3, "decode": 0.6, "worker": 0.9}
"""--gpu-memory-utilization of the engines of one role when several engines share one GPU, split evenly among the
role's instances: each engine holds its own weights, a prefill's pool only needs its in-flight prompts, and one
engine alone would take 0.9 and leave the next nothing (the CUDA out-of-memory of a first `pdserve up --device
cuda`). Together they stay at the engine default's 0.9."""


def gpu_memory_shares(cfg: UpConfig, file: ConfigFile | None = None) -> dict[str, float]:
    """Per service module, the --gpu-memory-utilization pdserve up gives its engines: only with --device cuda[:N]
    (all engines on that one GPU) and more than one engine, and only where the user set none (flag forwarded by a
    config file or PDSERVE_GPU_MEMORY_UTILIZATION)."""
    n_engines = cfg.decode + (0 if cfg.colocated else cfg.prefill)
    if not (cfg.device or "").startswith("cuda") or n_engines < 2 or \
            os.environ.get("PDSERVE_GPU_MEMORY_UTILIZATION"):
        return {}
    if file is not None and ("gpu_memory_utilization" in file.shared
                             or any("gpu_memory_utilization" in sec for sec in file.sections.values())):
        return {}
    if cfg.colocated:
        return {"decode": round(GPU_SHARES["worker"] / cfg.decode, 3)}
    return {"prefill": round(GPU_SHARES["prefill"] / cfg.prefill, 3),
            "decode": round(GPU_SHARES["decode"] / cfg.decode, 3)}


def _add_gpu_memory_shares(extra: dict[str, list[str]], cfg: UpConfig, file: ConfigFile | None) -> None:
    shares = gpu_memory_shares(cfg, file)
    for module, share in shares.items():
        extra.setdefault(module, []).extend(["--gpu-memory-utilization", str(share)])
    if shares:
        emit(f"pdserve up: {cfg.decode + (0 if cfg.colocated else cfg.prefill)} engines share {cfg.device}: "
             + ", ".join(f"{m} --gpu-memory-utilization {v} each" for m, v in shares.items()))


def one_gpu_pd_note(cfg: UpConfig) -> str:
    """The line `pdserve up` prints when its prefill and decode engines share one GPU ("" otherwise): they take
    turns on it and no decode row rides on a prompt's weight reads, so on one GPU a colocated worker serves more
    (measured on an H100: 1P1D 0.69-0.90x the in-process engine at C256-C512, colocated 0.75-1.15x)."""
    if cfg.colocated or not (cfg.device or "").startswith("cuda"):
        return ""
    return (f"pdserve up: prefill and decode take turns on {cfg.device} (one GPU): P/D pays across GPUs; "
            "--colocated serves more tokens on one")


def check_file(file: ConfigFile) -> None:
    """Every key of a config file names a setting of some service (top level) or of its section's service;
    ConfigError naming the first that does not. Imports the engine's settings (and torch) to know them."""
    # deferred: the engine's settings import torch; `pdserve up` checks a config file only when given one
    from services.decode.config import DecodeConfig
    from services.engine.config import EngineConfig
    from services.kvstore.config import KVStoreConfig

    classes: dict[str, list[type]] = {
        "up": [UpConfig], "router": [RouterConfig, LoggingConfig],
        "prefill": [PrefillConfig, EngineConfig, LoggingConfig], "decode": [DecodeConfig, EngineConfig, LoggingConfig],
        "kvstore": [KVStoreConfig, LoggingConfig]}
    for section, cls in classes.items():
        file.check(section, cls)
    file.check("", [c for cls in classes.values() for c in cls], shared=True)


SIGNAL_REPEAT_S = 1.0
"""A stop signal this soon (seconds) after the first is the same request: GNU timeout, a terminal or a
process manager often signals the whole group, so the launcher gets SIGINT twice microseconds apart."""


def fixed_ports(cfg: UpConfig) -> list[tuple[int, str]]:
    """(port, field of UpConfig that chose it) for every port the cluster binds that is not picked free at
    start: the router's HTTP and gRPC ports, and every service's metrics port under --metrics-port-base."""
    out = [(cfg.http_port, "http_port"), (cfg.grpc_port, "grpc_port")]
    if cfg.metrics_port_base:
        # The layout of LocalCluster.metrics_port: router, kvstore, mooncake master, prefills, decodes.
        offsets = [0, *([1] if cfg.kvstore != "none" else []), *([2] if cfg.kvstore == "mooncake" else [])]
        workers = cfg.decode + (0 if cfg.colocated else cfg.prefill)
        offsets += [3 + i for i in range(workers)]
        out += [(cfg.metrics_port_base + o, "metrics_port_base") for o in offsets]
    return [(port, name) for port, name in out if port > 0]


def startup_problems(cfg: UpConfig) -> list[str]:
    """What would stop the cluster part-way, found before anything starts: a port that cannot be bound
    (or is asked for twice), a model spec that names no model. One line per problem, naming the flag."""
    problems: list[str] = []
    seen: dict[int, str] = {}
    for port, name in fixed_ports(cfg):
        if port in seen:
            if seen[port] != name:
                problems.append(str(field_error(cfg, name, f"port {port} is also {flag_name(seen[port])}'s")))
            continue
        seen[port] = name
        problem = port_problem(cfg.host, port)
        if problem is not None:
            problems.append(str(field_error(cfg, name, f"cannot bind {cfg.host}:{port}: {problem}; stop whatever "
                                                       f"holds it (ss -ltnp 'sport = :{port}') or choose another "
                                                       "port (0 picks a free one)")))
    try:
        resolve(cfg.model)
    except ModelLoadError as e:
        problems.append(str(field_error(cfg, "model", str(e))))
    return problems


def _run(cfg: UpConfig, tls_dir: Path | None, key: str | None,
         extra: dict[str, list[str]] | None = None, own_cpu: frozenset[str] = frozenset()) -> int:
    policy = RestartPolicy(max_restarts=cfg.max_restarts, window_s=cfg.restart_window_s,
                           max_backoff_s=cfg.max_restart_backoff_s)
    cluster = LocalCluster(prefill=cfg.prefill, decode=cfg.decode,
                           kvstore=None if cfg.kvstore == "none" else cfg.kvstore, model=cfg.model,
                           dtype=cfg.dtype, host=cfg.host, http_port=cfg.http_port, grpc_port=cfg.grpc_port,
                           colocated=cfg.colocated, kv_transport=cfg.kv_transport, tls_dir=tls_dir,
                           api_key=None if cfg.api_key_file else key,
                           api_key_file=str(Path(cfg.api_key_file).resolve()) if cfg.api_key_file else None,
                           supervise=cfg.restart, restart_policy=policy, pin_cores=cfg.pin_cores,
                           metrics_port_base=cfg.metrics_port_base, extra=extra, lend_cores=cfg.lend_cores,
                           log_dir=cfg.log_dir or None, own_cpu=own_cpu)
    stop = threading.Event()

    first_signal: list[float] = []  # monotonic time of the first stop signal

    def handle(signum: int, again: bool) -> None:
        if again:  # a later signal: do not wait for draining
            _say(f"{signal.Signals(signum).name} again: killing every service", err=True)
            cluster.kill_all()
        stop.set()
        cluster.request_stop()

    def on_signal(signum: int, _frame: object) -> None:
        # The handler runs in the main thread between bytecodes, possibly while that thread holds the
        # lock of stop.wait()'s condition or of the output: it takes no lock itself, a thread does the work.
        now = time.monotonic()
        if first_signal and now - first_signal[0] < SIGNAL_REPEAT_S:
            return  # the same stop request, delivered twice
        again = bool(first_signal)
        first_signal.append(now)
        threading.Thread(target=handle, args=(signum, again), name="pdserve-up-signal", daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if tls_dir is None:  # only --insecure-internal gets here
        where = "from the network" if dial_host(cfg.host) not in ("127.0.0.1", "localhost", "::1") else \
            "by every local process"
        _say(f"WARNING: --insecure-internal: internal RPCs (Prefill, Reserve, PushKV, kvstore Put/Get) are "
             f"plaintext and answer anyone {where} (docs/SECURITY.md)", err=True)
    _say("starting ...")
    try:
        cluster.start(cfg.start_timeout_s)
    except StartCancelled:
        _say("stopped")
        return 0
    except (RuntimeError, OSError) as e:
        _say(str(e), err=True)
        return 1
    rc = 0
    try:
        _print_endpoints(cfg, cluster, tls_dir, key)
        if cfg.prometheus_sd:
            _write_targets(cfg.prometheus_sd, cluster)
            _say(f"Prometheus targets (fixed across restarts) in {cfg.prometheus_sd}")
        if cfg.demo:
            _demo(cluster.router["http"], key)
        while not stop.wait(0.5):
            if cluster.failed:
                _say(f"gave up on {', '.join(p.name for p in cluster.failed)}; stopping", err=True)
                rc = 1
                break
            if not cfg.restart and cluster.dead():
                _say(f"{', '.join(p.name for p in cluster.dead())} exited; stopping (--no-restart)", err=True)
                rc = 1
                break
    finally:
        _say("stopping (router first) ...")
        cluster.stop(grace=cfg.stop_grace_s)
        _say("stopped")
    return rc


def main(argv: list[str]) -> int:
    p = ArgParser(prog="pdserve up", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arg(p)
    add_dataclass_args(p, UpConfig)
    ns = p.parse_args(argv)
    try:
        file = config_file(ns)
        if file is not None:
            check_file(file)
        cfg = from_args(UpConfig, ns, file=file, section="up")
        key = cfg.key()
    except (ConfigError, OSError) as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    problems = startup_problems(cfg)
    for problem in problems:
        print(f"pdserve up: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    extra = _forwarded(ns, cfg, ns.config)
    _add_compile_flags(extra, cfg, file, given=ns.cpu_compile_decode is not None)
    _add_gpu_memory_shares(extra, cfg, file)
    if note := one_gpu_pd_note(cfg):
        emit(note)
    own_cpu = own_cpu_modules(file)
    if own_cpu:
        emit(f"pdserve up: {', '.join(sorted(own_cpu))} engines keep the CPU settings given ("
             + " / ".join(CPU_FIELDS) + "): no core share or lending of pdserve up's for them")
    tls_dir: Path | None = Path(cfg.tls_dir) if cfg.tls_dir else None
    tmp: str | None = None
    if tls_dir is None and not cfg.insecure_internal:
        tmp = tempfile.mkdtemp(prefix="pdserve-tls-")  # mode 0700: only this user reads the keys
        tls_dir = make_certs(tmp, hosts=tuple(dict.fromkeys(("localhost", "127.0.0.1", dial_host(cfg.host)))))
    try:
        return _run(cfg, tls_dir, key, extra, own_cpu)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
