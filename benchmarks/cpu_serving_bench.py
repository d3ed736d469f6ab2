"""CPU serving as deployed: ``pdserve up`` (disaggregated and --colocated) against the in-process engine and
llama.cpp's server, on the same GGUF, with the same OpenAI-compatible client, in one run. ``up`` lends cores
between its engines (the default); ``up-fixed`` is the same 1P1D cluster with ``--no-lend-cores`` (each engine
keeps its fixed share) and ``up-pinned`` the same with ``--pin-cores`` (pinned: no lending), so one run shows
what lending does and what pinning instead would.

    pdserve bench cpu-serving [--prompt-len 512] [--output-len 64] [--concurrency 1,4,16] [--repeats 3]
                              [--systems engine,up,up-fixed,up-pinned,colocated,llamacpp] [--llama-python PATH]
                              [--cpu-compile-decode N] [--json out.json]

Every system is started once and stays up; the systems then TAKE TURNS round by round (round i of
concurrency c: each system in turn, the order rotated by one every round), so that load from other
processes on a shared host hits all of them alike; the idle ones wait (passive OpenMP, no requests). The
1-minute load average is printed beside every round. A round of concurrency c = c streamed completions
(fresh prose prompts of --prompt-len tokens with unique openings, so no prefix cache hits), all sent at
once; figures are medians over the requests of the ``repeats`` rounds (TTFT, TPOT) and over rounds (output
tok/s = output tokens of a round / its wall time).

The in-process engine (LLMEngine in this process, same dtype, weight format and --cpu-compile-decode) gives
the ceilings, one measurement per round at the first concurrency: prefill seconds of one --prompt-len
prompt with all the cores AND with the thread share `pdserve up` gives its prefill engine (1P1D: half the
cores), and decode tok/s at batch 1. Ratios printed, with their goals:
  * served TTFT at c=1 / in-process prefill with all cores (goal <= 1.3), and beside it, for `pdserve up`,
    / in-process prefill at the served prefill's thread share (the serving overhead without the core split);
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
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.cpu_serving_systems import (  # noqa: F401  (parse_histogram_sums, stage_means: re-exported)
    SHORT_CONTEXT,
    InProcess,
    Server,
    free_port,
    free_port_run,
    parse_histogram_sums,
    stage_means,
    text_prompts,
)
from benchmarks.serve.client import RequestResult, Target
from services.common.cli_args import ArgParser

TTFT_GOAL = 1.3
"""Served TTFT at concurrency 1 over the in-process prefill time of the same prompt length (at most)."""
DECODE_GOAL = 1.0
"""pdserve batch-1 decode tok/s over llama.cpp's (at least)."""
THROUGHPUT_GOAL = 2.0
"""pdserve output tok/s at concurrency 16 over llama.cpp's (at least)."""
SYSTEMS = ("engine", "up", "up-fixed", "up-pinned", "colocated", "llamacpp")
SERVED = {"up": [], "up-fixed": ["--no-lend-cores"], "up-pinned": ["--pin-cores"], "colocated": ["--colocated"]}
"""pdserve systems -> their `pdserve up` flags (up-fixed: the same 1P1D cluster without core lending;
up-pinned: each engine pinned to its share's cores, where lending is off)."""


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
class Round:
    """One round of one system (concurrency 0: the in-process engine's prefill s and decode s/token)."""

    concurrency: int
    index: int
    load_1m: float
    """1-minute load average right after the round."""
    ttft_s: float
    tpot_s: float | None
    output_tok_s: float
    failed: int
    first_gap_s: float | None = None
    """Median gap between a request's first and second streamed token (P/D: the hand-off from prefill to decode)."""
    later_gap_s: float | None = None
    """Median of the gaps after that (the decode steps)."""


def gap_split(results: list[RequestResult]) -> tuple[float | None, float | None]:
    """(median first inter-token gap, median of the later gaps) over the requests that succeeded: TPOT averages
    both, and under P/D the first is the hand-off from prefill to decode, not a decode step."""
    firsts, later = [], []
    for r in results:
        gaps = r.itls() if r.ok else []
        if gaps:
            firsts.append(gaps[0])
            later += gaps[1:]
    return (statistics.median(firsts) if firsts else None, statistics.median(later) if later else None)


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
    rounds: list[Round] = field(default_factory=list)
    prefill_by_threads: dict[int, float] = field(default_factory=dict)
    """In-process engine only: median prefill seconds per torch thread count."""

    def at(self, c: int) -> Point | None:
        return next((p for p in self.points if p.concurrency == c), None)


