"""``pdserve bench kv``'s gRPC paths.

  grpc       what users get: prefill's sender (kv_stream.pump over the grpc transport: the pages gathered
             straight into each message, CRC in a worker, the header written in front of them) into a real decode service
             (``python -m services.decode``, random weights of the pool's model shape): PushKV parsed
             header-only, every chunk checked, CRC, the pages copied from gRPC's bytes into its KV pool.
             Each run is one reservation per stream (Reserve before the clock starts, Generate of the
             single token after it stops); the clock covers the pages' gather, send and landing.
  grpc-bare  the same message sizes as bare bytes (no protobuf, no CRC, no landing) to a sink that only
             counts them: what Python gRPC itself moves on this box, the ceiling of ``grpc``.
  grpc-tls   (``--tls``) ``grpc`` into a second decode service that runs mTLS, as `pdserve up` does by
             default: fresh certificates, the sender presenting a prefill's, Reserve/Generate a router's.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from services.common.grpc_util import create_channel, payload_budget
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.tls import TLSConfig
from services.engine.convert import layout_from_pb
from services.engine.kv_layout import PageLayout
from services.engine.kv_pages import MessageExport, gather_messages
from services.engine.kv_transport.grpc_stream import GrpcStreamTransport
from services.prefill.kv_stream import PagesReady, RequestKVStream, header_room, pages_per_message, pump
from services.process import ServiceProc

MAX_MESSAGE_BYTES = 64 << 20
BARE_METHOD = "/bench.Bytes/Push"


def _identity(b: bytes) -> bytes:
    return b


class DecodePeer:
    """A decode service process whose KV pool holds ``num_blocks`` pages of ``model``'s shape."""

    def __init__(self, model: str, dtype: str, num_blocks: int, threads: int, certs: Path | None = None) -> None:
        """``certs``: run mTLS with the decode certificate from this ``make_certs`` directory."""
        cmd = [sys.executable, "-m", "services.decode", "--port", "0", "--metrics-port", "0", "--model", model,
               "--dtype", dtype, "--num-kv-blocks", str(num_blocks), "--cpu-threads", str(threads),
               "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--log-level", "WARNING"]
        if certs is not None:
            cmd += ["--tls-cert", str(certs / "decode.pem"), "--tls-key", str(certs / "decode-key.pem"),
                    "--tls-ca", str(certs / "ca.pem")]
        self.proc = ServiceProc("decode", "services.decode", cmd, dict(os.environ), echo=False)
        self.proc.launch()
        if not self.proc.wait_ready(300):
            self.proc.terminate(5)
            raise RuntimeError(f"the bench's decode service did not start:\n{self.proc.tail(30)}")
        self.address = self.proc.ready["grpc"]
        assert self.proc.popen is not None
        self.pid = self.proc.popen.pid

    def close(self) -> None:
        self.proc.terminate(10)


def _export(src: torch.Tensor, layout: PageLayout, room: int) -> Callable[[list[int]], MessageExport]:
    """KVPages.export_messages on CPU for the pool ``src``: each message's pages gathered straight into it."""
    from services.kernels import pack_pages

    per = pages_per_message(payload_budget(MAX_MESSAGE_BYTES), layout.page_bytes)
    return lambda ids: gather_messages(
        lambda part, out: pack_pages(src, torch.tensor(part, dtype=torch.int64), out), ids, per, room,
        layout.page_bytes, (src.shape[0], 2, *src.shape[3:]), src.dtype)


def _producer(loop: asyncio.AbstractEventLoop, stream: RequestKVStream, chunks: list[list[int]],
              first_token: int) -> None:
    """The engine thread's part (RequestKVStream.on_chunk on CPU): each chunk's pages exported, handed
    over in order; a chunk's first page is at the reservation's block table index ``first``."""
    bs = stream.block_size
    first = 0
    for k, blocks in enumerate(chunks):
        pages = stream.export(blocks)
        n = len(blocks)
        item = PagesReady(first, first * bs, (first + n) * bs, pages, n, last=k == len(chunks) - 1,
                          first_token=first_token, prefill_done_unix=time.time())
        loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        first += n


