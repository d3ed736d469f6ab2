"""Fused MoE benchmark: the Triton layer at real expert shapes against its ceilings, in one run.

    pdserve bench moe --out results/moe.json                  (CUDA: the figures)
    pdserve bench moe --device cpu --out /tmp/moe.json       (CPU: tiny shapes, the Triton interpreter;
                                                               checks the plumbing, not the speed)

Ceilings, measured first in the same process: device-to-device copy bandwidth (clone of 1 GiB, read +
write) and sustained bf16 matmul (8192^3). Then per model shape (qwen3-30b-a3b: E=128 K=8 H=2048 I=768;
mixtral-8x7b: E=8 K=2 H=4096 I=14336), random routing (K distinct experts per token, uniform):
  decode T = 1, 16, 64, 256: time, the bytes the call must read (the distinct experts hit + x + out)
    and their ratio to the copy ceiling;
  prefill T = 8192: active FLOPs (6 T K H I) / time against the matmul ceiling;
  both: the torch reference (per-expert loop, fp32 math) and a bf16 per-expert loop, and the speed-up.
Then, when the engine knows the shape (`random:qwen3-30b-a3b`, `random:mixtral-8x7b`), its decode step
at batch 1/16/64/256 against the bandwidth limit of the bytes that step reads, and an 8K-token prefill
against the matmul limit of its active FLOPs (see benchmarks/moe_engine_bench.py). Each case fails
soft: its error is printed and recorded, and the run continues.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.kernels.reference import fused_moe_ref

MOE_ENGINE_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")
"""The engine section's default shapes (benchmarks/moe_engine_bench.py MODELS; named here so --help needs no engine)."""


@dataclass(frozen=True)
class MoEShape:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    inter: int


SHAPES = (MoEShape("qwen3-30b-a3b", 128, 8, 2048, 768), MoEShape("mixtral-8x7b", 8, 2, 4096, 14336))
TINY = (MoEShape("tiny-moe", 6, 2, 32, 48),)
DECODE_T, PREFILL_T = (1, 16, 64, 256), 8192
#: (what, goal as a fraction of its ceiling), printed beside the figures.
GOALS = {"decode T=1": 0.6, "decode T=64": 0.7, "prefill": 0.5}


@dataclass
class Row:
    shape: str
    tokens: int
    phase: str  # "decode" (bandwidth-bound) or "prefill" (matmul-bound)
    triton_us: float | None = None
    ref_us: float | None = None
    loop_bf16_us: float | None = None
    bytes_read: int | None = None
    flops: float | None = None
    experts_hit: int | None = None
    max_abs_err: float | None = None
    fraction_of_ceiling: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def bench_us(fn: Callable[[], Any], device: torch.device, rep_ms: int = 100) -> float:
    """Median microseconds of fn(): triton.testing.do_bench on CUDA (L2 flushed between runs), wall clock
    medians of a few calls on CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")) * 1e3
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def graph_us(fn: Callable[[], Any], device: torch.device, rep_ms: int = 100) -> float | None:
    """Median microseconds of one replay of fn() captured in a CUDA graph (as the engine's decode steps run
    it: no launch overhead per kernel); None off CUDA."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_us(graph.replay, device, rep_ms=rep_ms)


def ceilings(device: torch.device) -> dict[str, float]:
    """copy_gbps (read + write of a device-to-device clone) and matmul_tflops (bf16 on CUDA, fp32 on CPU)."""
    n_bytes, n = (1 << 30, 8192) if device.type == "cuda" else (1 << 26, 512)
    x = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    us = bench_us(lambda: x.clone(), device, rep_ms=200)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn((n, n), dtype=dtype, device=device)
    b = torch.randn((n, n), dtype=dtype, device=device)
    mm_us = bench_us(lambda: a @ b, device, rep_ms=200)
    return {"copy_gbps": 2 * n_bytes / (us * 1e-6) / 1e9, "matmul_tflops": 2 * n**3 / (mm_us * 1e-6) / 1e12}


def random_routing(tokens: int, shape: MoEShape, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 [T, K], topk_weights fp32 [T, K]): K distinct uniform experts per token, softmax weights."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand((tokens, shape.num_experts), generator=gen, device=device)
    ids = torch.topk(scores, shape.top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn((tokens, shape.top_k), generator=gen, device=device), dim=1)
    return ids, weights


