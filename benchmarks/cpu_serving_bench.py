"""CPU serving as deployed: ``pdserve up`` (disaggregated and --colocated) against the in-process engine and
llama.cpp's server, on the same GGUF, with the same OpenAI-compatible client, in one run.

    pdserve bench cpu-serving [--prompt-len 512] [--output-len 64] [--concurrency 1,4,16] [--repeats 3]
                              [--systems engine,up,colocated,llamacpp] [--llama-python PATH] [--json out.json]

Each system runs alone (the others stopped), so they share the host's cores only with whatever else runs on
it (the 1-minute load average is printed at every phase). Per system and concurrency c: ``repeats`` rounds
of c streamed completions (fresh random-token prompts of --prompt-len tokens each, so no prefix cache hits),
all sent at once; figures are medians over requests (TTFT, TPOT) and over rounds (output tok/s = output
tokens of a round / its wall time).

The in-process engine (LLMEngine, same dtype and weight format) gives the ceilings: prefill seconds of one
--prompt-len prompt, and decode tok/s at batch 1. Ratios printed (goals of issue 17):
  * served TTFT at c=1 / in-process prefill (goal <= 1.3);
  * pdserve decode tok/s at batch 1 (1 / TPOT at c=1) / llama.cpp's (goal >= 1);
  * pdserve output tok/s at c=16 / llama.cpp's (goal >= 2).

llama.cpp: the ``llama-cpp-python[server]`` package (``python -m llama_cpp.server``), threads = the CPUs this
process may use, requests queued rather than interrupted (``--interrupt_requests False``); that server runs
one request at a time (it offers no parallel slots or continuous batching, which only llama.cpp's C++
``llama-server`` has). It is skipped, with the reason, when the package is missing from --llama-python's
environment.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.serve.client import RequestResult, Target, send
from benchmarks.serve.load import wait_ready
from services.launcher import served_model

TTFT_GOAL = 1.3
"""Served TTFT at concurrency 1 over the in-process prefill time of the same prompt length (at most)."""
DECODE_GOAL = 1.0
"""pdserve batch-1 decode tok/s over llama.cpp's (at least)."""
THROUGHPUT_GOAL = 2.0
"""pdserve output tok/s at concurrency 16 over llama.cpp's (at least)."""
SYSTEMS = ("engine", "up", "colocated", "llamacpp")


@dataclass
class Point:
    """One system at one concurrency: medians."""

    concurrency: int
    ttft_s: float
    tpot_s: float | None
    output_tok_s: float
    requests: int
    failed: int
    prompt_tokens: int | None


@dataclass
class SystemResult:
    name: str
    command: str
    points: list[Point] = field(default_factory=list)
    load_avg: list[float] = field(default_factory=list)
    skipped: str = ""
    """Why the system did not run (e.g. llama-cpp-python missing); empty when it ran."""
    stages_c1: dict[str, float] = field(default_factory=dict)
    """Mean seconds of each STAGE_METRICS histogram over the c=1 requests (pdserve only)."""

    def at(self, c: int) -> Point | None:
        return next((p for p in self.points if p.concurrency == c), None)


@dataclass
class Ratios:
    ttft_over_prefill: dict[str, float] = field(default_factory=dict)
    """System -> served TTFT at c=1 / in-process prefill seconds."""
    decode_vs_llamacpp: dict[str, float] = field(default_factory=dict)
    """System -> (1 / TPOT at c=1) / llama.cpp's."""
    throughput16_vs_llamacpp: dict[str, float] = field(default_factory=dict)
    """System -> output tok/s at the largest concurrency / llama.cpp's."""


def summarize(results: list[RequestResult], concurrency: int, round_walls: list[float],
              round_tokens: list[int]) -> Point:
    """Medians of a system's requests at one concurrency. TPOT: (e2e - TTFT) / (tokens - 1), tokens from the
    server's usage, else the streamed events (llama.cpp streams one token per event)."""
    ok = [r for r in results if r.ok and r.ttft is not None]
    tpots = []
    for r in ok:
        n = r.output_tokens if r.output_tokens is not None else len(r.event_times)
        if n >= 2:
            tpots.append((r.e2e - r.ttft) / (n - 1))
    tput = [t / w for t, w in zip(round_tokens, round_walls, strict=True) if w > 0]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return Point(concurrency=concurrency, ttft_s=statistics.median(r.ttft for r in ok) if ok else float("nan"),
                 tpot_s=statistics.median(tpots) if tpots else None,
                 output_tok_s=statistics.median(tput) if tput else 0.0, requests=len(results),
                 failed=len(results) - len(ok), prompt_tokens=int(statistics.median(prompts)) if prompts else None)


