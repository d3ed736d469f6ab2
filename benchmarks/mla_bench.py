"""MLA (DeepSeek latent attention) on a GPU: the Triton latent kernels at a DeepSeek model's shapes and the engine's
decode steps and prefill of that random model (``--model``, default ``random:deepseek-v2-lite``), each against a
ceiling measured first in the same run.

    python -m benchmarks.mla_bench --section kernels --out results/mla_kernels.json
    python -m benchmarks.mla_bench --section engine --out results/mla_engine.json    (--batches 1,64 to split it)
    python -m benchmarks.mla_bench --section engine --model random:deepseek-v3-cut --batches 1,64 \
        --out results/mla_engine_v3cut.json    (DeepSeek-V3's widths, 3 layers: one 80 GB GPU; FP8 linears)
    python -m benchmarks.mla_bench --device cpu --out /tmp/mla.json    (tiny shapes under the Triton
                                                                        interpreter: the plumbing, not the speed)

Ceilings: device-to-device copy bandwidth (clone of 1 GiB, read + write) and sustained bf16 matmul (8192^3).

kernels: ``mla_decode_attention`` at the model's heads (V2-Lite 16, V3 128) x (512 + 64)-value latent, bf16, 16-token pages scattered over the
pool, batch 1 / 64 / 256 x context 1024 / 4096: time, bytes read (the latents, B x ctx x 576 x 2 B, plus queries
and outputs) and their ratio to the copy ceiling, the max error against the fp32 torch reference and the time of
the torch reference in bf16 (gather + SDPA); one case launched with the fixed bound a CUDA graph is captured with
(max_context_len 32768 for 1024-token contexts). ``mla_prefill_attention``: a 4096-token prompt and a 2048-token
chunk after a 2048-token prefix: absorbed FLOPs (2 x H x (576 + 512) per causal (query, key) pair) / time against
the matmul ceiling.

engine: ``random:deepseek-v2-lite`` (27 layers, hidden 2048, 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128,
64 routed experts top-6 + 2 shared, layer 0 dense) or ``random:deepseek-v3-cut`` (DeepSeek-V3: hidden 7168, 128
heads, q_lora_rank 1536, 256 routed experts top-8 + 1 shared; 3 layers, layer 0 dense; its linears FP8
block-scaled on CUDA, its experts bf16), 1024-token prompts, decode step at batch 1 / 64 / 256 as the engine runs
it (CUDA graphs), against bytes read / copy ceiling (benchmarks/moe_engine_bench.py ``bench_decode``). The bytes a
step reads, each tensor at its own element size (:func:`weight_classes` prints them by kind):
  - every weight but the embedding table and the routed experts: attention projections, layer 0's dense MLP, the
    shared experts (FP8 linears: 1 B per weight plus their fp32 128 x 128 block scales; plain ones 2 B), kv_b_proj,
    routers, norms and the LM head (2 B);
  - the routed experts the step's routing hits (bf16: 2 B per weight), counted per MoE call on an eager step of the
    same batch;
  - the latent KV of the batch: B x mean context x layers x 576 values x 2 B (a page holds nothing else).
Not counted: activations, the split-K partials (B x heads x partitions x 512 fp32 per layer), sampling.
Prefill: one 2048-token prompt, median of 3 after a recorded warm-up, against the bf16 matmul ceiling: FLOPs =
2 x tokens x the decoder layers' 2-D weights (FP8 linears included: their w8a8 GEMM may run above the bf16
ceiling), 6 T K H I per MoE call, the absorbed latent attention (2 x heads x (576 + 512) per causal (query, key)
pair and layer) and the LM head for the one sampled row.
Each case fails soft: its error is printed and recorded, and the run continues.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe_bench import bench_us, ceilings
from services.kernels.reference import ref_mla_decode_attention, ref_mla_prefill_attention
from services.text.model.config import ModelArchConfig
from services.text.model.random_shapes import RANDOM_SHAPES, random_arch

MODEL = "random:deepseek-v2-lite"
BLOCK = 16
DECODE = [(b, c) for b in (1, 64, 256) for c in (1024, 4096)]
GRAPH_BOUND = (64, 1024, 32768)
"""(batch, context, max_context_len): the decode launch a CUDA graph captured for max_model_len 32768 replays."""
PREFILL = ((4096, 4096), (2048, 4096))
"""(new tokens, context) of one sequence: a whole prompt, a chunk after a cached prefix."""
ENGINE_BATCHES = (1, 64, 256)
ENGINE_PREFILL_TOKENS, ENGINE_PREFILL_REPS = 2048, 3
TINY_DECODE, TINY_PREFILL, TINY_HEADS, TINY_LATENT = [(1, 20), (3, 50)], ((9, 9), (5, 30)), 4, (32, 8)


def _pool(batch: int, context: int, latent: tuple[int, int], dtype: torch.dtype, device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pool [2, blocks, BLOCK, 1, half] of random latents, block tables int32 [B, ctx/BLOCK] of shuffled blocks,
    context lens int32 [B]): the engine's K and V planes of one layer."""
    per_seq = -(-context // BLOCK)
    blocks = batch * per_seq + 1
    gen = torch.Generator(device=device).manual_seed(batch * 7919 + context)
    pool = torch.randn((2, blocks, BLOCK, 1, sum(latent) // 2), generator=gen, device=device).to(dtype)
    tables = torch.randperm(blocks, generator=gen, device=device)[:batch * per_seq].view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return pool, tables.to(torch.int32).contiguous(), lens


def decode_case(batch: int, context: int, bound: int | None, heads: int, latent: tuple[int, int], scale: float,
                device: torch.device, ceil: dict[str, float]) -> dict[str, Any]:
    # imported here: after main() settled TRITON_INTERPRET
    from services.kernels.mla_decode_attention import mla_decode_attention

    dtype = torch.bfloat16
    pool, tables, lens = _pool(batch, context, latent, dtype, device)
    key_dim, value_dim = sum(latent), latent[0]
    q = torch.randn((batch, heads, key_dim), device=device).to(dtype)

    def run() -> torch.Tensor:
        return mla_decode_attention(q, pool[0], pool[1], tables, lens, scale, value_dim, max_context_len=bound or context)

    out = run()
    ref = ref_mla_decode_attention(q.float(), pool[0].float(), pool[1].float(), tables, lens, scale, value_dim)
    row: dict[str, Any] = {"kernel": "decode", "batch": batch, "context": context, "max_context_len": bound or context,
                           "max_abs_err": float((out.float() - ref).abs().max()), "ref_abs_max": float(ref.abs().max())}
    del ref
    row["triton_us"] = bench_us(run, device)
    row["torch_bf16_us"] = bench_us(
        lambda: ref_mla_decode_attention(q, pool[0], pool[1], tables, lens, scale, value_dim, context), device,
        rep_ms=50)
    elem = q.element_size()
    row["bytes"] = batch * context * key_dim * elem + q.numel() * elem + out.numel() * elem
    if ceil.get("copy_gbps"):
        row["fraction_of_ceiling"] = row["bytes"] / (row["triton_us"] * 1e-6) / 1e9 / ceil["copy_gbps"]
    return row


def prefill_case(new: int, context: int, heads: int, latent: tuple[int, int], scale: float, device: torch.device,
                 ceil: dict[str, float]) -> dict[str, Any]:
    # imported here: after main() settled TRITON_INTERPRET
    from services.kernels.mla_prefill_attention import mla_prefill_attention

    dtype = torch.bfloat16
    pool, tables, lens = _pool(1, context, latent, dtype, device)
    key_dim, value_dim = sum(latent), latent[0]
    q = torch.randn((new, heads, key_dim), device=device).to(dtype)
    cu = torch.tensor([0, new], dtype=torch.int32, device=device)

    def run() -> torch.Tensor:
        return mla_prefill_attention(q, pool[0], pool[1], tables, cu, lens, scale, value_dim, max_seqlen_q=new)

    out = run()
    ref = ref_mla_prefill_attention(q.float(), pool[0].float(), pool[1].float(), tables, cu, lens, scale, value_dim)
    row: dict[str, Any] = {"kernel": "prefill", "tokens": new, "context": context,
                           "max_abs_err": float((out.float() - ref).abs().max()), "ref_abs_max": float(ref.abs().max())}
    del ref
    row["triton_us"] = bench_us(run, device)
    pairs = new * (context - new) + new * (new + 1) // 2  # causal (query, key) pairs
    row["flops"] = 2.0 * heads * (key_dim + value_dim) * pairs
    if ceil.get("matmul_tflops"):
        row["fraction_of_ceiling"] = row["flops"] / (row["triton_us"] * 1e-6) / 1e12 / ceil["matmul_tflops"]
    return row


def kernel_cases(arch: ModelArchConfig, device: torch.device, ceil: dict[str, float]) -> list[dict[str, Any]]:
    """The latent kernels at ``arch``'s heads and latent on CUDA, at tiny ones elsewhere (the interpreter)."""
    cuda = device.type == "cuda"
    mla = arch.mla
    assert mla is not None
    heads, latent = (arch.num_heads, (mla.kv_lora_rank, mla.qk_rope_head_dim)) if cuda else (TINY_HEADS, TINY_LATENT)
    decode = [(b, c, None) for b, c in DECODE] + [GRAPH_BOUND] if cuda else [(b, c, None) for b, c in TINY_DECODE]
    jobs = [(f"decode B={b} ctx={c}" + (f" bound={m}" if m else ""),
             lambda b=b, c=c, m=m: decode_case(b, c, m, heads, latent, mla.scale, device, ceil)) for b, c, m in decode]
    jobs += [(f"prefill T={n} ctx={c}", lambda n=n, c=c: prefill_case(n, c, heads, latent, mla.scale, device, ceil))
             for n, c in (PREFILL if cuda else TINY_PREFILL)]
    rows = []
    for what, job in jobs:
        print(f"kernels: {what} ...", flush=True)
        try:
            rows.append(job())
        except Exception:
            err = traceback.format_exc()
            print(err, file=sys.stderr)
            rows.append({"kernel": what, "error": err})
        if cuda:
            torch.cuda.empty_cache()
    print_kernels(rows)
    return rows


def print_kernels(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'kernel':<9}{'B/T':>6}{'ctx':>7}{'bound':>7}{'triton us':>11}{'torch us':>10}{'MB read':>9}"
          f"{'TFLOP/s':>9}{'of ceil':>9}{'err':>10}")
    for r in rows:
        if "triton_us" not in r:
            print(f"{r['kernel']:<40} {r.get('error', '').strip().splitlines()[-1]}")
            continue
        dec = r["kernel"] == "decode"
        mb = f"{r['bytes'] / 1e6:9.1f}" if dec else f"{'-':>9}"
        tf = f"{'-':>9}" if dec else f"{r['flops'] / (r['triton_us'] * 1e-6) / 1e12:9.1f}"
        torch_us = f"{r['torch_bf16_us']:10.1f}" if "torch_bf16_us" in r else f"{'-':>10}"
        frac = r.get("fraction_of_ceiling")
        print(f"{r['kernel']:<9}{r['batch'] if dec else r['tokens']:>6}{r['context']:>7}"
              f"{r.get('max_context_len', r['context']):>7}{r['triton_us']:>11.1f}{torch_us}{mb}{tf}"
              f"{'-' if frac is None else format(frac, '.2f'):>9}{r['max_abs_err']:>10.2e}")
    print("of ceil: decode = bytes read / time / copy GB/s; prefill = absorbed FLOPs / time / matmul TFLOP/s")


def weight_classes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the model's weights by kind, each tensor at its element size: FP8 linears' weights and their fp32
    block scales, the routed experts, the embedding table (gathered, not read whole), and every other weight."""
    out = {"fp8_linear_weights": 0, "fp8_block_scales": 0, "routed_experts": 0, "embedding": 0, "other_weights": 0}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        nbytes = t.numel() * t.element_size()
        if name.endswith("weight_scale_inv"):
            out["fp8_block_scales"] += nbytes
        elif t.dtype == torch.float8_e4m3fn:
            out["fp8_linear_weights"] += nbytes
        elif ".mlp.experts." in name:
            out["routed_experts"] += nbytes
        elif name == "model.embed_tokens.weight":
            out["embedding"] += nbytes
        elif "rotary" not in name:  # RoPE tables: rows gathered by position
            out["other_weights"] += nbytes
    return out


def latent_attention_flops(arch: ModelArchConfig, tokens: int, context: int) -> float:
    """FLOPs of the absorbed latent attention of ``tokens`` new tokens ending a ``context``-token sequence, all
    layers: 2 x heads x (latent + kv_lora_rank) per causal (query, key) pair."""
    mla = arch.mla
    assert mla is not None
    pairs = tokens * (context - tokens) + tokens * (tokens + 1) // 2
    return 2.0 * arch.num_heads * (mla.latent_dim + mla.kv_lora_rank) * pairs * arch.num_layers


def bench_engine_prefill(loaded: Any, spec: str, ceil: dict[str, float], tokens: int = ENGINE_PREFILL_TOKENS,
                         form: str = "absorbed", chunk: int = 0) -> dict[str, Any]:
    """One ``tokens``-token prompt through the engine (one chunk, or chunks of ``chunk`` tokens: the steps after the
    first attend over a cached prefix), median of ENGINE_PREFILL_REPS after a warm-up whose MoE calls are recorded;
    FLOPs / time against the bf16 matmul ceiling. ``form``: --mla-prefill (the FLOPs count the absorbed attention
    either way, so two forms' fractions compare their times)."""
    chunk = chunk or tokens
    # Imported here: they load the engine and the Triton kernel modules (CUDA only).
    from benchmarks.gpu_bench import random_prompts
    from benchmarks.moe_engine_bench import MoECalls
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.text.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=spec, dtype="bfloat16", device="cuda", block_size=BLOCK,
                                 enable_prefix_caching=False, max_num_seqs=1, max_model_len=tokens + 64,
                                 max_num_batched_tokens=tokens, max_prefill_chunk=chunk,
                                 num_kv_blocks=tokens // BLOCK + 16, mla_prefill=form), loaded=loaded)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    calls, times = MoECalls(), []
    for r in range(ENGINE_PREFILL_REPS + 1):
        eng.add_request(f"p{r}", random_prompts(1, tokens, loaded.arch.vocab_size, seed=1000 + r)[0], sp,
                        detokenize=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with calls.record() if r == 0 else contextlib.nullcontext():  # the warm-up's MoE calls are recorded
            out = eng.step()
            while not (out and out[0].finished):
                out = eng.step()
        torch.cuda.synchronize()
        if r:
            times.append((time.perf_counter() - t) * 1e3)
    ms = statistics.median(times)
    a = loaded.arch
    linear = sum(p.numel() for n, p in loaded.model.named_parameters()
                 if n.startswith("model.layers.") and p.dim() == 2)
    flops = (2.0 * linear * tokens + calls.flops + latent_attention_flops(a, tokens, tokens)
             + 2.0 * a.hidden_size * a.vocab_size)
    res: dict[str, Any] = {"model": spec, "phase": f"pf-{form[:6]}", "mla_prefill": form, "tokens": tokens,
                           "chunk": chunk,
                           "step_ms": ms, "flops": flops,
                           "moe_flops": calls.flops, "moe_calls": calls.calls}
    if calls.calls == 0:
        res["error"] = "the model's MoE layers do not call kernels.fused_moe: active FLOPs unknown"
        return res
    res["fraction_of_ceiling"] = flops / (ms * 1e-3) / 1e12 / ceil["matmul_tflops"]
    return res


def engine_section(ceil: dict[str, float], spec: str = MODEL, batches: tuple[int, ...] = ENGINE_BATCHES,
                   prefill_tokens: tuple[int, ...] = (ENGINE_PREFILL_TOKENS,),
                   prefill_forms: tuple[str, ...] = ("absorbed",), prefill_chunk: int = 0) -> list[dict[str, Any]]:
    # Imported here: it loads the engine and the Triton kernel modules (CUDA only).
    from benchmarks.moe_engine_bench import bench_decode, print_engine
    from services.engine.model_loader import load_model

    print(f"engine: loading {spec} ...", flush=True)
    try:
        loaded = load_model(spec, torch.bfloat16, "cuda")
    except Exception as e:
        print(f"engine: {spec} does not load: {e}", flush=True)
        return [{"model": spec, "error": f"load: {e}"}]
    classes = weight_classes(loaded.model)
    print(f"engine: {loaded.model_id} weights (GB): " + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in classes.items()),
          flush=True)
    rows: list[dict[str, Any]] = []
    jobs = [(f"decode B={b}", lambda b=b: bench_decode(loaded, spec, b, ceil)) for b in batches]
    jobs += [(f"prefill T={t} {f}", lambda t=t, f=f: bench_engine_prefill(loaded, spec, ceil, t, f, prefill_chunk))
             for t in prefill_tokens for f in prefill_forms]
    for what, job in jobs:
        print(f"engine: {spec} {what} ...", flush=True)
        try:
            rows.append(job() | {"model_id": loaded.model_id, "weight_bytes": classes})
        except Exception:
            err = traceback.format_exc()
            print(err, file=sys.stderr)
            rows.append({"model": spec, "phase": what, "error": err})
        torch.cuda.empty_cache()
    print_engine(rows)
    print("\nbytes a decode step reads (GB): weights but routed experts + routed experts hit + latent KV; "
          "tokens/s at that step time")
    for r in rows:
        if "bytes" in r:
            print(f"  B={r['batch']:<4} {r['dense_weight_bytes'] / 1e9:6.2f} + {r['expert_bytes_hit'] / 1e9:6.2f} + "
                  f"{r['kv_bytes'] / 1e9:6.2f} = {r['bytes'] / 1e9:6.2f} GB in {r['step_ms']:.2f} ms "
                  f"(mean context {r['avg_context']:.0f}; {r['batch'] / r['step_ms'] * 1e3:.0f} tok/s)")
    return rows


def _mla_spec(spec: str) -> str:
    """``spec`` if it names a random shape with latent attention; argparse's error otherwise."""
    name = spec.removeprefix("random:")
    if not spec.startswith("random:") or name not in RANDOM_SHAPES or random_arch(name).mla is None:
        shapes = [f"random:{n}" for n in RANDOM_SHAPES if random_arch(n).mla is not None]
        raise argparse.ArgumentTypeError(f"{spec!r}: expected a random shape with latent attention, one of {shapes}")
    return spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mla_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("mla_bench.json"), help="JSON results path")
    parser.add_argument("--section", choices=("all", "kernels", "engine"), default="all")
    parser.add_argument("--batches", default=",".join(map(str, ENGINE_BATCHES)),
                        help="engine section: decode batch sizes, comma-separated (default %(default)s)")
    parser.add_argument("--prefill-tokens", default=str(ENGINE_PREFILL_TOKENS),
                        help="engine section: prompt lengths of the prefill rows, comma-separated (default %(default)s)")
    parser.add_argument("--prefill-forms", default="absorbed",
                        help="engine section: --mla-prefill forms of the prefill rows, comma-separated, of absorbed "
                             "and expanded (default %(default)s)")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="engine section: the prefill rows' --max-prefill-chunk (0: the whole prompt in one step)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: real shapes; cpu: tiny kernel shapes under the Triton interpreter (plumbing)")
    parser.add_argument("--model", type=_mla_spec, default=MODEL,
                        help="random MLA shape whose kernels and engine run (default %(default)s; "
                             "random:deepseek-v3-cut: DeepSeek-V3's widths in 3 layers, FP8 linears)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("mla_bench: no CUDA device here (use --device cpu for the plumbing check)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules are first imported (in the cases)
    device = torch.device(args.device)
    torch.set_grad_enabled(False)

    ceil: dict[str, float] = {}
    try:
        ceil = ceilings(device)
        print(f"ceilings: copy {ceil['copy_gbps']:.1f} GB/s, matmul {ceil['matmul_tflops']:.1f} TFLOP/s", flush=True)
    except Exception:
        traceback.print_exc()
    arch = random_arch(args.model.removeprefix("random:"))
    kernels = kernel_cases(arch, device, ceil) if args.section in ("all", "kernels") else []
    engine: list[dict[str, Any]] = []
    if args.section in ("all", "engine"):
        if device.type == "cuda" and ceil:
            engine = engine_section(ceil, args.model, tuple(int(b) for b in args.batches.split(",")),
                                    tuple(int(t) for t in args.prefill_tokens.split(",")),
                                    tuple(args.prefill_forms.split(",")), args.prefill_chunk)
        else:
            print("engine: needs CUDA and the ceilings; skipped")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "model": args.model, "ceilings": ceil, "kernels": kernels, "engine": engine}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 1 if any(r.get("error") for r in kernels + engine) else 0


if __name__ == "__main__":
    sys.exit(main())
