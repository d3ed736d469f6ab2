"""Rank writes split into start and finish (parallel/rank_writes.py): a rank's acknowledgements reach rank 0 over
the instance's TCPStore however late they come (slow is not dead), a failed share is reported as an error, a dead
rank ends the wait at once and a silent live one after the bound; a head slice that goes through the staging
buffer waits for ``finish`` (off the engine thread), Mooncake batches are only submitted by the start."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import grpc
import pytest
import torch

from services.engine.async_engine import EngineDeadError
from services.engine.kv_layout import HeadSplitSpec
from services.engine.kv_transport import mooncake
from services.engine.kv_transport.base import TransferError
from services.engine.parallel import rank_writes
from services.engine.parallel.group import open_store
from services.engine.parallel.mooncake_ranks import RankMooncake
from services.engine.parallel.rank_pages import ShardWrites
from services.engine.parallel.rank_writes import (
    Acks,
    Attached,
    ChunkWrite,
    Settler,
    Shard,
    ShardWriter,
    ShareWrite,
    SilentRanks,
    copy_heads,
    start_share,
)
from services.engine.parallel.split import HeadSplit

LAYERS, BLOCKS, BS, HD = 2, 8, 4, 8


def _alive() -> None:
    return None


def test_acks_arrive_late_and_report_errors() -> None:
    store = open_store(3)
    acks = Acks(store.port, 3)
    late = 2.5 * rank_writes.ACK_POLL_S  # several polls: a slow rank is waited for, not declared dead
    threads = [threading.Thread(target=lambda: (time.sleep(late), acks.post(7, 1, 4))),
               threading.Thread(target=lambda: acks.post(7, 2, 0, "ValueError('block 99')"))]
    start = time.monotonic()
    for t in threads:
        t.start()
    counts, errors = acks.collect(7, range(1, 3), _alive)
    for t in threads:
        t.join()
    assert time.monotonic() - start >= late
    assert counts == [4, 0] and errors == ["rank 2: ValueError('block 99')"]
    assert not store.check([rank_writes._key(7, 1)]) and not store.check([rank_writes._key(7, 2)])  # deleted


class _RankDied(RuntimeError):
    pass


def test_a_dead_rank_ends_the_wait_and_a_silent_one_is_bounded() -> None:
    store = open_store(3)
    acks = Acks(store.port, 3)
    calls = []

    def dead() -> None:
        calls.append(1)
        if len(calls) > 1:
            raise _RankDied("rank 1 exited")

    with pytest.raises(_RankDied):
        acks.collect(1, range(1, 2), dead)
    acks.post(2, 1, 4)
    with pytest.raises(SilentRanks, match=r"ranks \[2\] did not report") as err:
        acks.collect(2, range(1, 3), _alive, time.monotonic() + 1.0)
    assert err.value.ranks == [2] and err.value.code == grpc.StatusCode.UNAVAILABLE
    assert not store.check([rank_writes._key(2, 1)])  # the answer that came is not left behind


class _Acks:
    """Acks whose posts are recorded, failing from the ``fail_from``-th on."""

    def __init__(self, fail_from: int = 1 << 30) -> None:
        self.posted: list[tuple[int, int, str]] = []
        self.fail_from = fail_from
        self.done = threading.Event()

    def post(self, seq: int, rank: int, written: int, error: str = "") -> None:
        if len(self.posted) + 1 >= self.fail_from:
            raise ConnectionError("store gone")
        self.posted.append((seq, written, error))
        if len(self.posted) == 2:
            self.done.set()


def test_the_settler_reports_a_failed_share_and_goes_on() -> None:
    acks = _Acks()
    settler = Settler(acks, 1)  # type: ignore[arg-type]
    settler.put(1, ValueError("block 99"))
    settler.put(2, ShareWrite(written=3))
    assert acks.done.wait(30)
    assert acks.posted == [(1, 0, "ValueError('block 99')"), (2, 3, "")]


def test_a_rank_that_cannot_acknowledge_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    exited = threading.Event()

    def fake_exit(code: int) -> None:
        exits.append(code)
        exited.set()  # returns: the settler thread goes back to its (empty) queue, where it stays

    monkeypatch.setattr(rank_writes.os, "_exit", fake_exit)
    acks = _Acks(fail_from=2)
    settler = Settler(acks, 1)  # type: ignore[arg-type]
    settler.put(1, ShareWrite(written=2))
    settler.put(2, ShareWrite(written=2))
    assert exited.wait(30)
    assert exits == [rank_writes.ACK_FAILED_EXIT] and acks.posted == [(1, 2, "")]


class _Runner:
    """What ShardWrites reads of rank 0's TP runner: a 2-rank group's store, liveness, the silent-rank hook."""

    def __init__(self, port: int) -> None:
        self.kv_cache = torch.zeros(LAYERS, 2, BLOCKS, BS, 1, HD)
        self.model = SimpleNamespace(tp_split=HeadSplit(4, 2, 2, 0))
        self.group = SimpleNamespace(store=SimpleNamespace(port=port), size=2)
        self.silenced: list[list[int]] = []

    def _check(self) -> None:
        return None

    def silent(self, ranks: list[int], reason: str) -> Exception:
        self.silenced.append(ranks)
        return _RankDied(reason)


def test_a_silent_rank_is_taken_as_dead_and_quiesce_has_one_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(2)  # kept: the store lives as long as this object
    runner = _Runner(store.port)
    writes = ShardWrites(runner)
    spec = HeadSplitSpec(2, 1, 1)
    writer = ShardWriter(writes, "shm", "pool", Attached(1, [], BLOCKS), list(range(BLOCKS)), (spec, spec))
    deadlines: list[float | None] = []
    collect = Acks.collect

    def spy(self: Acks, seq: int, ranks: range, alive: Callable[[], None],
            deadline: float | None = None) -> tuple[list[int], list[str]]:
        deadlines.append(deadline)
        return collect(self, seq, ranks, alive, deadline)

    monkeypatch.setattr(Acks, "collect", spy)
    monkeypatch.setattr(rank_writes, "COLLECTIVE_TIMEOUT_S", 1.0)
    w1, w2 = ChunkWrite(101, ShareWrite(), None), ChunkWrite(102, ShareWrite(), None)
    writer._pending += [w1, w2]
    writer.quiesce()
    assert not writer._pending and runner.silenced == [[1], [1]]
    assert len(deadlines) == 2 and deadlines[0] is not None and deadlines[0] == deadlines[1]
    with pytest.raises(TransferError, match="cannot be confirmed"):
        writer.wait(w1)  # the handle's failure stays with it


def test_a_rank_that_died_has_the_live_ones_stopped_before_the_chunk_is_dropped(monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    store = open_store(2)  # kept: the store lives as long as this object
    runner = _Runner(store.port)

    def dead() -> None:
        raise EngineDeadError("rank 1 exited")  # what RankSet.check raises: a RankDiedError

    runner._check = dead  # type: ignore[method-assign]
    writes = ShardWrites(runner)
    spec = HeadSplitSpec(2, 1, 1)
    writer = ShardWriter(writes, "shm", "pool", Attached(1, [], BLOCKS), list(range(BLOCKS)), (spec, spec))
    w = ChunkWrite(201, ShareWrite(), None)
    writer._pending.append(w)
    writer.quiesce()
    assert not writer._pending and runner.silenced == [[]]  # every rank stopped through the silent-rank hook
    with pytest.raises(TransferError):
        writer.wait(w)


NO_MOONCAKE = mooncake.available()


@pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")
def test_a_gathered_slice_is_written_by_finish_not_by_start() -> None:
    writer, decode = RankMooncake(), RankMooncake()
    writer.start("127.0.0.1", 1)
    decode.start("127.0.0.1", 1)
    torch.manual_seed(1)
    src = torch.randn(LAYERS, 2, BLOCKS, BS, 2, HD)  # a TP=1 writer: both heads
    pools = [torch.zeros(LAYERS, 2, BLOCKS, BS, 1, HD) for _ in range(2)]  # a TP=2 decode: one head each
    shards = [Shard((h, h + 1), writer.remote(decode.offer(p, "127.0.0.1", 1), src)) for h, p in enumerate(pools)]
    split = HeadSplit(4, 2, 1, 0)
    share = start_share(src, split, shards, [1, 2, 5], [3, 4, 0])
    assert len(share.deferred) == 2 and not share.batches and share.written == 6
    assert not any(p.any() for p in pools)  # nothing written yet: the engine thread did not wait for it
    assert share.finish() == 6
    for h, p in enumerate(pools):
        want = torch.zeros_like(p)
        copy_heads(src, [1, 2, 5], (h, h + 1), want, [3, 4, 0], (0, 1))
        assert torch.equal(p, want) and p.any()
    with pytest.raises(ValueError, match="destination block 8"):
        start_share(src, split, shards, [1], [BLOCKS])
