"""One layer's CPU decode attention alone, as services/engine/attention.py runs it: the K/V gather from paged
blocks + SDPA (today's path for fragmented block tables) against SDPA over views of the pool (consecutive blocks),
each at 1 torch thread and at the engine's count, per batch size and context. Rounds alternate the variants; the
median per variant is printed (us per layer call) with the CPU model, flags and load.

    python -m benchmarks.cpu_decode_attention [--keys 128,512,2048] [--batches 1,2,4] [--rounds 5]
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from services.common.cli_args import ArgParser
from services.engine.cpu.cpu_features import QUIET_OPENMP_ENV

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
"""The embedded SmolLM2-135M's attention shapes and the engine's default block size."""


def _variants(keys: int, batch: int) -> dict[str, Callable[[], object]]:
    import torch
    import torch.nn.functional as F

    nb = (keys + BLOCK - 1) // BLOCK
    pool = batch * (nb + 3) + 1
    kp = torch.randn(pool, BLOCK * KV_HEADS * HEAD_DIM).to(torch.bfloat16)
    vp = torch.randn_like(kp)
    kf, vf = kp.view(-1, KV_HEADS, HEAD_DIM), vp.view(-1, KV_HEADS, HEAD_DIM)
    q = torch.randn(batch, HEADS, 1, HEAD_DIM).to(torch.bfloat16)
    starts = [1 + i * (nb + 3) for i in range(batch)]  # each sequence's blocks consecutive, sequences apart
    ids = torch.cat([torch.arange(s, s + nb) for s in starts]).to(torch.int64)

    def gather() -> object:
        k = kp.index_select(0, ids).view(batch, -1, KV_HEADS, HEAD_DIM)[:, :keys].transpose(1, 2)
        v = vp.index_select(0, ids).view(batch, -1, KV_HEADS, HEAD_DIM)[:, :keys].transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def views() -> object:
        outs = [F.scaled_dot_product_attention(q[i:i + 1], kf[s * BLOCK:s * BLOCK + keys].unsqueeze(0).transpose(1, 2),
                                               vf[s * BLOCK:s * BLOCK + keys].unsqueeze(0).transpose(1, 2),
                                               enable_gqa=True) for i, s in enumerate(starts)]
        return outs[0] if batch == 1 else torch.cat(outs)

    torch.testing.assert_close(gather(), views())
    return {"gather": gather, "views": views}


def _timed(fn: Callable[[], object], calls: int) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="128,512,2048")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="the engine's count (0: every usable CPU)")
    a = ap.parse_args(argv)
    for k, v in QUIET_OPENMP_ENV.items():  # as pdserve up gives its engines; before torch loads OpenMP
        os.environ.setdefault(k, v)
    import torch

    from services.engine.cpu.cpu_features import available_cpus, host_cpu

    engine = a.threads or len(available_cpus())
    cpu = host_cpu()
    print(f"CPU {cpu.model} [{' '.join(cpu.reported_flags())}], torch {torch.__version__}, engine threads {engine}, "
          f"load {os.getloadavg()}")
    for keys in (int(x) for x in a.keys.split(",")):
        for batch in (int(x) for x in a.batches.split(",")):
            fns = _variants(keys, batch)
            calls = max(50, 200_000 // (keys * batch))
            times: dict[str, list[float]] = {}
            for _ in range(a.rounds):
                for t in sorted({1, engine}):
                    torch.set_num_threads(t)
                    for name, fn in fns.items():
                        times.setdefault(f"{name} {t}t", []).append(_timed(fn, calls))
            torch.set_num_threads(engine)
            row = ", ".join(f"{k} {statistics.median(v):7.1f}" for k, v in times.items())
            print(f"{keys:5d} keys, batch {batch}: {row} us; load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
