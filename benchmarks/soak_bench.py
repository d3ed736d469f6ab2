"""``pdserve bench soak``: a bounded loopback soak of a default `pdserve up` cluster (mTLS between every
service, supervised restarts) that counts every outcome and fails on any answer that is not designed.

For ``--duration-s`` (default 600 s) ``--concurrency`` clients (16) send chat completions with mixed
prompt lengths (short, ~200 and ~1000 tokens), half of them streamed; ``--cancel-fraction`` (10%) of the
requests are cancelled by the client (a streamed one after its first event, a plain one after a random
wait). During the run every service type is killed -9 once (prefill at 20% of the duration, decode at
35%, kvstore at 50%, router at 65%) and the supervisor restarts it; a CPU hog (one busy process per core
this process may use) runs from 25% to 75%. Everything stays on loopback and stops by itself.

An answer is designed when it is a 200 with a non-empty completion and finish_reason stop/length, or a
429/503/504 with Retry-After and a JSON error body, or (streamed, after the first byte) an error event
whose code is resource_exhausted/unavailable/deadline_exceeded. Anything else (an empty 200, a 404 or
500, a 503 without Retry-After) is counted as wrong. Connections refused or reset while the router
itself is down are counted apart (no answer is not a wrong answer). At the end, after the cluster is
idle: every decode block free again, and each service's RSS against its baseline (measured once the
cluster has served its warm-up) is printed; the exit status is 1 if anything wrong was seen or the
blocks are not back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc

from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, common_pb2_grpc
from services.common.tls import TLSConfig, make_certs
from services.engine.cpu.cpu_features import host_cpu
from services.launcher import LocalCluster, RestartPolicy, served_model

DESIGNED_STATUS = (429, 503, 504)
DESIGNED_STREAM_CODES = ("resource_exhausted", "unavailable", "deadline_exceeded")
KILLS = (("prefill-0", 0.20), ("decode-0", 0.35), ("kvstore", 0.50), ("router", 0.65))
HOG = (0.25, 0.75)
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree".split()


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    """One line per wrong answer (status, what was wrong, a prefix of the body)."""
    ok_latency_s: list[float] = field(default_factory=list)

    def bad(self, what: str) -> None:
        self.outcomes["wrong"] += 1
        if len(self.wrong) < 50:
            self.wrong.append(what)


def _prompt(rng: random.Random) -> str:
    words = rng.choice((12, 150, 750))  # ~16, ~200, ~1000 tokens
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _one(session: aiohttp.ClientSession, url: str, model: str, rng: random.Random, cancel_p: float,
               tally: Tally) -> None:
    stream = rng.random() < 0.5
    cancel = rng.random() < cancel_p
    body = {"model": model, "messages": [{"role": "user", "content": _prompt(rng)}],
            "max_tokens": rng.randint(8, 32), "temperature": 0.7, "stream": stream}
    t0 = time.monotonic()
    try:
        if cancel and not stream:
            task = asyncio.ensure_future(session.post(url, json=body))
            await asyncio.sleep(rng.uniform(0.05, 2.0))
            if not task.done():
                task.cancel()
                tally.outcomes["cancelled"] += 1
                return
            (await task).release()
            tally.outcomes["cancelled_after_answer"] += 1
            return
        async with session.post(url, json=body) as r:
            if r.status != 200:
                text = await r.text()
                if r.status in DESIGNED_STATUS and r.headers.get("Retry-After") and _json_error(text):
                    tally.outcomes[f"http_{r.status}"] += 1
                    await asyncio.sleep(min(5.0, float(r.headers["Retry-After"])))  # as told
                else:
                    tally.bad(f"HTTP {r.status} Retry-After={r.headers.get('Retry-After')!r}: {text[:200]}")
                return
            if not stream:
                data = await r.json()
                choice = (data.get("choices") or [{}])[0]
                content = (choice.get("message") or {}).get("content")
                if content and choice.get("finish_reason") in ("stop", "length"):
                    tally.outcomes["ok"] += 1
                    tally.ok_latency_s.append(time.monotonic() - t0)
                else:
                    tally.bad(f"200 without a completion: {json.dumps(data)[:200]}")
                return
            text, finish, error = "", None, None
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[len("data: "):])
                if "error" in ev:
                    error = ev["error"]
                    break
                ch = (ev.get("choices") or [{}])[0]
                text += (ch.get("delta") or {}).get("content") or ""
                finish = ch.get("finish_reason") or finish
                if cancel:  # the client goes away after its first event
                    tally.outcomes["cancelled"] += 1
                    return
            if error is not None:
                if error.get("code") in DESIGNED_STREAM_CODES:
                    tally.outcomes[f"stream_error_{error.get('code')}"] += 1
                else:
                    tally.bad(f"stream error event {error}")
            elif text and finish in ("stop", "length"):
                tally.outcomes["ok"] += 1
                tally.ok_latency_s.append(time.monotonic() - t0)
            else:
                tally.bad(f"stream ended without a completion (text {text!r}, finish {finish!r})")
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as e:
        tally.outcomes[f"no_answer_{type(e).__name__}"] += 1
        await asyncio.sleep(1.0)  # the router is down (restarting): back off as a client would
    except TimeoutError:
        tally.bad("no answer within the client's 300 s timeout")


def _json_error(text: str) -> bool:
    try:
        return bool(json.loads(text).get("error", {}).get("message"))
    except (ValueError, AttributeError):
        return False


async def _clients(http: str, model: str, concurrency: int, until: float, cancel_p: float, seed: int) -> Tally:
    tally = Tally()
    url = f"http://{http}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=300)

    async def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < until:
                await _one(session, url, model, rng, cancel_p, tally)
                if tally.outcomes.total() and tally.outcomes.total() % 100 == 0:
                    await asyncio.sleep(0)

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return tally


def _hog(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its children (the service's process group), MB."""
    total = 0
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) != group:  # pgrp (the fields after "(comm)": state, ppid, pgrp)
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ProcessLookupError, IndexError, ValueError):
            continue
    return total / 1024


