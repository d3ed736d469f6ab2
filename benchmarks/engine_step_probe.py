"""Where an in-process engine run spends its steps: one point (prompts of ``--input`` tokens, ``--output`` tokens
each, ``--concurrency`` in flight, greedy, ignore_eos) run with logprobs off and on in alternating rounds, every
step timed to the device's completion and classed as pure decode (graphed or eager) or a step that carries
prompt tokens. Prints per round and class: steps, seconds, median ms, tokens per step.

    python3 benchmarks/engine_step_probe.py --model random:llama-3-8b --concurrency 64 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_round(engine, n_in: int, n_out: int, conc: int, logprobs: bool, seed: int, profile: bool = False
              ) -> dict[str, list[tuple]]:
    """``profile``: the third step that starts with prompts waiting runs under torch.profiler (table printed)."""
    import torch

    from services.text.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    for i in range(conc):
        engine.add_request(f"r{seed}-{i}", torch.randint(0, engine.vocab_size, (n_in,), generator=g).tolist(), sp,
                           detokenize=False)
    classes: dict[str, list[tuple]] = {"decode graphed": [], "decode eager": [], "with prompt tokens": []}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    prompt_steps = 0
    while engine.has_work():
        graphed = getattr(engine.runner, "graphed_steps", 0)
        prompt_steps += engine.scheduler.num_waiting > 0
        sync()
        t0 = time.perf_counter()
        if profile and prompt_steps == 3 and engine.scheduler.num_waiting > 0:
            profile = False
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts) as prof:
                engine.step()
                sync()
            for key in ("self_cpu_time_total", "self_device_time_total" if torch.cuda.is_available() else None):
                if key:
                    print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=70))
        else:
            engine.step()
        sync()
        dt = time.perf_counter() - t0
        rows, tokens = engine.last_step_sequences, engine.last_step_tokens
        if not rows:
            continue
        if tokens > rows:
            classes["with prompt tokens"].append((dt, tokens, rows))
        elif getattr(engine.runner, "graphed_steps", 0) > graphed:
            classes["decode graphed"].append((dt, tokens, rows))
        else:
            classes["decode eager"].append((dt, tokens, rows))
    return classes


def report(title: str, classes: dict[str, list[tuple]]) -> None:
    total = sum(dt for c in classes.values() for dt, _, _ in c)
    print(f"{title}: {total:.3f} s in all")
    for name, steps in classes.items():
        if steps:
            ms = sorted(1e3 * dt for dt, _, _ in steps)
            print(f"  {name:18s} {len(steps):5d} steps {sum(ms) / 1e3:7.3f} s, median {statistics.median(ms):8.2f} ms, "
                  f"max {ms[-1]:8.2f} ms, tokens/step {statistics.mean(t for _, t, _ in steps):7.1f}, "
                  f"rows/step {statistics.mean(n for _, _, n in steps):6.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input", type=int, default=1024)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--concurrency", default="64", help="comma-separated; each runs --rounds rounds")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=9216)
    p.add_argument("--profile", action="store_true", help="profile one prompt-carrying step of the first round of each")
    a = p.parse_args()
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len))
    print(f"engine start-up warm-up: {engine.warmed_up}")
    run_round(engine, 64, 4, 4, True, seed=999)  # warm-up
    run_round(engine, a.input, 2, 2, False, seed=998)
    seed = 0
    for conc in map(int, a.concurrency.split(",")):
        for r in range(a.rounds):
            for lp in (False, True):
                seed += 1  # fresh prompts: no prefix-cache hits between rounds
                report(f"C{conc} round {r} logprobs {'on ' if lp else 'off'}",
                       run_round(engine, a.input, a.output, conc, lp, seed=seed, profile=a.profile and r == 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
