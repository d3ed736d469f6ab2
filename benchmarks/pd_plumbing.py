"""Where one P/D request's TTFT goes besides compute and transfer: a measured phase timeline.

    python -m benchmarks.pd_plumbing --model random:smollm2-135m --kv-transport shm,grpc --prompt-tokens 32
    python -m benchmarks.pd_plumbing --model random:llama-3-8b --device cuda --kv-transport cuda-ipc \
        --prompt-tokens 2000 --dtype bfloat16 --kv-cache-bytes 8589934592 --chunk 2048

Starts a local P/D cluster per transport (router, one prefill, one decode, each a process) and a
colocated one, sends ``--requests`` sequential requests with fresh prompts (no prefix reuse) after
``--warmup`` ones, and scrapes every service's /metrics before and after each request: one request in
flight, so a histogram's sum delta is that request's value. The phases come from
``pdserve_{router,prefill,decode}_handoff_phase_seconds`` (docs/METRICS.md) plus prefill's queue and
compute histograms and decode's exposed transfer. Each point is printed in ms from the request's arrival
at the router (each request's phases chained, then the median over requests per point; cross-process
points use the hop measured with Unix clocks, so on one host they line up). The client keeps one
channel open, so TTFT excludes connection set-up. Also printed: client TTFT, the colocated TTFT, and
plumbing = client TTFT - prefill compute - exposed transfer (the split of docs/PERFORMANCE.md's tables).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import time
import urllib.request
from collections.abc import Iterator

import grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common import metrics as m
from services.common.cli_args import ArgParser
from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, router_pb2, router_pb2_grpc
from services.launcher import LocalCluster

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""CPU flags printed beside the figures (the ones the engine's kernels choose by)."""


def cpu_line() -> str:
    model, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"CPU: {model}, {os.cpu_count()} logical CPUs, flags {' '.join(f for f in CPU_FLAGS if f in flags)}; "
            f"load average (1 min) {load:.1f}")


def scrape(address: str) -> dict[str, float]:
    """``name[phase]`` -> sum and ``name[phase]#n`` -> count of every histogram at ``address``/metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            for suffix, tag in (("_sum", ""), ("_count", "#n")):
                if s.name.endswith(suffix):
                    key = f"{s.name.removesuffix(suffix)}[{s.labels.get('phase', '')}]{tag}"
                    out[key] = out.get(key, 0.0) + s.value
    return out


def request_phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds per histogram[phase] observed once between two scrapes (the mean when observed more often)."""
    out = {}
    for key, value in after.items():
        if key.endswith("#n"):
            continue
        n = after.get(key + "#n", 0.0) - before.get(key + "#n", 0.0)
        if n > 0:
            out[key] = (value - before.get(key, 0.0)) / n
    return out


R, P, D = m.ROUTER_HANDOFF_PHASE_SECONDS, m.PREFILL_HANDOFF_PHASE_SECONDS, m.DECODE_HANDOFF_PHASE_SECONDS


def timeline(ph: dict[str, float]) -> list[tuple[str, float | None]]:
    """(point, ms from arrival at the router) of one P/D request, from its phase medians."""
    def g(name: str, phase: str = "") -> float | None:
        return ph.get(f"{name}[{phase}]")

    def plus(*parts: float | None) -> float | None:
        return None if any(p is None for p in parts) else sum(parts)  # type: ignore[arg-type]

    arrive = plus(g(R, "prefill_sent"), g(P, "rpc_in"))
    scheduled = plus(arrive, g(m.PREFILL_QUEUE_SECONDS))
    computed = plus(scheduled, g(m.PREFILL_COMPUTE_SECONDS))
    points = [
        ("router receives", 0.0),
        ("Reserve answered", g(R, "reserve")),
        ("Prefill call made", g(R, "prefill_sent")),
        ("Prefill arrives at prefill", arrive),
        ("AttachReservation answered (early prefill)", g(R, "attached")),
        ("reservation attached at prefill (early prefill)", plus(arrive, g(P, "attached"))),
        ("claim acknowledged (stream open)", plus(arrive, g(P, "claim"))),
        ("admitted to the engine", plus(arrive, g(P, "admitted"))),
        ("first chunk scheduled", scheduled),
        ("last chunk computed", computed),
        ("sender task took the last chunk", plus(computed, g(P, "picked"))),
        ("last KV message handed to the sender", plus(computed, g(P, "last_sent"))),
        ("last KV landed at decode (engine took it)", plus(computed, g(m.DECODE_KV_TRANSFER_EXPOSED_SECONDS))),
        ("decode's first message sent", plus(computed, g(m.DECODE_KV_TRANSFER_EXPOSED_SECONDS),
                                              g(D, "first_message"))),
        ("PushKV answered at prefill", plus(computed, g(P, "finish"))),
        ("PrefillResponse at the router", g(R, "prefill_response")),
        ("decode's first message at the router", g(R, "decode_first")),
        ("first token out to the client", g(R, "first_token")),
        ("client TTFT", g("client_ttft")),
    ]
    return [(name, None if v is None else v * 1000) for name, v in points]


