"""RequestKVStream's claim gate on the engine thread: a chunk computed before decode acknowledged the claim is
not written (a later write covers it); the last chunk computed before it never waits on the engine thread:
its blocks are held and its pages written by the sender once decode acknowledged (a retryable ClaimTimeout
past claim_wait_s); once the request is ending without an acknowledgement no chunk is written at all."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from services.common.pb import common_pb2
from services.engine.kv_pages import PageExport
from services.engine.kv_transport import TransferError
from services.prefill.engine_port import PrefillEngine
from services.prefill.kv_stream import ClaimTimeout, RequestKVStream

BS = 4


class _Writer:
    transport = "shm"
    overlaps_compute = False

    def __init__(self) -> None:
        self.writes: list[tuple[int, list[int]]] = []

    def write(self, first_block: int, src_blocks: list[int]) -> None:
        self.writes.append((first_block, list(src_blocks)))

    def release_source(self) -> None:
        return None


class _Sender:
    """bootstrap() returns once ``ack`` is set."""

    def __init__(self) -> None:
        self.ack = asyncio.Event()
        self.request_id = ""  # KVSender's: no engine request named (no layer-group export watched)

    async def bootstrap(self, claim=None) -> None:
        await self.ack.wait()


class _Engine(PrefillEngine):
    """The prefill engine's calls a deferred write makes, recorded; ``run`` runs them in a worker thread (as the
    engine thread would, away from the event loop)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def hold(self, seq) -> None:
        self.log.append(("hold", seq.request_id))

    async def release(self, request_id: str, before=None) -> None:
        if before is not None:
            await asyncio.to_thread(before)
        self.log.append(("release", request_id))

    async def run(self, fn, *args):
        return await asyncio.to_thread(fn, *args)

    def listen(self, fn) -> None:
        raise AssertionError("the claim gate's tests call on_chunk themselves")

    def stall(self, seconds: float) -> None:
        raise AssertionError("no slowdown here")

    async def prefix_blocks(self, ids):
        raise AssertionError("no kvstore here")

    async def admit(self, request_id, ids, params, stream_kv, first, pages):
        raise AssertionError("the claim gate's tests admit nothing")


def _chunk(start: int, n: int, last: bool) -> SimpleNamespace:
    seq = SimpleNamespace(num_computed_tokens=start, num_cached_tokens=0, block_table=list(range(100, 110)),
                          request_id="r/1")
    return SimpleNamespace(seq=seq, num_new_tokens=n, sample=last)


def _stream(writer: _Writer, engine: _Engine | None = None, claim_wait_s: float = 60.0) -> RequestKVStream:
    return RequestKVStream(asyncio.get_running_loop(), lambda ids: PageExport(torch.zeros(1)), BS, 0, True, 0.0,
                           writer, engine=engine, claim_wait_s=claim_wait_s)  # type: ignore[arg-type]


async def _on_chunk(stream: RequestKVStream, start: int, n: int, last: bool = False) -> None:
    """Run on_chunk on another thread, as the engine thread does."""
    await asyncio.to_thread(stream.on_chunk, _chunk(start, n, last), None, 0.0)  # type: ignore[arg-type]


async def test_chunks_before_the_ack_are_written_by_the_first_write_after_it() -> None:
    writer, sender = _Writer(), _Sender()
    stream = _stream(writer)
    claim = stream.claim(sender, common_pb2.KVChunk())  # type: ignore[arg-type]
    await _on_chunk(stream, 0, 8)  # blocks 0-1 computed, claim unanswered: deferred
    assert writer.writes == [] and stream.queue.empty()
    sender.ack.set()
    await claim
    await _on_chunk(stream, 8, 8)
    assert writer.writes == [(0, [100, 101, 102, 103])]  # the deferred blocks with the new ones
    assert (await stream.queue.get()).num_pages == 4


async def test_nothing_is_written_once_the_request_ends_without_an_ack() -> None:
    writer, sender = _Writer(), _Sender()
    stream = _stream(writer)
    claim = stream.claim(sender, common_pb2.KVChunk())  # type: ignore[arg-type]
    stream.stop_waiting()  # the request is being cleaned up; the claim is still unanswered
    await _on_chunk(stream, 0, 8)
    await _on_chunk(stream, 8, 6, last=True)
    assert writer.writes == []
    for _ in range(2):
        assert isinstance(await stream.queue.get(), TransferError)
    claim.cancel()
    await asyncio.gather(claim, return_exceptions=True)


async def test_the_last_chunk_before_the_ack_holds_its_blocks_and_the_sender_writes_them_after_it() -> None:
    writer, sender, engine = _Writer(), _Sender(), _Engine()
    stream = _stream(writer, engine)
    claim = stream.claim(sender, common_pb2.KVChunk())  # type: ignore[arg-type]
    await _on_chunk(stream, 0, 8)
    await _on_chunk(stream, 8, 6, last=True)  # returns at once: the engine thread does not wait for the ack
    assert writer.writes == [] and engine.log == [("hold", "r/1")]
    item = await stream.queue.get()
    assert item.last and item.write is None and item.deferred == [100, 101, 102, 103]
    write = asyncio.ensure_future(stream.write_deferred(item))
    await asyncio.sleep(0)
    assert not write.done() and writer.writes == []  # nothing before decode's answer
    sender.ack.set()
    await write
    assert writer.writes == [(0, [100, 101, 102, 103])]
    await stream.release_held()
    assert engine.log == [("hold", "r/1"), ("release", "r/1")] and stream.held_request is None
    await claim


async def test_a_claim_unanswered_past_claim_wait_s_is_a_retryable_timeout_writing_nothing() -> None:
    writer, sender, engine = _Writer(), _Sender(), _Engine()
    stream = _stream(writer, engine, claim_wait_s=0.01)
    claim = stream.claim(sender, common_pb2.KVChunk())  # type: ignore[arg-type]
    await _on_chunk(stream, 0, 6, last=True)
    item = await stream.queue.get()
    with pytest.raises(ClaimTimeout, match="--claim-wait-s"):
        await stream.write_deferred(item)
    assert writer.writes == [] and stream.held_request == "r/1"  # the servicer's abort frees the held blocks
    assert not claim.done()  # the claim itself is left to the servicer (cancelled in its cleanup)
    claim.cancel()
    await asyncio.gather(claim, return_exceptions=True)
