"""MooncakeEngine.submit / settle over loopback TCP: one batch per entry (settle polls each:
``transfer_check_status`` reads a batch's first entry only), a failed entry reported, every byte landed."""

from __future__ import annotations

import pytest
import torch

from services.engine.kv_transport import mooncake

NO_MOONCAKE = mooncake.available()
pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")


@pytest.fixture(scope="module")
def pair():
    return mooncake.MooncakeEngine("127.0.0.1", count=2), mooncake.MooncakeEngine("127.0.0.1", count=2)


def test_entries_land_one_batch_each_round_robin_and_settle_polls_without_spinning(pair) -> None:
    send, recv = pair
    n, entry = 8 << 20, 1 << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    s, d = send.register(src), recv.register(dst)
    offs = list(range(0, n, entry))
    batches = send.submit(recv.segments, [s + o for o in offs], [d + o for o in offs], [entry] * len(offs))
    assert len(batches) == len(offs)
    assert [te for te, _ in batches] == [send.tes[i % 2] for i in range(len(offs))]  # round-robin over engines
    assert mooncake.settle(batches) == 0
    assert torch.equal(src, dst)


def test_a_refused_entry_is_a_failure_after_the_others_settled(pair) -> None:
    send, recv = pair
    src = torch.ones(4096, dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    s, d = send.register(src), recv.register(dst)
    batches = send.submit(recv.segments, [s, s], [d, d + (1 << 40)], [4096, 4096])  # the second lands outside
    assert mooncake.settle(batches) != 0
    assert torch.equal(src, dst)  # the first entry still landed
