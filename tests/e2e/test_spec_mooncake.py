"""Speculative decoding across the P/D hop over the mooncake side transport (loopback TCP), real processes.

Cluster: 1 prefill (chunked transfer on, 37-token chunks) x 1 decode speculating with K = 3, both with the
draft ``layers:6``, ``--kv-transport mooncake``: decode registers its target AND draft pools with its transfer
engines and offers both (``DraftPool.mooncake``); the prefill writes both regions of every page straight into
them (region_pools.py); the PushKV stream carries the claim and descriptors only.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch

from services.common.grpc_util import create_channel
from services.common.kv_kinds import pool_id
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.engine.convert import layout_from_pb
from services.engine.kv_layout import Region, region_bytes
from services.engine.kv_transport import mooncake
from services.engine.region_pools import mooncake_region, region_name
from services.engine.shared_kv import SharedKVAttachError
from services.launcher import LocalCluster
from services.text.sampling_params import SamplingParams
from tests.e2e.cluster_util import CHAT_PROMPTS, generate_ids, metric_sum, wait_idle
from tests.e2e.conftest import SMALL_KV
from tests.e2e.test_spec_pd import _status
from tests.e2e.test_spec_shm import DRAFT, MAX_TOKENS

NO_MOONCAKE = mooncake.available()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(NO_MOONCAKE is not None,
                                                  reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")]

SPEC = {"prefill": ["--max-prefill-chunk", "37", *SMALL_KV, *DRAFT], "decode": [*SMALL_KV, *DRAFT, "--spec-tokens", "3"]}
"""K = 3 with the draft layers:6 on both sides, 37-token chunks (the long prompt spans several)."""


@pytest.fixture(scope="module")
def mc_cluster():
    with LocalCluster(prefill=1, decode=1, kv_transport="mooncake", dtype="float32", extra=SPEC, quiet=True) as c:
        yield c


def test_mooncake_greedy_equals_plain_with_both_regions_in_place(mc_cluster, reference_engine):
    prompts = [reference_engine.tokenizer.encode(t) for t in (CHAT_PROMPTS[0], CHAT_PROMPTS[1] * 3)]
    plain = reference_engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    served = [[t for msg in asyncio.run(generate_ids(mc_cluster.router["grpc"], ids, MAX_TOKENS))
               for t in msg.token_ids] for ids in prompts]
    assert served == plain
    prefill, decode = (mc_cluster.get(n).ready["metrics"] for n in ("prefill-0", "decode-0"))
    assert metric_sum(prefill, "pdserve_prefill_kv_transport_fallbacks_total") == 0  # no reason "draft"
    sent = {t: metric_sum(prefill, "pdserve_prefill_kv_chunks_sent_total", transport=t) for t in ("mooncake", "grpc")}
    assert sent["mooncake"] >= 2 and sent["grpc"] == 0, sent  # both regions in place, descriptors only
    assert metric_sum(decode, "pdserve_decode_spec_draft_tokens_total", acceptance="real") > 0
    rep = wait_idle(mc_cluster.get("decode-0").ready["grpc"])
    assert rep.free_blocks == rep.total_blocks


def test_offered_draft_pool_is_checked_against_the_writers_draft(mc_cluster):
    """Decode offers its draft pool on its target pool's engines; a writer whose draft region or cache differs,
    or a draft pool on other sessions, writes nothing (reason "draft", naming both)."""
    addr = mc_cluster.get("decode-0").ready["grpc"]

    async def reserve() -> decode_pb2.ReserveResponse:
        async with create_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            resv = await stub.Reserve(decode_pb2.ReserveRequest(
                request_id="spec-mc-offer", token_ids=list(range(100, 140)), lease_ms=30_000,
                params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)), timeout=30)
            await stub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id), timeout=30)
            return resv

    dest = asyncio.run(reserve()).destination
    assert dest.WhichOneof("pool") == "mooncake" and dest.draft.WhichOneof("pool") == "mooncake"
    assert mooncake.segments_of(dest.draft.mooncake) == mooncake.segments_of(dest.mooncake)
    assert dest.draft.mooncake.base_address != dest.mooncake.base_address
    name, codec = dest.draft.region.rsplit(":", 1)
    assert codec == "fp8-e4m3"
    layers, two, _, bs, kvh, hd = dest.draft.mooncake.shape
    cache = torch.zeros(layers, two, 4, bs, kvh, hd)
    region = Region(name, codec, 0)
    host = dest.mooncake.segment.rsplit(":", 1)[0]
    _, pool = mooncake_region(dest, region, cache, host)
    assert pool.base_address == dest.draft.mooncake.base_address
    fp32 = dataclasses.replace(region, codec="fp32")
    with pytest.raises(SharedKVAttachError) as e:
        mooncake_region(dest, fp32, cache, host)
    assert e.value.reason == "draft" and dest.draft.region in str(e.value) and region_name(fp32) in str(e.value)
    with pytest.raises(SharedKVAttachError, match="draft cache"):
        mooncake_region(dest, region, torch.zeros(layers + 1, two, 4, bs, kvh, hd), host)
    moved = decode_pb2.KVDestination()
    moved.CopyFrom(dest)
    moved.draft.mooncake.segment = f"{host}:1"
    with pytest.raises(SharedKVAttachError, match="transfer engines"):
        mooncake_region(moved, region, cache, host)


def test_mooncake_descriptor_with_another_draft_codec_is_refused(mc_cluster):
    """A mooncake writer's claim on decode's pools is accepted; its descriptor's layout with an fp32 draft region
    instead of fp8-e4m3 is refused (FAILED_PRECONDITION) naming both fingerprints."""
    addr = mc_cluster.get("decode-0").ready["grpc"]

    async def run() -> tuple[grpc.StatusCode, str, str, str]:
        async with create_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            resv = await stub.Reserve(decode_pb2.ReserveRequest(
                request_id="spec-mc-mismatch", token_ids=list(range(60, 100)), lease_ms=30_000,
                params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)), timeout=30)
            ours = layout_from_pb(resv.layout)
            target, draft = ours.regions
            fp32 = region_bytes(6, ours.num_kv_heads, ours.head_dim, ours.block_size, "fp32")
            theirs = dataclasses.replace(ours, regions=(target, dataclasses.replace(draft, codec="fp32",
                                                                                     bytes_per_page=fp32)))
            head = dict(reservation_id=resv.reservation_id, reservation_token=resv.reservation_token,
                        transport="mooncake")
            chunks = [common_pb2.KVChunk(**head, claim=common_pb2.KVClaim(
                          transport="mooncake", dest_block_ids=resv.block_ids, pool_id=pool_id(resv.destination))),
                      common_pb2.KVChunk(**head, chunk_index=0, first_block=0, num_pages=1, token_start=0,
                                         token_end=16, layout_fingerprint=theirs.fingerprint)]
            code, details = await _status(stub.PushKV(_stream(chunks), timeout=30))
            return code, details, ours.fingerprint, theirs.fingerprint

    code, details, ours, theirs = asyncio.run(run())
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert theirs in details and ours in details and "fp8-e4m3" in details


async def _stream(chunks: list[common_pb2.KVChunk]):
    for c in chunks:
        yield c
