"""1P1D against 2x data parallel: a prefill and a decode process (KV over cuda-ipc on a GPU, shm on CPU)
behind one router, then two colocated workers behind one router, each driven through the
router's OpenAI HTTP endpoint by the serving benchmark's streaming client (benchmarks/serve) with the same
fixed-length workload at each concurrency; one table with TTFT p50/p90, TPOT p50, output tok/s, req/s and
the 1P1D / 2xDP ratio of each figure.

    pdserve bench pd-vs-dp --model random:llama-3-8b --concurrency 8,32
    pdserve bench pd-vs-dp --model random:llama-3-8b --concurrency 8,32 --placement two-gpus
    pdserve bench pd-vs-dp --device cpu --model random:tiny-llama --input-tokens 128 --output-tokens 8 \\
        --concurrency 2,4 --kv-cache-bytes 67108864

Both set-ups are two engine processes, each with its own weights and a KV pool of ``--kv-cache-bytes``.
``--placement one-device`` (default) puts both on ``--device`` (on one H200: 2 x (16 GB of 8B bf16 weights +
the pool)); ``two-gpus`` puts 1P1D's prefill on cuda:0 and its decode on cuda:1 (cuda-ipc: the prefill
opens the decode pool's IPC handle on cuda:1 and copies over NVLink/PCIe) and 2xDP's workers one per GPU.
Requests are completions with ``ignore_eos`` and ``logprobs`` (a random model's tokens past the 256 bytes
decode to no text; with logprobs every token is a streamed event, so TTFT and TPOT are per token). Each
concurrency's prompts open with their own tag, so no request reuses another's cached prefix; one warm-up
round per set-up runs first and is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.serve.client import Target
from benchmarks.serve.load import LoadPoint, Runner, wait_ready
from benchmarks.serve.report import summarize_run
from benchmarks.serve.stats import SLO
from benchmarks.serve.tokens import TokenCounter, WordText
from benchmarks.serve.workload import RandomSpec, random_workload
from services.common.cli_args import ArgParser

PD, DP = "1P1D", "2xDP"
PLACEMENTS = ("one-device", "two-gpus")
COLUMNS = (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p90_ms", "TTFT p90 ms"), ("tpot_p50_ms", "TPOT p50 ms"),
           ("output_tok_s", "out tok/s"), ("requests_per_s", "req/s"))


@dataclass(frozen=True)
class Row:
    """One set-up at one concurrency (latencies in ms over completed requests, rates over the run)."""

    setup: str
    concurrency: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    output_tok_s: float
    requests_per_s: float
    completed: int
    failed: int

    @classmethod
    def of(cls, setup: str, concurrency: int, summary: dict[str, Any]) -> Row:
        """From benchmarks.serve.report.summarize_run's dict (seconds; None where nothing completed)."""
        def ms(v: float | None) -> float:
            return math.nan if v is None else v * 1000

        t = summary["throughput"]
        return cls(setup, concurrency, ms(summary["ttft_s"]["p50"]), ms(summary["ttft_s"]["p90"]),
                   ms(summary["tpot_s"]["p50"]), t["output_tok_s"], t["requests_per_s"],
                   summary["requests"]["completed"], summary["requests"]["failed"])


def ratios(rows: list[Row]) -> dict[int, dict[str, float]]:
    """Per concurrency that both set-ups ran: 1P1D's figure / 2xDP's, per column (NaN on a zero or NaN)."""
    by = {(r.setup, r.concurrency): r for r in rows}
    out: dict[int, dict[str, float]] = {}
    for c in sorted({r.concurrency for r in rows}):
        pd, dp = by.get((PD, c)), by.get((DP, c))
        if pd is None or dp is None:
            continue
        out[c] = {}
        for key, _ in COLUMNS:
            a, b = getattr(pd, key), getattr(dp, key)
            out[c][key] = a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan
    return out


