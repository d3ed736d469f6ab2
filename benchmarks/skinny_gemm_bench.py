"""The skinny GEMM (services/kernels/skinny_gemm.py) against torch's linear (cuBLAS) at decode row counts, both
replayed from CUDA graphs (no launch overhead on either side), with the device-copy ceiling of the same run.

For each weight shape of Qwen3-30B-A3B and Llama-3-8B (bf16) and M rows it prints us per product and the
fraction of the copy ceiling the weight read reaches (bytes = weight + x + y), for cuBLAS, the kernel at its
default tiles and at the best of a tile sweep (the sweep runs at M = 1 and 8).

    python3 -m benchmarks.skinny_gemm_bench --out skinny.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K)
    "qwen3-30b-a3b qkv": (5120, 2048), "qwen3-30b-a3b o": (2048, 4096), "qwen3-30b-a3b router": (128, 2048),
    "qwen3-30b-a3b lm_head": (151936, 2048),
    "llama-3-8b qkv": (6144, 4096), "llama-3-8b o": (4096, 4096), "llama-3-8b gate_up": (28672, 4096),
    "llama-3-8b down": (4096, 14336), "llama-3-8b lm_head": (128256, 4096), "mixtral router": (8, 4096),
}
ROWS = (1, 2, 4, 8, 16)
SWEEP_ROWS = (1, 8)


def graph_us(fn: Callable[[], torch.Tensor], reps: int = 20, rounds: int = 5) -> float:
    """us per call of ``fn`` replayed ``reps`` times from one CUDA graph (median of ``rounds`` replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def copy_ceiling_gbs(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us(lambda: dst.copy_(src), reps=5)
    return 2 * nbytes / us / 1e3


def main() -> None:
    from services.kernels.skinny_gemm import SkinnyTiles, skinny_gemm, skinny_tiles

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("skinny_gemm.json"))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-rows", default=",".join(map(str, SWEEP_ROWS)), help="row counts that sweep tiles")
    args = ap.parse_args()
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ceiling = copy_ceiling_gbs()
    print(f"device {torch.cuda.get_device_name(dev)}, {sms} SMs, copy ceiling {ceiling:.0f} GB/s", flush=True)
    sweep = [SkinnyTiles(bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256, 512), (3, 4, 5))]
    sweep += [SkinnyTiles(32, 256, 8, 4), SkinnyTiles(64, 256, 8, 4), SkinnyTiles(64, 512, 8, 3)]
    rows_out = []
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn((n, k), generator=gen, device=dev, dtype=torch.bfloat16) / k**0.5
        for m in ROWS:
            x = torch.randn((m, k), generator=gen, device=dev, dtype=torch.bfloat16)
            nbytes = (n * k + m * k + m * n) * 2
            ref = F.linear(x, w)
            got = skinny_gemm(x, w)
            err = (got.float() - ref.float()).abs().max().item()
            cublas = graph_us(lambda x=x, w=w: F.linear(x, w))
            default = graph_us(lambda x=x, w=w: skinny_gemm(x, w))
            best, best_us = skinny_tiles(n, k, sms), default
            if m in sweep_rows and not args.no_sweep:
                for t in sweep:
                    try:
                        us = graph_us(lambda t=t, x=x, w=w: skinny_gemm(x, w, tiles=t), reps=10, rounds=3)
                    except Exception as e:  # a tile that does not compile or fit is skipped, not fatal
                        print(f"  skip {t}: {type(e).__name__}", flush=True)
                        continue
                    if us < best_us:
                        best, best_us = t, us
            row = {"shape": name, "n": n, "k": k, "m": m, "cublas_us": cublas, "skinny_us": default,
                   "best_us": best_us, "best_tiles": best.__dict__, "max_abs_err": err,
                   "cublas_of_copy": nbytes / cublas / 1e3 / ceiling, "skinny_of_copy": nbytes / default / 1e3 / ceiling,
                   "best_of_copy": nbytes / best_us / 1e3 / ceiling}
            rows_out.append(row)
            print(f"{name:24s} M={m:2d}  cublas {cublas:8.1f} us ({row['cublas_of_copy']:.2f})  skinny {default:8.1f} "
                  f"({row['skinny_of_copy']:.2f})  best {best_us:8.1f} ({row['best_of_copy']:.2f}) {best}  "
                  f"err {err:.3g}", flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "copy_gbs": ceiling,
                                    "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
