"""What the served path costs per token at batch 1: CPU milliseconds per output token of each thread of
the worker and the router (and of this client) while streamed /v1/completions decode one at a time.

Thread CPU comes from /proc/<pid>/task/<tid>/stat (clock ticks), thread names from ``py-spy dump``
(threads Python does not know, e.g. OpenMP workers, count as "native/omp"). CPU time, unlike wall
time, barely moves with the load of a shared box, so it separates the serving work (event loop, gRPC,
router, detokenization, SSE) from the engine step.

    python -m benchmarks.served_overhead --url http://127.0.0.1:8000 --worker-pid W --router-pid R
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
import urllib.request

from services.common.cli_args import ArgParser


def thread_names(pid: int) -> dict[int, str]:
    out = subprocess.run(["py-spy", "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                         text=True, check=True).stdout
    return {int(t): name for t, name in re.findall(r'^Thread (\d+) \([^)]*\): "([^"]+)"', out, re.M)}


def thread_cpu_ms(pid: int) -> dict[int, float]:
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    cpu: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        cpu[int(tid)] = (int(fields[11]) + int(fields[12])) * tick_ms  # utime + stime
    return cpu


def stream_one(url: str, model: str, max_tokens: int, i: int) -> float:
    """One streamed request; returns its TPOT (ms) between the first and last output events."""
    body = json.dumps({"model": model, "prompt": f"Request {i} at {time.time()}: the history of the river is",
                       "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(req) as r:
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return (times[-1] - times[0]) / (len(times) - 1) * 1000


def per_token(before: dict[int, float], after: dict[int, float], names: dict[int, str], tokens: int
              ) -> dict[str, float]:
    groups: dict[str, float] = {}
    for tid, ms in after.items():
        key = names.get(tid, "native/omp")
        groups[key] = groups.get(key, 0.0) + ms - before.get(tid, 0.0)
    return {k: round(v / tokens, 3) for k, v in sorted(groups.items()) if v > 0}


def main(argv: list[str] | None = None) -> int:
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct.Q4_1")
    ap.add_argument("--worker-pid", type=int, required=True)
    ap.add_argument("--router-pid", type=int, required=True)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    names = {"worker": thread_names(a.worker_pid), "router": thread_names(a.router_pid)}
    pids = {"worker": a.worker_pid, "router": a.router_pid}
    before = {k: thread_cpu_ms(p) for k, p in pids.items()}
    t0 = os.times()
    tpots = [stream_one(a.url, a.model, a.max_tokens, i) for i in range(a.requests)]
    t1 = os.times()
    after = {k: thread_cpu_ms(p) for k, p in pids.items()}
    tokens = a.requests * (a.max_tokens - 1)
    print(f"TPOT median {statistics.median(tpots):.2f} ms over {a.requests} requests; load {os.getloadavg()}")
    for k in pids:
        print(f"{k} CPU ms/token", json.dumps(per_token(before[k], after[k], names[k], tokens)))
    print(f"client CPU ms/token {(t1.user + t1.system - t0.user - t0.system) * 1000 / tokens:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
