"""RequestKVStream's claim gate on the engine thread: a chunk computed before decode acknowledged the claim is
not written (a later write covers it), and once the request is ending without an acknowledgement no chunk
is written at all, even though the engine thread no longer waits."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from services.common.pb import common_pb2
from services.engine.kv_pages import PageExport
from services.engine.kv_transport import TransferError
from services.prefill.kv_stream import RequestKVStream

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

    async def bootstrap(self, claim=None) -> None:
        await self.ack.wait()


def _chunk(start: int, n: int, last: bool) -> SimpleNamespace:
    seq = SimpleNamespace(num_computed_tokens=start, num_cached_tokens=0, block_table=list(range(100, 110)))
    return SimpleNamespace(seq=seq, num_new_tokens=n, sample=last)


def _stream(writer: _Writer) -> RequestKVStream:
    return RequestKVStream(asyncio.get_running_loop(), lambda ids: PageExport(torch.zeros(1)), BS, 0, True, 0.0,
                           writer)  # type: ignore[arg-type]


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
