"""Engine section of `pdserve bench moe`: a random-weight MoE model's decode step and 8K prefill against
the limits of what that step must read or compute (CUDA only).

Decode: the bytes a step reads are the experts its routing actually hits (counted per MoE call on an
eager step of the same batch), every other weight but the embedding table, and the KV of the batch;
the step itself is timed as the engine runs it (CUDA graphs when enabled). Prefill: active FLOPs = the
dense matmuls (2 x params x tokens), 6 T K H I per MoE call, causal attention and the LM head.
Experts are counted by wrapping `fused_moe` wherever a loaded module imported it (and the `services.kernels`
package's `moe_experts`), so a model whose MoE does not call them is reported, not guessed.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import services.kernels as kernels
from benchmarks.gpu_bench import kv_bytes_per_token, random_prompts, weight_bytes_per_decode_step
from benchmarks.moe_bench import MOE_ENGINE_MODELS
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_loader import LoadedModel, load_model
from services.kernels.fused_moe import fused_moe
from services.text.model.random_shapes import RANDOM_SHAPES
from services.text.sampling_params import SamplingParams

MODELS = MOE_ENGINE_MODELS  # mixtral's 93 GB of bf16 weights need an H200
BATCHES, PREFILL_TOKENS, DECODE_CONTEXT, DECODE_STEPS = (1, 16, 64, 256), 8192, 1024, 20
ENGINE_GOALS = {"engine decode B=1": 0.6, "engine decode B=64": 0.7, "engine prefill": 0.5}


class MoECalls:
    """What the MoE calls of the steps run inside `record()` touched."""

    def __init__(self) -> None:
        self.hit_bytes = 0  # bytes of the distinct experts hit, summed over calls
        self.flops = 0.0  # 6 T K H I per call
        self.calls = 0
        self.expert_tensors: dict[int, int] = {}  # data_ptr -> nbytes of every w13/w2 seen

    def wrap(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def recorded(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, **kw: Any) -> torch.Tensor:
            hit = int(torch.unique(topk_ids).numel())  # a host sync: only on the recorded (untimed) steps
            self.hit_bytes += hit * (w13[0].numel() + w2[0].numel()) * w13.element_size()
            self.flops += 6.0 * topk_ids.numel() * w2.shape[1] * w2.shape[2]
            self.calls += 1
            for w in (w13, w2):
                self.expert_tensors[w.data_ptr()] = w.numel() * w.element_size()
            return fn(x, w13, w2, topk_ids, topk_weights, **kw)

        return recorded

    @contextmanager
    def record(self) -> Iterator[None]:
        """Wrap fused_moe / moe_experts in every loaded module that holds them, for the block's duration."""
        patched: list[tuple[object, str, object]] = []
        for module in list(sys.modules.values()):
            for name, target in (("fused_moe", fused_moe), ("moe_experts", kernels.moe_experts)):
                if getattr(module, name, None) is target:
                    patched.append((module, name, target))
                    setattr(module, name, self.wrap(target))
        try:
            yield
        finally:
            for module, name, target in patched:
                setattr(module, name, target)


def _engine(loaded: LoadedModel, spec: str, **kw: Any) -> LLMEngine:
    cfg = dict(model=spec, dtype="bfloat16", device="cuda", block_size=16, enable_prefix_caching=False)
    return LLMEngine(EngineConfig(**{**cfg, **kw}), loaded=loaded)


