"""Kernel benchmark at Llama-3-8B shapes: Triton kernels vs their torch references, with ceilings.

    pdserve bench kernels --out results/kernels.json [--quick]       (needs a CUDA device)

Per kernel: Triton time, torch reference time, achieved GB/s (memory-bound kernels) or TFLOP/s
(prefill attention), and torch SDPA on contiguous K/V for the attention kernels. Ceilings measured in
the same run: device copy bandwidth (clone of 1 GiB) and bf16 matmul TFLOP/s. Each case fails soft:
its error is printed and recorded, and the run continues.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.cli_args import ArgParser
from services.kernels import reference as ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 32, 8, 128, 16, 32
DTYPE = torch.bfloat16


@dataclass
class Row:
    kernel: str
    shape: str
    triton_us: float | None = None
    ref_us: float | None = None
    sdpa_us: float | None = None
    bytes_moved: int | None = None
    flops: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float | None:
        if self.bytes_moved is None or self.triton_us is None:
            return None
        return self.bytes_moved / (self.triton_us * 1e-6) / 1e9

    @property
    def tflops(self) -> float | None:
        if self.flops is None or self.triton_us is None:
            return None
        return self.flops / (self.triton_us * 1e-6) / 1e12


def bench_us(fn: Callable[[], Any], rep_ms: int = 100) -> float:
    """Median time in microseconds (triton.testing.do_bench, L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")) * 1e3


def _paged(batch: int, ctx: int, num_layers: int = 1, spare: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache [L, 2, NB, bs, kvh, hd] (random blocks per sequence) and block_tables int32 [B, W]."""
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + spare
    kv_cache = torch.randn(
        (num_layers, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda"
    )
    table = torch.randperm(num_blocks, device="cuda")[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    return kv_cache, table.to(torch.int32)


def _kv_bytes(tokens: int) -> int:
    return tokens * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize


def case_decode(batch: int, ctx: int) -> Row:
    from services.kernels.paged_decode_attention import paged_decode_attention

    row = Row("paged_decode_attention", f"B={batch} ctx={ctx} h={NUM_HEADS}/{NUM_KV_HEADS} hd={HEAD_DIM}")
    kv_cache, table = _paged(batch, ctx)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    q = torch.randn((batch, NUM_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, table, lens, scale, max_context_len=ctx)
    expected = ref.ref_paged_decode_attention(q, k_cache, v_cache, table, lens, scale, max_context_len=ctx)
    row.extra["max_abs_err"] = float((out.float() - expected.float()).abs().max())
    row.triton_us = bench_us(
        lambda: paged_decode_attention(q, k_cache, v_cache, table, lens, scale, max_context_len=ctx)
    )
    row.ref_us = bench_us(
        lambda: ref.ref_paged_decode_attention(q, k_cache, v_cache, table, lens, scale, max_context_len=ctx)
    )
    k = torch.randn((batch, NUM_KV_HEADS, ctx, HEAD_DIM), dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    q4 = q[:, :, None, :]
    row.sdpa_us = bench_us(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
    row.bytes_moved = batch * _kv_bytes(ctx) + 2 * q.numel() * q.element_size()
    return row


def case_prefill(seqs: list[tuple[int, int]]) -> Row:
    from services.kernels.prefill_attention import prefill_attention

    desc = "+".join(f"{n}@{c}" for c, n in seqs)
    row = Row("prefill_attention", f"new@ctx={desc} h={NUM_HEADS}/{NUM_KV_HEADS} hd={HEAD_DIM}")
    batch = len(seqs)
    max_ctx = max(c for c, _ in seqs)
    kv_cache, table = _paged(batch, max_ctx)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    q_lens = [n for _, n in seqs]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32, device="cuda")
    q = torch.randn((sum(q_lens), NUM_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    scale = HEAD_DIM**-0.5
    mq = max(q_lens)

    def run() -> torch.Tensor:
        return prefill_attention(q, k_cache, v_cache, table, cu, lens, scale, max_seqlen_q=mq)

    out = run()
    expected = ref.ref_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale)
    row.extra["max_abs_err"] = float((out.float() - expected.float()).abs().max())
    row.triton_us = bench_us(run)
    row.ref_us = bench_us(lambda: ref.ref_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale))
    # Visible (query, key) pairs: query i of a sequence sees ctx - n + i + 1 keys.
    pairs = sum(n * (c - n) + n * (n + 1) // 2 for c, n in seqs)
    row.flops = 4.0 * pairs * NUM_HEADS * HEAD_DIM
    if all(c == n for c, n in seqs) and batch == 1:
        qs = q.transpose(0, 1)[None]
        ks = torch.randn((1, NUM_KV_HEADS, max_ctx, HEAD_DIM), dtype=DTYPE, device="cuda")
        vs = torch.randn_like(ks)
        row.sdpa_us = bench_us(
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        )
    return row


def case_store_kv(num_tokens: int) -> Row:
    from services.kernels.store_kv import store_kv

    row = Row("store_kv", f"T={num_tokens} kvh={NUM_KV_HEADS} hd={HEAD_DIM}")
    kv_cache, _ = _paged(1, num_tokens, spare=64)
    k = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    slots = torch.randperm(kv_cache.shape[2] * BLOCK_SIZE, device="cuda")[:num_tokens]
    kc, vc = kv_cache[0, 0], kv_cache[0, 1]
    row.triton_us = bench_us(lambda: store_kv(k, v, kc, vc, slots))
    row.ref_us = bench_us(lambda: ref.ref_store_kv(k, v, kc, vc, slots))
    row.bytes_moved = 2 * _kv_bytes(num_tokens) + slots.numel() * 8
    return row


def case_pack(num_pages: int, fp8: bool) -> list[Row]:
    from services.kernels.fp8_kv import pack_pages_fp8, unpack_pages_fp8
    from services.kernels.page_pack import pack_pages, unpack_pages

    kv_cache, _ = _paged(1, num_pages * BLOCK_SIZE, num_layers=NUM_LAYERS, spare=num_pages)
    ids = torch.randperm(kv_cache.shape[2], device="cuda")[:num_pages]
    shape = f"P={num_pages} L={NUM_LAYERS} bs={BLOCK_SIZE} kvh={NUM_KV_HEADS} hd={HEAD_DIM}"
    page_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
    if fp8:
        pack, unpack = pack_pages_fp8, unpack_pages_fp8
        rpack, runpack = ref.ref_pack_pages_fp8, ref.ref_unpack_pages_fp8
        name = "fp8"
    else:
        pack, unpack = pack_pages, unpack_pages
        rpack, runpack = ref.ref_pack_pages, ref.ref_unpack_pages
        name = "page"
    rows = []
    buf = pack(kv_cache, ids)
    moved = num_pages * page_bytes + buf.numel() * buf.element_size()
    r = Row(f"{name}_pack", shape, bytes_moved=moved)
    r.triton_us = bench_us(lambda: pack(kv_cache, ids))
    r.ref_us = bench_us(lambda: rpack(kv_cache, ids))
    rows.append(r)
    r = Row(f"{name}_unpack", shape, bytes_moved=moved)
    r.triton_us = bench_us(lambda: unpack(buf, kv_cache, ids))
    r.ref_us = bench_us(lambda: runpack(buf, kv_cache, ids))
    rows.append(r)
    return rows


def case_fp8_quantize(num_tokens: int) -> Row:
    from services.kernels.fp8_kv import fp8_quantize

    row = Row("fp8_quantize", f"T={num_tokens} kvh={NUM_KV_HEADS} hd={HEAD_DIM}")
    x = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    row.triton_us = bench_us(lambda: fp8_quantize(x))
    row.ref_us = bench_us(lambda: ref.ref_fp8_quantize(x))
    row.bytes_moved = x.numel() * (x.element_size() + 1) + num_tokens * NUM_KV_HEADS * 4
    return row


def ceilings() -> dict[str, float]:
    out: dict[str, float] = {}
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    us = bench_us(lambda: x.clone(), rep_ms=200)
    out["copy_gbps"] = 2 * x.numel() / (us * 1e-6) / 1e9
    n = 8192
    a = torch.randn((n, n), dtype=torch.bfloat16, device="cuda")
    b = torch.randn((n, n), dtype=torch.bfloat16, device="cuda")
    us = bench_us(lambda: a @ b, rep_ms=200)
    out["bf16_matmul_tflops"] = 2 * n**3 / (us * 1e-6) / 1e12
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[Row], ceil: dict[str, float]) -> None:
    print(
        f"\nceilings: copy {_fmt(ceil.get('copy_gbps'), '.0f')} GB/s, bf16 matmul {_fmt(ceil.get('bf16_matmul_tflops'), '.0f')} TFLOP/s"
    )
    hdr = f"{'kernel':<24}{'shape':<52}{'triton us':>11}{'ref us':>11}{'sdpa us':>10}{'GB/s':>9}{'TFLOP/s':>9}{'x ref':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if r.error:
            print(f"{r.kernel:<24}{r.shape:<52}  ERROR: {r.error.splitlines()[-1][:80]}")
            continue
        speedup = r.ref_us / r.triton_us if r.ref_us and r.triton_us else None
        print(
            f"{r.kernel:<24}{r.shape[:51]:<52}{_fmt(r.triton_us, '11.1f')}{_fmt(r.ref_us, '11.1f')}"
            f"{_fmt(r.sdpa_us, '10.1f')}{_fmt(r.gbps, '9.0f')}{_fmt(r.tflops, '9.1f')}{_fmt(speedup, '8.1f')}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = ArgParser(
        prog="pdserve bench kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("kernels_bench.json"), help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_bench needs a CUDA device", file=sys.stderr)
        return 2

    cases: list[tuple[str, Callable[[], Row | list[Row]]]] = []
    for batch in (1, 16, 64) if not args.quick else (64,):
        cases.append((f"decode B={batch}", lambda batch=batch: case_decode(batch, 2048)))
    if not args.quick:
        cases.append(("decode B=1 ctx=32K", lambda: case_decode(1, 32768)))
    cases.append(("prefill 8K", lambda: case_prefill([(8192, 8192)])))
    if not args.quick:
        cases.append(("prefill 4x2K", lambda: case_prefill([(2048, 2048)] * 4)))
        cases.append(("extend 2K on 6K prefix", lambda: case_prefill([(8192, 2048)])))
    cases.append(("store_kv 8K", lambda: case_store_kv(8192)))
    cases.append(("page pack 128", lambda: case_pack(128, fp8=False)))
    cases.append(("fp8 page pack 128", lambda: case_pack(128, fp8=True)))
    cases.append(("fp8 quantize 8K", lambda: case_fp8_quantize(8192)))

    rows: list[Row] = []
    ceil: dict[str, float] = {}
    try:
        ceil = ceilings()
    except Exception:
        traceback.print_exc()
    for name, fn in cases:
        print(f"running {name} ...", flush=True)
        try:
            res = fn()
            rows.extend(res if isinstance(res, list) else [res])
        except Exception:
            err = traceback.format_exc()
            print(err, file=sys.stderr)
            rows.append(Row(name, "", error=err))
        torch.cuda.empty_cache()

    print_table(rows, ceil)
    import triton

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "ceilings": ceil,
        "rows": [{**asdict(r), "gbps": r.gbps, "tflops": r.tflops} for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(r.error is None for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