def loop_bf16(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
              ) -> torch.Tensor:
    """The plain torch layer in the weights' dtype: a loop over the experts hit, index_add of the rows."""
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    flat = ids.reshape(-1).long()
    for e in torch.unique(flat).tolist():
        pair = torch.nonzero(flat == e).squeeze(1)
        tok = pair // ids.shape[1]
        h = x[tok] @ w13[e].T
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].T
        out.index_add_(0, tok, y * weights.reshape(-1)[pair, None].to(x.dtype))
    return out


def sweep_configs(default: Any, phase: str = "decode") -> list[Any]:
    """Tile configs tried beside the default with --sweep (a MoETileConfig list). Decode: the default's
    block_m, other N/K tiles, warps and stages (18 configs); prefill: block_m 64/128 too and the program
    grouping (35 configs)."""
    from services.kernels.fused_moe import MoETileConfig  # after main() chose the interpreter or the GPU

    if phase == "prefill":
        return [*(MoETileConfig(bm, bn, bk, warps, stages, 8)
                  for bm in (64, 128) for bn in (64, 128) for bk in (32, 64)
                  for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4))),
                *(MoETileConfig(default.block_m, default.block_n, default.block_k, default.num_warps,
                                default.num_stages, g) for g in (1, 4, 16))]
    return [MoETileConfig(default.block_m, bn, bk, warps, stages, default.group_m)
            for bn in (32, 64, 128) for bk in (64, 128) for warps, stages in ((4, 3), (4, 4), (8, 3))]


def down_sweep(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               gate_up: Any, device: torch.device) -> dict[str, Any]:
    """The down projection's own tiles under the gate/up kernel's `gate_up` config (prefill): the layer's time
    with each of 16 down configs of the same block_m."""
    from services.kernels.fused_moe import MoETileConfig, fused_moe

    times: dict[str, float] = {}
    for bn in (64, 128, 256):
        for bk, warps, stages in ((32, 4, 4), (64, 4, 3), (64, 8, 3), (64, 8, 4), (128, 8, 3)):
            if bn == 256 and bk == 128:
                continue
            cfg = MoETileConfig(gate_up.block_m, bn, bk, warps, stages, gate_up.group_m)
            key = f"down bn{bn} bk{bk} w{warps} s{stages}"
            try:
                times[key] = bench_us(lambda cfg=cfg: fused_moe(x, w13, w2, ids, weights, config=gate_up,
                                                                down_config=cfg), device, rep_ms=25)
            except Exception as exc:
                print(f"  {key}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
    best = min(times, key=times.__getitem__) if times else None
    return {"down_sweep_us": times, "down_best": best, "down_best_us": times.get(best) if best else None}


PAIR_SWEEP_T = (1, 2, 4, 8, 16, 32)


def pair_sweep(shape: MoEShape, device: torch.device, ceil: dict[str, float]) -> list[dict[str, Any]]:
    """Both paths of the fused MoE in CUDA graphs at few tokens (the pair path with several tiles): where the
    pair path stops winning (what `use_pair_path` must encode), each against the copy ceiling."""
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn((e, 2 * i, h), generator=gen, device=device) * h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn((e, h, i), generator=gen, device=device) * i**-0.5).to(torch.bfloat16)
    out = []
    for tokens in PAIR_SWEEP_T:
        x = torch.randn((tokens, h), generator=gen, device=device).to(torch.bfloat16)
        rec = _sweep_point(shape, x, w13, w2, *random_routing(tokens, shape, device, seed=tokens), ceil)
        print(f"pair sweep {shape.name} T={tokens} hit={rec['experts_hit']} dup={rec['duplication']:.2f}: sorted "
              f"{rec['sorted_us']:.1f} us, pair default {rec['pair_default_us']:.1f}, best {rec['pair_best_us']:.1f} "
              f"({rec['pair_best']}); limit {rec['limit_us']:.1f} us (best of copy "
              f"{rec['limit_us'] / min(rec['sorted_us'], rec['pair_best_us']):.2f}); auto {rec['auto']}", flush=True)
        out.append(rec)
    return out