def bench_decode(loaded: LoadedModel, spec: str, batch: int, ceil: dict[str, float]) -> dict[str, Any]:
    steps = DECODE_STEPS
    per_seq_blocks = math.ceil((DECODE_CONTEXT + 3 * steps + 48) / 16)
    eng = _engine(loaded, spec, max_num_seqs=batch, max_model_len=DECODE_CONTEXT + 4 * steps + 64,
                  max_num_batched_tokens=8192, max_prefill_chunk=8192, num_kv_blocks=batch * per_seq_blocks + 8)
    sp = SamplingParams(max_tokens=3 * steps + 24, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, DECODE_CONTEXT, loaded.arch.vocab_size, seed=batch)):
        eng.add_request(f"d{i}", p, sp, detokenize=False)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in eng.step())
    for _ in range(3):
        eng.step()
    def mean_context() -> float:
        return statistics.mean(eng.scheduler.running[i].num_computed_tokens for i in range(batch))

    ctx0 = mean_context()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        assert len(eng.step()) == batch
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t) / steps * 1e3
    avg_ctx = (ctx0 + mean_context()) / 2  # keys read per sequence, averaged over the timed steps
    calls = MoECalls()
    graphs, eng.runner.graphs = eng.runner.graphs, None  # an eager step, so the Python MoE calls run
    with calls.record():
        eng.step()
    eng.runner.graphs = graphs
    res: dict[str, Any] = {"model": spec, "phase": "decode", "batch": batch, "step_ms": step_ms,
                           "avg_context": avg_ctx, "moe_calls": calls.calls, "cuda_graphs": graphs is not None}
    if batch in (1, 64):
        try:
            res["eager_kernels"] = _kernel_profile(eng)
        except Exception as e:  # a profiler problem must not cost the row its figures
            res["eager_kernels"] = f"profile failed: {e!r}"
    if calls.calls == 0:
        res["error"] = "the model's MoE layers do not call kernels.fused_moe: experts hit unknown"
        return res
    dense = weight_bytes_per_decode_step(loaded) - sum(calls.expert_tensors.values())
    kv = batch * avg_ctx * kv_bytes_per_token(loaded)
    total = dense + calls.hit_bytes + kv
    res |= {"expert_bytes_hit": calls.hit_bytes, "dense_weight_bytes": dense, "kv_bytes": kv, "bytes": total,
            "fraction_of_ceiling": total / (step_ms * 1e-3) / 1e9 / ceil["copy_gbps"]}
    return res