@contextlib.contextmanager
def started(c: LocalCluster, timeout_s: float) -> Iterator[LocalCluster]:
    """``c`` started with a start-up bound of ``timeout_s`` (a loaded host warms up slowly), stopped after."""
    c.start(timeout_s)
    try:
        yield c
    finally:
        c.stop()


def run_pd(args: argparse.Namespace, transport: str, prompts: Iterator[list[int]], early: str = "on",
           label: str = "") -> dict[str, float]:
    """``early``: the router's --early-prefill (on / off)."""
    extra = [*args.service_args]
    router = [] if early == "on" else ["--no-early-prefill"]
    c = LocalCluster(prefill=1, decode=1, kvstore=None, model=args.model, dtype=args.dtype, quiet=True,
                     extra={"prefill": extra, "decode": extra, "router": router}, kv_transport=transport)
    with started(c, args.start_timeout):
        addrs = [c.router["metrics"], c.get("prefill-0").ready["metrics"], c.get("decode-0").ready["metrics"]]
        grpc_addr = c.router["grpc"]
        return measure(args, grpc_addr, addrs, prompts, label or transport, PD_LAST)


PD_LAST = (f"{R}[prefill_response]#n", f"{P}[respond]#n")
"""Counts of the last observations of one P/D request (PrefillResponse may follow the client's last token)."""

LANDED_WITHIN_S = 10.0
"""Longest wait for a request's last observations before scraping anyway (seconds)."""


def scrape_landed(addrs: list[str], before: dict[str, float], last: tuple[str, ...]) -> dict[str, float]:
    """Every service's histograms once each count in ``last`` grew by one since ``before`` (a late observation
    would else land in the next request's delta), or as they are after LANDED_WITHIN_S."""
    deadline = time.monotonic() + LANDED_WITHIN_S
    while True:
        after = {k: v for a in addrs for k, v in scrape(a).items()}
        if all(after.get(k, 0.0) >= before.get(k, 0.0) + 1 for k in last):
            return after
        if time.monotonic() >= deadline:
            print(f"warning: {[k for k in last if after.get(k, 0.0) < before.get(k, 0.0) + 1]} not observed "
                  f"within {LANDED_WITHIN_S} s", flush=True)
            return after
        time.sleep(0.005)


def measure(args: argparse.Namespace, grpc_addr: str, addrs: list[str], prompts: Iterator[list[int]], label: str,
            last: tuple[str, ...] = ()) -> dict[str, float]:
    per: dict[str, list[float]] = {}
    points: dict[str, list[float]] = {}
    with Client(grpc_addr) as client:
        for _ in range(args.warmup):
            client.ttft(next(prompts), args.max_tokens)
        for _ in range(args.requests):
            before = {k: v for a in addrs for k, v in scrape(a).items()}
            ttft = client.ttft(next(prompts), args.max_tokens)
            after = scrape_landed(addrs, before, last)
            got = request_phases(before, after)
            got["client_ttft[]"] = ttft
            for k, v in got.items():
                per.setdefault(k, []).append(v)
            for name, ms in timeline(got):
                if ms is not None:
                    points.setdefault(name, []).append(ms)
    med = {k: statistics.median(v) for k, v in per.items()}
    med.update({f"point:{k}": statistics.median(v) for k, v in points.items()})
    print(f"{label}: client TTFT median {med['client_ttft[]'] * 1000:.2f} ms over {args.requests} requests",
          flush=True)
    return med


