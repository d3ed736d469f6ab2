"""Compiled CPU decode (``--cpu-compile-decode``) against the eager step, in ONE engine, alternating.

    python -m benchmarks.compiled_decode_bench [--batches 1,2,4] [--weight-format auto] [--output-len 64] [--pairs 5] [--json out.json]

One LLMEngine (default dtype, --weight-format, compiled decode for batch sizes 1..max(--batches)) is
built; it is ready as soon as its weights are loaded. Its background compile (decode_compiler.py: a niced
compile child fills the on-disk cache ``--cache-dir``, this process builds each variant from it) is held
back while ``--baseline-runs`` batch-1 requests of 16 tokens run eagerly (the undisturbed reference), then
runs while this process keeps decoding such requests: the time to ready, each variant's seconds in the
child and here, check and start-up timing, when it was switched on, and the eager/compiled ms per step
of those requests meanwhile are printed. While the child lives, every other request runs with the child
held stopped (``DecodeCompiler.hold_child``; otherwise the compiler's gate runs it for CHILD_DUTY of the
time while the engine serves), so its cost to serving is the ratio of neighbouring requests under the same
box load. Then:

  * correctness, teacher-forced on the real model: a 200-token prompt prefilled eagerly, then 48 decode
    steps, each run eagerly AND compiled from the same KV state (the cache restored in between): max
    |logit difference|, greedy agreement, and the max difference of the K/V the two paths store;
  * speed: for each batch size, ``--pairs`` pairs of decode runs (``--output-len`` tokens per sequence, EOS
    ignored) with the runner's compiled path off and on, alternating (the order flips every pair) so that
    load from other processes hits both alike; ms per step = median over the pair's runs; the 1-minute load
    average is printed per pair. Recompiles during the timed runs (context lengths grow) are counted.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch._dynamo.utils

from benchmarks.engine_bench import EngineBench, _machine, _prompts
from services.common.cli_args import ArgParser
from services.engine.attention import ForwardContext, TorchPagedAttention
from services.engine.cpu import compile_cache, decode_compiler
from services.engine.models.quant_linear import WEIGHT_FORMATS
from services.engine.step_inputs import prepare_rows


@dataclass
class Results:
    machine: str
    torch: str
    threads: int
    dtype: str
    weight_format: str
    compile_seconds: float
    ready_s: float = 0.0
    """Engine construction (weights, KV pool, compile thread started) in seconds."""
    variants: list[dict] = field(default_factory=list)
    """The background compile's VariantReport of each batch size, times relative to construction start."""
    cache_dir: str = ""
    baseline_ms: list[float] = field(default_factory=list)
    """ms per step of each batch-1 request before the compile began (eager, nothing compiling)."""
    during_compile: list[list[float]] = field(default_factory=list)
    """[seconds since the compile began, ms per step, batch 1 compiled (0/1), child stopped (1) / running (0) /
    gone (-1)] of each batch-1 run meanwhile."""
    max_logit_diff: float = 0.0
    greedy_agreement: float = 0.0
    max_kv_diff: float = 0.0
    recompiles_during_timing: int = 0
    ms_per_step: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """batch -> {"eager": [...], "compiled": [...]} (one figure per run)."""
    load_avg: list[float] = field(default_factory=list)


