"""Fake decode / prefill / colocated-worker servers for router tests, on real grpc.aio servers (127.0.0.1:0).

A toy "model" makes token sequences checkable: the next token is a function of the whole sequence so
far (:func:`next_token`), so a stream migrated with prompt + emitted tokens continues exactly where
an uninterrupted one would. ``die_*`` knobs stop a server abruptly (no trailing ErrorDetail), the way
a kill -9 looks to the router.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import grpc_util
from services.common.grpc_util import Reason, error_detail
from services.common.pb import (
    common_pb2,
    common_pb2_grpc,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

BLOCK = 16
FINGERPRINT = "fp-test"


def next_token(seq: list[int]) -> int:
    return (seq[-1] * 7 + len(seq) * 13 + 5) % 997


def reference(prompt: list[int], n: int) -> list[int]:
    """What an uninterrupted greedy run of ``n`` tokens gives."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.status = health_pb2.HealthCheckResponse.SERVING
        self.delay_s = 0.0
        self.checks = 0

    async def Check(self, request, context):
        self.checks += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=self.status)


class Admin(common_pb2_grpc.AdminServicer):
    def __init__(self) -> None:
        self.load = common_pb2.LoadReport(total_blocks=100, free_blocks=100)

    async def GetLoad(self, request, context):
        return self.load


@dataclass
class Peer:
    """One fake server: its address and the servicers behind it."""

    server: grpc.aio.Server
    address: str
    health: Health
    admin: Admin
    dead: bool = False

    async def die(self) -> None:
        """Stop at once, cancelling every call (a killed process, as the router sees it)."""
        if not self.dead:
            self.dead = True
            await self.server.stop(None)


async def serve(add: list[tuple[object, object]], port: int = 0) -> Peer:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health, admin = Health(), Admin()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    common_pb2_grpc.add_AdminServicer_to_server(admin, server)
    for adder, servicer in add:
        adder(servicer, server)  # type: ignore[operator]
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return Peer(server, f"127.0.0.1:{port}", health, admin)


async def _refuse_if_full(context, side: str, retry_after_ms: int | None) -> None:
    """Answer RESOURCE_EXHAUSTED (OVERLOADED, retryable, with ``retry_after_ms``) when that is set."""
    if retry_after_ms is not None:
        await grpc_util.abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{side} is full",
                              error_detail(Reason.ERROR_REASON_OVERLOADED, retryable=True, side=side,
                                           retry_after_ms=retry_after_ms))


