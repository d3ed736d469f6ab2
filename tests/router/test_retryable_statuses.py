"""Every internal failure reaches the client as a designed status: one test per row of docs/API.md's
"internal reason -> client status" table.

Two halves: fake prefill/decode peers answer the internal condition and the router's dispatch turns it
into a BackendError code (with a retry-after); that code, through the HTTP API and the gRPC API, is the
HTTP status with Retry-After and the gRPC status with a retryable ErrorDetail. An internal NOT_FOUND
(a reservation that ended) never becomes a 404."""

from __future__ import annotations

import grpc
import pytest

from services.common.grpc_util import Reason, detail_of
from services.common.pb import router_pb2
from services.router.openai_http import backend_api_error
from services.router.pipeline import BackendError
from tests.router.harness import FakeBackend, RouterRPC
from tests.router.test_router_dispatch import cluster_factory, failure, router  # noqa: F401 (fixture)

S = grpc.StatusCode

# (row, which peer fails, its status, its ErrorDetail reason, retryable) -> the client's BackendError code.
ROWS = [
    ("lease_ended", "decode", S.NOT_FOUND, Reason.ERROR_REASON_RESERVATION_GONE, True, "unavailable"),
    ("reservation_gone_not_retryable", "decode", S.NOT_FOUND, Reason.ERROR_REASON_RESERVATION_GONE, False,
     "unavailable"),
    ("kv_stream_refused", "decode", S.ABORTED, Reason.ERROR_REASON_KV_HANDOFF_FAILED, True, "unavailable"),
    ("decode_engine_dead", "decode", S.UNAVAILABLE, Reason.ERROR_REASON_ENGINE_DEAD, True, "unavailable"),
    ("decode_draining", "decode", S.UNAVAILABLE, Reason.ERROR_REASON_DRAINING, True, "unavailable"),
    ("decode_loading_after_restart", "decode", S.UNAVAILABLE, Reason.ERROR_REASON_LOADING, True, "unavailable"),
    ("deadline_inside_the_cluster", "decode", S.DEADLINE_EXCEEDED, Reason.ERROR_REASON_DEADLINE, False,
     "deadline_exceeded"),
    ("prefill_loading_after_restart", "prefill", S.UNAVAILABLE, Reason.ERROR_REASON_LOADING, True, "unavailable"),
    ("prefill_deadline", "prefill", S.DEADLINE_EXCEEDED, Reason.ERROR_REASON_DEADLINE, False, "deadline_exceeded"),
    ("prefill_overloaded", "prefill", S.RESOURCE_EXHAUSTED, Reason.ERROR_REASON_OVERLOADED, True,
     "resource_exhausted"),
]

CLIENT = {  # BackendError code -> (HTTP status, gRPC status)
    "unavailable": (503, S.UNAVAILABLE),
    "deadline_exceeded": (504, S.DEADLINE_EXCEEDED),
    "resource_exhausted": (429, S.RESOURCE_EXHAUSTED),
}


@pytest.mark.parametrize(("row", "side", "code", "reason", "retryable", "want"), ROWS, ids=[r[0] for r in ROWS])
async def test_internal_failure_reaches_the_client_as_designed(cluster_factory, row, side, code, reason,  # noqa: F811
                                                               retryable, want):
    c = await cluster_factory(1, 1)
    peer = c.decode(0) if side == "decode" else c.prefill(0)
    if side == "decode":
        peer.generate_error = (code, reason, retryable)
    else:
        peer.prefill_error = (code, reason, retryable)
    async with router(c, lease_ms=2000) as r:
        err = await failure(r, 4)
    assert err.code == want, (row, err)
    assert err.retry_after_s is None or err.retry_after_s > 0, (row, err)  # None: the API's default wait
    api = backend_api_error(err)
    assert api.status == CLIENT[want][0] and int(api.headers["Retry-After"]) >= 1, (row, api.status, api.headers)


async def grpc_failure(backend: FakeBackend) -> grpc.aio.AioRpcError:
    async with RouterRPC(backend) as rpc:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in rpc.stub.Generate(router_pb2.GenerateRequest(text="hi", model="fake"), timeout=20):
                pass
    return e.value


async def test_backend_gave_the_request_up_is_unavailable_with_retry_after():
    # A decode ends a stream with finish ABORT when the request's reservation ended under it.
    e = await grpc_failure(FakeBackend(finish="abort"))
    assert e.code() == S.UNAVAILABLE and detail_of(e).retryable and detail_of(e).retry_after_ms > 0


@pytest.mark.parametrize("code", sorted(CLIENT))
async def test_each_client_code_on_grpc_is_retryable_with_retry_after(code):
    http_status, grpc_status = CLIENT[code]
    e = await grpc_failure(FakeBackend(error=BackendError(code, f"scripted {code}", retry_after_s=2.0)))
    assert e.code() == grpc_status
    d = detail_of(e)
    assert d.retryable and d.retry_after_ms == 2000, d
    assert backend_api_error(BackendError(code, "x", retry_after_s=2.0)).status == http_status
