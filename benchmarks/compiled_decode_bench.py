"""Compiled CPU decode (``--cpu-compile-decode``) against the eager step, in ONE engine, alternating.

    python -m benchmarks.compiled_decode_bench [--batches 1,2,4] [--weight-format auto] [--output-len 64] [--pairs 5] [--json out.json]

One LLMEngine (default dtype, --weight-format, compiled decode for batch sizes 1..max(--batches)) is
built; its start-up compile time is reported. Then:

  * correctness, teacher-forced on the real model: a 200-token prompt prefilled eagerly, then 48 decode
    steps, each run eagerly AND compiled from the same KV state (the cache restored in between): max
    |logit difference|, greedy agreement, and the max difference of the K/V the two paths store;
  * speed: for each batch size, ``--pairs`` pairs of decode runs (``--output-len`` tokens per sequence, EOS
    ignored) with the runner's compiled path off and on, alternating (the order flips every pair) so that
    load from other processes hits both alike; ms per step = median over the pair's runs; the 1-minute load
    average is printed per pair. Recompiles during the timed runs (context lengths grow) are counted.
"""

from __future__ import annotations

import argparse
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
from services.engine.attention import ForwardContext, TorchPagedAttention
from services.engine.model_runner import prepare_rows
from services.engine.models.quant_linear import WEIGHT_FORMATS


@dataclass
class Results:
    machine: str
    torch: str
    threads: int
    dtype: str
    weight_format: str
    compile_seconds: float
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
    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled_decode_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,4", help="decode batch sizes to time")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of each timed sequence")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--cpu-threads", type=int, default=0)
    p.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    batches = sorted({int(b) for b in args.batches.split(",")})
    bench = EngineBench(None, "auto", args.prompt_len, max(batches), args.prompt_len + args.output_len + 64,
                        args.cpu_threads, args.weight_format, cpu_compile_decode=max(batches))
    cfg, runner = bench.config, bench.engine.runner
    assert runner.compiled_decode is not None, "the compiled decode path was not built (see the engine log)"
    r = Results(machine=_machine(), torch=torch.__version__, threads=torch.get_num_threads(),
                dtype=cfg.resolved_dtype, weight_format=cfg.resolved_weight_format,
                compile_seconds=runner.compiled_decode.compile_seconds)
    print(f"machine: {r.machine}; torch {r.torch}, {r.threads} threads; dtype {r.dtype}, weights "
          f"{r.weight_format}; compile at start {r.compile_seconds:.1f} s", flush=True)
    check(bench, r)
    print(f"teacher-forced, 48 steps: max |logit diff| {r.max_logit_diff:.4f}, greedy agreement "
          f"{r.greedy_agreement:.0%}, max K/V diff {r.max_kv_diff:.4f}", flush=True)
    cd = runner.compiled_decode
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
