"""Whole-step A/B of the CPU decode attention choices (not product code): the in-process engine (eager, bf16,
int4, 2 threads) decoding 64 tokens after a prompt, the variants alternating per request. The variants switch
services/engine/attention.py's two module-level choices: the view of consecutive blocks (``consecutive_starts``;
off: every step gathers, as before) and one-thread attention for small decode batches (``ONE_THREAD_MAX_BATCH``;
0: the step's threads, as before). "gather, 2 threads" is the code before this change.

    python docs/reports/cpu-serving-2026-12-01d/cpu-attn/decode_attention_ab.py [ROUNDS] [PROMPT_LENS]
"""

from __future__ import annotations

import os
import statistics
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as pdserve up gives its engines; before torch loads
os.environ.setdefault("KMP_BLOCKTIME", "0")
sys.path.insert(0, os.getcwd())

from benchmarks.engine_bench import EngineBench, _prompts
from services.engine import attention as A
from services.engine.cpu_features import host_cpu
from services.engine.weights.gguf_loader import default_gguf_path

STARTS, ONE = A.consecutive_starts, A.ONE_THREAD_MAX_BATCH
VARIANTS = {"gather, 2 threads (before)": (False, 0), "gather, 1 thread": (False, ONE),
            "views, 2 threads (now)": (True, ONE)}
"""Since 16:20 UTC views never change the thread count (ONE_THREAD_MAX_BATCH applies to gathered steps of at most
ONE_THREAD_MAX_KEYS keys); the passes before it ran a fourth variant, views on 1 thread."""


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    lens = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [512, 32]
    cpu = host_cpu()
    print(f"CPU {cpu.model} [{' '.join(cpu.reported_flags())}]; load {os.getloadavg()}")
    b = EngineBench(str(default_gguf_path()), "auto", max(lens), 1, max(lens) + 128, 2, "auto", cpu_compile_decode=0)
    for plen in lens:
        res: dict[str, list[float]] = {k: [] for k in VARIANTS}
        for r in range(rounds):
            for name, (views, one) in VARIANTS.items():
                A.consecutive_starts = STARTS if views else (lambda tables, bs: None)
                A.ONE_THREAD_MAX_BATCH = one
                res[name].append(b.decode(_prompts(1, plen, b.vocab, seed=r), 64) / 63 * 1000)
        print(f"prompt {plen}: " + "; ".join(f"{k}: median {statistics.median(v):.2f} ms {[round(x, 2) for x in v]}"
                                              for k, v in res.items()), "; load", os.getloadavg(), flush=True)
    A.consecutive_starts, A.ONE_THREAD_MAX_BATCH = STARTS, ONE


if __name__ == "__main__":
    main()
