"""Whole-step A/B behind docs/PERFORMANCE.md run 7 (not product code): batch-1 decode attention run on one torch
thread (a monkeypatch of TorchPagedAttention._decode) against today's two, the variants alternating per request.

    python docs/reports/cpu-serving-2026-12-01d/cpu-served/attention_one_thread_ab.py [ROUNDS]
"""

from __future__ import annotations

import os
import statistics
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as pdserve up gives its engines; before torch loads
os.environ.setdefault("KMP_BLOCKTIME", "0")
sys.path.insert(0, os.getcwd())

import torch

from benchmarks.engine_bench import EngineBench, _prompts
from services.engine import attention as A
from services.engine.weights.gguf_loader import default_gguf_path

ORIG = A.TorchPagedAttention._decode


def one_thread(self: A.TorchPagedAttention, layer: int, q: torch.Tensor, plan: A.DecodePlan, gqa: bool
               ) -> torch.Tensor:
    if q.shape[0] != 1:
        return ORIG(self, layer, q, plan, gqa)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return ORIG(self, layer, q, plan, gqa)
    finally:
        torch.set_num_threads(n)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    b = EngineBench(str(default_gguf_path()), "auto", 512, 1, 512 + 64 + 64, 2, "auto", cpu_compile_decode=0)
    for plen in (512, 32):
        res: dict[str, list[float]] = {"2 threads (today)": [], "attention on 1 thread": []}
        for r in range(rounds):
            for name in res:
                A.TorchPagedAttention._decode = ORIG if name.startswith("2") else one_thread
                res[name].append(b.decode(_prompts(1, plen, b.vocab, seed=r), 64) / 63 * 1000)
        print(f"prompt {plen}: " + "; ".join(f"{k}: median {statistics.median(v):.2f} ms {[round(x, 2) for x in v]}"
                                              for k, v in res.items()), "load", os.getloadavg())
    A.TorchPagedAttention._decode = ORIG


if __name__ == "__main__":
    main()
