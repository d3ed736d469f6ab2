"""Rank writes split into start and finish (parallel/rank_writes.py): a rank's acknowledgements reach rank 0 over
the instance's TCPStore however late they come (slow is not dead), a failed share is reported as an error, a dead
rank ends the wait at once and a silent live one after the bound; a head slice that goes through the staging
buffer waits for ``finish`` (off the engine thread), Mooncake batches are only submitted by the start."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.engine.kv_transport import mooncake
from services.engine.kv_transport.base import TransferError
from services.engine.parallel import rank_writes
from services.engine.parallel.group import open_store
from services.engine.parallel.mooncake_ranks import RankMooncake
from services.engine.parallel.rank_writes import Acks, Shard, copy_heads, start_share
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
    for t in threads:
        t.start()
    start = time.monotonic()
    counts, errors = acks.collect(7, range(1, 3), _alive)
    for t in threads:
        t.join()
    assert time.monotonic() - start >= late
    assert counts == [4, 0] and errors == ["rank 2: ValueError('block 99')"]
    assert not store.check([rank_writes._key(7, 1)]) and not store.check([rank_writes._key(7, 2)])  # deleted


class _RankDied(RuntimeError):
    pass


def test_a_dead_rank_ends_the_wait_and_a_silent_one_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(2)
    acks = Acks(store.port, 2)
    calls = []

    def dead() -> None:
        calls.append(1)
        if len(calls) > 1:
            raise _RankDied("rank 1 exited")

    with pytest.raises(_RankDied):
        acks.collect(1, range(1, 2), dead)
    monkeypatch.setattr(rank_writes, "ACK_WAIT_S", 1.0)
    with pytest.raises(TransferError, match=r"ranks \[1\] did not report"):
        acks.collect(2, range(1, 2), _alive)


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