def _sweep_point(shape: MoEShape, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor, ceil: dict[str, float]) -> dict[str, Any]:
    """One token count of `pair_sweep`: graph replay times of the sorted path and of the pair path's tiles."""
    from services.kernels.fused_moe import PairTileConfig, expected_distinct_experts, fused_moe, use_pair_path

    tokens, k, e = x.shape[0], shape.top_k, shape.num_experts
    configs = [PairTileConfig(gn, dn, bk, 4, 3) for gn in (4, 8, 16) for dn in (8, 16) for bk in (128, 256)]
    hit = int(torch.unique(ids).numel())

    def run(**kw: Any) -> float:
        return graph_us(lambda: fused_moe(x, w13, w2, ids, weights, **kw), x.device, rep_ms=25) or 0.0

    pair_us = {f"gu{c.gate_up_n} dn{c.down_n} bk{c.block_k} w{c.num_warps} s{c.num_stages}":
               run(path="pair", pair_config=c) for c in configs}
    best = min(pair_us, key=pair_us.__getitem__)
    return {"shape": shape.name, "tokens": tokens, "experts_hit": hit, "sorted_us": run(path="sorted"),
            "pair_default_us": run(path="pair"), "pair_best": best, "pair_best_us": pair_us[best],
            "limit_us": hit * (w13[0].numel() + w2[0].numel()) * 2 / (ceil["copy_gbps"] * 1e9) * 1e6,
            "auto": "pair" if use_pair_path(tokens, k, e) else "sorted",
            "duplication": tokens * k / expected_distinct_experts(tokens * k, e), "pair_us": pair_us}


def align_rows(device: torch.device) -> list[dict[str, Any]]:
    """The alignment step alone, both forms replayed from CUDA graphs (as the engine's decode steps run them):
    the one-launch kernel (kernels/moe_align.py) against the torch form, per shape and token count."""
    from services.kernels.fused_moe import align_pairs_torch, tile_config
    from services.kernels.moe_align import FUSED_ALIGN_MAX_PAIRS, align_pairs_fused

    out = []
    for shape in SHAPES:
        for tokens in (1, 16, 64, 256, 512, 1024):
            if tokens * shape.top_k > FUSED_ALIGN_MAX_PAIRS:
                continue
            ids, _ = random_routing(tokens, shape, device, seed=tokens)
            bm = tile_config(tokens, shape.top_k, shape.num_experts, torch.bfloat16).block_m
            e = shape.num_experts
            fused = graph_us(lambda ids=ids, e=e, bm=bm: align_pairs_fused(ids, e, bm), device, rep_ms=25)
            torch_us = graph_us(lambda ids=ids, e=e, bm=bm: align_pairs_torch(ids, e, bm), device, rep_ms=25)
            row = {"shape": shape.name, "tokens": tokens, "block_m": bm, "fused_us": fused, "torch_us": torch_us}
            print(f"align {shape.name} T={tokens} block_m={bm}: one launch {fused or 0:.1f} us, "
                  f"torch {torch_us or 0:.1f} us", flush=True)
            out.append(row)
    return out


