"""Speculative decoding across the P/D hop over the shm side transport, with real processes on loopback.

Cluster: 1 prefill (chunked transfer on, 37-token chunks) x 1 decode speculating with K = 3, both with the
draft ``layers:6``, ``--kv-transport shm``: decode offers its target AND draft pools, the prefill writes
both regions of every page straight into them (region_pools.py); the PushKV stream carries descriptors.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from services.common.grpc_util import create_channel
from services.common.kv_kinds import pool_id
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.engine.convert import layout_from_pb
from services.engine.kv_layout import region_bytes
from services.launcher import LocalCluster
from services.text.sampling_params import SamplingParams
from tests.e2e.cluster_util import CHAT_PROMPTS, generate_ids, metric_sum
from tests.e2e.conftest import SMALL_KV
from tests.e2e.test_spec_pd import _status

pytestmark = pytest.mark.e2e

DRAFT = ["--draft-model", "layers:6"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def shm_cluster():
    extra = {
        "prefill": ["--max-prefill-chunk", "37", *SMALL_KV, *DRAFT],
        "decode": [*SMALL_KV, *DRAFT, "--spec-tokens", "3"],
    }
    with LocalCluster(prefill=1, decode=1, kv_transport="shm", dtype="float32", extra=extra, quiet=True) as c:
        yield c


def test_shm_greedy_equals_plain_with_both_regions_in_place(shm_cluster, reference_engine):
    router = shm_cluster.router["grpc"]
    for text in (CHAT_PROMPTS[0], CHAT_PROMPTS[1] * 3):  # the second spans several 37-token chunks
        ids = reference_engine.tokenizer.encode(text)
        want = reference_engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                               ignore_eos=True))[0]
        got = [t for msg in asyncio.run(generate_ids(router, ids, MAX_TOKENS)) for t in msg.token_ids]
        assert got == want, text[:30]
    prefill = shm_cluster.get("prefill-0").ready["metrics"]
    decode = shm_cluster.get("decode-0").ready["metrics"]
    assert metric_sum(prefill, "pdserve_prefill_kv_transport_fallbacks_total") == 0
    assert metric_sum(prefill, "pdserve_prefill_kv_chunks_sent_total", transport="shm") >= 2  # in place
    assert metric_sum(prefill, "pdserve_prefill_kv_chunks_sent_total", transport="grpc") == 0
    assert metric_sum(decode, "pdserve_decode_spec_draft_tokens_total", acceptance="real") > 0


def test_side_transport_descriptor_with_another_draft_codec_is_refused(shm_cluster):
    """A writer that claims the reservation's blocks in decode's shm pool (claim accepted), then sends a
    descriptor whose layout has an fp32 draft region instead of fp8-e4m3: FAILED_PRECONDITION naming both."""
    addr = shm_cluster.get("decode-0").ready["grpc"]
    ids = list(range(100, 140))

    async def run() -> tuple[grpc.StatusCode, str, str, str]:
        async with create_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            resv = await stub.Reserve(decode_pb2.ReserveRequest(
                request_id="spec-shm-mismatch", token_ids=ids, lease_ms=30_000,
                params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)), timeout=30)
            assert resv.destination.HasField("draft") and resv.destination.draft.region.endswith(":fp8-e4m3")
            ours = layout_from_pb(resv.layout)
            target, draft = ours.regions
            theirs = dataclasses.replace(ours, regions=(target, dataclasses.replace(
                draft, codec="fp32", bytes_per_page=region_bytes(6, ours.num_kv_heads, ours.head_dim,
                                                                 ours.block_size, "fp32"))))
            claim = common_pb2.KVChunk(
                reservation_id=resv.reservation_id, reservation_token=resv.reservation_token, transport="shm",
                claim=common_pb2.KVClaim(transport="shm", dest_block_ids=resv.block_ids,
                                         pool_id=pool_id(resv.destination)))
            chunk = common_pb2.KVChunk(reservation_id=resv.reservation_id, chunk_index=0, first_block=0,
                                       num_pages=1, token_start=0, token_end=16,
                                       layout_fingerprint=theirs.fingerprint, transport="shm",
                                       reservation_token=resv.reservation_token)

            async def gen():
                yield claim
                yield chunk

            code, details = await _status(stub.PushKV(gen(), timeout=30))
            return code, details, ours.fingerprint, theirs.fingerprint

    code, details, ours, theirs = asyncio.run(run())
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert theirs in details and ours in details and "fp8-e4m3" in details
