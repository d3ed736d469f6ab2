"""The one-shot all-reduce's setup fails fast (gloo on the CPU stands in for NCCL: the agreement collective and
the store waits are the same calls): a peer that never reaches a step makes the waiting rank raise
SetupTimeoutError naming the step within the setup timeout, and store waits inside the setup are bounded by it
(restored afterwards)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.multiprocessing as mp

from services.engine.parallel import fast_allreduce
from services.engine.parallel.group import connect, open_store

LIMIT_S = 2.0


def _absent_peer(port: int) -> None:
    """Rank 1: joins the group, then never enters the setup (sleeps until the test ends it)."""
    connect(open_store(2, port), 1, 2, torch.device("cpu"))
    time.sleep(60)


def test_a_peer_that_never_enters_fails_the_setup_step_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_allreduce, "SETUP_TIMEOUT_S", LIMIT_S)
    store = open_store(2)
    peer = mp.get_context("spawn").Process(target=_absent_peer, args=(store.port,), daemon=True)
    peer.start()
    try:
        group = connect(store, 0, 2, torch.device("cpu"))
        start = time.monotonic()
        with pytest.raises(fast_allreduce.SetupTimeoutError, match="'peer check'"):
            fast_allreduce._agree(group.pg, True, torch.device("cpu"), "peer check")
        assert time.monotonic() - start < LIMIT_S + 10
    finally:
        peer.terminate()
        peer.join(10)


def test_store_waits_inside_the_setup_are_bounded_and_restored() -> None:
    store = open_store(1)
    before = store.timeout
    start = time.monotonic()
    with fast_allreduce._store_timeout(store, 0.5), pytest.raises(RuntimeError):
        store.get("pdserve/symm_mem_group")  # never set: the wait ends at the setup's bound
    assert time.monotonic() - start < 5
    assert store.timeout == before == datetime.timedelta(seconds=120)