@dataclass
class Ratios:
    ttft_over_prefill: dict[str, float] = field(default_factory=dict)
    """System -> served TTFT at c=1 / in-process prefill seconds (all cores)."""
    ttft_over_share_prefill: dict[str, float] = field(default_factory=dict)
    """`up` -> served TTFT at c=1 / in-process prefill at the thread share its prefill engine gets."""
    share_threads: int = 0
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
           top: int, share: int = 0) -> Ratios:
    """The goal ratios from measured points (missing inputs leave a ratio out); ``share``: the prefill
    engine's threads in `pdserve up`, whose in-process prefill (``engine.prefill_by_threads``) is the
    like-for-like reference of `up`'s TTFT."""
    r = Ratios(share_threads=share)
    share_prefill = engine.prefill_by_threads.get(share) if engine and share else None
    prefill = engine.at(0) if engine else None  # the engine's prefill is stored as concurrency 0
    base1 = llama.at(1) if llama and not llama.skipped else None
    base_top = llama.at(top) if llama and not llama.skipped else None
    for s in served:
        one = s.at(1)
        if one is None:
            continue
        if prefill is not None and prefill.ttft_s > 0:
            r.ttft_over_prefill[s.name] = one.ttft_s / prefill.ttft_s
        if s.name.startswith("up") and share_prefill:
            r.ttft_over_share_prefill[s.name] = one.ttft_s / share_prefill
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
    for name, v in r.ttft_over_share_prefill.items():
        lines.append(f"  served TTFT / in-process prefill at the served prefill's {r.share_threads} thread(s) "
                     f"({name}, c=1): {v:.2f}x (serving overhead alone; not the issue's goal)")
    for name, v in r.decode_vs_llamacpp.items():
        lines.append(f"batch-1 decode tok/s vs llama.cpp ({name}): {v:.2f}x (goal >= {DECODE_GOAL}) "
                     f"{'MET' if v >= DECODE_GOAL else 'MISSED'}")
    for name, v in r.throughput16_vs_llamacpp.items():
        lines.append(f"output tok/s at c={top} vs llama.cpp ({name}): {v:.2f}x (goal >= {THROUGHPUT_GOAL}) "
                     f"{'MET' if v >= THROUGHPUT_GOAL else 'MISSED'}")
    return lines


# --- running -----------------------------------------------------------------------------------------


def turn_order(names: list[str], round_index: int) -> list[str]:
    """The systems' order in round ``round_index``: rotated by one each round, so that no system always
    runs right after the same other one (a server's leftover work, or the load it just caused, would
    otherwise always land on the same neighbour)."""
    k = round_index % len(names) if names else 0
    return names[k:] + names[:k]


@dataclass
class Collected:
    """A server's requests, round walls and tokens at one concurrency, gathered over interleaved rounds."""

    results: list[RequestResult] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def _served_round(srv: Server, res: SystemResult, got: Collected, spec: str, c: int, i: int, args: argparse.Namespace
                  ) -> None:
    prompts = text_prompts(spec, c, args.prompt_len, args.seed + 1000 * c + i)
    results, wall = srv.round(prompts, args.output_len, stages=c == 1)
    ok = [r for r in results if r.ok]
    got.results += results
    got.walls.append(wall)
    got.tokens.append(sum((r.output_tokens if r.output_tokens is not None else len(r.event_times)) for r in ok))
    p = summarize(results, c, [wall], got.tokens[-1:])
    load = os.getloadavg()[0]
    first, later = gap_split(results)
    res.rounds.append(Round(c, i, load, p.ttft_s, p.tpot_s, p.output_tok_s, p.failed, first, later))
    errors = sorted({f"{r.error}: {r.detail[:80]}" for r in results if not r.ok})
    gaps = f" (gaps: first {first * 1e3:.1f} ms, later {later * 1e3:.1f} ms)" if first is not None and later else ""
    print(f"  round {i} c={c} {srv.name:<10} TTFT {p.ttft_s:.3f} s, TPOT {(p.tpot_s or 0) * 1e3:.1f} ms{gaps}, "
          f"{p.output_tok_s:.1f} out tok/s, {p.failed} failed {errors[:2]}; 1-min load {load:.2f}", flush=True)