def case(shape: MoEShape, tokens: int, phase: str, device: torch.device, ceil: dict[str, float],
         with_ref: bool = True, sweep: bool = False) -> Row:
    from services.kernels.fused_moe import (  # after main() chose the interpreter or the GPU
        fused_moe,
        tile_config,
        use_pair_path,
    )

    row = Row(shape.name, tokens, phase)
    dtype = torch.bfloat16
    e, k, h, i = shape.num_experts, shape.top_k, shape.hidden, shape.inter
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((tokens, h), generator=gen, device=device).to(dtype)
    w13 = (torch.randn((e, 2 * i, h), generator=gen, device=device) * h**-0.5).to(dtype)
    w2 = (torch.randn((e, h, i), generator=gen, device=device) * i**-0.5).to(dtype)
    ids, weights = random_routing(tokens, shape, device, seed=tokens)
    out = fused_moe(x, w13, w2, ids, weights)
    expected = fused_moe_ref(x, w13, w2, ids, weights)
    row.max_abs_err = float((out.float() - expected.float()).abs().max())
    row.extra["ref_abs_max"] = float(expected.float().abs().max())
    row.triton_us = bench_us(lambda: fused_moe(x, w13, w2, ids, weights), device)
    if phase == "decode":
        row.extra["graph_us"] = graph_us(lambda: fused_moe(x, w13, w2, ids, weights), device)
        row.extra["path"] = "pair" if use_pair_path(tokens, k, e) else "sorted"
    default = tile_config(tokens, k, e, dtype)
    row.extra["config"] = asdict(default)
    if sweep:
        times = {}
        for cfg in sweep_configs(default, phase):
            key = f"bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} g{cfg.group_m}"
            try:
                times[key] = bench_us(lambda cfg=cfg: fused_moe(x, w13, w2, ids, weights, config=cfg), device,
                                      rep_ms=25)
            except Exception as exc:  # e.g. a tile past the shared memory
                print(f"  sweep {key}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
        best = min(times, key=times.__getitem__)
        row.extra |= {"sweep_us": times, "best_config": best, "best_us": times[best]}
        if phase == "prefill":
            row.extra |= down_sweep(x, w13, w2, ids, weights, default, device)
    if with_ref:
        row.ref_us = bench_us(lambda: fused_moe_ref(x, w13, w2, ids, weights), device, rep_ms=50)
        row.loop_bf16_us = bench_us(lambda: loop_bf16(x, w13, w2, ids, weights), device, rep_ms=50)
    row.experts_hit = int(torch.unique(ids).numel())
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    row.bytes_read = row.experts_hit * expert_bytes + 2 * x.numel() * x.element_size() + ids.numel() * 8
    row.flops = 6.0 * tokens * k * h * i
    if phase == "decode":
        row.fraction_of_ceiling = row.bytes_read / (row.triton_us * 1e-6) / 1e9 / ceil["copy_gbps"]
        if row.extra.get("graph_us"):
            row.extra["graph_fraction"] = row.bytes_read / (row.extra["graph_us"] * 1e-6) / 1e9 / ceil["copy_gbps"]
    else:
        row.fraction_of_ceiling = row.flops / (row.triton_us * 1e-6) / 1e12 / ceil["matmul_tflops"]
    return row


def _fmt(v: float | None, spec: str) -> str:
    """v formatted by spec, or "-" right-aligned to the spec's width."""
    if v is None:
        width = spec.split(".")[0].rstrip("df")
        return "-".rjust(int(width) if width.isdigit() else 1)
    return format(v, spec)


def _goal(row: Row) -> float | None:
    if row.phase == "prefill":
        return GOALS["prefill"]
    return GOALS.get(f"decode T={row.tokens}")


def print_table(rows: list[Row], ceil: dict[str, float]) -> None:
    print(f"\nceilings: copy {_fmt(ceil.get('copy_gbps'), '.1f')} GB/s, matmul "
          f"{_fmt(ceil.get('matmul_tflops'), '.3f')} TFLOP/s")
    hdr = (f"{'shape':<15}{'phase':<8}{'T':>6}{'hit':>5}{'triton us':>11}{'ref us':>11}{'bf16 loop':>11}"
           f"{'x ref':>7}{'x loop':>7}{'MB read':>9}{'TFLOP/s':>9}{'of ceil':>8}{'goal':>6}{'err':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if r.error:
            print(f"{r.shape:<15}{r.phase:<8}{r.tokens:>6}  ERROR: {r.error.strip().splitlines()[-1][:90]}")
            continue
        tflops = r.flops / (r.triton_us * 1e-6) / 1e12 if r.flops and r.triton_us else None
        x_ref = r.ref_us / r.triton_us if r.ref_us and r.triton_us else None
        x_loop = r.loop_bf16_us / r.triton_us if r.loop_bf16_us and r.triton_us else None
        goal = _goal(r)
        print(f"{r.shape:<15}{r.phase:<8}{r.tokens:>6}{_fmt(r.experts_hit, '5d')}{_fmt(r.triton_us, '11.1f')}"
              f"{_fmt(r.ref_us, '11.1f')}{_fmt(r.loop_bf16_us, '11.1f')}{_fmt(x_ref, '7.1f')}{_fmt(x_loop, '7.1f')}"
              f"{_fmt(r.bytes_read / 1e6 if r.bytes_read else None, '9.1f')}{_fmt(tflops, '9.1f')}"
              f"{_fmt(r.fraction_of_ceiling, '8.2f')}{_fmt(goal, '6.1f')}{_fmt(r.max_abs_err, '9.1e')}")
    print("of ceil: decode = bytes read / time / copy GB/s; prefill = active FLOPs / time / matmul TFLOP/s")
    for r in rows:
        if r.extra.get("graph_us"):
            print(f"in a CUDA graph: {r.shape} T={r.tokens} ({r.extra['path']} path): {r.extra['graph_us']:.1f} us, "
                  f"{r.extra['graph_fraction']:.2f} of copy")
    for r in rows:
        if "best_config" in r.extra:
            print(f"sweep {r.shape} {r.phase} T={r.tokens}: default {r.extra['config']} {r.triton_us:.1f} us, "
                  f"best {r.extra['best_config']} {r.extra['best_us']:.1f} us")
        if r.extra.get("down_best"):
            print(f"down sweep {r.shape} T={r.tokens}: best {r.extra['down_best']} {r.extra['down_best_us']:.1f} us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("moe_bench.json"), help="JSON results path")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: real shapes; cpu: tiny shapes under the Triton interpreter (plumbing check)")
    parser.add_argument("--skip-engine", action="store_true", help="skip the engine decode/prefill section")
    parser.add_argument("--skip-ref", action="store_true", help="skip the torch baselines (faster)")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs per case (18 decode, 35 prefill)")
    parser.add_argument("--sweep-phase", choices=("decode", "prefill", "all"), default="all",
                        help="with --sweep: which phase's cases sweep")
    parser.add_argument("--pair-sweep", action="store_true",
                        help="CUDA: both paths in CUDA graphs at T=1..32, the pair path with 12 tile configs")
    parser.add_argument("--align", action="store_true",
                        help="CUDA: the alignment step alone, one-launch kernel against the torch form, in CUDA graphs")
    parser.add_argument("--skip-cases", action="store_true", help="skip the kernel rows (with --pair-sweep)")
    parser.add_argument("--engine-batches", default="1,16,64,256", help="the engine section's decode batches")
    parser.add_argument("--skip-engine-prefill", action="store_true", help="no 8K-token engine prefill")
    parser.add_argument("--engine-models", default=",".join(MOE_ENGINE_MODELS),
                        help="random shapes the engine section loads (mixtral-8x7b's 93 GB need an H200)")
    parser.add_argument("--skinny-rows", type=int, default=None,
                        help="CUDA: the LM head of at most N rows on the skinny GEMM (kernels/skinny_gemm.py RULE; "
                             "0: always cuBLAS; default: 16)")
    args = parser.parse_args(argv)
    if args.skinny_rows is not None:
        from services.kernels.skinny_gemm import RULE

        RULE["max_rows"] = args.skinny_rows
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pdserve bench moe: no CUDA device here (use --device cpu for the plumbing check)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when kernels.fused_moe is first imported (in case())
    device = torch.device(args.device)
    torch.set_grad_enabled(False)

    ceil: dict[str, float] = {}
    try:
        ceil = ceilings(device)
    except Exception:
        traceback.print_exc()
    shapes = SHAPES if device.type == "cuda" else TINY
    decode_t, prefill_t = (DECODE_T, PREFILL_T) if device.type == "cuda" else ((1, 5), 40)
    rows: list[Row] = []
    sweeps: list[dict[str, Any]] = []
    if args.pair_sweep and device.type == "cuda":
        for shape in shapes:
            try:
                sweeps += pair_sweep(shape, device, ceil)
            except Exception:
                traceback.print_exc()
            torch.cuda.empty_cache()
    aligns: list[dict[str, Any]] = []
    if args.align and device.type == "cuda":
        try:
            aligns = align_rows(device)
        except Exception:
            traceback.print_exc()
    for shape in shapes if not args.skip_cases else ():
        for tokens, phase in [*((t, "decode") for t in decode_t), (prefill_t, "prefill")]:
            print(f"running {shape.name} {phase} T={tokens} ...", flush=True)
            try:
                rows.append(case(shape, tokens, phase, device, ceil, with_ref=not args.skip_ref,
                                 sweep=args.sweep and args.sweep_phase in (phase, "all")))
            except Exception:
                err = traceback.format_exc()
                print(err, file=sys.stderr)
                rows.append(Row(shape.name, tokens, phase, error=err))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows, ceil)

    # Imported here, not at the top: it loads the engine and the Triton kernel modules, which must come
    # after TRITON_INTERPRET is settled above.
    from benchmarks.moe_engine_bench import ENGINE_GOALS, engine_cases

    engine: list[dict[str, Any]] = []
    if not args.skip_engine and device.type == "cuda" and ceil:
        engine = engine_cases(ceil, tuple(m for m in args.engine_models.split(",") if m),
                              tuple(int(b) for b in args.engine_batches.split(",") if b), not args.skip_engine_prefill)
    elif not args.skip_engine:
        print("engine section: needs CUDA and the ceilings; skipped")
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "ceilings": ceil,
        "goals": {**GOALS, **ENGINE_GOALS},
        "rows": [asdict(r) for r in rows],
        "engine": engine,
        "pair_sweep": sweeps,
        "align": aligns,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    failed = any(r.error for r in rows) or any(e.get("error") for e in engine)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