class Client:
    """One channel to the router for every request (connected before the first is timed: TTFT excludes
    the TCP/HTTP2 set-up a fresh channel would add)."""

    def __init__(self, address: str) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.channel = self.loop.run_until_complete(self._connect(address))
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    @staticmethod
    async def _connect(address: str) -> grpc.aio.Channel:
        channel = create_channel(address)  # inside the loop: a grpc.aio channel binds to the running loop
        await channel.channel_ready()
        return channel

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()

    def ttft(self, ids: list[int], max_tokens: int) -> float:
        return self.loop.run_until_complete(self._ttft(ids, max_tokens))

    async def _ttft(self, ids: list[int], max_tokens: int) -> float:
        req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), stream=True,
                                         params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True))
        t0 = time.perf_counter()
        ttft = 0.0
        async for msg in self.stub.Generate(req, timeout=300):
            if msg.token_ids and not ttft:
                ttft = time.perf_counter() - t0
        return ttft


def run_colocated(args: argparse.Namespace, prompts: Iterator[list[int]]) -> dict[str, float]:
    c = LocalCluster(prefill=0, decode=1, kvstore=None, model=args.model, dtype=args.dtype, quiet=True,
                     colocated=True, extra={"decode": [*args.service_args]})
    with started(c, args.start_timeout):
        return measure(args, c.router["grpc"], [c.router["metrics"]], prompts, "colocated")


def prompt_stream(tokens: int) -> Iterator[list[int]]:
    k = 0
    while True:
        k += 1
        yield [(k * 7919 + i * 131 + (i * i) % 97) % 245 + 1 for i in range(tokens)]


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-transport", default="shm,grpc", help="comma-separated: grpc, shm, cuda-ipc, mooncake")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--kv-cache-bytes", type=int, default=0, help="the services' --kv-cache-bytes (0: their default)")
    p.add_argument("--chunk", type=int, default=0, help="the services' --max-prefill-chunk (0: their default)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a cluster may take to start")
    p.add_argument("--no-colocated", action="store_true", help="skip the colocated baseline")
    p.add_argument("--service-flags", default="", help="more flags for every engine service, space-separated "
                                                           "(e.g. \"--cpu-compile-decode 0\")")
    p.add_argument("--early-prefill", default="on", help="comma-separated router --early-prefill settings to run "
                                                         "per transport, e.g. off,on (columns 'grpc early-off')")
    p.add_argument("--rounds", type=int, default=1, help="run every (transport, early) cluster this many times, "
                                                         "alternating (columns get ' #k')")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    args.service_args = ["--device", args.device]
    if args.kv_cache_bytes:
        args.service_args += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if args.chunk:
        args.service_args += ["--max-prefill-chunk", str(args.chunk)]
    args.service_args += args.service_flags.split()
    print(cpu_line(), flush=True)
    prompts = prompt_stream(args.prompt_tokens)
    col = None if args.no_colocated else run_colocated(args, prompts)
    early = args.early_prefill.split(",")
    results: dict[str, dict[str, float]] = {}
    for k in range(args.rounds):
        for t in args.kv_transport.split(","):
            for e in early:
                name = t + (f" early-{e}" if len(early) > 1 else "") + (f" #{k + 1}" if args.rounds > 1 else "")
                results[name] = run_pd(args, t, prompts, e, name)
    print(f"\n{args.model} {args.dtype} on {args.device}, {args.prompt_tokens}-token prompts, median of "
          f"{args.requests} sequential requests; ms from arrival at the router\n")
    names = list(results)
    print("| point | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for point, _ in timeline({}):
        cells = [results[t].get(f"point:{point}") for t in names]
        print(f"| {point} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in cells) + " |")
    for t, r in results.items():
        ttft = r["client_ttft[]"]
        compute = r.get(f"{m.PREFILL_COMPUTE_SECONDS}[]", 0.0)
        exposed = r.get(f"{m.DECODE_KV_TRANSFER_EXPOSED_SECONDS}[]", 0.0)
        ratio = f", {ttft / col['client_ttft[]']:.2f}x colocated {col['client_ttft[]'] * 1000:.2f} ms" if col else ""
        print(f"{t}: TTFT {ttft * 1000:.2f} ms = compute {compute * 1000:.2f} + exposed {exposed * 1000:.2f} + "
              f"plumbing {(ttft - compute - exposed) * 1000:.2f}{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "colocated": col, "pd": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
