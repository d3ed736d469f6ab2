"""Tensor-parallel step times: a TP=N forward against TP=1 on the same shapes, measured in one run.

    # GPU (N GPUs of one host, NCCL; random Llama-3-8B, bf16):
    python benchmarks/tp_bench.py --device cuda --tp 2 --model random:llama-3-8b --dtype bfloat16 \
        --decode-batch 64 --context 2048 --prefill-tokens 8192
    # CPU (gloo; tiny shapes, runs anywhere):
    python benchmarks/tp_bench.py --device cpu --tp 2 --model random:tiny-llama --dtype float32 \
        --decode-batch 4 --context 64 --prefill-tokens 128

Two timings per degree, each the median of ``--iters`` after ``--warmup``: one decode step (batch B, every
sequence at ``--context`` tokens of paged KV; attention reads the pool's contents, whatever they are) and
one prefill forward of ``--prefill-tokens`` tokens (one sequence, no cached prefix). On CUDA the decode step
replays the engine's decode CUDA graph of batch B (``--graphs on``, the default: forward, LM head and greedy
argmax; at TP>1 every rank captured its graphs together and they replay in lockstep, NCCL inside) or runs
eagerly (``--graphs off``); prefill is always eager, as in the engine. Weights are random per
shard (timings need shapes, not values). Prints one JSON line per degree and the TP=N/TP=1 ratios last
(the issue's goal: <= 0.6 at TP=2 on GPU). Each rank is its own process on cpu / cuda:<rank>.

On CUDA, ``--allreduce`` picks TP=N's all-reduce: ``oneshot`` (the default: small tensors one-shot over
symmetric memory, parallel/fast_allreduce.py), ``nccl`` (NCCL only) or ``both`` (TP=N measured with each,
one TP=1 baseline). ``--allreduce-sweep`` adds, per size, one all-reduce's device time on each path (50
all-reduces captured in one CUDA graph, median replay / 50). ``--engine-steps K`` adds the engine's own
decode step: an LLMEngine per degree (--decode-batch requests of --engine-prompt tokens), the median of K
pure-decode steps (LLMEngine.step: scheduler, plan broadcast, graph replay, sampling, outputs); what the
engine adds is that minus decode_step_s (use a tiny model: every rank draws a random model whole on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.cli_args import ArgParser
from services.engine.attention import ForwardContext
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_loader import LoadedModel, build_empty_model
from services.engine.model_runner import ModelRunner
from services.engine.parallel.fast_allreduce import forbid_multicast
from services.engine.parallel.group import TPGroup, building, connect, open_store
from services.engine.parallel.worker import rank_device
from services.engine.step_inputs import prepare_rows
from services.engine.weights.random_weights import init_random_
from services.text.model.config import ModelArchConfig
from services.text.model.random_shapes import BYTE_EOS_ID, random_arch
from services.text.model.source import resolve
from services.text.sampling_params import SamplingParams
from services.text.tokenizer import Tokenizer


def _shard_arch(arch: ModelArchConfig, n: int) -> ModelArchConfig:
    """One rank's share of ``arch`` at TP=n as a whole model: heads, KV heads (at least one: replicated
    below n), MLP width and vocabulary divided by n; the hidden size and the layers unchanged."""
    return dataclasses.replace(arch, num_heads=arch.num_heads // n, num_kv_heads=max(1, arch.num_kv_heads // n),
                               intermediate_size=arch.intermediate_size // n, vocab_size=arch.vocab_size // n)


def _runner(args: argparse.Namespace, group, arch: ModelArchConfig | None = None) -> ModelRunner:
    arch = arch or random_arch(resolve(args.model).shape)
    device = rank_device(args.device, group.rank if group else 0)
    # Graphs: one bucket per batch size up to decode_batch; the decode kernel is captured for contexts up to
    # max_model_len, so that is --context (what the eager step reads too); prefill's rotary table is grown apart.
    cfg = EngineConfig(model=args.model, dtype=args.dtype, device=str(device), block_size=16,
                       num_kv_blocks=args.decode_batch * (-(-args.context // 16)) + (-(-args.prefill_tokens // 16)) + 1,
                       cuda_graphs=args.graphs == "on", max_num_seqs=args.decode_batch, max_model_len=args.context,
                       cpu_threads=args.cpu_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with building(group):
        model = build_empty_model(arch, cfg.torch_dtype, device)
    init_random_(model, seed=group.rank if group else 0)
    model.eval().requires_grad_(False)
    model.rotary.ensure(max(args.context, args.prefill_tokens))
    loaded = LoadedModel(model, arch, Tokenizer.byte_level(BYTE_EOS_ID), args.model, arch.max_position_embeddings)
    return ModelRunner(loaded, cfg)


def _time(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _kernel_table(fn, steps: int) -> list[tuple[str, float, int]]:
    """(kernel name, device us per call of ``fn``, launches per call) of ``steps`` calls, most time first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / steps, e.count // steps) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