def _cell(v: float, digits: int) -> str:
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def table(rows: list[Row]) -> str:
    """Markdown: each set-up's row per concurrency, then the 1P1D / 2xDP ratio row."""
    head = ["set-up", "conc", *(title for _, title in COLUMNS), "ok/failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rs = ratios(rows)
    for c in sorted({r.concurrency for r in rows}):
        for r in sorted((r for r in rows if r.concurrency == c), key=lambda r: r.setup != PD):
            cells = [_cell(getattr(r, k), 1) for k, _ in COLUMNS]
            lines.append(f"| {r.setup} | {c} | " + " | ".join(cells) + f" | {r.completed}/{r.failed} |")
        if c in rs:
            cells = ["-" if math.isnan(rs[c][k]) else f"{rs[c][k]:.2f}x" for k, _ in COLUMNS]
            lines.append(f"| {PD} / {DP} | {c} | " + " | ".join(cells) + " | |")
    return "\n".join(lines)


def _machine(device: str) -> str:
    import platform

    import torch

    from services.engine.cpu.cpu_features import host_cpu

    cpu = host_cpu()
    host = f"{len(cpu.cpus)} CPUs {platform.machine()} {cpu.model} ({', '.join(cpu.reported_flags()) or 'no AVX2'})"
    gpu = "no GPU"
    if device.startswith("cuda") and torch.cuda.is_available():
        n = torch.cuda.device_count()
        gpu = f"{n} x {torch.cuda.get_device_name(0)}"
    return f"{gpu}; {host}; torch {torch.__version__}"


def _kv_via(metrics: str) -> str:
    """Transports prefill's KV bytes-sent counter grew under (the whole run; warm-up included)."""
    from benchmarks.gpu_kv_table import _kv_route

    sent, fallbacks = _kv_route(metrics)
    return ("+".join(sorted(sent)) or "-") + f" ({sum(sent.values()) / 1e6:.0f} MB, {fallbacks:.0f} fallbacks)"


def _measure(setup: str, http: str, args: argparse.Namespace, texts: WordText, counter: TokenCounter
             ) -> list[Row]:
    target = Target(f"http://{http}", args.model, api="completions", logprobs=True, timeout_s=args.timeout_s)
    spec = RandomSpec(args.input_tokens, args.output_tokens)
    asyncio.run(wait_ready(target, 60.0))
    runner = Runner(target, counter, progress=False)
    rows = []
    for k, c in enumerate(args.concurrencies):
        work = random_workload(spec, texts, requests=args.rounds * c, seed=args.seed, tag=f"Request c{c}")
        warm = random_workload(spec, texts, requests=c, seed=args.seed, tag=f"Warmup c{c}") if k == 0 else None
        point = LoadPoint(concurrency=c, requests=args.rounds * c, warmup=c if warm else 0, seed=args.seed)
        run = asyncio.run(runner.run(work, point, warm))
        summary = summarize_run(run, SLO())
        row = Row.of(setup, c, summary)
        rows.append(row)
        print(f"{setup} c={c}: " + ", ".join(f"{title} {_cell(getattr(row, key), 1)}" for key, title in COLUMNS)
              + f", {row.completed} ok / {row.failed} failed {summary['requests']['error_examples'] or ''}",
              flush=True)
    return rows


def placement_flags(setup: str, placement: str) -> dict[str, list[str]]:
    """Per-instance flags (LocalCluster extra, by instance name) that place a set-up's two engine processes:
    none on one device; on two GPUs 1P1D's prefill on cuda:0 and decode on cuda:1, 2xDP's workers one each."""
    if placement == "one-device":
        return {}
    names = ("prefill-0", "decode-0") if setup == PD else ("worker-0", "worker-1")
    return {name: ["--device", f"cuda:{i}"] for i, name in enumerate(names)}


def run_setup(setup: str, args: argparse.Namespace, texts: WordText, counter: TokenCounter) -> list[Row]:
    from services.launcher import LocalCluster

    dev = ["--device", args.device, "--kv-cache-bytes", str(args.kv_cache_bytes),
           "--max-prefill-chunk", str(args.chunk)]
    if setup == PD:
        shape: dict[str, Any] = {"prefill": 1, "decode": 1, "kv_transport": args.kv_transport,
                                 "extra": {"prefill": dev, "decode": dev}}
    else:
        shape = {"prefill": 0, "decode": 2, "colocated": True, "extra": {"decode": dev}}
    shape["extra"].update(placement_flags(setup, args.placement))  # after the role's flags: these win
    t0 = time.perf_counter()
    with LocalCluster(kvstore=None, model=args.model, dtype=args.dtype, quiet=True, **shape) as c:
        print(f"{setup}: {len(c.procs) - 1} engine processes ready in {time.perf_counter() - t0:.0f} s",
              flush=True)
        rows = _measure(setup, c.router["http"], args, texts, counter)
        if any(r.failed for r in rows):  # the services' last words say why
            for proc in c.procs:
                print(f"--- {proc.name}\n{proc.tail(10)}", flush=True)
        if setup == PD:
            print(f"{PD} KV via {_kv_via(c.get('prefill-0').ready['metrics'])}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="pdserve bench pd-vs-dp", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-bytes", type=int, default=24 << 30, help="each engine process's KV pool (bytes)")
    p.add_argument("--chunk", type=int, default=2048, help="--max-prefill-chunk of every engine (tokens)")
    p.add_argument("--kv-transport", default="auto", help="1P1D's prefill -> decode transport (auto: cuda-ipc "
                                                          "on GPU, shm on CPU)")
    p.add_argument("--placement", default="one-device", choices=PLACEMENTS,
                   help="one-device: both processes of each set-up on --device; two-gpus: 1P1D prefill on cuda:0 "
                        "and decode on cuda:1, 2xDP one worker per GPU")
    p.add_argument("--input-tokens", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="8,32", help="comma-separated; each runs --rounds x C requests")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--setups", default=f"{PD},{DP}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--json", default="", help="write the rows, ratios and run facts here")
    args = p.parse_args(argv)
    args.concurrencies = [int(x) for x in args.concurrency.split(",")]
    from services.text.model.source import load_tokenizer

    tok = load_tokenizer(args.model).tokenizer
    texts, counter = WordText(tok), TokenCounter(tok)
    command = "pdserve bench pd-vs-dp " + shlex.join(sys.argv[1:] if argv is None else argv)
    machine = _machine(args.device)
    print(f"{machine}\n{command}", flush=True)
    rows: list[Row] = []
    for setup in args.setups.split(","):
        rows += run_setup(setup, args, texts, counter)
    print(f"\n{args.model} {args.dtype} on {args.device} ({args.placement}): {args.input_tokens} in / {args.output_tokens} out "
          f"(ignore_eos), {args.rounds} x C requests per concurrency, prefill chunk {args.chunk}, "
          f"KV pool {args.kv_cache_bytes / 2**30:g} GiB per process\n{machine}\n{command}\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "machine": machine, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                       "rows": [asdict(r) for r in rows],
                       "ratios": {str(c): v for c, v in ratios(rows).items()}}, f, indent=1)
    return 0 if rows and all(r.failed == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
