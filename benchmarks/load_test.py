"""``python -m benchmarks.load_test``: the router under load on a busy host, with the real ``openai`` client.

For each set-up (1P1D, 2P2D, colocated: real processes from :class:`services.launcher.LocalCluster`) and
each concurrency (4, 16, 64), ``concurrency`` clients send streamed completions of exactly
``--prompt-tokens`` token ids (each prompt unique, so no prefix reuse) for ``--duration-s`` seconds while
a CPU hog (a Python busy loop) runs beside the cluster. A client that is refused waits the advised
Retry-After and goes on. Every request is classified:

- ``completed``: finish_reason stop/length with at least one token;
- ``429`` / ``503``: refused with Retry-After (the designed backpressure answers);
- ``empty_200``: a 200 that did not complete (no finish_reason or no token): must be 0;
- ``other``: anything else (a 429/503 without Retry-After, another status, an SSE error mid-stream,
  a client timeout or connection error).

Meanwhile a sampler reads every service's RSS and the router's ``pdserve_router_instance_healthy``:
an instance reported 0 while its process lives is an ``unhealthy`` event (must be 0). RSS must stay
flat under steady load: within each level, after its first ``--warmup-s`` seconds (a new concurrency
grows the batches, hence the activations, once), the median RSS of the window's last third may exceed
that of its first third by at most ``--rss-bound-mib`` (a leak grows with requests served; the
allocator's ups and downs cancel out). The kvstore is a cache that fills by design: its memory tier is
capped at ``--kvstore-memory-mib`` for the run, and its RSS may not pass its start value plus that cap,
its in-flight Put quota (``--kvstore-put-quota-mib``: pages being assembled are held apart from the
tier) and the same bound (eviction must hold it).
Prints the CPU model and flags (lscpu) and a table; ``--json PATH`` writes everything. Exit status 0
when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

from services.common.cli_args import ArgParser
from services.common.metrics import ROUTER_INSTANCE_HEALTHY
from services.launcher import LocalCluster, served_model

SETUPS: dict[str, dict[str, Any]] = {
    "1p1d": {"prefill": 1, "decode": 1},
    "2p2d": {"prefill": 2, "decode": 2},
    "colocated": {"prefill": 0, "decode": 1, "colocated": True},
}
KINDS = ("completed", "429", "503", "empty_200", "other")
FILLER = ("The survey of the river delta recorded the tides, the silt carried by each flood, the birds that "
          "nested on the sandbanks and the boats that worked the channels between them. ")


@dataclass
class Result:
    kind: str
    detail: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    tokens: int = 0
    retry_after_s: float = 0.0


@dataclass
class Level:
    setup: str
    concurrency: int
    duration_s: float
    counts: dict[str, int] = field(default_factory=dict)
    details: dict[str, int] = field(default_factory=dict)
    """What ``other`` and ``empty_200`` requests were (first words of the error), with counts."""
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    e2e_p50_s: float | None = None


def cpu_info() -> dict[str, Any]:
    """The CPU model and flags as lscpu reports them (empty when lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {"model": "unknown", "flags": [], "cpus": psutil.cpu_count()}
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {"model": info.get("Model name", "unknown").strip(), "flags": info.get("Flags", "").split(),
            "cpus": psutil.cpu_count()}


@contextlib.contextmanager
def cpu_hog(on: bool = True) -> Iterator[subprocess.Popen[bytes] | None]:
    """A Python busy loop on one core for the duration (imitates a host busy with other work)."""
    if not on:
        yield None
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


def make_prompts(n: int, prompt_tokens: int, model: str | None = None) -> list[list[int]]:
    """``n`` unique prompts of exactly ``prompt_tokens`` token ids (the router's tokenizer)."""
    from services.text.model.source import load_tokenizer  # the model's tokenizer, loaded once

    tok, _, _ = load_tokenizer(model)
    base = tok.encode(FILLER * (prompt_tokens // 8 + 8), add_special_tokens=False)
    prompts = []
    for i in range(n):
        head = tok.encode(f"Report {i} of the survey. ")
        prompts.append((head + base)[:prompt_tokens])
    return prompts


def _retry_after(e: openai.APIStatusError) -> float | None:
    value = e.response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> Result:
    t0 = time.perf_counter()
    ttft, tokens, finish, text = None, 0, None, ""
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 temperature=0, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            for c in chunk.choices:
                if c.text and ttft is None:
                    ttft = time.perf_counter() - t0
                text += c.text
                finish = c.finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIStatusError as e:
        ra = _retry_after(e)
        if e.status_code in (429, 503) and ra is not None:
            return Result(str(e.status_code), _brief(e), e2e_s=time.perf_counter() - t0, retry_after_s=ra)
        return Result("other", f"HTTP {e.status_code}{'' if ra is not None else ' no Retry-After'}: {_brief(e)}")
    except openai.APIError as e:  # an SSE error event mid-stream, a timeout, a dropped connection
        return Result("other", f"{type(e).__name__}: {_brief(e)}")
    e2e = time.perf_counter() - t0
    if finish not in ("stop", "length") or tokens < 1 or not text:
        return Result("empty_200", f"finish={finish} tokens={tokens}", ttft, e2e, tokens)
    return Result("completed", "", ttft, e2e, tokens)


def _brief(e: BaseException) -> str:
    """An error's message on one line, cut at 80 characters."""
    return " ".join(str(e).split())[:80]


async def run_level(http: str, model: str, prompts: list[list[int]], setup: str, concurrency: int,
                    duration_s: float, max_tokens: int, request_timeout_s: float, drain_s: float,
                    max_requests: int | None = None) -> Level:
    """``concurrency`` clients in a closed loop for ``duration_s`` (or until ``max_requests`` were sent);
    in-flight requests then get ``drain_s`` to finish (past it they count as ``other``)."""
    client = openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key="load-test", max_retries=0,
                                timeout=request_timeout_s)
    results: list[Result] = []
    next_prompt = iter(range(10**9))
    stop_at = time.monotonic() + duration_s

    async def worker() -> None:
        while time.monotonic() < stop_at:
            i = next(next_prompt)
            if max_requests is not None and i >= max_requests:
                return
            r = await one_request(client, model, prompts[i % len(prompts)], max_tokens)
            results.append(r)
            if r.retry_after_s:
                await asyncio.sleep(min(r.retry_after_s, max(0.0, stop_at - time.monotonic())))

    t0 = time.monotonic()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=duration_s + drain_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    results += [Result("other", "unfinished at the drain bound")] * len(pending)
    elapsed = time.monotonic() - t0
    await client.close()
    counts = Counter(r.kind for r in results)
    ok = [r for r in results if r.kind == "completed"]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    e2es = sorted(r.e2e_s for r in ok)
    return Level(setup, concurrency, round(elapsed, 1), {k: counts.get(k, 0) for k in KINDS},
                 dict(Counter(f"{r.kind}: {r.detail}" for r in results
                              if r.kind in ("other", "empty_200")).most_common(8)),
                 round(len(ok) / elapsed, 3), round(sum(r.tokens for r in ok) / elapsed, 2),
                 _pct(ttfts, 0.5), _pct(ttfts, 0.99), _pct(e2es, 0.5))


def _pct(xs: list[float], q: float) -> float | None:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


class Sampler:
    """Samples every service's RSS and the router's instance_healthy gauge, in a thread."""

    def __init__(self, cluster: LocalCluster, interval_s: float = 1.0) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.rss: dict[str, list[tuple[float, int]]] = {}
        """service -> [(monotonic seconds, RSS bytes)]."""
        self.unhealthy: list[dict[str, Any]] = []
        """Samples where the router reported an instance unhealthy while its process was alive."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        now = time.monotonic()
        alive: dict[str, bool] = {}
        for p in self.cluster.procs:
            pid = int(p.ready.get("pid", 0)) or (p.popen.pid if p.popen is not None else 0)
            alive[p.ready.get("grpc", "")] = p.popen is not None and p.popen.poll() is None
            with contextlib.suppress(psutil.Error, ValueError):
                self.rss.setdefault(p.name, []).append((now, psutil.Process(pid).memory_info().rss))
        for role, endpoint, value in router_health(self.cluster.router.get("metrics", "")):
            if value == 0 and alive.get(endpoint, False):
                self.unhealthy.append({"t": round(now, 1), "role": role, "endpoint": endpoint})


def router_health(metrics_address: str) -> list[tuple[str, str, float]]:
    """(role, endpoint, value) of every pdserve_router_instance_healthy sample; [] if unreachable."""
    if not metrics_address:
        return []
    try:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return []
    return [(s.labels.get("role", ""), s.labels.get("endpoint", ""), s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == ROUTER_INSTANCE_HEALTHY]


def rss_report(rss: dict[str, list[tuple[float, int]]], windows: list[tuple[int, float, float]]
               ) -> dict[str, dict[str, Any]]:
    """Per service, MiB: first, peak and last sample, and per level window (concurrency, steady-state
    start, end; monotonic seconds) the median of its first third and the growth of its last third's
    median over it."""
    mib = 1 / 2**20
    out: dict[str, dict[str, Any]] = {}
    for name, samples in rss.items():
        if not samples:
            continue
        t0 = samples[0][0]
        levels = []
        for conc, start, end in windows:
            inside = [v for t, v in samples if start <= t <= end]
            if len(inside) >= 3:
                third = len(inside) // 3
                first, last = statistics.median(inside[:third]), statistics.median(inside[-third:])
                levels.append({"concurrency": conc, "baseline": round(first * mib, 1),
                               "growth": round((last - first) * mib, 1)})
        out[name] = {"first": round(samples[0][1] * mib, 1), "peak": round(max(v for _, v in samples) * mib, 1),
                     "last": round(samples[-1][1] * mib, 1),
                     "growth": max((lv["growth"] for lv in levels), default=0.0), "levels": levels,
                     "series": [(round(t - t0, 1), round(v * mib, 1)) for t, v in samples]}
    return out


def run_setup(name: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    spec = SETUPS[name]
    levels: list[Level] = []
    extra = {"kvstore": ["--memory-bytes", str(int(args.kvstore_memory_mib * 2**20)),
                         "--max-inflight-put-bytes", str(int(args.kvstore_put_quota_mib * 2**20))]}
    with cpu_hog(args.hog), LocalCluster(**spec, extra=extra, quiet=True) as cluster, \
            Sampler(cluster, args.sample_s) as sampler:
        http = cluster.router["http"]
        model = served_model(http)
        windows: list[tuple[int, float, float]] = []
        for conc in args.concurrency:
            start = time.monotonic()
            level = asyncio.run(run_level(http, model, prompts, name, conc, args.duration_s, args.max_tokens,
                                          args.request_timeout_s, args.drain_s))
            windows.append((conc, start + args.warmup_s, start + args.duration_s))
            levels.append(level)
            print(f"  {name} c={conc}: {level.counts} {level.details or ''}", flush=True)
        sampler.sample()
    rss = rss_report(sampler.rss, windows)
    return {"setup": name, "levels": [asdict(lv) for lv in levels], "unhealthy_events": sampler.unhealthy,
            "rss_mib": rss}


def checks(results: list[dict[str, Any]], rss_bound_mib: float, kvstore_memory_mib: float,
           kvstore_put_quota_mib: float) -> list[str]:
    """What failed, in words (empty: every check holds). The kvstore may hold its memory tier plus the
    pages open Put streams are assembling (its in-flight quota) on top of its start RSS."""
    bad = []
    for res in results:
        for lv in res["levels"]:
            tag = f"{res['setup']} c={lv['concurrency']}"
            if lv["counts"]["empty_200"]:
                bad.append(f"{tag}: {lv['counts']['empty_200']} empty 200s")
            if lv["counts"]["other"]:
                bad.append(f"{tag}: {lv['counts']['other']} requests neither completed nor 429/503 with "
                           f"Retry-After: {lv['details']}")
        if res["unhealthy_events"]:
            bad.append(f"{res['setup']}: live instances reported unhealthy: {res['unhealthy_events'][:5]}")
        for svc, r in res["rss_mib"].items():
            if svc == "kvstore":
                if r["peak"] > r["first"] + kvstore_memory_mib + kvstore_put_quota_mib + rss_bound_mib:
                    bad.append(f"{res['setup']}: kvstore RSS reached {r['peak']} MiB from {r['first']} MiB with a "
                               f"{kvstore_memory_mib} MiB memory tier and a {kvstore_put_quota_mib} MiB Put "
                               f"quota (bound {rss_bound_mib} over those)")
            elif r["growth"] > rss_bound_mib:
                bad.append(f"{res['setup']}: {svc} RSS grew {r['growth']} MiB within a level after its warm-up "
                           f"(bound {rss_bound_mib}): {r['levels']}")
    return bad


def print_table(cpu: dict[str, Any], results: list[dict[str, Any]]) -> None:
    print(f"CPU: {cpu['model']} ({cpu['cpus']} logical CPUs)")
    print(f"flags: {' '.join(cpu['flags'])}")
    head = ("setup", "conc", "done", "429", "503", "empty200", "other", "req/s", "tok/s", "TTFT p50", "TTFT p99",
            "e2e p50", "unhealthy", "RSS growth MiB (worst engine/router)")
    print(" | ".join(head))
    for res in results:
        for lv in res["levels"]:
            growth = max((w["growth"] for svc, r in res["rss_mib"].items() if svc != "kvstore"
                          for w in r["levels"] if w["concurrency"] == lv["concurrency"]), default=0.0)
            c = lv["counts"]
            row = (res["setup"], lv["concurrency"], c["completed"], c["429"], c["503"], c["empty_200"], c["other"],
                   lv["requests_per_s"], lv["tokens_per_s"], lv["ttft_p50_s"], lv["ttft_p99_s"], lv["e2e_p50_s"],
                   len(res["unhealthy_events"]), growth)
            print(" | ".join(str(x) for x in row))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgParser(prog="python -m benchmarks.load_test", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", default="1p1d,2p2d,colocated", help=f"comma-separated, of {', '.join(SETUPS)}")
    p.add_argument("--concurrency", default="4,16,64", help="comma-separated client counts")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--duration-s", type=float, default=60.0, help="load time per concurrency level")
    p.add_argument("--drain-s", type=float, default=120.0, help="bound on in-flight requests after a level")
    p.add_argument("--warmup-s", type=float, default=15.0, help="RSS baseline: this long into each level")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="client-side timeout per request")
    p.add_argument("--rss-bound-mib", type=float, default=64.0,
                   help="allowed RSS growth per service within a level after its warm-up")
    p.add_argument("--sample-s", type=float, default=1.0, help="RSS / health sampling period")
    p.add_argument("--kvstore-memory-mib", type=float, default=256.0, help="the kvstore's memory tier for the run")
    p.add_argument("--kvstore-put-quota-mib", type=float, default=64.0,
                   help="the kvstore's --max-inflight-put-bytes for the run (>= its 64 MiB largest page)")
    p.add_argument("--no-hog", dest="hog", action="store_false", help="no CPU hog beside the cluster")
    p.add_argument("--json", default="", help="write the results here")
    ns = p.parse_args(argv)
    ns.setups = [s for s in ns.setups.split(",") if s]
    ns.concurrency = [int(c) for c in ns.concurrency.split(",") if c]
    unknown = [s for s in ns.setups if s not in SETUPS]
    if unknown:
        p.error(f"unknown setups {unknown}; choose from {list(SETUPS)}")
    return ns


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = cpu_info()
    prompts = make_prompts(max(256, 4 * max(args.concurrency)), args.prompt_tokens)
    results = []
    for name in args.setups:
        print(f"{name}: concurrency {args.concurrency}, {args.prompt_tokens}-token prompts, "
              f"{args.max_tokens} output tokens, {args.duration_s:g} s each, hog {'on' if args.hog else 'off'}",
              flush=True)
        results.append(run_setup(name, args, prompts))
    print_table(cpu, results)
    failed = checks(results, args.rss_bound_mib, args.kvstore_memory_mib, args.kvstore_put_quota_mib)
    for f in failed:
        print(f"CHECK FAILED: {f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": cpu, "args": {k: v for k, v in vars(args).items()}, "results": results,
                       "failed": failed}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