def ratios(engine: SystemResult | None, served: list[SystemResult], llama: SystemResult | None,
           top: int) -> Ratios:
    """The goal ratios from measured points (missing inputs leave a ratio out)."""
    r = Ratios()
    prefill = engine.at(0) if engine else None  # the engine's prefill is stored as concurrency 0
    base1 = llama.at(1) if llama and not llama.skipped else None
    base_top = llama.at(top) if llama and not llama.skipped else None
    for s in served:
        one = s.at(1)
        if one is None:
            continue
        if prefill is not None and prefill.ttft_s > 0:
            r.ttft_over_prefill[s.name] = one.ttft_s / prefill.ttft_s
        if base1 is not None and base1.tpot_s and one.tpot_s:
            r.decode_vs_llamacpp[s.name] = base1.tpot_s / one.tpot_s
        hi = s.at(top)
        if base_top is not None and hi is not None and base_top.output_tok_s > 0:
            r.throughput16_vs_llamacpp[s.name] = hi.output_tok_s / base_top.output_tok_s
    return r


def table(systems: list[SystemResult], concurrencies: list[int]) -> str:
    out = [f"{'system':<12}{'conc':>5}{'TTFT s':>9}{'TPOT ms':>9}{'1/TPOT':>8}{'out tok/s':>11}{'prompt':>8}"
           f"{'failed':>8}"]
    for s in systems:
        if s.skipped:
            out.append(f"{s.name:<12} skipped: {s.skipped}")
            continue
        for p in s.points:
            if p.concurrency == 0:
                out.append(f"{s.name:<12}{'-':>5}{p.ttft_s:>9.3f}{p.tpot_s * 1e3 if p.tpot_s else 0:>9.1f}"
                           f"{1 / p.tpot_s if p.tpot_s else 0:>8.1f}{'-':>11}{p.prompt_tokens or 0:>8}{'-':>8}"
                           "   (in-process: prefill s, batch-1 decode)")
                continue
            tpot = f"{p.tpot_s * 1e3:.1f}" if p.tpot_s else "-"
            inv = f"{1 / p.tpot_s:.1f}" if p.tpot_s else "-"
            out.append(f"{s.name:<12}{p.concurrency:>5}{p.ttft_s:>9.3f}{tpot:>9}{inv:>8}{p.output_tok_s:>11.1f}"
                       f"{p.prompt_tokens or 0:>8}{p.failed:>8}")
    return "\n".join(out)


def goal_lines(r: Ratios, top: int) -> list[str]:
    lines = []
    for name, v in r.ttft_over_prefill.items():
        lines.append(f"served TTFT / in-process prefill ({name}, c=1): {v:.2f}x (goal <= {TTFT_GOAL}) "
                     f"{'MET' if v <= TTFT_GOAL else 'MISSED'}")
    for name, v in r.decode_vs_llamacpp.items():
        lines.append(f"batch-1 decode tok/s vs llama.cpp ({name}): {v:.2f}x (goal >= {DECODE_GOAL}) "
                     f"{'MET' if v >= DECODE_GOAL else 'MISSED'}")
    for name, v in r.throughput16_vs_llamacpp.items():
        lines.append(f"output tok/s at c={top} vs llama.cpp ({name}): {v:.2f}x (goal >= {THROUGHPUT_GOAL}) "
                     f"{'MET' if v >= THROUGHPUT_GOAL else 'MISSED'}")
    return lines


# --- running -----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_TOPIC = ("the history of bridges, from fallen logs across streams to stone arches, iron trusses and long "
          "suspension spans, and what each new material allowed engineers to build. ")