def _engine_round(eng: InProcess, res: SystemResult, i: int, threads: list[int], acc: dict[int, list[float]],
                  decode: list[float]) -> None:
    prefill, per_token = eng.round(threads)
    for t, s in prefill.items():
        acc.setdefault(t, []).append(s)
    decode.append(per_token)
    load = os.getloadavg()[0]
    res.rounds.append(Round(0, i, load, prefill[threads[0]], per_token, 0.0, 0))
    shown = ", ".join(f"{t} thread{'s' if t > 1 else ''} {s:.3f} s" for t, s in prefill.items())
    print(f"  round {i}     engine     prefill {shown}; batch-1 decode {per_token * 1e3:.1f} ms "
          f"({1 / per_token:.1f} tok/s) after a {eng.prompt_len}-token prompt ({eng.short_decode_s * 1e3:.1f} ms after "
          f"{SHORT_CONTEXT}); 1-min load {load:.2f}", flush=True)


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
    from services.engine.cpu.cpu_features import QUIET_OPENMP_ENV, available_cpus, host_cpu, split_cores

    for k, v in QUIET_OPENMP_ENV.items():  # as pdserve up gives its engines; before torch loads OpenMP
        os.environ.setdefault(k, v)
    from benchmarks.engine_bench import _machine
    from services.text.model.gguf_meta import default_gguf_path
    from services.text.model.source import load_tokenizer

    p = ArgParser(prog="pdserve bench cpu-serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M Q4_1 GGUF)")
    p.add_argument("--dtype", default="auto", help="pdserve --dtype (engine and pdserve up)")
    p.add_argument("--weight-format", default="auto", help="pdserve --weight-format (engine and pdserve up)")
    p.add_argument("--cpu-compile-decode", type=int, default=0,
                   help="pdserve --cpu-compile-decode (engine and every engine pdserve up starts); 0: eager")
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
    share = split_cores(threads, 1, 1)[0]  # the prefill's thread share in `pdserve up` (1P1D) on this host
    cpu = host_cpu()
    print(f"machine: {_machine()}", flush=True)
    print(f"cpu: {cpu.model}; flags: {' '.join(cpu.reported_flags()) or '-'}; {threads} CPUs usable; "
          f"load {os.getloadavg()}", flush=True)
    t_start = time.time()
    results: dict[str, SystemResult] = {}
    servers: dict[str, Server] = {}
    notes: dict[str, str] = {}
    eng: InProcess | None = None
    dtype_s = fmt_s = "(engine not run)"
    os.environ.update({"PDSERVE_WEIGHT_FORMAT": args.weight_format,  # reach every engine pdserve up starts
                       "PDSERVE_CPU_COMPILE_DECODE": str(args.cpu_compile_decode)})
    try:
        if "engine" in systems:
            eng = InProcess(gguf, args.dtype, args.weight_format, args.prompt_len, args.output_len, threads,
                            args.cpu_compile_decode)
            dtype_s, fmt_s = eng.dtype, eng.weight_format
            results["engine"] = SystemResult("engine", f"LLMEngine(dtype={args.dtype}, weight_format="
                                             f"{args.weight_format}, cpu_threads={threads}, cpu_compile_decode="
                                             f"{args.cpu_compile_decode}); prefill also at {share} thread(s)")
            print(f"engine: ready; dtype {dtype_s}, weight format {fmt_s}", flush=True)
        common = ["--model", str(gguf), "--dtype", args.dtype]
        for name, extra in SERVED.items():
            if name not in systems:
                continue
            port, base = free_port(), free_port_run(6)
            cmd = [sys.executable, "-m", "services.cli", "up", *extra, *common, "--http-port", str(port),
                   "--grpc-port", "0", "--metrics-port-base", str(base)]
            target = Target(f"http://127.0.0.1:{port}", "", api="completions")  # model: read from /v1/models
            servers[name] = Server(name, cmd, target, str(gguf), list(range(base, base + 6)),
                                   compiling_engines=1 if args.cpu_compile_decode else 0)  # decode-0 / worker-0
        if "llamacpp" in systems:
            exe, info = llama_python(args.llama_python)
            if exe is None:
                results["llamacpp"] = SystemResult("llamacpp", "", skipped=info)
                print(f"llamacpp: skipped: {info}", flush=True)
            else:
                port = free_port()
                ctx = max(2048, 2 * (args.prompt_len + args.output_len))
                cmd = [exe, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port",
                       str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
                       "--n_batch", str(args.prompt_len), "--model_alias", "smollm2",
                       "--interrupt_requests", "False"]  # queue concurrent requests instead of cutting one off
                eos = sorted(load_tokenizer(str(gguf)).tokenizer.eos_token_ids)
                target = LlamaTarget(f"http://127.0.0.1:{port}", "smollm2", api="completions",
                                     banned_token_ids=tuple(eos))
                servers["llamacpp"] = Server("llamacpp", cmd, target, str(gguf))
                notes["llamacpp"] = f"  (llama-cpp-python {info})"
        for name, srv in servers.items():
            srv.start(args.ready_timeout_s, args.prompt_len, args.seed)
            results[name] = SystemResult(name, " ".join(srv.command) + notes.get(name, ""),
                                         load_avg=[os.getloadavg()[0]])
        order = [n for n in SYSTEMS if n in servers or (n == "engine" and eng is not None)]
        collected = {(n, c): Collected() for n in servers for c in concurrencies}
        prefills: dict[int, list[float]] = {}
        decodes: list[float] = []
        for c in concurrencies:
            print(f"concurrency {c}: {args.repeats} rounds, systems taking turns", flush=True)
            for i in range(args.repeats):
                for name in turn_order(order, i):
                    if name == "engine":
                        if eng is not None and c == concurrencies[0]:  # the in-process ceilings: once per round
                            _engine_round(eng, results["engine"], i, sorted({threads, share}, reverse=True),
                                          prefills, decodes)
                        continue
                    _served_round(servers[name], results[name], collected[(name, c)], str(gguf), c, i, args)
        for (name, c), got in collected.items():
            results[name].points.append(summarize(got.results, c, got.walls, got.tokens))
        for name, srv in servers.items():
            results[name].stages_c1 = srv.stage_means()
        if eng is not None and decodes:
            res = results["engine"]
            res.points.append(Point(0, statistics.median(prefills[threads]), statistics.median(decodes), 0.0, 0, 0,
                                    args.prompt_len))
            res.prefill_by_threads = {t: statistics.median(v) for t, v in prefills.items()}
    finally:
        for srv in servers.values():
            srv.stop()
        if eng is not None:
            eng.stop()
    for res in results.values():
        res.load_avg.append(os.getloadavg()[0])
    ordered = [results[n] for n in SYSTEMS if n in results]
    top = max(concurrencies)
    r = ratios(results.get("engine"), [s for s in ordered if s.name in SERVED], results.get("llamacpp"), top, share)
    print()
    print(f"{cpu.model} [{' '.join(cpu.reported_flags()) or '-'}], dtype {dtype_s}, weight format {fmt_s}, "
          f"cpu_compile_decode {args.cpu_compile_decode}, prompt {args.prompt_len} tokens, {args.output_len} output "
          f"tokens, {args.repeats} interleaved rounds per point, {time.time() - t_start:.0f} s")
    print(table(ordered, concurrencies))
    eng_res = results.get("engine")
    if eng_res is not None and eng_res.prefill_by_threads:
        print("in-process prefill by torch threads: " + ", ".join(
            f"{t}: {s:.3f} s" for t, s in sorted(eng_res.prefill_by_threads.items(), reverse=True)))
    print()
    for line in goal_lines(r, top):
        print(line)
    for s in ordered:
        loads = [x.load_1m for x in s.rounds] or s.load_avg
        print(f"{s.name}: {s.command or '-'}; 1-min load over its rounds {min(loads):.2f}-{max(loads):.2f}")
        if s.stages_c1:
            shown = ", ".join(f"{k.removeprefix('pdserve_')} {v * 1e3:.0f} ms" for k, v in s.stages_c1.items())
            print(f"  {s.name} c=1 stage means (server metrics): {shown}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu_model": cpu.model, "cpu_flags": cpu.reported_flags(),
                                         "dtype": dtype_s, "weight_format": fmt_s,
                                         "cpu_compile_decode": args.cpu_compile_decode,
                                         "systems": [asdict(s) for s in ordered], "ratios": asdict(r)}, indent=2))
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
