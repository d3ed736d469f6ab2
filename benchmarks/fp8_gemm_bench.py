"""FP8 block-scaled GEMM benchmark (kernels/fp8_block_gemm.py) at DeepSeek-V3-like shapes, against its ceilings
measured in the same run.

    python benchmarks/fp8_gemm_bench.py --out results/fp8_gemm.json            (CUDA: the figures)
    python benchmarks/fp8_gemm_bench.py --device cpu --out /tmp/fp8_gemm.json (CPU: tiny shapes under the
                                                                              Triton interpreter; plumbing)

Ceilings, measured first: device-to-device copy bandwidth (clone of 1 GiB, read + write), bf16 matmul
(8192^3) and the FP8 matmul (``torch._scaled_mm`` on 8192^3 e4m3 with per-tensor scales, bf16 out; with and
without fast accumulation). Then per weight shape N x K (block 128 x 128) and M = 1, 16, 64, 256, 2048, 8192:
  - the automatic path (w8a16 for M <= W8A16_MAX_M, else w8a8): time, TFLOP/s (2 M N K / time) and its
    fraction of the FP8 and bf16 ceilings; at M <= 256 the bytes the call must read (fp8 weight + scales +
    x + y) over the time against the copy ceiling, and both paths forced (to check W8A16_MAX_M);
  - at M = 1 the call replayed from a CUDA graph (the GPU time without Python launch costs); on w8a8 rows
    the activation-quant kernel alone;
  - torch's bf16 matmul with the dequantized weight (what the engine ran before) and the speed-up;
  - the relative error ||y - ref|| / ||ref|| against the fp32 dequantize-then-matmul reference;
  - at M >= 2048 (--sweep) a few other w8a8 tile configs.
Each case fails soft: its error is printed and recorded, and the run continues.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe_bench import bench_us
from benchmarks.moe_bench import ceilings as moe_ceilings
from services.kernels.reference import ref_fp8_block_dequantize, ref_fp8_block_gemm

BLOCK = (128, 128)
SHAPES = ((7168, 2048), (2048, 7168), (7168, 18432), (36864, 7168), (576, 7168))
"""(N, K): o_proj-like 7168x2048 (per 16 heads), 2048x7168 (a q/kv LoRA-ish down), the dense MLP's down
7168x18432 and fused gate_up 36864x7168, kv_a_proj_with_mqa 576x7168 (partial last row block)."""
M_VALUES = (1, 16, 64, 256, 2048, 8192)
TINY_SHAPES = ((96, 160),)
TINY_M = (1, 40)


@dataclass
class Row:
    n: int
    k: int
    m: int
    path: str = ""
    us: float | None = None
    tflops: float | None = None
    of_fp8: float | None = None
    of_bf16: float | None = None
    bytes_read: int | None = None
    of_copy: float | None = None
    w8a16_us: float | None = None
    w8a8_us: float | None = None
    graph_us: float | None = None
    quant_us: float | None = None
    cublas_us: float | None = None
    """cuBLAS's blockwise FP8 GEMM (backend="cublas") at M >= CUBLAS_MIN_M, where this torch and GPU run it."""
    bf16_us: float | None = None
    rel_err: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def ceilings(device: torch.device) -> dict[str, float]:
    """copy_gbps and bf16_tflops (moe_bench's device copy and bf16 matmul), fp8_tflops / fp8_fast_tflops
    (torch._scaled_mm with per-tensor scales; CUDA only)."""
    base = moe_ceilings(device)
    out = {"copy_gbps": base["copy_gbps"], "bf16_tflops": base["matmul_tflops"]}
    if device.type == "cuda":
        n = 8192
        a8 = torch.randn((n, n), dtype=torch.bfloat16, device=device).to(torch.float8_e4m3fn)
        b8 = torch.randn((n, n), dtype=torch.bfloat16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32, device=device)
        for key, fast in (("fp8_tflops", False), ("fp8_fast_tflops", True)):
            try:
                us = bench_us(lambda fast=fast: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16,
                                                                 use_fast_accum=fast), device, rep_ms=200)
                out[key] = 2 * n**3 / (us * 1e-6) / 1e12
            except Exception as e:  # an older torch without _scaled_mm's keywords
                print(f"ceiling {key}: {e}", file=sys.stderr)
    return out


