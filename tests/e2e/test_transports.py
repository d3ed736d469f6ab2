"""Each CPU KV transport in a real 1P1D cluster (separate processes, the real model): the router's tokens
equal the in-process engine's; the pages went the chosen way (bytes metric by transport, no fallback);
decode is idle with every block free afterwards. mooncake runs over loopback TCP."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.engine.kv_transport import mooncake
from services.launcher import LocalCluster
from tests.e2e.cluster_util import CHAT_PROMPTS, metric_sum, wait_idle
from tests.e2e.test_faults import CHUNK, SLOWDOWN_MS, _completion, _kill_prefill_mid_transfer, _post_async
from tests.e2e.test_pd_cluster import LONG, _chat_ids, _reference, _router_generate

pytestmark = pytest.mark.e2e
NO_MOONCAKE = mooncake.available()



@pytest.mark.parametrize("transport", ["grpc", "shm", pytest.param("mooncake", marks=pytest.mark.skipif(
    NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}"))])
def test_transport_gives_engine_tokens(reference_engine, transport: str) -> None:
    sizes = {"prefill": ["--max-prefill-chunk", "29", "--kv-cache-bytes", str(96 << 20)],
             "decode": ["--kv-cache-bytes", str(96 << 20)]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, dtype="float32", extra=sizes, quiet=True,
                      kv_transport=transport) as c:
        for text in [*CHAT_PROMPTS, LONG]:
            ids = _chat_ids(reference_engine, text)
            got = asyncio.run(_router_generate(c.router["grpc"], ids))
            assert list(got.token_ids) == _reference(reference_engine, ids), text
        pm, dm = c.get("prefill-0").ready["metrics"], c.get("decode-0").ready["metrics"]
        sent = metric_sum(pm, "pdserve_prefill_kv_sent_bytes_total", transport=transport)
        assert sent > 0
        assert metric_sum(pm, "pdserve_prefill_kv_sent_bytes_total") == sent  # nothing went another way
        assert metric_sum(pm, "pdserve_prefill_kv_transport_fallbacks_total") == 0
        assert metric_sum(dm, "pdserve_decode_kv_received_bytes_total", transport=transport) == sent
        rep = wait_idle(c.get("decode-0").ready["grpc"])
        assert rep.free_blocks == rep.total_blocks


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", pytest.param("mooncake", marks=pytest.mark.skipif(
    NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}"))])
def test_prefill_killed_mid_side_transfer_fails_cleanly_and_frees_decode_blocks(transport: str) -> None:
    """kill -9 of the only prefill while it writes pages into decode's pool: the client gets a 503 with a
    JSON error, and decode's blocks (held while the writer's claimed stream was open) are all free again
    within 10 s, sooner than any lease would free them."""
    slow = ["--max-prefill-chunk", str(CHUNK), "--slowdown-ms-per-chunk", str(SLOWDOWN_MS),
            "--kv-cache-bytes", str(96 << 20)]
    # Nothing restarts the killed prefill here: the router waits 3 s for one to come back, not its default 60.
    sizes = {"prefill": slow, "decode": ["--kv-cache-bytes", str(96 << 20)], "router": ["--restart-wait-s", "3"]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, dtype="float32", extra=sizes, quiet=True,
                      kv_transport=transport) as c:
        t0 = time.monotonic()
        thread, out = _post_async(c.router["http"], _completion(c, 8, "Rivers"))
        _kill_prefill_mid_transfer(c, ["prefill-0"])
        thread.join(90)
        assert out.get("status") == 503, out
        assert out["body"].get("error", {}).get("message"), out
        assert time.monotonic() - t0 < 60
        rep = wait_idle(c.get("decode-0").ready["grpc"], timeout=10)
        assert rep.free_blocks == rep.total_blocks and rep.waiting_for_kv == 0, rep
        dm = c.get("decode-0").ready["metrics"]
        assert metric_sum(dm, "pdserve_decode_kv_streams_broken_total") >= 1  # killed while its stream was open
