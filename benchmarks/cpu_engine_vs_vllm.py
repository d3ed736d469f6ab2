"""pdserve's in-process engine against vLLM's offline engine on CPU, alternated in one driver so a drifting host hits
both: each engine runs in a worker process that loads once and then, per round, times three 512-token prefills
(the median is reported) and 16 prompts of 512 tokens with 33 output tokens. Rounds go A B C, then C B A.

    python -m benchmarks.cpu_engine_vs_vllm --vllm-python /tmp/vllmenv/bin/python --hf-model DIR [--rounds 4]

DIR: an HF copy of the embedded GGUF (docs/reports/cpu-vllm-2026-12-06/run.sh, prepare_hf, makes one); the vLLM venv
is made as that script's header says. pdserve runs at 1 and 2 threads, vLLM with its own default (one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

# No pdserve import at the top: the vLLM worker runs this file with the vLLM venv's Python.

PROMPT, OUT, BATCH = 512, 33, 16


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(100, 49000) for _ in range(PROMPT)] for _ in range(n)]


def _serve(prefill, batch) -> None:
    """Worker loop: READY, then one JSON line of figures per line read from stdin."""
    prefill()
    batch()
    print("READY", flush=True)
    for _ in sys.stdin:
        p = sorted(prefill() for _ in range(3))
        print(json.dumps({"prefill_ms": p[1], "batch_s": batch()}), flush=True)


def vllm_worker(model: str) -> None:
    from vllm import LLM, SamplingParams  # the peer, in its own venv

    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False)
    rng = random.Random(0)

    def run(prompts: list[list[int]], n: int) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    _serve(lambda: run(_prompts(rng, 1), 1) * 1000, lambda: run(_prompts(rng, BATCH), OUT))


def pdserve_worker(threads: int) -> None:
    # deferred: the vLLM worker imports this module without pdserve on its path
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.text.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(cpu_threads=threads, enable_prefix_caching=False, max_prefill_chunk=PROMPT,
                                 cpu_compile_decode=0))
    rng = random.Random(0)

    def run(prompts: list[list[int]], n: int) -> float:
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add_request(f"r{rng.random()}-{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                            detokenize=False)
        while eng.has_work():
            eng.step()
        return time.perf_counter() - t

    _serve(lambda: run(_prompts(rng, 1), 1) * 1000, lambda: run(_prompts(rng, BATCH), OUT))


def drive(workers: dict[str, list[str]], rounds: int) -> dict[str, dict[str, float]]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2")
    procs = {}
    for name, cmd in workers.items():
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=env)
        while (line := p.stdout.readline()) and not line.startswith("READY"):
            pass
        if not line:
            raise SystemExit(f"{name}: the worker exited before it was ready ({' '.join(cmd)})")
        procs[name] = p
    res: dict[str, list[dict[str, float]]] = {n: [] for n in procs}
    order = list(procs)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            p = procs[name]
            p.stdin.write("go\n")
            p.stdin.flush()
            res[name].append(json.loads(p.stdout.readline()))
            print(f"round {r} {name}: {res[name][-1]}", flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait(timeout=120)
    return {n: {k: statistics.median(x[k] for x in v) for k in ("prefill_ms", "batch_s")} for n, v in res.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--vllm-python", default="", help="Python of the vLLM venv; empty: pdserve only.")
    ap.add_argument("--hf-model", default="", help="HF directory vLLM loads.")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--worker", default="", choices=("", "vllm", "pdserve"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if a.worker == "vllm":
        return vllm_worker(a.hf_model)
    if a.worker == "pdserve":
        return pdserve_worker(a.threads)
    if a.vllm_python and not a.hf_model:
        raise SystemExit("--hf-model: required with --vllm-python")
    me = [sys.executable, "-m", "benchmarks.cpu_engine_vs_vllm"]
    workers = {"pdserve 1 thread": [*me, "--worker", "pdserve", "--threads", "1"],
               "pdserve 2 threads": [*me, "--worker", "pdserve", "--threads", "2"]}
    if a.vllm_python:
        workers = {"vLLM": [a.vllm_python, os.path.abspath(__file__), "--worker", "vllm", "--hf-model", a.hf_model],
                   **workers}
    subprocess.run(["sh", "-c", "lscpu | grep -E 'Model name|^Flags'"], check=False)
    for name, fig in drive(workers, a.rounds).items():
        print(f"MEDIAN {name}: 512-token prefill {fig['prefill_ms']:.1f} ms, {BATCH} x {PROMPT}/{OUT} "
              f"{fig['batch_s']:.2f} s")


if __name__ == "__main__":
    main()
