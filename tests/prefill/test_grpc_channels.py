"""The grpc transport's per-decode channel cache: bounded (least recently used out), an evicted decode's
channels closed only once the streams on them have ended, every channel closed on close()."""

from __future__ import annotations

import asyncio

import grpc

from services.engine.kv_transport.grpc_stream import GrpcStreamTransport

SHUT = grpc.ChannelConnectivity.SHUTDOWN


async def _holding_server() -> tuple[grpc.aio.Server, str, asyncio.Event]:
    """A PushKV that answers only once ``release`` is set (a transfer in flight)."""
    release = asyncio.Event()

    async def push(it, _context):
        async for _ in it:
            pass
        await release.wait()
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Decode", {
        "PushKV": grpc.stream_unary_rpc_method_handler(push, request_deserializer=lambda b: b,
                                                       response_serializer=lambda b: b)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", release


async def test_the_least_recently_used_decode_is_closed_beyond_the_cap() -> None:
    t = GrpcStreamTransport(channels_per_peer=1, max_peers=2)
    a, b = t.channel("127.0.0.1:1"), t.channel("127.0.0.1:2")
    assert t.channel("127.0.0.1:1") is a  # reused, and now the most recently used
    c = t.channel("127.0.0.1:3")
    assert t.open_peers == ["127.0.0.1:1", "127.0.0.1:3"]
    for _ in range(50):
        if b.get_state() is SHUT:
            break
        await asyncio.sleep(0.02)
    assert b.get_state() is SHUT
    assert a.get_state() is not SHUT and c.get_state() is not SHUT
    assert t.channel("127.0.0.1:2") is not b  # a fresh channel when it comes back
    await t.close()
    assert t.open_peers == []
    assert all(ch.get_state() is SHUT for ch in (a, c))


async def test_an_evicted_decode_keeps_its_channel_until_its_stream_ends() -> None:
    server, address, release = await _holding_server()
    t = GrpcStreamTransport(channels_per_peer=1, max_peers=1)
    try:
        sender = t.open(address, "r1")
        await sender.bootstrap()
        ch = t.channel(address)
        t.channel("127.0.0.1:1")  # evicts the busy decode
        assert t.open_peers == ["127.0.0.1:1"]
        await asyncio.sleep(0.2)
        assert ch.get_state() is not SHUT  # the transfer on it goes on
        finishing = asyncio.ensure_future(sender.finish())
        await asyncio.sleep(0.1)
        release.set()
        await finishing
        for _ in range(50):
            if ch.get_state() is SHUT:
                break
            await asyncio.sleep(0.02)
        assert ch.get_state() is SHUT
    finally:
        await t.close()
        await server.stop(None)
