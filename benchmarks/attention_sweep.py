"""Tile sweep of the paged attention kernels at serving shapes, against their ceilings and torch's SDPA.

    python3 -m benchmarks.attention_sweep --out results/attention_sweep.json     (CUDA only)

Ceilings, measured first in the same process: device copy (clone of 1 GiB, read + write) and bf16 matmul
(8192^3). Shapes: Llama-3-8B heads (32 query / 8 KV heads of 128) and Qwen3-30B-A3B's (32 / 4 of 128), bf16,
16-token pages in a random permutation (a fragmented pool).

- prefill: one 8192-token prompt, four 2048-token prompts, and a 2048-token chunk after a 6144-token prefix,
  with every tile config of PREFILL_CONFIGS and the default launched light-first; FLOPs = 4 * heads * head_dim *
  (visible keys summed over queries), against the matmul ceiling. Beside it torch's SDPA on contiguous K/V
  (flash, cuDNN and memory-efficient backends where they run): the peer a fresh prompt could use instead.
- decode: batch 1 / 16 / 64 / 256 at 1152- and 2048-token contexts with every config of DECODE_CONFIGS; bytes =
  the K and V read, against the copy ceiling.
Each point prints as it runs; failures are recorded and the sweep goes on.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe_bench import bench_us, ceilings, graph_us

HEADS = {"llama-3-8b": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128)}
BLOCK_SIZE = 16
#: (block_m, block_n, num_warps, num_stages)
PREFILL_CONFIGS = ((128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
                   (128, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2),
                   (64, 128, 4, 3), (64, 32, 4, 3), (128, 128, 4, 2))
#: (block_n, num_warps, num_stages)
DECODE_CONFIGS = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 2), (32, 4, 3), (32, 2, 3), (128, 4, 2),
                  (128, 4, 3), (128, 8, 2), (128, 8, 3), (64, 8, 2), (64, 2, 3), (16, 2, 3), (16, 4, 3))
#: (name, new tokens per sequence, prefix per sequence, sequences)
PREFILL_CASES = (("8192", 8192, 0, 1), ("4x2048", 2048, 0, 4), ("2048 after 6144", 2048, 6144, 1))
DECODE_CASES = ((1, 2048), (16, 2048), (64, 2048), (64, 1152), (256, 1152))


def paged_cache(tokens_per_seq: list[int], kv_heads: int, head_dim: int, device: torch.device, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables, context_lens), the pages of every sequence drawn from a random permutation
    of the pool."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in tokens_per_seq]
    perm = torch.randperm(sum(blocks), generator=gen, device=device).to(torch.int32)
    tables = torch.zeros((len(blocks), max(blocks)), dtype=torch.int32, device=device)
    k_cache = torch.randn((sum(blocks), BLOCK_SIZE, kv_heads, head_dim), generator=gen, device=device).to(torch.bfloat16)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(torch.bfloat16)
    at = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = perm[at:at + nb]
        at += nb
    lens = torch.tensor(tokens_per_seq, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens


def contiguous(cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> list[torch.Tensor]:
    """Each sequence's keys (or values) of a paged ``cache`` gathered contiguous: [len, kv_heads, head_dim]."""
    return [cache[row[:-(-n // BLOCK_SIZE)].long()].flatten(0, 1)[:n] for row, n in zip(tables, lens.tolist(),
                                                                                           strict=True)]


def prefill_points(ceil: dict[str, float], device: torch.device) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for shape, dims in HEADS.items():
        for case in PREFILL_CASES:
            out.append(prefill_case(shape, dims, case, ceil, device))
            torch.cuda.empty_cache()
    return out


def prefill_case(shape: str, dims: tuple[int, int, int], case: tuple[str, int, int, int], ceil: dict[str, float],
                 device: torch.device) -> dict[str, Any]:
    from services.kernels.prefill_attention import prefill_attention

    heads, kv_heads, hd = dims
    name, new, prefix, seqs = case
    k_cache, v_cache, tables, lens = paged_cache([prefix + new] * seqs, kv_heads, hd, device, seed=new)
    ks, vs = contiguous(k_cache, tables, lens), contiguous(v_cache, tables, lens)
    q = torch.randn((seqs * new, heads, hd), device=device).to(torch.bfloat16)
    cu = torch.arange(0, seqs + 1, dtype=torch.int32, device=device) * new
    visible = seqs * (new * prefix + new * (new + 1) / 2)
    flops = 4.0 * heads * hd * visible
    scale = hd**-0.5

    def run(**kw: Any) -> float:
        return bench_us(lambda: prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, max_seqlen_q=new,
                                                  **kw), device, rep_ms=50)

    rec: dict[str, Any] = {"shape": shape, "case": name, "flops": flops, "configs": {}}
    try:
        rec["default_us"] = run()
        rec["default_light_first_us"] = run(heavy_first=False)
    except Exception:
        rec["error"] = traceback.format_exc()
        print(rec["error"], file=sys.stderr)
    for bm, bn, w, s in PREFILL_CONFIGS:
        key = f"bm{bm} bn{bn} w{w} s{s}"
        try:
            rec["configs"][key] = run(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        except Exception as exc:  # e.g. out of shared memory for this tile
            rec["configs"][key] = None
            print(f"  {key}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
    rec["sdpa"] = sdpa_times(q, ks, vs, heads, kv_heads, prefix, new, scale, device)
    timed = {k: v for k, v in rec["configs"].items() if v}
    if timed:
        best = min(timed, key=timed.__getitem__)
        rec |= {"best": best, "best_us": timed[best]}
    tf = {k: flops / (v * 1e-6) / 1e12 for k, v in
          [("default", rec.get("default_us")), ("best", rec.get("best_us")),
           *((f"sdpa {b}", t) for b, t in rec["sdpa"].items())] if v}
    rec["tflops"] = tf
    print(f"prefill {shape} {name}: " + ", ".join(
        f"{k} {v:.0f} TFLOP/s ({v / ceil['matmul_tflops']:.2f})" for k, v in tf.items())
          + f"; light-first {rec.get('default_light_first_us', 0):.0f} us vs {rec.get('default_us', 0):.0f}; "
          f"best {rec.get('best')}", flush=True)
    return rec


def sdpa_times(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], heads: int, kv_heads: int,
               prefix: int, new: int, scale: float, device: torch.device) -> dict[str, float]:
    """Microseconds of torch SDPA per backend over the same sequences (one call per sequence), K/V contiguous
    and expanded to every query head; None where the backend refuses the case."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = heads // kv_heads
    qs = q.view(len(ks), new, heads, -1).transpose(1, 2)  # [S, H, new, D]
    kk = [k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0) for k in ks]  # [1, H, ctx, D]
    vv = [v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0) for v in vs]
    mask = None
    if prefix:
        ctx = prefix + new
        rows = torch.arange(new, device=device)[:, None] + prefix
        mask = torch.arange(ctx, device=device)[None, :] <= rows
    out: dict[str, float] = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend: SDPBackend = backend) -> None:
            with sdpa_kernel(backend):
                for i in range(len(ks)):
                    F.scaled_dot_product_attention(qs[i:i + 1], kk[i], vv[i], attn_mask=mask,
                                                   is_causal=mask is None, scale=scale)
        try:
            run()
            out[name] = bench_us(run, device, rep_ms=50)
        except Exception as exc:
            print(f"  sdpa {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
    return out


def decode_points(ceil: dict[str, float], device: torch.device) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for batch, ctx in DECODE_CASES:
        out.append(decode_case("llama-3-8b", batch, ctx, ceil, device))
        torch.cuda.empty_cache()
    return out


def decode_case(shape: str, batch: int, ctx: int, ceil: dict[str, float], device: torch.device) -> dict[str, Any]:
    from services.kernels.paged_decode_attention import paged_decode_attention

    heads, kv_heads, hd = HEADS[shape]
    k_cache, v_cache, tables, lens = paged_cache([ctx] * batch, kv_heads, hd, device, seed=batch)
    q = torch.randn((batch, heads, hd), device=device).to(torch.bfloat16)
    kv_bytes = 2 * batch * ctx * kv_heads * hd * 2
    scale = hd**-0.5

    def run(**kw: Any) -> float:
        return bench_us(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_context_len=ctx,
                                                       **kw), device, rep_ms=30)

    rec: dict[str, Any] = {"shape": shape, "batch": batch, "context": ctx, "bytes": kv_bytes, "configs": {}}
    try:
        rec["default_us"] = run()
    except Exception:
        rec["error"] = traceback.format_exc()
        print(rec["error"], file=sys.stderr)
    for bn, w, s in DECODE_CONFIGS:
        key = f"bn{bn} w{w} s{s}"
        try:
            rec["configs"][key] = run(block_n=bn, num_warps=w, num_stages=s)
        except Exception as exc:
            rec["configs"][key] = None
            print(f"  {key}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
    timed = {k: v for k, v in rec["configs"].items() if v}
    if timed:
        best = min(timed, key=timed.__getitem__)
        rec |= {"best": best, "best_us": timed[best]}
    gbps = {k: kv_bytes / (v * 1e-6) / 1e9 for k, v in (("default", rec.get("default_us")),
                                                        ("best", rec.get("best_us"))) if v}
    rec["of_copy"] = {k: v / ceil["copy_gbps"] for k, v in gbps.items()}
    print(f"decode {shape} B={batch} ctx={ctx}: default {rec.get('default_us', 0):.1f} us "
          f"({rec['of_copy'].get('default', 0):.2f} of copy), best {rec.get('best')} {rec.get('best_us', 0):.1f} us "
          f"({rec['of_copy'].get('best', 0):.2f})", flush=True)
    return rec


#: (batch, context) of the few-row decode cases timed from CUDA graphs with fixed partition sizes.
FEW_ROW_CASES = ((1, 1024), (1, 4096), (4, 1024))
FEW_ROW_PARTITIONS = (None, 32, 64, 128, 256)


def few_row_points(ceil: dict[str, float], device: torch.device) -> list[dict[str, Any]]:
    """Decode of 1-4 rows, replayed from CUDA graphs as the engine's decode steps run (an eager loop would time the
    host's launches): the default split against fixed partition sizes (the keys each program walks)."""
    from services.kernels.paged_decode_attention import paged_decode_attention

    out: list[dict[str, Any]] = []
    for shape in ("qwen3-30b-a3b", "llama-3-8b"):
        heads, kv_heads, hd = HEADS[shape]
        for batch, ctx in FEW_ROW_CASES:
            k_cache, v_cache, tables, lens = paged_cache([ctx] * batch, kv_heads, hd, device, seed=batch)
            q = torch.randn((batch, heads, hd), device=device).to(torch.bfloat16)
            rec: dict[str, Any] = {"shape": shape, "batch": batch, "context": ctx, "us": {}}
            for part in FEW_ROW_PARTITIONS:
                kw = {} if part is None else {"partition_size": part, "block_n": 32}
                fn = partial(paged_decode_attention, q, k_cache, v_cache, tables, lens, hd**-0.5, max_context_len=ctx,
                             **kw)
                try:
                    rec["us"][str(part or "default")] = graph_us(fn, device, rep_ms=25)
                except Exception as exc:
                    print(f"  few-row {shape} part {part}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            print(f"decode (graph) {shape} B={batch} ctx={ctx}: " +
                  ", ".join(f"{k} {v:.1f} us" for k, v in rec["us"].items() if v), flush=True)
            out.append(rec)
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("attention_sweep.json"))
    parser.add_argument("--sections", default="prefill,decode",
                        help="comma-separated: prefill, decode, few-rows (1-4 row decode from CUDA graphs)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.set_grad_enabled(False)
    ceil = ceilings(device)
    print(f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s, matmul {ceil['matmul_tflops']:.1f} TFLOP/s", flush=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil}
    sections = args.sections.split(",")
    if "prefill" in sections:
        result["prefill"] = prefill_points(ceil, device)
    if "decode" in sections:
        result["decode"] = decode_points(ceil, device)
    if "few-rows" in sections:
        result["few_rows"] = few_row_points(ceil, device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