def _weights(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp8 [N, K] with fp32 block scales around 1/sqrt(K) / 448 (values of a real projection)."""
    gen = torch.Generator(device=device).manual_seed(n + k)
    w = torch.randn((n, k), generator=gen, device=device).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand((-(-n // BLOCK[0]), -(-k // BLOCK[1])), generator=gen, device=device) + 0.5
    return w, scales * (k**-0.5 / 4)


def case(n: int, k: int, m: int, w: torch.Tensor, s: torch.Tensor, w_bf16: torch.Tensor, device: torch.device,
         ceil: dict[str, float], sweep: bool) -> Row:
    from services.kernels.fp8_block_gemm import (  # after main() chose the interpreter or the GPU
        CUBLAS_MIN_M,
        W8A16_MAX_M,
        Fp8GemmConfig,
        act_quant,
        cublas_blockwise_available,
        fp8_block_gemm,
        tile_config,
        w8a8_supported,
    )

    row = Row(n, k, m)
    x = torch.randn((m, k), device=device).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    w8a16 = m <= W8A16_MAX_M or not w8a8_supported(BLOCK[1])
    row.path = "w8a16" if w8a16 else "w8a8"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    row.extra["config"] = asdict(tile_config(m, n, k, BLOCK, w8a16, sms))
    y = fp8_block_gemm(x, w, s, BLOCK, backend="triton")
    ref = ref_fp8_block_gemm(x, w, s, BLOCK).float()
    row.rel_err = float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))
    del ref
    row.us = bench_us(lambda: fp8_block_gemm(x, w, s, BLOCK, backend="triton"), device)
    if m >= CUBLAS_MIN_M and n % 128 == 0 and k % 128 == 0 and cublas_blockwise_available(device):
        row.cublas_us = bench_us(lambda: fp8_block_gemm(x, w, s, BLOCK, backend="cublas"), device)
    flops = 2.0 * m * n * k
    row.tflops = flops / (row.us * 1e-6) / 1e12
    row.of_fp8 = row.tflops / ceil["fp8_tflops"] if ceil.get("fp8_tflops") else None
    row.of_bf16 = row.tflops / ceil["bf16_tflops"] if ceil.get("bf16_tflops") else None
    if m <= 256:
        row.bytes_read = w.numel() + s.numel() * 4 + (m * k + m * n) * x.element_size()
        row.of_copy = row.bytes_read / (row.us * 1e-6) / 1e9 / ceil["copy_gbps"] if ceil.get("copy_gbps") else None
        row.w8a16_us = bench_us(lambda: fp8_block_gemm(x, w, s, BLOCK, w8a16=True), device)
        row.w8a8_us = bench_us(lambda: fp8_block_gemm(x, w, s, BLOCK, w8a16=False), device)
    if m == 1 and device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fp8_block_gemm(x, w, s, BLOCK)
        row.graph_us = bench_us(graph.replay, device)
    row.bf16_us = bench_us(lambda: x @ w_bf16.T, device)
    if not w8a16:
        row.quant_us = bench_us(lambda: act_quant(x, BLOCK[1]), device)
    if sweep and m >= 2048:
        times = {}
        for bm, bn, warps, stages, gm in ((64, 128, 4, 3, 8), (128, 128, 8, 3, 8), (128, 128, 8, 4, 8),
                                          (128, 256, 8, 3, 8), (64, 256, 8, 3, 8), (128, 64, 4, 3, 8)):
            cfg = Fp8GemmConfig(bm, bn, 128, group_m=gm, num_warps=warps, num_stages=stages)
            key = f"bm{bm} bn{bn} w{warps} s{stages} g{gm}"
            try:
                times[key] = bench_us(lambda cfg=cfg: fp8_block_gemm(x, w, s, BLOCK, w8a16=False, config=cfg),
                                      device, rep_ms=25)
            except Exception as e:  # e.g. out of shared memory for the tile
                times[key] = None
                row.extra.setdefault("sweep_errors", {})[key] = str(e).splitlines()[0][:200] if str(e) else repr(e)
        done = {key: t for key, t in times.items() if t is not None}
        best = min(done, key=done.__getitem__) if done else None
        row.extra |= {"sweep_us": times, "best_config": best, "best_us": done.get(best) if best else None}
    return row


def _fmt(v: float | None, spec: str) -> str:
    """v formatted by spec, or "-" right-aligned to the spec's width."""
    if v is None:
        width = spec.split(".")[0].rstrip("df")
        return "-".rjust(int(width) if width.isdigit() else 1)
    return format(v, spec)


def print_table(rows: list[Row], ceil: dict[str, float]) -> None:
    print(f"\nceilings: copy {_fmt(ceil.get('copy_gbps'), '.0f')} GB/s, bf16 matmul "
          f"{_fmt(ceil.get('bf16_tflops'), '.0f')} TFLOP/s, fp8 _scaled_mm {_fmt(ceil.get('fp8_tflops'), '.0f')} "
          f"TFLOP/s (fast accum {_fmt(ceil.get('fp8_fast_tflops'), '.0f')})")
    hdr = (f"{'N x K':<13}{'M':>6}{'path':>7}{'us':>9}{'TFLOP/s':>9}{'of fp8':>8}{'of bf16':>8}{'MB':>8}"
           f"{'of copy':>8}{'w8a16':>9}{'w8a8':>9}{'graph':>8}{'quant':>8}{'bf16 mm':>9}{'x bf16':>7}{'rel err':>9}"
           f"{'cublas':>9}{'TFLOP/s':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        name = f"{r.n}x{r.k}"
        if r.error:
            print(f"{name:<13}{r.m:>6}  ERROR: {r.error.strip().splitlines()[-1][:100]}")
            continue
        speedup = r.bf16_us / r.us if r.bf16_us and r.us else None
        print(f"{name:<13}{r.m:>6}{r.path:>7}{_fmt(r.us, '9.1f')}{_fmt(r.tflops, '9.1f')}{_fmt(r.of_fp8, '8.2f')}"
              f"{_fmt(r.of_bf16, '8.2f')}{_fmt(r.bytes_read / 1e6 if r.bytes_read else None, '8.1f')}"
              f"{_fmt(r.of_copy, '8.2f')}{_fmt(r.w8a16_us, '9.1f')}{_fmt(r.w8a8_us, '9.1f')}"
              f"{_fmt(r.graph_us, '8.1f')}{_fmt(r.quant_us, '8.1f')}{_fmt(r.bf16_us, '9.1f')}{_fmt(speedup, '7.2f')}{_fmt(r.rel_err, '9.1e')}"
              f"{_fmt(r.cublas_us, '9.1f')}{_fmt(2.0 * r.m * r.n * r.k / (r.cublas_us * 1e6) if r.cublas_us else None, '9.1f')}")
    print("of fp8 / of bf16: TFLOP/s over the _scaled_mm / bf16 matmul ceilings; of copy: (fp8 weight + scales + x "
          "+ y bytes) / time / copy GB/s; w8a16, w8a8: both paths forced; graph: the M=1 call replayed from a CUDA "
          "graph; quant: the activation-quant kernel alone (w8a8 rows); x bf16: torch bf16 matmul time (dequantized weight) / ours; "
          "cublas: the same product through cuBLAS's blockwise FP8 GEMM (activation quant included) and its TFLOP/s")
    for r in rows:
        if r.extra.get("best_config"):
            print(f"sweep {r.n}x{r.k} M={r.m}: default {r.extra['config']} {r.us:.1f} us, best "
                  f"{r.extra['best_config']} {r.extra['best_us']:.1f} us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp8_gemm_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("fp8_gemm_bench.json"), help="JSON results path")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: real shapes; cpu: tiny shapes under the Triton interpreter (plumbing check)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the w8a8 tile sweep at M >= 2048")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fp8_gemm_bench: no CUDA device here (use --device cpu for the plumbing check)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when kernels.fp8_block_gemm is first imported (in case())
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    t0 = time.monotonic()
    ceil: dict[str, float] = {}
    try:
        ceil = ceilings(device)
    except Exception:
        traceback.print_exc()
    print(f"ceilings: {ceil}", flush=True)
    shapes, m_values = (SHAPES, M_VALUES) if device.type == "cuda" else (TINY_SHAPES, TINY_M)
    rows: list[Row] = []
    for n, k in shapes:
        try:
            w, s = _weights(n, k, device)
            dense_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            w_bf16 = ref_fp8_block_dequantize(w, s, BLOCK).to(dense_dtype)
        except Exception:
            err = traceback.format_exc()
            print(err, file=sys.stderr)
            rows += [Row(n, k, m, error=err) for m in m_values]
            continue
        for m in m_values:
            print(f"running N={n} K={k} M={m} ...", flush=True)
            try:
                rows.append(case(n, k, m, w, s, w_bf16, device, ceil, sweep=not args.no_sweep))
            except Exception:
                err = traceback.format_exc()
                print(err, file=sys.stderr)
                rows.append(Row(n, k, m, error=err))
        del w, s, w_bf16
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, ceil)
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "block": BLOCK,
        "ceilings": ceil,
        "rows": [asdict(r) for r in rows],
        "seconds": time.monotonic() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    return 1 if any(r.error for r in rows) else 0


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