@dataclass(eq=False)
class Reservation:
    rid: str
    token: bytes
    prompt: list[int]
    max_tokens: int
    landed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """Reserve/Generate/RenewLease/Abort; a fake prefill lands KV with :meth:`land`. Also serves
    colocated Generate (prompt in the request)."""

    _ids = itertools.count()

    def __init__(self) -> None:
        self.peer: Peer | None = None
        self.reservations: dict[str, Reservation] = {}
        self.reserves: list[decode_pb2.ReserveRequest] = []
        self.renewals: list[decode_pb2.RenewLeaseRequest] = []
        self.aborts: list[str] = []
        self.colocated: list[decode_pb2.DecodeGenerateRequest] = []
        self.cancels: list[int] = []
        """Keys cancelled on a Stream while their request ran."""
        self.full_retry_after_ms: int | None = None
        """Set: Reserve (and colocated Generate) answer RESOURCE_EXHAUSTED/OVERLOADED with this retry-after."""
        self.die_after_tokens: int | None = None
        """Set: the server dies once a stream has sent this many tokens."""
        self.finish_abort_after: int | None = None
        """Set: the stream ends with FINISH_REASON_ABORT after this many tokens (a lease ran out)."""
        self.token_delay_s = 0.005
        self.reserve_delay_s = 0.0
        """Time Reserve takes before it answers (seconds)."""
        self.generate_error: tuple[grpc.StatusCode, int, bool] | None = None
        """Set: Generate fails at once with (status, ErrorDetail reason, retryable), as a real decode does
        when the reservation's lease ran out, its engine died, ..."""

    async def Reserve(self, request, context):
        self.reserves.append(request)
        await asyncio.sleep(self.reserve_delay_s)
        await _refuse_if_full(context, "decode", self.full_retry_after_ms)
        r = Reservation(f"rsv-{next(self._ids)}", b"token-%d" % len(self.reserves), list(request.token_ids),
                        request.params.max_tokens)
        self.reservations[r.rid] = r
        return decode_pb2.ReserveResponse(
            reservation_id=r.rid, reservation_token=r.token, num_cached_blocks=0, block_size=BLOCK,
            layout=common_pb2.PageLayout(fingerprint=FINGERPRINT, block_size=BLOCK), block_ids=[1, 2, 3],
            accepted_wire_fingerprints=["fp-wire"], lease_expires_unix=time.time() + request.lease_ms / 1000)

    def land(self, rid: str, first: int) -> bool:
        r = self.reservations.get(rid)
        if r is None or r.landed.done():
            return False
        r.landed.set_result(first)
        return True

    async def RenewLease(self, request, context):
        self.renewals.append(request)
        if request.reservation_id not in self.reservations:
            await grpc_util.abort(context, grpc.StatusCode.NOT_FOUND, "no such reservation",
                                  error_detail(Reason.ERROR_REASON_RESERVATION_GONE))
        return decode_pb2.RenewLeaseResponse(lease_expires_unix=time.time() + request.lease_ms / 1000)

    async def Abort(self, request, context):
        self.aborts.append(request.request_id)
        return common_pb2.AbortResponse(found=self.reservations.pop(request.request_id, None) is not None)

    async def Stream(self, request_iterator, context) -> AsyncIterator[decode_pb2.StreamStep]:
        async for step in _stream(self, request_iterator, context):
            yield step

    async def Generate(self, request, context) -> AsyncIterator[common_pb2.GenerateResponse]:
        if self.generate_error is not None:
            code, reason, retryable = self.generate_error
            await grpc_util.abort(context, code, f"scripted {code.name}",
                                  error_detail(reason, retryable=retryable, side="decode"))
        if request.reservation_id:
            r = self.reservations.get(request.reservation_id)
            if r is None:
                await grpc_util.abort(context, grpc.StatusCode.NOT_FOUND, "no such reservation",
                                      error_detail(Reason.ERROR_REASON_RESERVATION_GONE))
            first = await r.landed
            prompt, max_tokens = r.prompt, r.max_tokens
        else:
            self.colocated.append(request)
            if self.full_retry_after_ms is not None:
                await grpc_util.abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "worker is full",
                                      error_detail(Reason.ERROR_REASON_OVERLOADED, retryable=True,
                                                   retry_after_ms=self.full_retry_after_ms))
            prompt, max_tokens = list(request.token_ids), request.params.max_tokens
            first = next_token(prompt)
        seq = [*prompt, first]
        for i in range(max_tokens):
            if self.die_after_tokens is not None and i == self.die_after_tokens:
                assert self.peer is not None
                await self.peer.die()
                await asyncio.sleep(3600)
            tok = seq[-1] if i == 0 else next_token(seq)
            if i:
                seq.append(tok)
            if self.finish_abort_after is not None and i == self.finish_abort_after:
                yield common_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_ABORT)
                return
            msg = common_pb2.GenerateResponse(token_ids=[tok])
            if i == max_tokens - 1:
                msg.finish_reason = common_pb2.FINISH_REASON_LENGTH
                msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=i + 1))
            yield msg
            await asyncio.sleep(self.token_delay_s)


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    """Lands KV on the fake decode named by decode_address, then answers the first token."""

    def __init__(self, decodes: dict[str, FakeDecode]) -> None:
        self.peer: Peer | None = None
        self.decodes = decodes
        self.requests: list[prefill_pb2.PrefillRequest] = []
        self.compute_s = 0.0
        """Time spent 'computing' before the KV lands (seconds)."""
        self.reply_delay_s = 0.0
        """Delay between the KV landing and the response (decode's stream may deliver first)."""
        self.die_after_s: float | None = None
        """Set: the server dies this long into a Prefill call (mid-transfer)."""
        self.full_retry_after_ms: int | None = None
        self.handoff_fails = False
        self.prefill_error: tuple[grpc.StatusCode, int, bool] | None = None
        """Set: Prefill fails at once with (status, ErrorDetail reason, retryable)."""
        self.attaches: dict[str, asyncio.Future[prefill_pb2.AttachReservationRequest]] = {}
        """Reservations of early Prefill calls by attach_id (AttachReservation sets them, once)."""
        self.early_cancelled = 0
        """Early Prefill calls the router cancelled while they waited for their reservation."""

    async def AttachReservation(self, request, context):
        fut = self.attaches.setdefault(request.attach_id, asyncio.get_running_loop().create_future())
        if fut.done():
            await grpc_util.abort(context, grpc.StatusCode.FAILED_PRECONDITION, "attached already",
                                  error_detail(Reason.ERROR_REASON_INVALID_INPUT, side="prefill", field="attach_id"))
        fut.set_result(request)
        return prefill_pb2.AttachReservationResponse()

    async def Prefill(self, request, context):
        self.requests.append(request)
        await _refuse_if_full(context, "prefill", self.full_retry_after_ms)
        if self.prefill_error is not None:
            code, reason, retryable = self.prefill_error
            await grpc_util.abort(context, code, f"scripted {code.name}",
                                  error_detail(reason, retryable=retryable, side="prefill"))
        if request.attach_id:  # early: the reservation comes with AttachReservation (the request as it ends up)
            fut = self.attaches.setdefault(request.attach_id, asyncio.get_running_loop().create_future())
            try:
                att = await fut
            except asyncio.CancelledError:
                self.early_cancelled += 1
                raise
            full = prefill_pb2.PrefillRequest()
            full.CopyFrom(request)
            for name in ("decode_address", "reservation_id", "reservation_token", "num_skip_blocks",
                         "expected_layout_fingerprint"):
                setattr(full, name, getattr(att, name))
            full.dest_block_ids.extend(att.dest_block_ids)
            full.accepted_wire_fingerprints.extend(att.accepted_wire_fingerprints)
            full.destination.CopyFrom(att.destination)
            self.requests[self.requests.index(request)] = request = full
        if self.die_after_s is not None:
            await asyncio.sleep(self.die_after_s)
            assert self.peer is not None
            await self.peer.die()
            await asyncio.sleep(3600)
        await asyncio.sleep(self.compute_s)
        decode = self.decodes.get(request.decode_address)
        r = decode.reservations.get(request.reservation_id) if decode is not None else None
        if self.handoff_fails or decode is None or decode.peer is None or decode.peer.dead or r is None \
                or r.token != request.reservation_token:
            await grpc_util.abort(context, grpc.StatusCode.UNAVAILABLE, "decode did not take the KV",
                                  error_detail(Reason.ERROR_REASON_KV_HANDOFF_FAILED, retryable=False,
                                               side="decode"))
        first = next_token(list(request.token_ids))
        decode.land(request.reservation_id, first)
        await asyncio.sleep(self.reply_delay_s)
        return prefill_pb2.PrefillResponse(first_token=first, num_prompt_tokens=len(request.token_ids))


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, detail: bytes) -> None:
        super().__init__(message)
        self.code, self.message, self.detail = code, message, detail


