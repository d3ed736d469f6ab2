"""Speculative decoding across the P/D hop, with real processes on loopback.

Cluster: 2 prefills (prefill-0 chunked transfer off, prefill-1 on) x 3 decodes speculating with K = 1,
3 and 7, all with the draft ``layers:6`` (SmolLM2's first 6 of 30 layers) whose KV travels as an
fp8-e4m3 page region, and an embedded kvstore. Round-robin over 2 prefills and 3 decodes: six sends of
a prompt visit every (prefill, decode) pair; repeats hit decode's prefix cache and the kvstore.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import zlib

import grpc
import pytest

from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.engine.convert import layout_from_pb
from services.engine.kv_layout import region_bytes
from services.launcher import LocalCluster
from services.text.sampling_params import SamplingParams
from tests.common.test_dashboards import SPEC_PANEL, _exprs, panel_failures
from tests.e2e.cluster_util import CHAT_PROMPTS, generate_ids, metric_sum
from tests.e2e.conftest import SMALL_KV
from tests.prom_harness import PrometheusHarness, require_prometheus

pytestmark = pytest.mark.e2e

DRAFT = ["--draft-model", "layers:6"]
KS = (1, 3, 7)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def spec_cluster():
    extra = {
        "prefill": ["--max-prefill-chunk", "37", *SMALL_KV, *DRAFT],
        "prefill-0": ["--no-chunked-transfer"],
        "decode": [*SMALL_KV, *DRAFT],
        **{f"decode-{i}": ["--spec-tokens", str(k)] for i, k in enumerate(KS)},
        "router": ["--policy", "round_robin", "--lease-ms", "60000"],
    }
    with LocalCluster(prefill=2, decode=3, kvstore="embedded", dtype="float32", extra=extra, quiet=True) as c:
        yield c


async def _generate(router: str, ids: list[int]) -> list[int]:
    """Greedy, ignore-EOS token ids of one router gRPC Generate over prompt token ids."""
    return [t for msg in await generate_ids(router, ids, MAX_TOKENS) for t in msg.token_ids]


def test_disaggregated_greedy_equals_plain_for_every_k(spec_cluster, reference_engine):
    router = spec_cluster.router["grpc"]
    prompts = [CHAT_PROMPTS[0], CHAT_PROMPTS[1] * 3]  # the second spans several 37-token chunks
    for text in prompts:
        ids = reference_engine.tokenizer.encode(text)
        want = reference_engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                               ignore_eos=True))[0]
        for _ in range(6):  # every (prefill, decode) pair once; repeats hit caches
            assert asyncio.run(_generate(router, ids)) == want, text[:30]
    for i, k in enumerate(KS):
        m = spec_cluster.get(f"decode-{i}").ready["metrics"]
        proposed = metric_sum(m, "pdserve_decode_spec_draft_tokens_total", acceptance="real")
        assert proposed > 0, f"decode-{i} (K={k}) never speculated"
        assert metric_sum(m, "pdserve_decode_spec_accepted_tokens_total", acceptance="real") <= proposed
    prefills = [spec_cluster.get(f"prefill-{i}").ready["metrics"] for i in range(2)]
    assert sum(metric_sum(p, "pdserve_prefill_kv_chunks_sent_total") for p in prefills) > 0
    cached = sum(metric_sum(p, "pdserve_prefill_cached_prefix_tokens_total") for p in prefills)
    skipped = sum(metric_sum(p, "pdserve_prefill_kv_skipped_tokens_total") for p in prefills)
    assert cached + skipped > 0  # repeats reused pages (both regions) from a prefix cache


async def _reserve(addr: str, ids: list[int]) -> decode_pb2.ReserveResponse:
    async with create_channel(addr) as ch:
        return await decode_pb2_grpc.DecodeStub(ch).Reserve(decode_pb2.ReserveRequest(
            request_id="spec-mismatch", token_ids=ids, lease_ms=30_000,
            params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)), timeout=30)


async def _status(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_handoff_with_another_draft_codec_is_refused(spec_cluster):
    """A sender whose draft region is fp32 instead of fp8-e4m3: decode refuses its chunk, prefill refuses a
    decode that expects it; both statuses name both fingerprints."""
    decode = spec_cluster.get("decode-1").ready["grpc"]
    prefill = spec_cluster.get("prefill-1").ready["grpc"]
    ids = list(range(100, 140))
    resv = asyncio.run(_reserve(decode, ids))
    ours = layout_from_pb(resv.layout)
    target, draft = ours.regions
    assert draft.codec == "fp8-e4m3" and draft.name.startswith("draft[layers:6 of ")
    fp32_draft = dataclasses.replace(draft, codec="fp32",
                                     bytes_per_page=region_bytes(6, ours.num_kv_heads, ours.head_dim,
                                                                 ours.block_size, "fp32"))
    theirs = dataclasses.replace(ours, regions=(target, fp32_draft))
    assert theirs.fingerprint != ours.fingerprint
    data = bytes(theirs.page_bytes)
    chunk = common_pb2.KVChunk(reservation_id=resv.reservation_id, chunk_index=0, first_block=0, num_pages=1,
                               token_start=0, token_end=16, layout_fingerprint=theirs.fingerprint, payload=data,
                               checksum=zlib.crc32(data), transport="grpc", reservation_token=resv.reservation_token)

    async def push():
        async def gen():
            yield chunk
        async with create_channel(decode) as ch:
            return await _status(decode_pb2_grpc.DecodeStub(ch).PushKV(gen(), timeout=30))

    code, details = asyncio.run(push())
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert theirs.fingerprint in details and ours.fingerprint in details and "fp8-e4m3" in details

    async def prefill_call():
        async with create_channel(prefill) as ch:
            return await _status(prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                request_id="p", token_ids=ids, decode_address=decode, reservation_id="rsv-x",
                reservation_token=bytes(16), params=common_pb2.SamplingParams(max_tokens=4),
                expected_layout_fingerprint=theirs.fingerprint), timeout=60))

    code, details = asyncio.run(prefill_call())
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert theirs.fingerprint in details and ours.fingerprint in details and "draft[layers:6" in details


def test_speculation_dashboard_panel_has_data_from_speculating_decodes(spec_cluster, reference_engine):
    """The dashboards' speculation panel (left out of test_observability's cluster, which does not
    speculate) gives finite numbers from a real Prometheus scraping these decodes."""
    require_prometheus()
    targets = [spec_cluster.get(f"decode-{i}").ready["metrics"] for i in range(len(KS))]
    with PrometheusHarness(targets) as prom:
        prom.wait_for_scrapes(1)
        ids = reference_engine.tokenizer.encode(CHAT_PROMPTS[0])
        for _ in range(len(KS)):  # round-robin: every decode speculates at least once
            asyncio.run(_generate(spec_cluster.router["grpc"], ids))
        time.sleep(4)  # several scrapes after the traffic, so rate() sees the counters grow
        exprs = [(where, expr) for where, expr in _exprs() if f"/ {SPEC_PANEL} /" in where]
        assert exprs, f"no dashboard panel titled {SPEC_PANEL!r}"
        failures = panel_failures(prom, exprs)
    assert not failures, "\n".join(failures)
