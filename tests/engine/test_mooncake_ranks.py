"""RemotePool.write_heads (parallel/mooncake_ranks.py) in one process over loopback TCP: a writer engine puts a
slice of KV heads of some blocks into a registered "decode rank" pool; the pool then equals what
rank_writes.copy_heads writes into a copy of it, for whole shards (one range per run and plane) and for partial
head slices (gathered into staging, or one range per token row); bad blocks and another rank's checks are refused."""

from __future__ import annotations

import pytest
import torch

from services.engine.kv_transport import mooncake
from services.engine.parallel import mooncake_ranks
from services.engine.parallel.mooncake_ranks import RankMooncake, RemotePool, settle_writes
from services.engine.parallel.rank_writes import copy_heads
from services.engine.shared_kv import SharedKVAttachError

NO_MOONCAKE = mooncake.available()
pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")

LAYERS, BLOCKS, BS, HD = 2, 8, 4, 8
KEEP: list[torch.Tensor] = []
"""Every registered tensor stays alive for the module (an engine keeps memory registered; a freed tensor's
address reused by the next one would overlap a registration, as a real cache never does)."""


@pytest.fixture(scope="module")
def engines() -> tuple[RankMooncake, RankMooncake]:
    writer, decode = RankMooncake(), RankMooncake()
    writer.start("127.0.0.1", 1)
    decode.start("127.0.0.1", 2)
    return writer, decode


@pytest.mark.parametrize(("src_heads", "pool_heads", "a_b", "c_d"), [
    (2, 2, (0, 2), (0, 2)),  # (2,2)-like: whole shard on both sides
    (2, 1, (1, 2), (0, 1)),  # (1,2)-like: one of the writer's heads into a one-head rank
    (1, 2, (0, 1), (1, 2)),  # (2,1)-like: the writer's one head into half of a two-head pool
])
def test_write_heads_equals_copy_heads(engines, src_heads, pool_heads, a_b, c_d) -> None:
    writer, decode = engines
    torch.manual_seed(0)
    src = torch.randn(LAYERS, 2, BLOCKS, BS, src_heads, HD)
    pool = torch.zeros(LAYERS, 2, BLOCKS, BS, pool_heads, HD)
    KEEP.extend((src, pool))
    offer = decode.offer(pool, "127.0.0.1", 2)
    assert offer is not None and offer.mooncake.extra_segments
    remote = writer.remote(offer, src)
    src_blocks, dst_blocks = [1, 2, 3, 6], [4, 5, 6, 0]  # runs of 3 and 1
    settle_writes(remote.write_heads(src, src_blocks, a_b, dst_blocks, c_d))
    want = torch.zeros_like(pool)
    copy_heads(src, src_blocks, a_b, want, dst_blocks, c_d)
    assert torch.equal(pool, want)
    if c_d[1] - c_d[0] == pool_heads and a_b[1] - a_b[0] < src_heads:  # went through the gather buffer
        assert writer._staging is not None
    assert pool.abs().sum() > 0
    with pytest.raises(ValueError, match="destination block 8"):
        remote.write_heads(src, [0], a_b, [BLOCKS], c_d)


def test_remote_pool_refuses_a_landing_area_and_a_bad_size(engines) -> None:
    writer, decode = engines
    KEEP.append(torch.zeros(LAYERS, 2, BLOCKS, BS, 1, HD))
    offer = decode.offer(KEEP[-1], "127.0.0.1", 2)
    assert offer is not None
    landing = type(offer.mooncake)()
    landing.CopyFrom(offer.mooncake)
    landing.page_major = True
    with pytest.raises(SharedKVAttachError, match="landing area"):
        RemotePool(writer.engine, landing, writer.staging)
    offer.mooncake.pool_bytes += 4
    with pytest.raises(SharedKVAttachError, match="does not hold shape"):
        writer.remote(offer, KEEP[-1])
    with pytest.raises(SharedKVAttachError, match="no Mooncake transfer engine"):
        RankMooncake().remote(offer, KEEP[-1])


def test_a_run_larger_than_the_staging_buffer_goes_in_pieces(engines, monkeypatch) -> None:
    writer, decode = engines
    writer.staging()  # allocated at full size before the limit shrinks: pieces then reuse its first bytes
    monkeypatch.setattr(mooncake_ranks, "STAGING_BYTES", LAYERS * 2 * BS * HD * 4 * 2)  # 2 one-head blocks
    src = torch.randn(LAYERS, 2, BLOCKS, BS, 2, HD)
    pool = torch.zeros(LAYERS, 2, BLOCKS, BS, 1, HD)
    KEEP.extend((src, pool))
    remote = writer.remote(decode.offer(pool, "127.0.0.1", 2), src)
    src_blocks, dst_blocks = [0, 1, 2, 3, 4], [2, 3, 4, 5, 6]  # one run of 5: pieces of 2, 2, 1
    assert remote.write_heads(src, src_blocks, (1, 2), dst_blocks, (0, 1)) == []
    want = torch.zeros_like(pool)
    copy_heads(src, src_blocks, (1, 2), want, dst_blocks, (0, 1))
    assert torch.equal(pool, want) and pool.abs().sum() > 0
