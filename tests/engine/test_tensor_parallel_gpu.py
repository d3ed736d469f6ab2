"""Tensor parallelism on two GPUs (NCCL, rank r on cuda:r) against TP=1 on the same random weights, bf16,
with the decode CUDA graphs on and off (small all-reduces one-shot over symmetric memory); the one-shot
all-reduce against NCCL's in and out of graph capture; an engine on cuda:1; cuda-ipc from a cache on cuda:0
into a pool exported on cuda:1 by another process. Skips cleanly without two CUDA GPUs."""

from __future__ import annotations

import queue
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_transport.base import KVPoll
from services.engine.model_loader import LoadedModel, build_empty_model, load_model
from services.engine.parallel import fast_allreduce
from services.engine.sampler import Sampled
from services.text.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

SPEC = "random:tiny-qwen3"
STEPS = 12
PROMPT_LENS = (9, 40, 23)
"""Distinct lengths: a sequence is known by its prompt length in the traces. 3 rows replay in bucket 4."""
REL_TOL = 2e-2
"""Relative L2 of TP=2 logits against TP=1's, bf16: the row-parallel partial sums and the all-reduce add the
same products in another order (the GPU engine's own graph-vs-eager check allows 1e-2 on one GPU)."""

Trace = dict[int, list[torch.Tensor]]


def _cfg(tp: int, graphs: bool, device: str = "cuda") -> EngineConfig:
    return EngineConfig(model=SPEC, dtype="bfloat16", device=device, block_size=16, num_kv_blocks=64,
                        max_num_seqs=8, max_model_len=256, max_prefill_chunk=16, cuda_graphs=graphs,
                        tensor_parallel_size=tp, tp_fast_allreduce=True)