def _kernel_profile(eng: LLMEngine, steps: int = 3, top: int = 22) -> str:
    """The GPU kernels of `steps` eager decode steps (graphs off: the same kernels without the replay), by total
    device time: where a small-batch step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    graphs, eng.runner.graphs = eng.runner.graphs, None
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
    finally:
        eng.runner.graphs = graphs
    try:
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=top, max_name_column_width=60)
    except (KeyError, AttributeError, ValueError):  # torch before the device_* names
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60)
    print(f"eager decode step kernels ({steps} steps):\n{table}", flush=True)
    return table


def bench_prefill(loaded: LoadedModel, spec: str, ceil: dict[str, float], reps: int = 3) -> dict[str, Any]:
    tokens = PREFILL_TOKENS
    eng = _engine(loaded, spec, max_num_seqs=1, max_model_len=tokens + 64, max_num_batched_tokens=tokens,
                  max_prefill_chunk=tokens, num_kv_blocks=tokens // 16 + 16)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    calls = MoECalls()
    times: list[float] = []
    step_counts: list[int] = []
    for r in range(reps + 1):
        eng.add_request(f"p{r}", random_prompts(1, tokens, loaded.arch.vocab_size, seed=1000 + r)[0], sp,
                        detokenize=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        if r == 0:  # warm-up, recorded
            with calls.record():
                steps = _until_finished(eng, f"p{r}")
        else:
            steps = _until_finished(eng, f"p{r}")
        torch.cuda.synchronize()
        if r:
            times.append((time.perf_counter() - t) * 1e3)
            step_counts.append(steps)
    ms = statistics.median(times)
    a = loaded.arch
    dense_params = sum(p.numel() for n, p in loaded.model.named_parameters()
                       if n.startswith("model.layers.") and p.dim() == 2)
    attn = 2.0 * tokens * tokens * a.num_heads * a.head_dim * a.num_layers
    flops = 2.0 * dense_params * tokens + calls.flops + attn + 2.0 * a.hidden_size * a.vocab_size
    res: dict[str, Any] = {"model": spec, "phase": "prefill", "tokens": tokens, "step_ms": ms, "flops": flops,
                           "moe_flops": calls.flops, "moe_calls": calls.calls, "engine_steps": step_counts}
    if calls.calls == 0:
        res["error"] = "the model's MoE layers do not call kernels.fused_moe: active FLOPs unknown"
        return res
    res["fraction_of_ceiling"] = flops / (ms * 1e-3) / 1e12 / ceil["matmul_tflops"]
    return res


def _until_finished(eng: LLMEngine, request_id: str, limit: int = 16) -> int:
    """Steps the engine until request_id finishes (one step when the whole prompt fits one chunk and the
    output comes back in the same step); the number of steps it took. Raises past `limit` steps."""
    for n in range(1, limit + 1):
        if any(o.request_id == request_id and o.finished for o in eng.step()):
            return n
    raise RuntimeError(f"{request_id} did not finish in {limit} steps")


def engine_cases(ceil: dict[str, float], models: tuple[str, ...] = MODELS, batches: tuple[int, ...] = BATCHES,
                 prefill: bool = True) -> list[dict[str, Any]]:
    """Every model's decode batches and prefill; a shape this checkout lacks is one line and skipped."""
    rows: list[dict[str, Any]] = []
    for name in models:
        spec = f"random:{name}"
        if name not in RANDOM_SHAPES:
            print(f"engine section: {spec} is not a random shape in this checkout; skipped", flush=True)
            rows.append({"model": spec, "skipped": "not a random shape in this checkout"})
            continue
        print(f"engine section: loading {spec} ...", flush=True)
        try:
            loaded = load_model(spec, torch.bfloat16, "cuda")
        except Exception as e:
            print(f"engine section: {spec} does not load: {e}", flush=True)
            rows.append({"model": spec, "error": f"load: {e}"})
            continue
        jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            (f"decode B={b}", lambda b=b, m=loaded, s=spec: bench_decode(m, s, b, ceil)) for b in batches
        ]
        if prefill:
            jobs.append(("prefill", lambda m=loaded, s=spec: bench_prefill(m, s, ceil)))
        for what, job in jobs:
            print(f"engine section: {spec} {what} ...", flush=True)
            try:
                rows.append(job())
                print(f"engine section: {spec} {what}: " + ", ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()
                    if k in ("step_ms", "fraction_of_ceiling", "bytes", "flops", "engine_steps", "error")), flush=True)
            except Exception:
                err = traceback.format_exc()
                print(err, file=sys.stderr)
                rows.append({"model": spec, "phase": what, "error": err})
            torch.cuda.empty_cache()
        del loaded, jobs, job  # the jobs' default arguments hold the model too
        gc.collect()
        torch.cuda.empty_cache()
    print_engine(rows)
    return rows


def print_engine(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'model':<24}{'phase':<9}{'batch/T':>8}{'step ms':>10}{'GB read':>9}{'TFLOP':>8}{'of ceil':>9}{'goal':>6}")
    for r in rows:
        if "step_ms" not in r:
            print(f"{r['model']:<24}{r.get('phase', '-'):<9}  {r.get('skipped') or r.get('error', '').splitlines()[-1]}")
            continue
        decode = r["phase"] == "decode"
        size = r["batch"] if decode else r["tokens"]
        goal = ENGINE_GOALS.get(f"engine decode B={size}" if decode else "engine prefill")
        frac = r.get("fraction_of_ceiling")
        gb = f"{r['bytes'] / 1e9:9.2f}" if "bytes" in r else f"{'-':>9}"
        tf = f"{r['flops'] / 1e12:8.1f}" if "flops" in r else f"{'-':>8}"
        print(f"{r['model']:<24}{r['phase']:<9}{size:>8}{r['step_ms']:>10.2f}{gb}{tf}"
              f"{'-' if frac is None else format(frac, '.2f'):>9}{'-' if goal is None else format(goal, '.1f'):>6}")
    print("of ceil: decode = bytes read / step time / copy GB/s; prefill = active FLOPs / time / matmul TFLOP/s")
