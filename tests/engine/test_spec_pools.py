"""The draft region over the shm side transport, in one process: decode shares its target AND draft pools,
a prefill engine writes both regions of its pages straight into the reserved blocks (region_pools.py), and
decode then speculates: greedy output equals plain decoding. A writer whose draft region differs (another
codec) or a decode without a draft pool is refused before anything is written."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.kv_kinds import pool_id
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_pages import pages_of
from services.engine.kv_transport.base import KVPoll
from services.engine.region_pools import RegionPoolWriter, region_name, region_writer
from services.engine.scheduler import ScheduledChunk
from services.engine.shared_kv import SharedKVAttachError, SharedKVPools
from services.kv.offer import offered_pool
from services.text.sampling_params import SamplingParams

TINY = "random:tiny-llama"
BS = 4
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)


class _Open:
    """The request's KV stream as the writer polls it: open."""

    @staticmethod
    def poll() -> KVPoll:
        return KVPoll.TRANSFERRING


def _engine(k: int, draft: str = "layers:1", **kw: object) -> LLMEngine:
    cfg = dict(model=TINY, dtype="float32", num_kv_blocks=64, block_size=BS, max_prefill_chunk=8)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg, draft_model=draft, spec_tokens=k))  # type: ignore[arg-type]


@pytest.fixture()
def decode():
    eng = _engine(3, kv_cache_shared=True)
    yield eng
    eng.runner.release()
    eng.runner.spec.release()


def _handoff_in_place(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], rid: str) -> list[int]:
    """Prefill computes the prompt chunk by chunk; each chunk's pages (both regions) are written into
    decode's reserved blocks through the offered pools as the chunk completes (chunked transfer)."""
    dest = offered_pool(pages_of(decode), "")
    assert dest is not None and dest.HasField("draft")
    seq, cached = decode.add_kv_import(rid, prompt, GREEDY, detokenize=False)
    pools = SharedKVPools()
    writer = region_writer(pools, dest, pages_of(prefill).region_pools, "shm", pool_id(dest), prefill.runner.kv_cache,
                          pools.attach(dest), list(seq.block_table))
    assert isinstance(writer, RegionPoolWriter)
    writer.sender = _Open()  # type: ignore[assignment]
    sent = [cached]
    first: list[int] = []

    def listener(ch: ScheduledChunk, sampled) -> None:
        full = (ch.seq.num_computed_tokens + ch.num_new_tokens) // BS
        limit = -(-len(ch.seq.token_ids) // BS) if ch.sample else full
        if limit > sent[0]:
            src = ch.seq.block_table[sent[0]:limit]
            writer.write(sent[0], src)
            dst = seq.block_table[sent[0]:limit]
            for ours, theirs in ((decode.runner.spec.kv_cache, prefill.runner.spec.kv_cache),
                                 (decode.runner.kv_cache, prefill.runner.kv_cache)):
                assert torch.equal(ours[:, :, dst], theirs[:, :, src])  # both regions landed, bit for bit
            sent[0] = limit
        if ch.sample:
            first.append(sampled.token)

    prefill.chunk_listeners.append(listener)
    prefill.add_request(rid, prompt, dataclasses.replace(GREEDY, max_tokens=1), detokenize=False)
    while prefill.has_work():
        prefill.step()
    prefill.chunk_listeners.remove(listener)
    out = list(decode.kv_import_done(rid, first[0], None)[0].new_token_ids)
    while decode.has_work():
        for o in decode.step():
            out.extend(o.new_token_ids)
    return out


def test_shm_writes_both_regions_greedy_equals_plain(decode: LLMEngine) -> None:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 255, (n,), generator=g).tolist() for n in (23, 9)]
    want = _engine(0, "").generate(prompts, GREEDY)
    prefill = _engine(0)
    assert prefill.layout.fingerprint == decode.layout.fingerprint
    dest = offered_pool(pages_of(decode), "")
    assert dest is not None and dest.draft.region == region_name(decode.runner.spec.region())
    for i, p in enumerate(prompts):
        assert _handoff_in_place(prefill, decode, p, f"r{i}") == want[i]
    assert _handoff_in_place(prefill, decode, prompts[0], "again") == want[0]  # decode's prefix cache hit
    assert decode.block_manager.num_prefix_hit_tokens > 0
    assert decode.runner.spec.stats.steps > 0


def test_writer_with_another_draft_codec_is_refused(decode: LLMEngine) -> None:
    dest = offered_pool(pages_of(decode), "")
    assert dest is not None
    other = _engine(0, draft_kv_codec="native")  # decode's draft region is fp8-e4m3
    assert other.layout.fingerprint != decode.layout.fingerprint
    pools = SharedKVPools()
    with pytest.raises(SharedKVAttachError) as e:
        region_writer(pools, dest, pages_of(other).region_pools, "shm", pool_id(dest), other.runner.kv_cache,
                     pools.attach(dest), [0, 1])
    msg = str(e.value)
    assert e.value.reason == "draft" and ":fp8-e4m3" in msg and ":fp32" in msg


def test_decode_without_a_shared_draft_pool_offers_none() -> None:
    eng = _engine(3, kv_cache_shared=True)
    try:
        assert offered_pool(pages_of(eng), "") is not None
        eng.runner.spec.release()  # the draft pool is no longer shared: a plain target pool would be refused
        eng.runner.kv_destination.ClearField("draft")
        assert offered_pool(pages_of(eng), "") is None
        pools = SharedKVPools()
        dest = eng.runner.kv_destination
        with pytest.raises(SharedKVAttachError, match="no draft pool"):
            region_writer(pools, dest, pages_of(eng).region_pools, "shm", pool_id(dest), eng.runner.kv_cache,
                         pools.attach(dest), [0])
    finally:
        eng.runner.release()