def _tp1(device: str, graphs: bool) -> LLMEngine:
    """TP=1 on ``device`` with the weights TP=2 shards (random models are drawn whole on the CPU there)."""
    cpu = load_model(SPEC, torch.bfloat16, "cpu")
    model = build_empty_model(cpu.arch, torch.bfloat16, device)
    model.load_state_dict(cpu.model.state_dict())
    model.eval().requires_grad_(False)
    loaded = LoadedModel(model, cpu.arch, cpu.tokenizer, cpu.model_id, cpu.max_model_len)
    return LLMEngine(_cfg(1, graphs, device), loaded=loaded)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(eng: LLMEngine, forced: dict[int, list[int]] | None = None) -> tuple[dict[int, list[int]], Trace, list[int]]:
    """Greedy STEPS tokens of every prompt in one batch: (tokens, fp32 logits of every sampled step, graph
    buckets replayed), by prompt length. With ``forced``, each step emits the forced token (teacher forcing)."""
    runner = eng.runner
    sample, trace, buckets = runner._sample_gpu, {}, []

    def hook(logits, greedy, rows, seq_ids):
        out = sample(logits, greedy, rows, seq_ids)
        for i, sid in enumerate(seq_ids):
            key = eng._by_seq[sid].seq.num_prompt_tokens
            trace.setdefault(key, []).append(logits[i].float().cpu())
            if forced is not None:
                out[sid] = Sampled(forced[key][len(trace[key]) - 1])
        return out

    runner._sample_gpu = hook
    if runner.graphs is not None:
        replay = runner.graphs.replay
        runner.graphs.replay = lambda bucket, b: (buckets.append(bucket), replay(bucket, b))[1]
    try:
        outs = eng.generate(_prompts(), SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    finally:
        del runner._sample_gpu
        if runner.graphs is not None:
            del runner.graphs.replay
    return {len(p): o for p, o in zip(_prompts(), outs, strict=True)}, trace, buckets


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x, y = torch.stack(a), torch.stack(b)
    return float((x - y).norm() / y.norm())


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_tp2_on_two_gpus_matches_tp1(graphs: bool) -> None:
    tp1 = _tp1("cuda:0", graphs)
    want, ref, buckets1 = _run(tp1)
    first_group = fast_allreduce._rendezvoused == 0  # this process builds its first symmetric-memory group
    tp2 = LLMEngine(_cfg(2, graphs))
    try:
        assert (tp2.runner.graphs is not None) == graphs
        assert tp2.runner.kv_cache.device == torch.device("cuda:0") and tp2.runner.kv_cache.shape[-2] == 1
        _, got, buckets2 = _run(tp2, forced=want)  # the same token history as TP=1
        for n in PROMPT_LENS:
            assert len(got[n]) == len(ref[n]) == STEPS
            prefill, decode = _rel(got[n][:1], ref[n][:1]), _rel(got[n][1:], ref[n][1:])
            assert prefill < REL_TOL and decode < REL_TOL, (n, prefill, decode)
        if graphs:  # every pure-decode step replayed, in the same buckets on both degrees (3 rows: bucket 4)
            assert 4 in buckets2 and buckets2 == buckets1, (buckets1, buckets2)
        tokens, _, _ = _run(tp2)
        for n in PROMPT_LENS:  # equal, or first differ where TP=1's top two logits tie within bf16 noise
            k = next((i for i, (a, b) in enumerate(zip(tokens[n], want[n], strict=True)) if a != b), None)
            if k is not None:
                top2 = ref[n][k].topk(2).values
                noise = float((got[n][k] - ref[n][k]).abs().max())
                assert float(top2[0] - top2[1]) <= 2 * noise, (n, k, tokens[n], want[n])
        # Last, so a setup that fell back to NCCL still shows whether TP=2 matched: two GPUs over NVLink
        # (P2P-reachable) take the one-shot path for these small all-reduces, in and out of the graphs. A second
        # group in this process beside fresh rank processes is refused (torch numbers its handle exchange per
        # process, fast_allreduce._rendezvoused): NCCL, at once, instead of a hang in the rendezvous.
        fast = tp2.runner.group.fast is not None
        assert fast == first_group, ("the one-shot all-reduce fell back to NCCL (see the log)" if first_group else
                                     "a second group in one process took the one-shot path")
    finally:
        tp2.runner.release()


ALLREDUCE_SHAPES = ((3, 64), (64, 4096), (256, 4096), (1024, 4096))
"""Rows x hidden: a 3-row tiny step, a batch-64 and batch-256 Llama-3-8B decode step (512 KiB, 2 MiB), and
8 MiB (above ONE_SHOT_MAX_BYTES: NCCL even with the fast path on)."""


RANK_LIMIT_S = 150
"""A rank still running after this long dumps every thread's stack to stderr and exits (the test then names it),
instead of spinning unseen; its own setup steps give up after fast_allreduce.SETUP_TIMEOUT_S each."""


def _allreduce_rank(rank: int, port: int, results) -> None:
    """One rank: (rank, one-shot on, rows, error): per case (shape, dtype, took one-shot, max |eager - NCCL|,
    max |graph replay - NCCL|, max |NCCL|); error: the traceback of a failure (the test shows it)."""
    import faulthandler

    faulthandler.dump_traceback_later(RANK_LIMIT_S, exit=True)
    try:
        _allreduce_cases(rank, port, results)
    except BaseException:
        import traceback

        results.put((rank, False, [], traceback.format_exc()))
        raise


def _allreduce_cases(rank: int, port: int, results) -> None:
    from services.engine.parallel.group import connect, open_store

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    group = connect(open_store(2, port), rank, 2, dev)
    print(f"rank {rank}: connected, one-shot {'on' if group.fast is not None else 'off'}", file=sys.stderr,
          flush=True)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ALLREDUCE_SHAPES:
            g = torch.Generator(device=dev).manual_seed(100 * rank + shape[0])
            x = torch.randn(shape, generator=g, device=dev).to(dtype)
            want = x.clone()
            group.pg.allreduce([want]).wait()
            fits = group.fast is not None and group.fast.fits(x)
            eager = group.all_reduce(x.clone())
            static = torch.zeros_like(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
                out = group.all_reduce(static)
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            rows.append((shape, str(dtype), fits, float((eager - want).abs().max()), float((out - want).abs().max()),
                         float(want.abs().max())))
    results.put((rank, group.fast is not None, rows, ""))


def test_oneshot_allreduce_equals_nccl_in_and_out_of_graphs() -> None:
    from services.engine.parallel.fast_allreduce import ONE_SHOT_MAX_BYTES
    from services.engine.parallel.group import open_store

    ctx = mp.get_context("spawn")
    store = open_store(2)
    results = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, store.port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + RANK_LIMIT_S + 30
        while len(got) < len(procs):  # a failed rank reports at once; its peer may be left waiting on it
            try:
                r, on, rows, err = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(len(procs))) - set(got))
                pytest.fail(f"ranks {missing} gave no result within {RANK_LIMIT_S + 30} s (exit codes "
                            f"{[procs[m].exitcode for m in missing]}; a hung rank dumps its stacks to stderr)")
            got[r] = (on, rows, err)
            if err:
                break
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    for rank, (on, rows, err) in got.items():
        assert not err, f"rank {rank} failed:\n{err}"
        assert on, f"rank {rank}: no one-shot all-reduce between two NVLink GPUs"
        for shape, dtype, fits, eager_err, graph_err, scale in rows:
            nbytes = shape[0] * shape[1] * (2 if "bfloat16" in dtype else 4)
            assert fits == (nbytes <= ONE_SHOT_MAX_BYTES), (rank, shape, dtype, fits)
            tol = 1e-2 * scale if "bfloat16" in dtype else 1e-5 * scale  # a + b, rounded once either way
            assert eager_err <= tol and graph_err <= tol, (rank, shape, dtype, eager_err, graph_err, scale)


