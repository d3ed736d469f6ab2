"""``pdserve up``: a local P/D cluster as real processes on loopback.

Starts kvstore, N prefill and M decode services, then the router pointed at them; waits until
every one reports ready (its ``PDSERVE_READY`` line, printed once health is SERVING), prints the
endpoints, and stops them all on Ctrl-C / SIGTERM (or when any of them dies).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

READY_PREFIX = "PDSERVE_READY "


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    ready: dict[str, str] = field(default_factory=dict)
    event: threading.Event = field(default_factory=threading.Event)
    lines: list[str] = field(default_factory=list)


def parse_ready(line: str) -> dict[str, str] | None:
    if not line.startswith(READY_PREFIX):
        return None
    return dict(kv.split("=", 1) for kv in line[len(READY_PREFIX):].split() if "=" in kv)


class LocalCluster:
    """Processes of one local cluster; usable from tests as a context manager."""

    def __init__(self, *, prefill: int = 1, decode: int = 1, kvstore: str | None = "embedded",
                 model: str | None = None, dtype: str = "bfloat16", host: str = "127.0.0.1",
                 http_port: int = 0, grpc_port: int = 0, extra: dict[str, list[str]] | None = None,
                 colocated: bool = False, env: dict[str, str] | None = None, quiet: bool = False,
                 kv_transport: str = "grpc") -> None:
        self.n_prefill, self.n_decode, self.kvstore = prefill, decode, kvstore
        self.model, self.dtype, self.host = model, dtype, host
        self.http_port, self.grpc_port = http_port, grpc_port
        self.extra = extra or {}
        self.colocated = colocated
        self.kv_transport = kv_transport
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.quiet = quiet
        self.procs: list[Proc] = []

    def _spawn(self, name: str, module: str, args: list[str]) -> Proc:
        cmd = [sys.executable, "-m", f"services.{module}", "--host", self.host, *args,
               *self.extra.get(module, []), *self.extra.get(name, [])]
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=self.env, start_new_session=True)
        proc = Proc(name, popen)

        def pump() -> None:
            assert popen.stdout is not None
            for line in popen.stdout:
                line = line.rstrip("\n")
                proc.lines.append(line)
                del proc.lines[:-400]
                info = parse_ready(line)
                if info is not None:
                    proc.ready = info
                    proc.event.set()
                elif not self.quiet:
                    print(f"[{name}] {line}", flush=True)
            proc.event.set()

        threading.Thread(target=pump, daemon=True).start()
        self.procs.append(proc)
        return proc

    def _wait(self, procs: list[Proc], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in procs:
            if not p.event.wait(max(0.0, deadline - time.monotonic())) or not p.ready:
                tail = "\n".join(p.lines[-30:])
                raise RuntimeError(f"{p.name} did not become ready (exit code {p.popen.poll()}):\n{tail}")

    def model_args(self) -> list[str]:
        args = ["--dtype", self.dtype]
        if self.model:
            args += ["--model", self.model]
        return args

    def start(self, timeout: float = 180.0) -> LocalCluster:
        try:
            first: list[Proc] = []
            kv_addr = ""
            if self.kvstore:
                kv_flags = ["--port", "0", "--metrics-port", "0", "--backend", self.kvstore]
                if self.kvstore == "mooncake":  # a Mooncake Store master on loopback holds the pages
                    master = self._spawn("mooncake-master", "kvstore.mooncake_master", ["--rpc-port", "0"])
                    self._wait([master], timeout)
                    kv_flags += ["--mooncake-master", master.ready["rpc"]]
                kv = self._spawn("kvstore", "kvstore", kv_flags)
                self._wait([kv], timeout)
                kv_addr = kv.ready["grpc"]
            kv_args = ["--kvstore-address", kv_addr] if kv_addr else []
            shm = self.kv_transport in ("shm", "cuda-ipc")  # decode shares its pool; prefill writes into it
            kv_args += ["--kv-transport", self.kv_transport] if shm else []
            if self.colocated:
                for j in range(self.n_decode):
                    first.append(self._spawn(f"worker-{j}", "decode", ["--port", "0", "--metrics-port", "0",
                                                                       "--mode", "colocated",
                                                                       *self.model_args()]))
            else:
                for i in range(self.n_prefill):
                    first.append(self._spawn(f"prefill-{i}", "prefill", ["--port", "0", "--metrics-port", "0",
                                                                         *kv_args, *self.model_args()]))
                for j in range(self.n_decode):
                    first.append(self._spawn(f"decode-{j}", "decode", ["--port", "0", "--metrics-port", "0",
                                                                       *(["--kv-cache-shared"] if shm else []),
                                                                       *self.model_args()]))
            self._wait(first, timeout)
            prefills = [p.ready["grpc"] for p in first if p.name.startswith("prefill")]
            decodes = [p.ready["grpc"] for p in first if not p.name.startswith("prefill")]
            rargs = ["--http-port", str(self.http_port), "--port", str(self.grpc_port), "--metrics-port", "0",
                     "--decode", ",".join(decodes)]
            if prefills:
                rargs += ["--prefill", ",".join(prefills)]
            if self.model:
                rargs += ["--model", self.model]
            router = self._spawn("router", "router", rargs)
            self._wait([router], timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def get(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    @property
    def router(self) -> dict[str, str]:
        return self.get("router").ready

    def endpoints(self) -> dict[str, dict[str, str]]:
        return {p.name: p.ready for p in self.procs}

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if p.popen.poll() is not None]

    def stop(self, grace: float = 10.0) -> None:
        # Router first, so no new work arrives while the workers drain.
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def served_model(http: str) -> str:
    with urllib.request.urlopen(f"http://{http}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def _demo(http: str) -> None:
    body = json.dumps({"model": served_model(http), "max_tokens": 48, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
    req = urllib.request.Request(f"http://{http}/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    dt = time.perf_counter() - t0
    print(f"demo: Q: What is the capital of France?\ndemo: A: {out['choices'][0]['message']['content']!r}"
          f"  ({out['usage']['completion_tokens']} tokens in {dt:.2f}s)", flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__)
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--kvstore", choices=("embedded", "mooncake", "none"), default="embedded")
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--colocated", action="store_true", help="one service does prefill and decode (A/B)")
    p.add_argument("--kv-transport", choices=("shm", "cuda-ipc", "grpc"), default="shm",
                   help="shm (CPU) / cuda-ipc (GPU): prefill writes pages straight into decode's pool (one host); "
                        "grpc: page bytes inside the PushKV stream (what crosses hosts)")
    p.add_argument("--demo", action="store_true", help="send one chat request once the cluster is up")
    args = p.parse_args(argv)
    cluster = LocalCluster(prefill=args.prefill, decode=args.decode,
                           kvstore=None if args.kvstore == "none" else args.kvstore, model=args.model,
                           dtype=args.dtype, host=args.host, http_port=args.http_port,
                           grpc_port=args.grpc_port, colocated=args.colocated, kv_transport=args.kv_transport)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print("pdserve up: starting ...", flush=True)
    try:
        cluster.start()
    except RuntimeError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 1
    for name, info in cluster.endpoints().items():
        print(f"  {name:10s} " + "  ".join(f"{k}={v}" for k, v in sorted(info.items())), flush=True)
    http = cluster.router["http"]
    print(f"pdserve up: serving. OpenAI API at http://{http}/v1 (Ctrl-C stops everything)\n"
          f"  curl http://{http}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\":\"{served_model(http)}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hi\"}}]}}'", flush=True)
    try:
        if args.demo:
            _demo(http)
        while not stop.wait(0.5):
            if cluster.dead():
                print(f"pdserve up: {', '.join(p.name for p in cluster.dead())} exited; stopping", file=sys.stderr)
                return 1
    finally:
        cluster.stop()
        print("pdserve up: stopped", flush=True)
    return 0
