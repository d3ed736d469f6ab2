"""Where a served batch-1 token's wall time goes: per thread of the worker (or decode), the router and this
client, CPU ms, run-queue wait ms (runnable but off-CPU: another thread had the core) and context switches per
output token, beside the wall TPOT; and the same for the in-process engine (``--in-process``) at the same
prompt length, so the served step and the engine's own step are compared thread by thread.

CPU and run-queue wait come from ``/proc/<pid>/task/<tid>/schedstat`` (ns), switches from ``.../status``;
thread names from ``py-spy dump`` where installed (threads Python does not know, the OpenMP workers, count as
"native/omp"), else the kernel's thread name. Wall per token minus CPU minus run-queue wait is the time the
thread slept (GIL, OpenMP barrier, waiting for work).

    python -m benchmarks.cpu_serving_probe --url http://127.0.0.1:8000 --pid worker=W --pid router=R
    python -m benchmarks.cpu_serving_probe --in-process [--prompt-len 512] [--profile TOP]
    python -m benchmarks.cpu_serving_probe --attention 32,128,576,2048
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.cli_args import ArgParser

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from benchmarks.engine_bench import EngineBench
    from services.text.sampling_params import SamplingParams


@dataclass
class ThreadStat:
    cpu_ns: int
    wait_ns: int
    voluntary: int
    involuntary: int


def read_threads(pid: int) -> dict[int, ThreadStat]:
    """Every thread of ``pid`` as read now (a thread that ends meanwhile is skipped)."""
    out: dict[int, ThreadStat] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/schedstat") as f:
                cpu, wait, _ = (int(x) for x in f.read().split())
            with open(f"{base}/status") as f:
                status = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        vol = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
        inv = int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
        out[int(tid)] = ThreadStat(cpu, wait, vol, inv)
    return out


def thread_names(pid: int) -> dict[int, str]:
    """tid -> name: py-spy's Python thread names where it runs, the kernel's comm otherwise."""
    names = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[int(tid)] = f"comm:{f.read().strip()}"
        except FileNotFoundError:
            continue
    if shutil.which("py-spy"):
        run = subprocess.run(["py-spy", "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True)
        py = {int(t): n for t, n in re.findall(r'^Thread (\d+) \([^)]*\): "([^"]+)"', run.stdout, re.M)}
        names = {t: py.get(t, "native/omp") for t in names}
    return names


def per_token(before: dict[int, ThreadStat], after: dict[int, ThreadStat], names: dict[int, str], tokens: int
              ) -> dict[str, dict[str, float]]:
    """name -> {cpu_ms, wait_ms, vol, invol} per output token, threads of one name summed; idle ones left out."""
    groups: dict[str, list[float]] = {}
    for tid, a in after.items():
        b = before.get(tid, ThreadStat(0, 0, 0, 0))
        g = groups.setdefault(names.get(tid, "native/omp"), [0.0, 0.0, 0.0, 0.0])
        g[0] += (a.cpu_ns - b.cpu_ns) / 1e6
        g[1] += (a.wait_ns - b.wait_ns) / 1e6
        g[2] += a.voluntary - b.voluntary
        g[3] += a.involuntary - b.involuntary
    return {k: {"cpu_ms": round(v[0] / tokens, 3), "wait_ms": round(v[1] / tokens, 3),
                "vol": round(v[2] / tokens, 2), "invol": round(v[3] / tokens, 2)}
            for k, v in sorted(groups.items()) if v[0] > 0.001 * tokens}


def prompt_text(prompt_len: int, i: int) -> str:
    """About ``prompt_len`` tokens of prose with a unique opening (no cached prefix between requests)."""
    body = "the history of bridges, from fallen logs across streams to stone arches and suspension spans. "
    return f"Request {i} at {time.time()}: " + body * max(1, prompt_len // 18)


def stream_one(url: str, model: str, prompt: str, max_tokens: int) -> float:
    """One streamed /v1/completions through the bench's client; its TPOT (ms) between the first and last
    output events (the same definition as ``pdserve bench cpu-serving``)."""
    import asyncio

    import aiohttp

    from benchmarks.serve.client import RequestResult, Target, send

    async def one() -> RequestResult:
        async with aiohttp.ClientSession() as session:
            return await send(session, Target(url, model, api="completions"), prompt, max_tokens,
                              RequestResult("probe", 0, 0.0), time.perf_counter())

    res = asyncio.run(one())
    if not res.ok or len(res.event_times) < 2:
        raise RuntimeError(f"request failed: {res.error} {res.detail[:200]}")
    t = res.event_times
    return (t[-1] - t[0]) / (len(t) - 1) * 1000


def served(a: argparse.Namespace) -> None:
    pids = dict(p.split("=", 1) for p in a.pid)
    pids = {k: int(v) for k, v in pids.items()} | {"client": os.getpid()}
    names = {k: thread_names(p) for k, p in pids.items()}
    stream_one(a.url, a.model, prompt_text(a.prompt_len, -1), 4)  # warm-up
    before = {k: read_threads(p) for k, p in pids.items()}
    tpots = [stream_one(a.url, a.model, prompt_text(a.prompt_len, i), a.max_tokens) for i in range(a.requests)]
    after = {k: read_threads(p) for k, p in pids.items()}
    tokens = a.requests * a.max_tokens  # prefill-side work of the first token is counted too (small at 128 tokens)
    print(f"served: wall TPOT median {statistics.median(tpots):.2f} ms (all: {[round(t, 2) for t in tpots]}); "
          f"{a.requests} requests x {a.max_tokens} tokens, prompt ~{a.prompt_len}; load {os.getloadavg()}")
    for k in pids:
        for name, row in per_token(before[k], after[k], names[k], tokens).items():
            print(f"  {k:8s} {name:28s} {json.dumps(row)}")


def in_process(a: argparse.Namespace) -> None:
    from services.engine.cpu.cpu_features import QUIET_OPENMP_ENV

    for k, v in QUIET_OPENMP_ENV.items():  # as pdserve up gives its engines; before torch loads OpenMP
        os.environ.setdefault(k, v)
    from benchmarks.engine_bench import EngineBench
    from benchmarks.engine_bench import _prompts as token_prompts
    from services.engine.cpu.cpu_features import available_cpus
    from services.text.model.gguf_meta import default_gguf_path

    threads = a.threads or len(available_cpus())
    bench = EngineBench(str(default_gguf_path()), "auto", a.prompt_len, 1, a.prompt_len + a.max_tokens + 64,
                        threads, "auto", cpu_compile_decode=0)
    if a.profile:
        profile(bench, sorted({32, a.prompt_len}), a.max_tokens, a.profile)
        return
    names = thread_names(os.getpid())
    for plen in sorted({32, a.prompt_len}):
        bench.decode(token_prompts(1, plen, bench.vocab, seed=7), 8)  # warm-up
        walls, before = [], read_threads(os.getpid())
        for i in range(a.requests):
            walls.append(bench.decode(token_prompts(1, plen, bench.vocab, seed=i), a.max_tokens) /
                         (a.max_tokens - 1) * 1000)
        after = read_threads(os.getpid())
        names |= {t: n for t, n in thread_names(os.getpid()).items() if t not in names}
        print(f"in-process ({threads} threads), prompt {plen}: decode median {statistics.median(walls):.2f} "
              f"ms/token (all: {[round(w, 2) for w in walls]}); load {os.getloadavg()}")
        for name, row in per_token(before, after, names, a.requests * a.max_tokens).items():
            print(f"  engine   {name:28s} {json.dumps(row)}")


def profile(bench: EngineBench, prompt_lens: list[int], tokens: int, top: int) -> None:
    """torch.profiler over ``tokens`` batch-1 decode steps after a prompt of each length: self CPU ms per step
    of the ops whose cost changes most between the shortest and the longest context."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from benchmarks.engine_bench import _prompts as token_prompts

    per_len: dict[int, dict[str, tuple[float, int]]] = {}
    for plen in prompt_lens:
        eng = bench.engine
        eng.add_request(f"profile-{plen}", token_prompts(1, plen, bench.vocab, seed=3)[0], _params(tokens + 2),
                        detokenize=False)
        eng.step()  # the prompt
        eng.step()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(tokens):
                eng.step()
        while eng.has_work():
            eng.step()
        per_len[plen] = {e.key: (e.self_cpu_time_total / 1e3 / tokens, e.count // tokens)
                         for e in prof.key_averages()}
        total = sum(ms for ms, _ in per_len[plen].values())
        print(f"profile, prompt {plen}: {total:.2f} ms self CPU per step in aten ops (profiler on)")
    lo, hi = per_len[min(prompt_lens)], per_len[max(prompt_lens)]
    keys = sorted(set(lo) | set(hi), key=lambda k: -abs(hi.get(k, (0, 0))[0] - lo.get(k, (0, 0))[0]))
    for k in keys[:top]:
        a, b = lo.get(k, (0.0, 0)), hi.get(k, (0.0, 0))
        print(f"  {k:40s} {a[0]:7.3f} -> {b[0]:7.3f} ms/step  calls/step {a[1]} -> {b[1]}")


def _attention_layer(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, ids: torch.Tensor, ctx: int,
                     kv_heads: int, head_dim: int) -> torch.Tensor:
    """What the CPU backend does per layer at batch 1: K and V gathered from paged blocks, then SDPA (GQA)."""
    import torch.nn.functional as F

    shape = (1, -1, kv_heads, head_dim)
    k = kp.index_select(0, ids).view(shape)[:, :ctx].transpose(1, 2)
    v = vp.index_select(0, ids).view(shape)[:, :ctx].transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def attention_ops(contexts: list[int], heads: int = 9, kv_heads: int = 3, head_dim: int = 64, block: int = 16,
                  threads: tuple[int, ...] = (2, 1), calls: int = 2000) -> None:
    """One layer's batch-1 decode attention (the embedded model's shapes), bf16, timed alone at each thread
    count (us per call)."""
    import torch

    def timed(fn: Callable[[], torch.Tensor]) -> float:
        for _ in range(50):
            fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6

    q = torch.randn(1, heads, 1, head_dim).to(torch.bfloat16)
    for ctx in contexts:
        nb = (ctx + block - 1) // block
        kp = torch.randn(nb + 8, block * kv_heads * head_dim).to(torch.bfloat16)
        layer = functools.partial(_attention_layer, q, kp, torch.randn_like(kp),
                                  torch.arange(4, 4 + nb, dtype=torch.int64), ctx, kv_heads, head_dim)
        row = []
        for t in threads:
            torch.set_num_threads(t)
            row.append(f"{t} thread{'s' if t > 1 else ''} {timed(layer):.1f} us")
        print(f"attention, {ctx} keys: " + ", ".join(row) + f"; load {os.getloadavg()[0]:.2f}")


def _params(max_tokens: int) -> SamplingParams:
    from services.text.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def main(argv: list[str] | None = None) -> int:
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct.Q4_1")
    ap.add_argument("--pid", action="append", default=[], help="NAME=PID of a served process to watch")
    ap.add_argument("--in-process", action="store_true", help="measure the in-process engine instead")
    ap.add_argument("--threads", type=int, default=0, help="--in-process: torch threads (0: every usable CPU)")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="--in-process: torch.profiler instead, the TOP ops whose cost grows most with the context")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--attention", default="", metavar="CONTEXTS",
                    help="time one layer's batch-1 decode attention alone at 2 and 1 threads, e.g. 32,128,576,2048")
    a = ap.parse_args(argv)
    if a.attention:
        from services.engine.cpu.cpu_features import QUIET_OPENMP_ENV

        for k, v in QUIET_OPENMP_ENV.items():  # before torch loads OpenMP, as the engines get it
            os.environ.setdefault(k, v)
        attention_ops([int(c) for c in a.attention.split(",")])
    elif a.in_process:
        in_process(a)
    elif a.url:
        served(a)
    else:
        ap.error("give --url and --pid NAME=PID, or --in-process")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