async def _one_request(stub: decode_pb2_grpc.DecodeStub, transport: GrpcStreamTransport, address: str,
                       src: torch.Tensor, chunks: list[list[int]], seed: int, start: asyncio.Event
                       ) -> tuple[float, int]:
    """Reserve, wait for ``start``, push the pages, Generate; returns (push seconds, payload bytes)."""
    rng = random.Random(seed)  # a fresh prompt each run: decode's prefix cache holds none of its pages
    block_size = src.shape[3]
    ids = [rng.randrange(1, 30000) for _ in range(sum(map(len, chunks)) * block_size)]
    rid = f"bench-{seed}"
    resv = await stub.Reserve(decode_pb2.ReserveRequest(
        request_id=rid, token_ids=ids, params=common_pb2.SamplingParams(max_tokens=1, temperature=0)), timeout=60)
    if resv.num_cached_blocks:
        raise RuntimeError(f"decode already caches {resv.num_cached_blocks} pages of a fresh prompt")
    layout = layout_from_pb(resv.layout)
    loop = asyncio.get_running_loop()
    if layout.page_bytes != src[:, :, 0].numel() * src.element_size():
        raise RuntimeError(f"decode's pages are {layout.page_bytes} bytes ({layout.describe()}); the bench's pool "
                           f"{list(src.shape)} {src.dtype} has other pages: pick --page-shape of the decode model")
    room = header_room(rid, resv.reservation_id, resv.reservation_token, layout, "grpc", 0)
    stream = RequestKVStream(loop, _export(src, layout, room), block_size, 0, True, time.monotonic())
    await start.wait()
    t0 = time.perf_counter()
    thread = threading.Thread(target=_producer, args=(loop, stream, chunks, 7), daemon=True)
    thread.start()
    sender = transport.open(address, rid)
    await sender.bootstrap()
    _, nbytes = await pump(stream, sender, rid, resv.reservation_id, resv.reservation_token, layout,
                           payload_budget(MAX_MESSAGE_BYTES), "grpc")
    resp = await sender.finish()
    secs = time.perf_counter() - t0
    thread.join()
    async for _ in stub.Generate(decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id), timeout=60):
        pass
    if resp.bytes_received != nbytes:
        raise RuntimeError(f"decode landed {resp.bytes_received} of {nbytes} bytes")
    return secs, nbytes


class GrpcPaths:
    """The two gRPC paths' clients, on one event loop of their own (a thread), reused across runs."""

    def __init__(self, decode_address: str, bare_address: str, streams: int, certs: Path | None = None) -> None:
        """``certs``: mTLS to the decode (a prefill's certificate on PushKV, a router's on Reserve/Generate)."""
        self.streams = streams
        push_tls = control_tls = None
        if certs is not None:
            push_tls, control_tls = (TLSConfig(tls_cert=str(certs / f"{r}.pem"), tls_key=str(certs / f"{r}-key.pem"),
                                               tls_ca=str(certs / "ca.pem")) for r in ("prefill", "router"))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.decode_address = decode_address
        self.bare_address = bare_address
        self._seed = 0

        async def make() -> None:
            self.transport = GrpcStreamTransport(max_message_bytes=MAX_MESSAGE_BYTES, channels_per_peer=streams,
                                                 tls=push_tls)
            self.control = create_channel(decode_address, tls=control_tls)
            self.stub = decode_pb2_grpc.DecodeStub(self.control)
            self.bare = [create_channel(bare_address, max_message_bytes=MAX_MESSAGE_BYTES,
                                        options=(("grpc.channel_id", k),)) for k in range(streams)]

        self._run(make())

    def _run(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def decode(self, src: torch.Tensor, chunks: list[list[int]]) -> float:
        """Seconds to land ``chunks`` of ``src`` in the decode's pool, as ``streams`` concurrent requests."""
        async def go() -> float:
            start = asyncio.Event()
            base = self._seed
            self._seed += self.streams
            tasks = [asyncio.ensure_future(_one_request(self.stub, self.transport, self.decode_address, src,
                                                        chunks[k::self.streams], base + k, start))
                     for k in range(self.streams)]
            await asyncio.sleep(0.05)
            start.set()
            return max(secs for secs, _ in await asyncio.gather(*tasks))

        return self._run(go())

    def bare_bytes(self, sizes: list[int]) -> float:
        """Seconds to push messages of ``sizes`` bytes as bare gRPC bytes (``streams`` concurrent calls)."""
        async def go() -> float:
            payloads = {n: bytes(n) for n in set(sizes)}

            async def one(ch: grpc.aio.Channel, mine: list[int]) -> None:
                call = ch.stream_unary(BARE_METHOD, request_serializer=_identity, response_deserializer=_identity)
                await call(iter([payloads[n] for n in mine]), timeout=300)

            t0 = time.perf_counter()
            await asyncio.gather(*[one(self.bare[k], sizes[k::self.streams]) for k in range(self.streams)])
            return time.perf_counter() - t0

        return self._run(go())

    def close(self) -> None:
        async def shut() -> None:
            await self.transport.close()
            await self.control.close()
            for ch in self.bare:
                await ch.close()

        self._run(shut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def bare_handler() -> grpc.GenericRpcHandler:
    """The bare sink (runs in the bench's receiving process): counts the bytes, keeps none."""
    async def push(it, _context) -> bytes:  # type: ignore[no-untyped-def]
        n = 0
        async for m in it:
            n += len(m)
        return str(n).encode()

    return grpc.method_handlers_generic_handler("bench.Bytes", {"Push": grpc.stream_unary_rpc_method_handler(
        push, request_deserializer=_identity, response_serializer=_identity)})