def test_an_engine_on_cuda1_decodes_like_cuda0() -> None:
    """Every thread that launches kernels enters the engine's device (the step thread starts on cuda:0)."""
    a, b = _tp1("cuda:0", True), _tp1("cuda:1", True)
    assert b.runner.kv_cache.device == torch.device("cuda:1")
    tokens_a, trace_a, _ = _run(a)
    _, trace_b, buckets = _run(b, forced=tokens_a)
    assert buckets and all(_rel(trace_b[n], trace_a[n]) < 1e-3 for n in PROMPT_LENS)


def _decode_side(dest_q, done_q, result_q) -> None:
    """Another process: a pool on cuda:1 exported over CUDA IPC; reports the blocks the prefill wrote."""
    from services.engine.shared_kv import export_cuda_kv

    torch.cuda.set_device(1)
    pool = torch.zeros((2, 2, 8, 4, 2, 16), dtype=torch.bfloat16, device="cuda:1")
    dest_q.put(export_cuda_kv(pool).SerializeToString())
    done_q.get(timeout=120)
    result_q.put(pool[:, :, [5, 6, 2]].float().cpu().tolist())  # plain data: this process may exit first


class _Open:
    """A request's KV stream that stays open (the writer polls it before every write)."""

    @staticmethod
    def poll() -> KVPoll:
        return KVPoll.TRANSFERRING


def test_cuda_ipc_writes_from_cuda0_into_a_pool_exported_on_cuda1() -> None:
    from services.common.kv_kinds import pool_id
    from services.common.pb import decode_pb2
    from services.engine.kv_transport.shared_pool import SharedPoolWriter
    from services.engine.shared_kv import open_cuda_pool

    ctx = mp.get_context("spawn")
    dest_q, done_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_decode_side, args=(dest_q, done_q, result_q), daemon=True)
    proc.start()
    try:
        dest = decode_pb2.KVDestination.FromString(dest_q.get(timeout=120))
        assert dest.cuda_ipc.device == 1
        pool = open_cuda_pool(dest.cuda_ipc)
        assert pool.device == torch.device("cuda:1")
        src = torch.randn((2, 2, 6, 4, 2, 16), device="cuda:0").to(torch.bfloat16)
        writer = SharedPoolWriter("cuda-ipc", pool_id(dest), src, pool, [5, 6, 2])
        writer.sender = _Open()  # type: ignore[assignment]
        writer.write(0, [1, 2])  # a run of two consecutive blocks, then one more
        writer.write(2, [4])
        done_q.put(True)
        landed = torch.tensor(result_q.get(timeout=120))
        assert torch.equal(landed, src[:, :, [1, 2, 4]].float().cpu())
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