class _RequestContext:
    """What a Stream entry's Generate aborts through: the abort ends that request only."""

    def __init__(self) -> None:
        self._detail = b""

    def set_trailing_metadata(self, md) -> None:
        self._detail = next((v for k, v in md if k == grpc_util.ERROR_DETAIL_KEY), b"")

    async def abort(self, code: grpc.StatusCode, message: str = "") -> None:
        raise _Aborted(code, message, self._detail)


async def _stream(decode: FakeDecode, request_iterator, context) -> AsyncIterator[decode_pb2.StreamStep]:
    """Decode.Stream over the fake's own Generate: one StreamStep per message (the fake has no engine steps),
    an abort as that request's StreamError, a cancel ends its Generate."""
    out: asyncio.Queue[decode_pb2.StreamStep | None] = asyncio.Queue()
    runs: dict[int, asyncio.Task] = {}

    async def run(start: decode_pb2.StreamStart) -> None:
        try:
            async for msg in decode.Generate(start.request, _RequestContext()):
                out.put_nowait(decode_pb2.StreamStep(tokens=[decode_pb2.StreamTokens(key=start.key, response=msg)]))
        except _Aborted as e:
            err = decode_pb2.StreamError(key=start.key, code=e.code.value[0], message=e.message)
            err.detail.ParseFromString(e.detail)
            out.put_nowait(decode_pb2.StreamStep(errors=[err]))
        finally:
            runs.pop(start.key, None)

    async def read() -> None:
        async for ctl in request_iterator:
            if ctl.WhichOneof("kind") == "start":
                runs[ctl.start.key] = asyncio.ensure_future(run(ctl.start))
            elif (t := runs.get(ctl.cancel.key)) is not None:
                decode.cancels.append(ctl.cancel.key)
                t.cancel()
        out.put_nowait(None)

    reader = asyncio.ensure_future(read())
    try:
        while (step := await out.get()) is not None:
            yield step
    finally:
        for t in [reader, *runs.values()]:
            t.cancel()
        await asyncio.gather(reader, *runs.values(), return_exceptions=True)


@dataclass
class FakeCluster:
    decodes: list[tuple[Peer, FakeDecode]]
    prefills: list[tuple[Peer, FakePrefill]]
    decode_stream: str = "step"
    """How routers made for this cluster get tokens back (--decode-stream)."""

    @classmethod
    async def start(cls, n_decode: int, n_prefill: int) -> FakeCluster:
        by_addr: dict[str, FakeDecode] = {}
        decodes, prefills = [], []
        for _ in range(n_decode):
            d = FakeDecode()
            peer = await serve([(decode_pb2_grpc.add_DecodeServicer_to_server, d)])
            d.peer = peer
            by_addr[peer.address] = d
            decodes.append((peer, d))
        for _ in range(n_prefill):
            p = FakePrefill(by_addr)
            peer = await serve([(prefill_pb2_grpc.add_PrefillServicer_to_server, p)])
            p.peer = peer
            prefills.append((peer, p))
        return cls(decodes, prefills)

    def decode(self, i: int) -> FakeDecode:
        return self.decodes[i][1]

    def prefill(self, i: int) -> FakePrefill:
        return self.prefills[i][1]

    def decode_addr(self, i: int) -> str:
        return self.decodes[i][0].address

    def prefill_addr(self, i: int) -> str:
        return self.prefills[i][0].address

    async def stop(self) -> None:
        for peer, _ in [*self.decodes, *self.prefills]:
            await peer.die()
