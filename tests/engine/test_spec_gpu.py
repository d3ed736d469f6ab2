"""Speculative decoding on the GPU with CUDA graphs: greedy output identical to plain decoding (whose
decode steps replay their own graphs), and the speculative steps replay the captured step. fp32 weights,
so the verify kernel (K+1 query rows) and the plain decode kernel agree on every argmax. Skips cleanly
without CUDA."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_loader import LoadedModel, load_model
from services.text.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPEC = "random:smollm2-135m"
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(SPEC, torch.float32, "cuda:0")


def _engine(loaded: LoadedModel, k: int, synthetic: float = 0.0) -> LLMEngine:
    cfg = EngineConfig(model=SPEC, dtype="float32", device="cuda:0", num_kv_blocks=256, max_num_seqs=8,
                       max_model_len=512, max_num_batched_tokens=512, max_prefill_chunk=64,
                       draft_model="layers:6" if k else "", spec_tokens=k, spec_synthetic_acceptance=synthetic)
    return LLMEngine(cfg, loaded=loaded)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (130, 17, 64, 5, 90)]


def _count_replays(eng: LLMEngine) -> list[int]:
    graphs = eng.runner.spec.graphs
    assert graphs is not None and graphs.graphs
    calls = [0]
    run = graphs.run

    def counted(bucket, steps):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return run(bucket, steps)

    graphs.run = counted  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("k", [1, 3, 7])
def test_spec_graphs_greedy_equal_plain_graphs(loaded: LoadedModel, k: int) -> None:
    prompts = _prompts(loaded.arch.vocab_size)
    plain = _engine(loaded, 0)
    assert plain.runner.graphs is not None
    want = plain.generate(prompts, GREEDY)
    eng = _engine(loaded, k)
    calls = _count_replays(eng)
    assert eng.generate(prompts, GREEDY) == want
    st = eng.runner.spec.stats
    assert calls[0] > 0 and st.steps > 0 and st.proposed > 0
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks


def test_spec_graphs_synthetic_acceptance(loaded: LoadedModel) -> None:
    eng = _engine(loaded, 7, synthetic=3.0)
    calls = _count_replays(eng)
    out = eng.generate(_prompts(loaded.arch.vocab_size), GREEDY)
    assert [len(o) for o in out] == [GREEDY.max_tokens] * 5
    st = eng.runner.spec.stats
    assert calls[0] > 0 and st.synthetic
    assert st.accept_hist[3] >= st.steps - 5 * 3  # 3 per row but rows capped near max_tokens


def _ipc_config(k: int, shared: bool) -> EngineConfig:
    return EngineConfig(model=SPEC, dtype="float32", device="cuda:0", num_kv_blocks=16, max_num_seqs=2,
                        max_model_len=64, cuda_graphs=False, draft_model="layers:6", spec_tokens=k,
                        kv_cache_shared=shared)


def _decode_side(dest_q, done_q, result_q) -> None:
    """Another process: a speculating decode whose target and draft pools are exported over CUDA IPC;
    reports blocks 5, 6, 2 of both pools once the prefill wrote them."""
    from services.engine.kv_pages import pages_of
    from services.kv.offer import offered_pool

    eng = LLMEngine(_ipc_config(3, True))
    dest = offered_pool(pages_of(eng), "")
    dest_q.put(b"" if dest is None else dest.SerializeToString())
    done_q.get(timeout=120)
    r = eng.runner
    result_q.put((r.kv_cache[:, :, [5, 6, 2]].cpu().tolist(), r.spec.kv_cache[:, :, [5, 6, 2]].cpu().tolist()))


def test_cuda_ipc_writes_both_regions_into_a_decode_in_another_process() -> None:
    import torch.multiprocessing as mp

    from services.common.kv_kinds import pool_id
    from services.common.pb import decode_pb2
    from services.engine.kv_pages import pages_of
    from services.engine.kv_transport.base import KVPoll
    from services.engine.region_pools import region_writer
    from services.engine.shared_kv import SharedKVPools

    class _Open:
        @staticmethod
        def poll() -> KVPoll:
            return KVPoll.TRANSFERRING

    ctx = mp.get_context("spawn")
    dest_q, done_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_decode_side, args=(dest_q, done_q, result_q), daemon=True)
    proc.start()
    try:
        raw = dest_q.get(timeout=300)
        assert raw, "the decode offered no pool"
        dest = decode_pb2.KVDestination.FromString(raw)
        assert dest.HasField("cuda_ipc") and dest.draft.HasField("cuda_ipc")
        prefill = LLMEngine(_ipc_config(0, False))
        src, draft_src = prefill.runner.kv_cache, prefill.runner.spec.kv_cache
        src.normal_()
        draft_src.normal_()
        pools = SharedKVPools()
        writer = region_writer(pools, dest, pages_of(prefill).region_pools, "cuda-ipc", pool_id(dest), src, pools.attach(dest),
                              [5, 6, 2])
        writer.sender = _Open()  # type: ignore[assignment]
        writer.write(0, [1, 2])
        writer.write(2, [4])
        done_q.put(True)
        target, draft = result_q.get(timeout=120)
        assert torch.equal(torch.tensor(target), src[:, :, [1, 2, 4]].cpu())
        assert torch.equal(torch.tensor(draft), draft_src[:, :, [1, 2, 4]].cpu())
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