@torch.inference_mode()
def _measure(args: argparse.Namespace, group, arch: ModelArchConfig | None = None) -> dict[str, float]:
    r = _runner(args, group, arch)
    bs, ctx, b = 16, args.context, args.decode_batch
    per_seq = -(-ctx // bs)
    dec_rows = [([7], ctx - 1, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(b)]
    first = b * per_seq
    pre_rows = [([7] * args.prefill_tokens, 0, list(range(first, first + -(-args.prefill_tokens // bs))))]
    def forward(rows):
        ids, pos, meta = prepare_rows(rows, bs, r.device)
        hidden = r.model(ids, pos, ForwardContext(r.attn_backend, meta))
        return r.model.compute_logits(hidden[-len(rows):])

    decode = lambda: forward(dec_rows)  # noqa: E731
    g = r.graphs
    bucket = g.bucket_for(b, ctx) if g is not None else None
    if g is not None and bucket is not None:
        ids, pos, meta = prepare_rows(dec_rows, bs, torch.device("cpu"))
        host = [t.numpy() for t in (ids, pos, meta.slot_mapping, meta.context_lens, meta.block_tables)]

        def decode():
            g.fill_rows(bucket, *host)
            return g.replay(bucket, b)

    out = {"decode_step_s": _time(decode, r.device, args.warmup, args.iters),
           "prefill_s": _time(lambda: forward(pre_rows), r.device, args.warmup, args.iters),
           "decode_graph_bucket": bucket or 0}
    if group is not None and args.allreduce_sweep and r.device.type == "cuda":
        out["allreduce_us"] = _sweep(group, r.dtype)
    if args.profile_steps and r.device.type == "cuda" and (group is None or group.rank == 0):
        table = _kernel_table(decode, args.profile_steps)
        out["decode_kernels_us"] = [[name[:90], round(us, 1), n] for name, us, n in table[:args.profile_top]]
        out["decode_kernels_total_us"] = round(sum(us for _, us, _ in table), 1)
    r.release()
    return out


SWEEP_BYTES = (8 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20)
SWEEP_REPEAT = 50
"""All-reduces per captured graph in the sweep (one replay: their summed device time)."""


def _sweep(group: TPGroup, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Per size (bytes): one all-reduce's device time in us on NCCL and, where it fits, one-shot."""
    out: dict[str, dict[str, float]] = {}
    fast, dev = group.fast, group.device
    for n in SWEEP_BYTES:
        x = torch.ones(n // torch.finfo(dtype).bits * 8, dtype=dtype, device=dev)
        row = {}
        for path in ("nccl", "oneshot"):
            if path == "oneshot" and (fast is None or not fast.fits(x)):
                continue
            group.fast = fast if path == "oneshot" else None
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            group.all_reduce(x)  # warm (NCCL's first call of a size sets it up)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                for _ in range(SWEEP_REPEAT):
                    group.all_reduce(x)
            row[path] = round(_time(graph.replay, dev, 3, 11) / SWEEP_REPEAT * 1e6, 2)
        group.fast = fast
        out[str(n)] = row
    return out


def _engine_step(args: argparse.Namespace, tp: int, fast: bool) -> float:
    """Median LLMEngine.step of --decode-batch sequences in pure decode at TP=tp (seconds; printed too)."""
    total = args.warmup + args.engine_steps + 2
    cfg = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=16,
                       num_kv_blocks=args.decode_batch * (-(-(args.engine_prompt + total) // 16)) + 8,
                       max_num_seqs=args.decode_batch, max_model_len=args.engine_prompt + total + 16,
                       max_num_batched_tokens=max(2048, args.decode_batch * args.engine_prompt),
                       cuda_graphs=True, tensor_parallel_size=tp, tp_fast_allreduce=fast, cpu_threads=4)
    eng = LLMEngine(cfg)
    try:
        params = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
        for i in range(args.decode_batch):
            eng.add_request(f"r{i}", [(7 * i + j) % 200 + 1 for j in range(args.engine_prompt)], params,
                            detokenize=False)
        times: list[float] = []
        decoding = False
        while len(times) < args.warmup + args.engine_steps:
            t0 = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t0
            if decoding:
                times.append(dt)  # a pure-decode step of the whole batch (every prompt was prefilled before)
            decoding = decoding or len(outs) == args.decode_batch
        step = statistics.median(times[args.warmup:])
        print(json.dumps({"engine_decode_step_s": round(step, 6), "tp": tp, "allreduce": "oneshot" if fast else "nccl",
                          "decode_batch": args.decode_batch, "engine_prompt": args.engine_prompt,
                          "model": args.model}), flush=True)  # before release: stopping the ranks may take a while
        return step
    finally:
        eng.runner.release()


def _rank(rank: int, size: int, port: int, args: argparse.Namespace, fast: bool, results) -> None:
    torch.set_grad_enabled(False)
    group = connect(open_store(size, port), rank, size, rank_device(args.device, rank), fast_allreduce=fast)
    out = _measure(args, group)
    out["oneshot_allreduce"] = group.fast is not None
    if rank == 0:
        results.put(out)


def _tp_run(args: argparse.Namespace, fast: bool) -> dict:
    ctx = mp.get_context("spawn")
    store = open_store(args.tp)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.tp, store.port, args, fast, results), daemon=True)
             for r in range(args.tp)]
    for proc in procs:
        proc.start()
    tp = results.get(timeout=3600)
    for proc in procs:
        proc.join()
    return tp


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="tp_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="the TP degree compared with TP=1")
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="random:tiny-llama", help="a random:NAME shape")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--context", type=int, default=64, help="tokens of KV per decode sequence")
    p.add_argument("--prefill-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="decode in CUDA graphs (CUDA only)")
    p.add_argument("--allreduce", default="oneshot", choices=("oneshot", "nccl", "both"),
                   help="TP=N's all-reduce on CUDA: one-shot for small tensors, NCCL only, or each in turn")
    p.add_argument("--allreduce-sweep", action="store_true", help="per-size all-reduce device times (CUDA)")
    p.add_argument("--engine-steps", type=int, default=0, help="also time K LLMEngine decode steps per degree")
    p.add_argument("--engine-prompt", type=int, default=16, help="prompt tokens of the engine-step requests")
    p.add_argument("--shard-of", type=int, default=0,
                   help="one device, no collectives: TP=1 against one rank's share of the model at TP=N run whole "
                        "(heads, KV heads, MLP width, vocabulary / N): the per-rank compute of TP=N alone")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="CUDA: also profile K decode steps and print their kernels (device us per step)")
    p.add_argument("--profile-top", type=int, default=25, help="kernels listed per profile")
    args = p.parse_args(argv)
    torch.set_num_threads(args.cpu_threads)
    cuda = args.device.startswith("cuda")
    if cuda:
        forbid_multicast()
    base = _measure(args, None)
    print(json.dumps({"tp": 1, **base}), flush=True)
    if args.shard_of:
        if cuda:
            torch.cuda.empty_cache()
        shard = _measure(args, None, _shard_arch(random_arch(resolve(args.model).shape), args.shard_of))
        print(json.dumps({"shard_of": args.shard_of, **shard}), flush=True)
        print(json.dumps({"ratio_shard_over_tp1": {k: round(shard[k] / base[k], 3)
                                                   for k in ("decode_step_s", "prefill_s")},
                          "shard_of": args.shard_of, "graphs": args.graphs, "model": args.model,
                          "device": args.device, "dtype": args.dtype, "decode_batch": args.decode_batch,
                          "context": args.context, "prefill_tokens": args.prefill_tokens}), flush=True)
        return 0
    if cuda:
        torch.cuda.empty_cache()  # TP=1's weights and pool are freed; rank 0 shares cuda:0
    modes = {"oneshot": [True], "nccl": [False], "both": [True, False]}[args.allreduce] if cuda else [False]
    for fast in modes:
        tp = _tp_run(args, fast)
        print(json.dumps({"tp": args.tp, **tp}), flush=True)
        print(json.dumps({"ratio_tp_over_tp1": {k: round(tp[k] / base[k], 3) for k in ("decode_step_s", "prefill_s")},
                          "allreduce": "oneshot" if tp["oneshot_allreduce"] else "nccl", "graphs": args.graphs,
                          "model": args.model, "device": args.device, "dtype": args.dtype,
                          "decode_batch": args.decode_batch, "context": args.context,
                          "prefill_tokens": args.prefill_tokens}), flush=True)
    if args.engine_steps:  # one JSON line per engine
        for tp, fast in [(1, False)] + [(args.tp, fast) for fast in modes]:
            _engine_step(args, tp, fast)
    return 0


if __name__ == "__main__":
    sys.exit(main())
