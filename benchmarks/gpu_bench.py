"""GPU engine benchmark (one run, one GPU): ceilings, decode/prefill efficiency, throughput vs transformers,
and GPU-vs-CPU greedy agreement. Writes JSON and prints a table last.

    python benchmarks/gpu_bench.py --out gpu_bench.json [--quick]

All figures come from the same process: the copy and matmul ceilings are measured first and every ratio
divides by them. Models are random-weight (`random:llama-3-8b` in bf16; `random:smollm2-135m` for the
CPU comparison), so no download is needed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.cli_args import ArgParser
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_loader import LoadedModel, build_empty_model, load_model
from services.text.sampling_params import SamplingParams

GiB = 2**30
MODEL = "random:llama-3-8b"


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def bench_ms(fn, warmup: int = 25, rep: int = 200) -> float:
    """Median milliseconds of fn() by CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


# --- ceilings ---

def ceilings() -> dict[str, float]:
    x = torch.empty(GiB // 2, dtype=torch.bfloat16, device="cuda").normal_()  # 1 GiB
    copy_ms = bench_ms(lambda: x.clone())
    copy_gbs = 2 * x.numel() * 2 / copy_ms / 1e6  # read + write
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    mm_ms = bench_ms(lambda: a @ b)
    return {"copy_ms_1GiB": copy_ms, "copy_GBps": copy_gbs, "matmul_ms_8192": mm_ms,
            "matmul_TFLOPs": 2 * n**3 / mm_ms / 1e9}


def _fused_cases(t: int, rope: Any) -> list[tuple[str, Any, Any, int]]:
    """(name, triton fn, torch reference fn, bytes moved) at Llama-3-8B shapes for t tokens."""
    from services.kernels.activation import silu_and_mul
    from services.kernels.reference import ref_apply_rotary_, ref_fused_add_rms_norm, ref_silu_and_mul
    from services.kernels.rms_norm import fused_add_rms_norm
    from services.kernels.rotary import apply_rotary_

    x = torch.randn(t, 4096, dtype=torch.bfloat16, device="cuda")
    r = torch.randn_like(x)
    w = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    gu = torch.randn(t, 2 * 14336, dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(t, 48 * 128, dtype=torch.bfloat16, device="cuda")
    q, k = qkv[:, :4096].view(t, 32, 128), qkv[:, 4096:5120].view(t, 8, 128)
    pos = torch.randint(0, 8192, (t,), device="cuda")
    cos, sin = rope.cos_cache, rope.sin_cache
    return [
        ("fused_add_rms_norm", lambda: fused_add_rms_norm(x, r, w, 1e-5),
         lambda: ref_fused_add_rms_norm(x, r, w, 1e-5), 4 * x.numel() * 2),
        ("silu_and_mul", lambda: silu_and_mul(gu), lambda: ref_silu_and_mul(gu), gu.numel() * 3),
        ("apply_rotary_", lambda: apply_rotary_(q, k, pos, cos, sin),
         lambda: ref_apply_rotary_(q, k, pos, cos, sin), 2 * 40 * 128 * t * 2),
    ]


def bench_fused_kernels(copy_gbps: float) -> list[dict[str, Any]]:
    """The fused elementwise kernels vs their torch references at the decode-64 and prefill-8K shapes."""
    from services.engine.models.rope import RotaryEmbedding

    rope = RotaryEmbedding(128, 500000.0, None, 8192).to("cuda")
    rows = []
    for t in (64, 8192):
        for name, fn, ref, nbytes in _fused_cases(t, rope):
            us, ref_us = bench_ms(fn) * 1e3, bench_ms(ref) * 1e3
            rows.append({"kernel": name, "tokens": t, "triton_us": us, "torch_ref_us": ref_us,
                         "GBps": nbytes / us / 1e3, "fraction_of_copy": nbytes / us / 1e3 / copy_gbps})
    return rows


# --- model accounting ---

def weight_bytes_per_decode_step(loaded: LoadedModel) -> int:
    """Bytes of every parameter a decode step reads: all but the embedding table (B rows are gathered), each at
    its element size (an FP8 linear's weight 1 byte), plus the FP8 linears' fp32 block scales (buffers)."""
    m = loaded.model
    emb = m.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    total += sum(b.numel() * b.element_size() for n, b in m.named_buffers() if n.endswith("weight_scale_inv"))
    if m.lm_head is None:  # tied: the embedding IS read in full as the LM head
        return total
    return total - emb.numel() * emb.element_size()


def kv_bytes_per_token(loaded: LoadedModel, elem: int = 2) -> int:
    a = loaded.arch
    return a.num_layers * 2 * a.num_kv_heads * a.head_dim * elem


def matmul_params(loaded: LoadedModel) -> int:
    """Parameters of the decoder layers' linear layers (the per-token matmul work)."""
    return sum(p.numel() for n, p in loaded.model.named_parameters() if n.startswith("model.layers.")
               and p.dim() == 2)


def prefill_flops(loaded: LoadedModel, tokens: int) -> float:
    """2*params*tokens for the layers' matmuls + causal attention (QK^T and PV: 2*T^2*H*D per layer)
    + the LM head for the one sampled token."""
    a = loaded.arch
    attn = 2.0 * tokens * tokens * a.num_heads * a.head_dim * a.num_layers
    return 2.0 * matmul_params(loaded) * tokens + attn + 2.0 * a.hidden_size * a.vocab_size


# --- engine helpers ---

def make_engine(loaded: LoadedModel, **kw: Any) -> LLMEngine:
    cfg = dict(model=MODEL, dtype="bfloat16", device="cuda", block_size=16, enable_prefix_caching=False)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def bench_decode(loaded: LoadedModel, batch: int, ctx: int, steps: int, ceil: dict[str, float]) -> dict[str, Any]:
    per_seq_blocks = math.ceil((ctx + 3 * steps + 48) / 16)
    eng = make_engine(loaded, max_num_seqs=batch, max_model_len=4096, max_num_batched_tokens=8192,
                      max_prefill_chunk=8192, num_kv_blocks=batch * per_seq_blocks + 8)
    sp = SamplingParams(max_tokens=3 * steps + 24, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, ctx, loaded.arch.vocab_size, seed=batch)):
        eng.add_request(f"d{i}", p, sp, detokenize=False)
    started: set[str] = set()
    t0 = time.perf_counter()
    while len(started) < batch:  # prefill (chunked by the scheduler) until every request has its first token
        started.update(o.request_id for o in eng.step())
    prefill_s = time.perf_counter() - t0
    for _ in range(3):
        eng.step()

    def timed_steps(n: int) -> tuple[float, float]:
        ctx0 = statistics.mean(eng.scheduler.running[i].num_computed_tokens + 1 for i in range(batch))
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            out = eng.step()
            assert len(out) == batch
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e3, ctx0 + (n - 1) / 2

    runner = eng.runner
    exec_times: list[float] = []
    orig_execute = runner.execute

    def timed_execute(out):  # host + GPU time inside the model runner (prep, replay, token copy back)
        t = time.perf_counter()
        r = orig_execute(out)
        exec_times.append(time.perf_counter() - t)
        return r

    runner.execute = timed_execute
    graph_ms, avg_ctx = timed_steps(steps)
    del runner.execute
    execute_ms = statistics.mean(exec_times) * 1e3
    replay_ms = None
    if runner.graphs is not None:
        bucket = runner.graphs.bucket_for(batch, ctx + steps)
        if bucket is not None:
            replay_ms = bench_ms(runner.graphs.graphs[bucket].replay, warmup=5, rep=100)
    graphs, runner.graphs = runner.graphs, None
    for _ in range(2):  # eager warm-up: the eager launches specialize differently from the captured ones
        eng.step()
    eager_ms, _ = timed_steps(max(5, steps // 2))
    runner.graphs = graphs
    wbytes = weight_bytes_per_decode_step(loaded)
    kvbytes = batch * avg_ctx * kv_bytes_per_token(loaded)
    total = wbytes + kvbytes
    res = {"batch": batch, "context": ctx, "avg_context_timed": avg_ctx, "step_ms": graph_ms,
           "runner_execute_ms": execute_ms, "fused_kernels": loaded.model.fused_kernels,
           "step_ms_eager": eager_ms, "graph_replay_ms": replay_ms, "weight_bytes": wbytes,
           "kv_bytes": kvbytes, "prefill_s_all_prompts": prefill_s,
           "hbm_GBps": total / graph_ms / 1e6, "hbm_fraction_of_copy": total / graph_ms / 1e6 / ceil["copy_GBps"],
           "hbm_fraction_graph_replay": (total / replay_ms / 1e6 / ceil["copy_GBps"]) if replay_ms else None}
    return res


def bench_prefill(loaded: LoadedModel, tokens: int, reps: int, ceil: dict[str, float]) -> dict[str, Any]:
    eng = make_engine(loaded, max_num_seqs=1, max_model_len=tokens + 64, max_num_batched_tokens=tokens,
                      max_prefill_chunk=tokens, num_kv_blocks=tokens // 16 + 16)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for r in range(reps + 2):
        prompt = random_prompts(1, tokens, loaded.arch.vocab_size, seed=1000 + r)[0]
        eng.add_request(f"p{r}", prompt, sp, detokenize=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = eng.step()
        torch.cuda.synchronize()
        assert out and out[0].finished
        if r >= 2:
            times.append((time.perf_counter() - t) * 1e3)
    ms = statistics.median(times)
    flops = prefill_flops(loaded, tokens)
    del eng
    torch.cuda.empty_cache()
    return {"tokens": tokens, "step_ms": ms, "step_ms_all": times, "flops": flops,
            "TFLOPs": flops / ms / 1e9, "fraction_of_matmul": flops / ms / 1e9 / ceil["matmul_TFLOPs"]}


def bench_ours_throughput(loaded: LoadedModel, prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    eng = make_engine(loaded, max_num_seqs=len(prompts), max_model_len=2048, max_num_batched_tokens=8192,
                      max_prefill_chunk=8192, num_kv_blocks=len(prompts) * math.ceil((len(prompts[0]) + out_len) / 16)
                      + 64)
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    eng.generate(prompts[:4], sp)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = eng.generate(prompts, sp)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    n = sum(len(o) for o in outs)
    del eng
    torch.cuda.empty_cache()
    return {"seconds": s, "output_tokens": n, "tokens_per_s": n / s, "outputs": outs}


# --- transformers baseline ---

def hf_introspect() -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {"transformers": transformers.__version__}
    from transformers import LlamaForCausalLM

    for name in ("generate_batch", "init_continuous_batching", "continuous_batching_context_manager"):
        fn = getattr(LlamaForCausalLM, name, None)
        info[name] = str(inspect.signature(fn)) if fn is not None else None
    try:
        from transformers.generation import ContinuousBatchingConfig

        info["ContinuousBatchingConfig"] = str(inspect.signature(ContinuousBatchingConfig))
    except Exception as e:  # older API: no such class
        info["ContinuousBatchingConfig"] = f"unavailable: {e!r}"
    return info


def build_hf_model(loaded: LoadedModel):
    """transformers LlamaForCausalLM with the same shapes and (unfused) weights as `loaded`, bf16 on cuda."""
    from transformers import LlamaConfig, LlamaForCausalLM

    a = loaded.arch
    common = dict(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                  num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                  head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps, max_position_embeddings=a.max_position_embeddings,
                  tie_word_embeddings=a.tie_word_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    rope = dict(a.rope_scaling or {"rope_type": "default"})
    try:
        cfg = LlamaConfig(**common, rope_parameters={**rope, "rope_theta": a.rope_theta})
    except TypeError:
        cfg = LlamaConfig(**common, rope_theta=a.rope_theta, rope_scaling=a.rope_scaling)
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    hf.eval().requires_grad_(False)
    q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    sd: dict[str, torch.Tensor] = {}
    for name, p in loaded.model.state_dict().items():
        if ".qkv_proj." in name:
            for part, rows in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
                sd[name.replace("qkv_proj", part)] = p[rows[0]:rows[1]]
        elif ".gate_up_proj." in name:
            sd[name.replace("gate_up_proj", "gate_proj")] = p[:inter]
            sd[name.replace("gate_up_proj", "up_proj")] = p[inter:]
        else:
            sd[name] = p
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"HF weight mapping: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return hf


def bench_hf_throughput(hf, prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    attempts: list[tuple[str, dict[str, Any]]] = []
    try:
        from transformers.generation import ContinuousBatchingConfig

        for label, graphs in (("cuda_graphs", True), ("no_cuda_graphs", False)):
            cb = ContinuousBatchingConfig(use_cuda_graph=graphs, max_memory_percent=0.5)
            attempts.append((label, {"continuous_batching_config": cb}))
    except Exception:
        pass
    attempts.append(("defaults", {}))
    errors = []
    for label, kw in attempts:
        try:
            hf.generate_batch(inputs=prompts[:4], generation_config=gen, **kw)  # warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = hf.generate_batch(inputs=prompts, generation_config=gen, **kw)
            torch.cuda.synchronize()
            s = time.perf_counter() - t
            toks = [list(o.generated_tokens) for o in outs.values()]
            ordered = [list(outs[k].generated_tokens) for k in sorted(outs, key=lambda r: int(str(r).split("_")[-1]))] \
                if all(str(k).split("_")[-1].isdigit() for k in outs) else toks
            n = sum(len(t_) for t_ in toks)
            return {"config": label, "seconds": s, "output_tokens": n, "tokens_per_s": n / s,
                    "requests": len(outs), "errors": errors, "outputs": ordered}
        except Exception as e:
            errors.append(f"{label}: {e!r}")
            log(f"transformers generate_batch ({label}) failed: {e!r}\n{traceback.format_exc(limit=4)}")
    return {"errors": errors}


# --- GPU vs CPU greedy ---

def logits_trace(engine: LLMEngine, prompt: list[int], steps: int, forced: list[int] | None = None
                 ) -> tuple[list[int], torch.Tensor]:
    """Greedy-generate `steps` tokens of one prompt, recording the fp32 logits of every sampled position.

    With `forced`, step i emits forced[i] whatever the logits say (teacher forcing), so two engines are
    compared on the same token history even where bf16 flips a near-tie.
    """
    model = engine.runner.model
    orig = model.compute_logits
    trace: list[torch.Tensor] = []

    def hook(hidden: torch.Tensor) -> torch.Tensor:
        logits = orig(hidden)
        trace.append(logits[0].float().cpu())
        if forced is not None:
            logits = logits.clone()
            logits[0, forced[len(trace) - 1]] = 1e9
        return logits

    model.compute_logits = hook
    try:
        tokens = engine.generate([prompt], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))[0]
    finally:
        del model.compute_logits
    return tokens, torch.stack(trace)


def gpu_vs_cpu(spec: str, steps: int, prompt_lens: tuple[int, ...]) -> dict[str, Any]:
    cpu_loaded = load_model(spec, torch.float32, "cpu")
    gpu_model = build_empty_model(cpu_loaded.arch, torch.bfloat16, "cuda")
    gpu_model.load_state_dict(cpu_loaded.model.state_dict())
    gpu_model.eval().requires_grad_(False)
    gpu_loaded = LoadedModel(gpu_model, cpu_loaded.arch, cpu_loaded.tokenizer, cpu_loaded.model_id,
                             cpu_loaded.max_model_len)
    common = dict(model=spec, block_size=16, num_kv_blocks=256, max_num_seqs=8, max_model_len=1024)
    # eager CPU steps only: a background decode compile would run the model (and the logits hook) on its own
    cpu = LLMEngine(EngineConfig(dtype="float32", device="cpu", cpu_compile_decode=0, **common), loaded=cpu_loaded)
    gpu = LLMEngine(EngineConfig(dtype="bfloat16", device="cuda", **common), loaded=gpu_loaded)
    rows = []
    for i, n in enumerate(prompt_lens):
        prompt = random_prompts(1, n, cpu_loaded.arch.vocab_size, seed=7 + i)[0]
        ref_tokens, ref = logits_trace(cpu, prompt, steps)
        free_tokens, _ = logits_trace(gpu, prompt, steps)
        _, got = logits_trace(gpu, prompt, steps, forced=ref_tokens)
        diff = (got - ref).abs()
        agree = next((j for j, (x, y) in enumerate(zip(free_tokens, ref_tokens, strict=True)) if x != y), steps)
        rows.append({"prompt_len": n, "max_abs_diff": float(diff.max()), "ref_max_abs": float(ref.abs().max()),
                     "rel_l2": float((got - ref).norm() / ref.norm()),
                     "teacher_forced_argmax_match": int((got.argmax(-1) == ref.argmax(-1)).sum()),
                     "free_running_identical_prefix": agree, "steps": steps})
    return {"model": spec, "gpu_dtype": "bfloat16", "cpu_dtype": "float32", "rows": rows,
            "max_abs_diff": max(r["max_abs_diff"] for r in rows), "rel_l2": max(r["rel_l2"] for r in rows)}


# --- main ---

def fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def main() -> int:
    ap = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_bench.json"), help="JSON results path")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--skip-unfused", action="store_true", help="skip the unfused-elementwise decode ablation")
    ap.add_argument("--skinny-rows", type=int, default=None,
                    help="the LM head of at most N rows on the skinny GEMM (kernels/skinny_gemm.py RULE; 0: always cuBLAS; "
                         "default: 16)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "gpu_bench needs a CUDA device"
    import triton

    if args.skinny_rows is not None:
        from services.kernels.skinny_gemm import RULE

        RULE["max_rows"] = args.skinny_rows

    res: dict[str, Any] = {"quick": args.quick, "device": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                           "errors": {}}

    def section(name: str, fn) -> Any:
        log(f"{name} ...")
        t = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:
            res["errors"][name] = repr(e)
            log(f"{name} FAILED: {e!r}\n{traceback.format_exc()}")
        torch.cuda.empty_cache()
        log(f"{name} done in {time.perf_counter() - t:.1f}s")
        args.out.write_text(json.dumps(res, indent=1, default=str))
        return res.get(name)

    section("hf_api", hf_introspect)
    log(f"hf_api: {json.dumps(res.get('hf_api'), indent=1)}")
    ceil = section("ceilings", ceilings)
    t = time.perf_counter()
    loaded = load_model(MODEL, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    log(f"loaded {MODEL} in {time.perf_counter() - t:.1f}s")
    if ceil:
        section("fused_kernels", lambda: bench_fused_kernels(ceil["copy_GBps"]))
    batches, ctx, steps = ((1, 16), 512, 8) if args.quick else ((1, 16, 64), 2048, 24)
    res["decode"] = []
    for b in batches:
        r = section(f"decode_b{b}", lambda b=b: bench_decode(loaded, b, ctx, steps, ceil))
        if r:
            res["decode"].append(r)
    if not args.skip_unfused:  # ablation: the same step with the plain torch elementwise ops
        loaded.model.fused_kernels = False
        b = batches[-1]
        r = section(f"decode_b{b}_unfused", lambda: bench_decode(loaded, b, ctx, steps, ceil))
        loaded.model.fused_kernels = None
        if r:
            res["decode"].append(r)
    section("prefill", lambda: bench_prefill(loaded, 2048 if args.quick else 8192, 3 if args.quick else 5, ceil))
    n_req, p_len, o_len = (16, 64, 32) if args.quick else (64, 128, 128)
    prompts = random_prompts(n_req, p_len, loaded.arch.vocab_size, seed=42)
    ours = section("throughput_ours", lambda: bench_ours_throughput(loaded, prompts, o_len))
    if not args.skip_hf:
        def hf_run() -> dict[str, Any]:
            nonlocal loaded
            hf = build_hf_model(loaded)
            loaded = None  # free our copy of the weights before transformers sizes its KV cache
            torch.cuda.empty_cache()
            try:
                return bench_hf_throughput(hf, prompts, o_len)
            finally:
                del hf
                torch.cuda.empty_cache()
        hf = section("throughput_hf", hf_run)
        if ours and hf and "tokens_per_s" in hf:
            res["throughput_speedup"] = ours["tokens_per_s"] / hf["tokens_per_s"]
            same = [sum(1 for x, y in zip(a, b, strict=False) if x == y) / max(1, len(a))
                    for a, b in zip(ours["outputs"], hf["outputs"], strict=False)]
            res["throughput_token_agreement_mean"] = statistics.mean(same) if same else None
            res["throughput_first_token_agreement"] = statistics.mean(
                1.0 if a[:1] == b[:1] else 0.0 for a, b in zip(ours["outputs"], hf["outputs"], strict=False))
    for k in ("throughput_ours", "throughput_hf"):
        if isinstance(res.get(k), dict):
            res[k].pop("outputs", None)
    loaded = None
    section("gpu_vs_cpu", lambda: gpu_vs_cpu("random:smollm2-135m", 16, (40, 200)))
    args.out.write_text(json.dumps(res, indent=1, default=str))

    # --- table (last, so the reply's tail carries it) ---
    c = res.get("ceilings") or {}
    print("\n=== gpu_bench summary ===")
    print(f"device {res['device']}  torch {res['torch']}  triton {res['triton']}")
    print(f"ceilings: copy {fmt(c.get('copy_GBps'), 0)} GB/s (read+write, 1 GiB clone), "
          f"bf16 matmul {fmt(c.get('matmul_TFLOPs'), 1)} TFLOP/s (8192^3)")
    print(f"{'decode':<12}{'ctx':>6}{'step ms':>9}{'exec ms':>9}{'eager ms':>10}{'replay ms':>11}{'GB/s':>8}"
          f"{'frac':>7}{'frac(replay)':>14}")
    for r in res.get("decode", []):
        label = f"b={r['batch']}" + ("u" if r.get("fused_kernels") is False else "")
        print(f"{label:<12}{r['context']:>6}{r['step_ms']:>9.2f}{r['runner_execute_ms']:>9.2f}"
              f"{r['step_ms_eager']:>10.2f}{fmt(r['graph_replay_ms'], 2):>11}{r['hbm_GBps']:>8.0f}"
              f"{r['hbm_fraction_of_copy']:>7.2f}{fmt(r['hbm_fraction_graph_replay'], 2):>14}")
    for k in res.get("fused_kernels") or []:
        print(f"{k['kernel']:<20} T={k['tokens']:<6} triton {k['triton_us']:8.1f} us  torch {k['torch_ref_us']:8.1f} us"
              f"  {k['GBps']:6.0f} GB/s ({k['fraction_of_copy']:.2f} of copy)")
    # One line per section present in the results: key -> its line.
    lines: dict[str, Callable[[Any], str]] = {
        "prefill": lambda p: f"prefill {p['tokens']} tok: {p['step_ms']:.1f} ms, {p['TFLOPs']:.0f} TFLOP/s, "
                             f"{p['fraction_of_matmul']:.2f} of matmul",
        "throughput_ours": lambda o: f"throughput ours: {o['tokens_per_s']:.0f} tok/s ({o['output_tokens']} tokens, "
                                     f"{o['seconds']:.2f}s)",
        "throughput_hf": lambda h: f"throughput transformers: {fmt(h.get('tokens_per_s'), 0)} tok/s "
                                   f"({h.get('config')}) errors={h.get('errors')}",
        "throughput_speedup": lambda x: f"speedup {x:.2f}x  token agreement "
                                        f"{fmt(res['throughput_token_agreement_mean'])}  first-token agreement "
                                        f"{fmt(res['throughput_first_token_agreement'])}",
        "gpu_vs_cpu": lambda g: f"gpu(bf16) vs cpu(fp32) {g['model']}: max|dlogit| {g['max_abs_diff']:.4f}, "
                                f"rel_l2 {g['rel_l2']:.4f}, rows "
                                f"{[(r['prompt_len'], r['teacher_forced_argmax_match'], r['free_running_identical_prefix']) for r in g['rows']]}",
    }
    for key, line in lines.items():
        if res.get(key):
            print(line(res[key]))
    if res["errors"]:
        print(f"ERRORS: {res['errors']}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