def _rss_all(c: LocalCluster) -> dict[str, float]:
    return {p.name: _rss_mb(p.popen.pid) for p in c.procs if p.popen is not None and p.popen.poll() is None}


async def _free_blocks(address: str, tls: TLSConfig) -> tuple[int, int]:
    async with create_channel(address, tls=tls) as ch:
        rep = await common_pb2_grpc.AdminStub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=10)
    return rep.free_blocks, rep.total_blocks


def _wait_blocks(address: str, tls: TLSConfig, within_s: float) -> tuple[int, int]:
    deadline = time.monotonic() + within_s
    while True:
        try:
            free, total = asyncio.run(_free_blocks(address, tls))
        except grpc.aio.AioRpcError:  # restarting: try again until the deadline
            free, total = -1, 0
        if (free == total and total > 0) or time.monotonic() > deadline:
            return free, total
        time.sleep(1.0)


def run(args: argparse.Namespace) -> int:
    cpu = host_cpu()
    print(f"CPU: {cpu.model} ({len(os.sched_getaffinity(0))} cores usable); flags: {cpu.reported_flags()}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    tmp = tempfile.mkdtemp(prefix="pdserve-soak-tls-")  # mode 0700, removed at the end
    try:
        return _soak(args, make_certs(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _soak(args: argparse.Namespace, certs: Path) -> int:
    client_tls = TLSConfig(tls_cert=str(certs / "client.pem"), tls_key=str(certs / "client-key.pem"),
                           tls_ca=str(certs / "ca.pem"))
    kv = ["--kv-cache-bytes", str(args.kv_cache_mib << 20)]
    extra = {"prefill": kv, "decode": kv, "router": ["--health-interval-s", "0.5"]}
    policy = RestartPolicy(max_restarts=3, window_s=args.duration_s + 600, backoff_s=0.5, max_backoff_s=2.0)
    with LocalCluster(prefill=1, decode=1, kvstore="embedded", tls_dir=certs, extra=extra, quiet=True,
                      supervise=True, restart_policy=policy) as c:
        http = c.router["http"]
        model = served_model(http)
        decode = c.get("decode-0").ready["grpc"]
        warm = asyncio.run(_clients(http, model, args.concurrency, time.monotonic() + 20, 0.0, seed=0))
        free0, total = _wait_blocks(decode, client_tls, 60)
        rss0 = _rss_all(c)
        print(f"warm-up: {dict(warm.outcomes)}; decode blocks free {free0}/{total}; RSS MB "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(rss0.items())), flush=True)
        t0 = time.monotonic()
        until = t0 + args.duration_s
        hog_procs: list[mp.Process] = []
        kills_done: list[str] = []

        async def faults() -> None:
            pending = sorted(KILLS, key=lambda k: k[1])
            hog_started = False
            while time.monotonic() < until:
                frac = (time.monotonic() - t0) / args.duration_s
                if not hog_started and frac >= HOG[0]:
                    hog_started = True
                    stop_at = t0 + HOG[1] * args.duration_s
                    for _ in os.sched_getaffinity(0):
                        p = mp.get_context("fork").Process(target=_hog, args=(stop_at,), daemon=True)
                        p.start()
                        hog_procs.append(p)
                    print(f"[{time.monotonic() - t0:6.1f}s] CPU hog: {len(hog_procs)} busy processes", flush=True)
                while pending and frac >= pending[0][1]:
                    name, _ = pending.pop(0)
                    pid = c.kill(name, signal.SIGKILL)
                    kills_done.append(name)
                    print(f"[{time.monotonic() - t0:6.1f}s] kill -9 {name} (pid {pid})", flush=True)
                await asyncio.sleep(0.5)

        async def main() -> Tally:
            f = asyncio.ensure_future(faults())
            tally = await _clients(http, model, args.concurrency, until, args.cancel_fraction, seed=args.seed)
            await f
            return tally

        tally = asyncio.run(main())
        for p in hog_procs:
            p.join(5)
        elapsed = time.monotonic() - t0
        time.sleep(5)
        free1, total1 = _wait_blocks(c.get("decode-0").ready["grpc"], client_tls, 120)
        rss1 = _rss_all(c)
    n = tally.outcomes.total()
    lat = sorted(tally.ok_latency_s)
    print(f"\nsoak: {elapsed:.0f}s, concurrency {args.concurrency}, {n} requests ({n / elapsed:.2f}/s); "
          f"kills: {', '.join(kills_done)}; restarts given up: {[p.name for p in c.failed]}")
    for k, v in sorted(tally.outcomes.items()):
        print(f"  {k:34s} {v:6d}  ({100 * v / max(1, n):.1f}%)")
    if lat:
        print(f"  ok latency: p50 {lat[len(lat) // 2]:.2f}s, p99 {lat[int(len(lat) * 0.99)]:.2f}s")
    for w in tally.wrong:
        print(f"  WRONG: {w}")
    print(f"decode blocks free after: {free1}/{total1} (before: {free0}/{total})")
    print("RSS MB baseline -> after: " + ", ".join(
        f"{k} {rss0.get(k, 0):.0f} -> {rss1.get(k, 0):.0f}" for k in sorted(set(rss0) | set(rss1))))
    ok = tally.outcomes["wrong"] == 0 and free1 == total1 and total1 > 0 and not c.failed
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=600.0, help="Length of the soak (seconds).")
    p.add_argument("--concurrency", type=int, default=16, help="Concurrent clients.")
    p.add_argument("--cancel-fraction", type=float, default=0.1, help="Requests the client cancels.")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="Each engine's KV pool (MiB).")
    p.add_argument("--seed", type=int, default=1, help="Seed of the prompts and cancellations.")
    args = p.parse_args(argv)
    if args.duration_s <= 0 or args.concurrency <= 0 or not 0 <= args.cancel_fraction <= 1:
        p.error("--duration-s and --concurrency must be > 0, --cancel-fraction in [0, 1]")
    return run(args)