@torch.inference_mode()
def check(bench: EngineBench, r: Results, prompt_len: int = 200, steps: int = 48) -> None:
    runner = bench.engine.runner
    model, kv, bs = runner.model, runner.kv_cache, runner.block_size
    compiled = runner.compiled_decode
    assert compiled is not None
    backend = TorchPagedAttention(kv, runner.head_dim ** -0.5)
    table = list(range((prompt_len + steps + bs) // bs))
    prompt = _prompts(1, prompt_len, bench.vocab, seed=3)[0]
    ids, pos, meta = prepare_rows([(prompt, 0, table)], bs, runner.device)
    hidden = model(ids, pos, ForwardContext(backend, meta))
    tok = int(model.compute_logits(hidden[-1:]).argmax())
    agree = 0
    for i in range(steps):
        p = prompt_len + i
        before = kv.clone()
        ids, pos, meta = prepare_rows([([tok], p, table)], bs, runner.device)
        eager = model.compute_logits(model(ids, pos, ForwardContext(backend, meta)))[0]
        after_eager = kv.clone()
        kv.copy_(before)
        got = compiled.forward([(tok, p, table)])[0]
        r.max_logit_diff = max(r.max_logit_diff, (got - eager).abs().max().item())
        r.max_kv_diff = max(r.max_kv_diff, (kv.float() - after_eager.float()).abs().max().item())
        agree += int(got.argmax() == eager.argmax())
        tok = int(eager.argmax())  # teacher-forced: both paths see the eager greedy sequence
    r.greedy_agreement = agree / steps


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m benchmarks.compiled_decode_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,4", help="decode batch sizes to time")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of each timed sequence")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--cpu-threads", type=int, default=0)
    p.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS)
    p.add_argument("--idle-during-compile", action="store_true",
                   help="wait for the background compile instead of decoding batch-1 requests meanwhile")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="the compile cache directory (default: the engine's, ~/.cache/pdserve/torch-compile); an "
                        "empty one measures a first start")
    p.add_argument("--gap-s", type=float, default=0.0,
                   help="idle seconds between the batch-1 requests served during the compile (0: back to back)")
    p.add_argument("--baseline-runs", type=int, default=8,
                   help="batch-1 requests decoded eagerly before the background compile may start")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    batches = sorted({int(b) for b in args.batches.split(",")})
    if args.cache_dir is not None:  # EngineBench builds its config with the default cache directory
        compile_cache.DEFAULT_CACHE_DIR = str(args.cache_dir)
    t0 = time.monotonic()
    with decode_compiler._ONE_AT_A_TIME:  # the compile (child included) waits until the baseline is taken
        bench = EngineBench(None, "auto", args.prompt_len, max(batches), args.prompt_len + args.output_len + 64,
                            args.cpu_threads, args.weight_format, cpu_compile_decode=max(batches))
        ready_s = time.monotonic() - t0
        one = _prompts(1, args.prompt_len, bench.vocab, seed=5)
        baseline = [bench.decode(one, 16) / 15 * 1e3 for _ in range(args.baseline_runs)]
    t0 = time.monotonic()  # compile timeline from here: the compile starts now
    cfg, runner = bench.config, bench.engine.runner
    cd, compiler = runner.compiled_decode, runner.decode_compiler
    assert cd is not None and compiler is not None, "the compiled decode path was not built (see the engine log)"
    during: list[list[float]] = []
    while not compiler.wait(1.0 if args.idle_during_compile else 0):  # serve batch-1 requests meanwhile
        if args.idle_during_compile:
            continue
        on = 1 in cd.active
        child = compiler._child
        state = -1.0 if child is None or child.proc.poll() is not None else float(len(during) % 2)
        compiler.hold_child = state == 1.0
        try:
            ms = bench.decode(one, 16) / 15 * 1e3
        finally:
            compiler.hold_child = False
        during.append([time.monotonic() - t0, ms, float(on and 1 in cd.active), state])
        time.sleep(args.gap_s)
    report = compiler.report
    r = Results(machine=_machine(), torch=torch.__version__, threads=torch.get_num_threads(),
                dtype=cfg.resolved_dtype, weight_format=cfg.resolved_weight_format,
                compile_seconds=cd.compile_seconds, ready_s=ready_s, during_compile=during,
                cache_dir=str(compile_cache.cache_dir_of(cfg)), baseline_ms=baseline,
                variants=[dict(asdict(v), decided=v.decided - t0) for v in report.variants])
    print(f"machine: {r.machine}; torch {r.torch}, {r.threads} threads; dtype {r.dtype}, weights "
          f"{r.weight_format}; engine ready in {ready_s:.1f} s; background compile {report.status}, "
          f"{r.compile_seconds:.1f} s building variants in this process; cache {r.cache_dir}", flush=True)
    if baseline:
        print(f"  batch-1 requests before the compile (eager): {len(baseline)} runs, median "
              f"{statistics.median(baseline):.2f} ms/step", flush=True)
    for v in report.variants:
        print(f"  batch {v.batch} at {v.threads} threads: {v.child_s:.1f} s in the compile child, built here in "
              f"{v.compile_s:.1f} s ({v.cache_misses} cache misses), max |logit diff| {v.max_logit_diff:.3g}, "
              f"same argmax {v.same_argmax}, start-up timing {v.compiled_ms:.2f} ms vs eager {v.eager_ms:.2f} ms, "
              f"{'switched on' if v.active else 'stays eager'} at {v.decided - t0:.1f} s", flush=True)
    for label, sel in (("eager", 0.0), ("compiled", 1.0)):
        ms = [d[1] for d in during if d[2] == sel]
        if ms:
            slow = f", {statistics.median(ms) / statistics.median(baseline):.2f}x the eager baseline" if baseline else ""
            print(f"  batch-1 requests during the compile, {label} steps: {len(ms)} runs, median "
                  f"{statistics.median(ms):.2f} ms/step, max {max(ms):.2f}{slow}", flush=True)
    for label, sel in (("eager", 0.0), ("compiled", 1.0)):
        run = [d[1] for d in during if d[2] == sel and d[3] == 0.0]
        stopped = [d[1] for d in during if d[2] == sel and d[3] == 1.0]
        if run and stopped:
            print(f"  while the child lived, {label} steps: child gated {statistics.median(run):.2f} ms/step "
                  f"({len(run)} runs), child stopped {statistics.median(stopped):.2f} ({len(stopped)} runs): "
                  f"{statistics.median(run) / statistics.median(stopped):.3f}x", flush=True)
    if not all(v.same_argmax for v in report.variants if v.batch in batches) or report.status != "done":
        print("a variant failed to compile or its check: no timed comparison", flush=True)
        return 1
    cd.on = frozenset((b, cd.threads) for b in batches)  # time every asked size, whatever the start-up timing decided
    check(bench, r)
    print(f"teacher-forced, 48 steps: max |logit diff| {r.max_logit_diff:.4f}, greedy agreement "
          f"{r.greedy_agreement:.0%}, max K/V diff {r.max_kv_diff:.4f}", flush=True)
    frames0 = torch._dynamo.utils.counters["frames"]["ok"]
    n = args.output_len
    for b in batches:
        prompts = _prompts(b, args.prompt_len, bench.vocab, seed=4)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for i in range(args.pairs + 1):  # the first pair warms up and is not kept
            for name in (("eager", "compiled") if i % 2 else ("compiled", "eager")):
                runner.compiled_decode = cd if name == "compiled" else None
                ms = bench.decode(prompts, n) / (n - 1) * 1e3
                if i:
                    times[name].append(ms)
            load = os.getloadavg()[0]
            r.load_avg.append(load)
            if i:
                print(f"batch {b} pair {i}: eager {times['eager'][-1]:.2f} ms/step, compiled "
                      f"{times['compiled'][-1]:.2f} ms/step (load {load:.2f})", flush=True)
        runner.compiled_decode = cd
        r.ms_per_step[str(b)] = times
    r.recompiles_during_timing = torch._dynamo.utils.counters["frames"]["ok"] - frames0
    print("\n| batch | eager ms/step | compiled ms/step | eager tok/s | compiled tok/s | speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for b in batches:
        e, c = (statistics.median(r.ms_per_step[str(b)][k]) for k in ("eager", "compiled"))
        print(f"| {b} | {e:.2f} | {c:.2f} | {b * 1e3 / e:.1f} | {b * 1e3 / c:.1f} | {e / c:.2f}x |")
    print(f"\nrecompiles during the timed runs: {r.recompiles_during_timing}; 1-min load "
          f"{min(r.load_avg):.2f}-{max(r.load_avg):.2f} on {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(r), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
