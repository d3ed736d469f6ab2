"""mooncake.settle is bounded: a batch the transfer engine never ends (a frozen peer; the engine reports a
slice timeout only when MC_SLICE_TIMEOUT > 0) counts as timed out (-2) past the limit instead of being polled
forever. A fake transfer engine stands in for the native one (no wheel needed)."""

from __future__ import annotations

import time

import pytest

from services.engine.kv_transport import mooncake


class _FakeTE:
    """``transfer_check_status``: 0 (in flight) for ``polls`` reads of a batch, then ``final``; never ends
    when ``polls`` is None."""

    def __init__(self, polls: int | None, final: int = 1) -> None:
        self.polls = polls
        self.final = final
        self.reads: dict[int, int] = {}

    def transfer_check_status(self, batch: int) -> int:
        self.reads[batch] = self.reads.get(batch, 0) + 1
        if self.polls is None or self.reads[batch] <= self.polls:
            return 0
        return self.final


@pytest.fixture
def short_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mooncake, "SETTLE_BASE_S", 0.05)


def test_a_batch_that_never_ends_times_out(short_limit: None) -> None:
    frozen, done = _FakeTE(polls=None), _FakeTE(polls=0)
    t0 = time.monotonic()
    assert mooncake.settle([(frozen, 1), (done, 2), (frozen, 3)]) == -2
    assert time.monotonic() - t0 < 5.0  # bounded (the limit is 0.05 s; generous for a loaded box)
    assert frozen.reads[3] == 1  # past the deadline a later batch is read once, not polled


def test_bytes_extend_the_limit(short_limit: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mooncake, "SETTLE_BYTES_PER_S", 1.0)  # 1 byte/s: 10 bytes allow 10 s more
    slow = _FakeTE(polls=300)  # ends after 300 polls (>= 0.06 s of POLL_S sleeps, past the bare 0.05 s)
    assert mooncake.settle([(slow, 1)], nbytes=10) == 0


def test_completion_and_failure_within_the_limit() -> None:
    assert mooncake.settle([(_FakeTE(polls=3), 1), (_FakeTE(polls=1), 2)]) == 0
    assert mooncake.settle([(_FakeTE(polls=2, final=-1), 1), (_FakeTE(polls=0), 2)]) == -1