def _free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 free now (for --metrics-port-base)."""
    for _ in range(50):
        base = _free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")


def _prompts(spec: str, n: int, length: int, seed: int) -> list[str]:
    """Texts of about ``length`` tokens (re-encoding may differ by a few): a unique numbered opening, so no
    prompt shares a cached prefix block with another, then plain prose (random token ids make the model
    emit special tokens, whose empty text would delay the first streamed event)."""
    from services.engine.model_source import load_tokenizer

    tok = load_tokenizer(spec).tokenizer
    body = tok.encode(_TOPIC * (length // 20 + 2), add_special_tokens=False)
    out = []
    for i in range(n):
        head = tok.encode(f"Request {seed}-{i}. Write about ", add_special_tokens=False)
        out.append(tok.decode((head + body)[:length]))
    return out


STAGE_METRICS = ("pdserve_router_time_to_first_token_seconds", "pdserve_prefill_queue_seconds",
                 "pdserve_prefill_compute_seconds", "pdserve_decode_kv_wait_seconds", "pdserve_decode_queue_seconds")
"""Histograms whose mean over the c=1 requests splits a served TTFT into stages (router view, prefill queue
and compute, decode's wait for the KV); the rest of the client's TTFT is HTTP, gRPC and detokenization."""


def parse_histogram_sums(text: str, names: tuple[str, ...] = STAGE_METRICS) -> dict[str, tuple[float, float]]:
    """Prometheus text -> {name: (sum, count)} over every label set of each named histogram."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        metric = key.split("{", 1)[0]
        for name in names:
            if metric in (f"{name}_sum", f"{name}_count"):
                acc = out.setdefault(name, [0.0, 0.0])
                acc[0 if metric.endswith("_sum") else 1] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def stage_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean seconds per observation of each histogram between two scrapes."""
    means = {}
    for name, (s1, c1) in after.items():
        s0, c0 = before.get(name, (0.0, 0.0))
        if c1 > c0:
            means[name] = (s1 - s0) / (c1 - c0)
    return means


def _scrape(ports: list[int]) -> dict[str, tuple[float, float]]:
    import urllib.request

    total: dict[str, tuple[float, float]] = {}
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                part = parse_histogram_sums(r.read().decode())
        except OSError:
            continue
        for k, (a, b) in part.items():
            s0, c0 = total.get(k, (0.0, 0.0))
            total[k] = (s0 + a, c0 + b)
    return total


async def _round(target: Target, prompts: list[str], max_tokens: int) -> tuple[list[RequestResult], float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(send(session, target, p, max_tokens, RequestResult("bench", 0, 0.0), t0)
                                          for p in prompts))
        return list(results), time.perf_counter() - t0


def measure_server(name: str, command: list[str], target: Target, spec: str, concurrencies: list[int],
                   repeats: int, prompt_len: int, output_len: int, seed: int, ready_timeout_s: float,
                   metrics_ports: list[int] | None = None) -> SystemResult:
    res = SystemResult(name, " ".join(command), load_avg=[os.getloadavg()[0]])
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-bench-{name}-{os.getpid()}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        asyncio.run(wait_ready(target, ready_timeout_s))
        if not target.model:
            target = dataclasses.replace(target, model=served_model(target.base_url.removeprefix("http://")))
        print(f"{name}: ready ({' '.join(command[:6])} ...), log {log}", flush=True)
        asyncio.run(_round(target, _prompts(spec, 1, prompt_len, seed + 999), 4))  # warm-up (first-call costs)
        for c in concurrencies:
            all_results: list[RequestResult] = []
            walls, tokens = [], []
            before = _scrape(metrics_ports or [])
            for i in range(repeats):
                prompts = _prompts(spec, c, prompt_len, seed + 1000 * c + i)
                results, wall = asyncio.run(_round(target, prompts, output_len))
                all_results += results
                walls.append(wall)
                tokens.append(sum((r.output_tokens if r.output_tokens is not None else len(r.event_times))
                                  for r in results if r.ok))
            p = summarize(all_results, c, walls, tokens)
            if c == 1 and metrics_ports:
                res.stages_c1 = stage_means(before, _scrape(metrics_ports))
            res.points.append(p)
            errors = sorted({f"{r.error}: {r.detail[:80]}" for r in all_results if not r.ok})
            print(f"{name} c={c}: TTFT {p.ttft_s:.3f} s, TPOT {(p.tpot_s or 0) * 1e3:.1f} ms, "
                  f"{p.output_tok_s:.1f} out tok/s, {p.failed} failed {errors[:2]}; load {os.getloadavg()[0]:.2f}",
                  flush=True)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    res.load_avg.append(os.getloadavg()[0])
    return res


def measure_engine(gguf: Path, dtype: str, weight_format: str, prompt_len: int, output_len: int, repeats: int,
                   threads: int) -> tuple[SystemResult, str, str]:
    """In-process ceilings: prefill seconds of one prompt, batch-1 decode (stored as concurrency 0)."""
    import torch

    from benchmarks.engine_bench import EngineBench
    from benchmarks.engine_bench import _prompts as token_prompts

    res = SystemResult("engine", f"LLMEngine(dtype={dtype}, weight_format={weight_format}, cpu_threads={threads})",
                       load_avg=[os.getloadavg()[0]])
    bench = EngineBench(str(gguf), dtype, prompt_len, 1, 64 + output_len, threads, weight_format)
    cfg = bench.engine.config
    prompts = token_prompts(repeats + 1, prompt_len, bench.vocab, seed=7)
    prefill = [bench.prefill(p) for p in prompts][1:]
    short = token_prompts(repeats + 1, 32, bench.vocab, seed=8)
    decode = [bench.decode([p], output_len) / (output_len - 1) for p in short][1:]
    res.points.append(Point(0, statistics.median(prefill), statistics.median(decode), 0.0, 0, 0, prompt_len))
    res.load_avg.append(os.getloadavg()[0])
    fmt = f"{cfg.resolved_weight_format} ({cfg.weight_format_reason})"
    dt = f"{cfg.resolved_dtype} ({cfg.dtype_reason})"
    del bench
    gc.collect()
    torch.set_num_threads(1)
    return res, dt, fmt


def llama_python(arg: str) -> tuple[str | None, str]:
    """(interpreter that has llama_cpp.server, or None, and why not)."""
    exe = arg or sys.executable
    probe = subprocess.run([exe, "-c", "import llama_cpp.server, llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return None, (f"llama-cpp-python[server] is not installed for {exe} (CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip "
                      "install 'llama-cpp-python[server]', or pass --llama-python)")
    return exe, probe.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    from services.engine.cpu_features import QUIET_OPENMP_ENV, available_cpus, host_cpu

    for k, v in QUIET_OPENMP_ENV.items():  # as pdserve up gives its engines; before torch loads OpenMP
        os.environ.setdefault(k, v)
    from benchmarks.engine_bench import _machine
    from services.engine.model_source import load_tokenizer
    from services.engine.weights.gguf_loader import default_gguf_path

    p = argparse.ArgumentParser(prog="pdserve bench cpu-serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M Q4_1 GGUF)")
    p.add_argument("--dtype", default="auto", help="pdserve --dtype (engine and pdserve up)")
    p.add_argument("--weight-format", default="auto", help="pdserve --weight-format (engine and pdserve up)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--repeats", type=int, default=3, help="rounds per concurrency (medians)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--llama-python", default="", help="python with llama-cpp-python[server] (default: this one)")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}; known {list(SYSTEMS)}")
    concurrencies = sorted({int(c) for c in args.concurrency.split(",")})
    gguf = Path(args.model) if args.model else default_gguf_path()
    threads = len(available_cpus())
    cpu = host_cpu()
    print(f"machine: {_machine()}", flush=True)
    print(f"cpu: {cpu.model}; flags: {' '.join(cpu.reported_flags()) or '-'}; {threads} CPUs usable; "
          f"load {os.getloadavg()}", flush=True)
    results: list[SystemResult] = []
    dtype_s = fmt_s = "(engine not run)"
    if "engine" in systems:
        eng, dtype_s, fmt_s = measure_engine(gguf, args.dtype, args.weight_format, args.prompt_len,
                                             args.output_len, args.repeats, threads)
        results.append(eng)
        pt = eng.points[0]
        print(f"engine: prefill {args.prompt_len} tokens {pt.ttft_s:.3f} s, batch-1 decode "
              f"{1 / (pt.tpot_s or 1):.1f} tok/s; dtype {dtype_s}, weight format {fmt_s}", flush=True)
    common = ["--model", str(gguf), "--dtype", args.dtype]
    env_fmt = {"PDSERVE_WEIGHT_FORMAT": args.weight_format}
    os.environ.update(env_fmt)  # reaches every engine pdserve up starts (one declaration, env fallback)
    for name, extra in (("up", []), ("colocated", ["--colocated"])):
        if name not in systems:
            continue
        port, base = _free_port(), _free_port_run(6)
        cmd = [sys.executable, "-m", "services.cli", "up", *extra, *common, "--http-port", str(port),
               "--grpc-port", "0", "--metrics-port-base", str(base)]
        target = Target(f"http://127.0.0.1:{port}", "", api="completions")  # model: read from /v1/models
        results.append(measure_server(name, cmd, target, str(gguf), concurrencies, args.repeats, args.prompt_len,
                                      args.output_len, args.seed, args.ready_timeout_s, list(range(base, base + 6))))
    llama: SystemResult | None = None
    if "llamacpp" in systems:
        exe, info = llama_python(args.llama_python)
        if exe is None:
            llama = SystemResult("llamacpp", "", skipped=info)
            print(f"llamacpp: skipped: {info}", flush=True)
        else:
            port = _free_port()
            ctx = max(2048, 2 * (args.prompt_len + args.output_len))
            cmd = [exe, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
                   "--n_batch", str(args.prompt_len), "--model_alias", "smollm2",
                   "--interrupt_requests", "False"]  # queue concurrent requests instead of cutting one off
            eos = sorted(load_tokenizer(str(gguf)).tokenizer.eos_token_ids)
            target = LlamaTarget(f"http://127.0.0.1:{port}", "smollm2", api="completions", banned_token_ids=tuple(eos))
            llama = measure_server("llamacpp", cmd, target, str(gguf), concurrencies, args.repeats, args.prompt_len,
                                   args.output_len, args.seed, args.ready_timeout_s)
            llama.command += f"  (llama-cpp-python {info})"
        results.append(llama)
    top = max(concurrencies)
    r = ratios(next((s for s in results if s.name == "engine"), None),
               [s for s in results if s.name in ("up", "colocated")], llama, top)
    print()
    print(f"{cpu.model} [{' '.join(cpu.reported_flags()) or '-'}], dtype {dtype_s}, weight format {fmt_s}, "
          f"prompt {args.prompt_len} tokens, {args.output_len} output tokens, {args.repeats} rounds per point")
    print(table(results, concurrencies))
    print()
    for line in goal_lines(r, top):
        print(line)
    for s in results:
        print(f"{s.name}: {s.command or '-'}; 1-min load {', '.join(f'{x:.2f}' for x in s.load_avg)}")
        if s.stages_c1:
            shown = ", ".join(f"{k.removeprefix('pdserve_')} {v * 1e3:.0f} ms" for k, v in s.stages_c1.items())
            print(f"  {s.name} c=1 stage means (server metrics): {shown}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu_model": cpu.model, "cpu_flags": cpu.reported_flags(),
                                         "dtype": dtype_s, "weight_format": fmt_s,
                                         "systems": [asdict(s) for s in results], "ratios": asdict(r)}, indent=2))
    return 0


@dataclass(frozen=True)
class LlamaTarget(Target):
    """llama.cpp's server has no ignore_eos: the end-of-text token is banned instead, so both servers
    generate exactly --output-len tokens."""

    banned_token_ids: tuple[int, ...] = ()

    def body(self, payload: list[dict[str, str]] | str, max_tokens: int) -> dict[str, Any]:
        body = super().body(payload, max_tokens)
        body.pop("ignore_eos", None)
        body["logit_bias"] = {str(t): -100.0 for t in self.banned_token_ids}
        return body


if __name__ == "__main__":
    sys.exit(main())
