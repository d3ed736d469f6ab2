"""services/engine/cpu/core_share.py: engines of one host lend each other idle cores."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.engine.cpu import core_share as cs
from services.engine.cpu.cpu_features import split_cores

HOLD = cs.HOLD_NS
T0 = 10**12
"""A CLOCK_MONOTONIC ns far from 0, so 'idle since start' is long past."""


class Threads:
    """The set_threads callback: records every change it is asked for."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


def _join(tmp_path: Path, share: int, pid: int, group: str = "g1") -> tuple[cs.CoreShare, Threads]:
    rec = Threads()
    return cs.CoreShare.join(group, share, rec, shm_dir=tmp_path, pid=pid), rec


@pytest.fixture
def live_pids() -> list[int]:
    """Pids of two live processes of this user (this test process and its parent)."""
    return [os.getpid(), os.getppid()]


def test_shares_add_up_to_the_cores_when_every_engine_is_busy(tmp_path: Path, live_pids: list[int]) -> None:
    shares = split_cores(2, 1, 1)
    assert sum(shares) == 2
    (a, _), (b, _) = (_join(tmp_path, s, pid) for s, pid in zip(shares, live_pids, strict=True))
    assert a.busy(T0) + b.busy(T0) == 2
    assert a.busy(T0 + 10 * HOLD) + b.busy(T0 + 10 * HOLD) == 2


def test_an_idle_peer_is_borrowed_after_the_hold_a_busy_one_never(tmp_path: Path, live_pids: list[int]) -> None:
    a, rec_a = _join(tmp_path, 1, live_pids[0])
    b, _ = _join(tmp_path, 3, live_pids[1])
    b.idle(T0)
    assert a.busy(T0 + HOLD - 1) == 1  # b paused for less than the hold: not lent
    assert a.busy(T0 + HOLD) == 4  # idle for the hold: its 3 threads are lent
    b.busy(T0 + HOLD + 5)
    assert a.busy(T0 + HOLD + 6) == 1  # b works again: a gives its cores back at its next step
    assert rec_a.calls == [4, 1]


def test_borrowing_stops_at_the_hosts_cpus(tmp_path: Path, live_pids: list[int]) -> None:
    """A one-thread decode beside a prefill widened over both cores of a 2-core host borrows up to 2 threads, not
    its share plus the prefill's (3); the prefill borrows nothing beyond its 2."""
    rec = Threads()
    decode = cs.CoreShare.join("g1", 1, rec, shm_dir=tmp_path, pid=live_pids[0], max_threads=2)
    prefill = cs.CoreShare.join("g1", 2, Threads(), shm_dir=tmp_path, pid=live_pids[1], max_threads=2)
    prefill.idle(T0)
    decode.idle(T0)
    assert decode.busy(T0 + HOLD) == 2
    assert rec.calls == [2]
    decode.idle(T0 + HOLD + 1)
    assert prefill.busy(T0 + 3 * HOLD) == 2
    unbounded, _ = _join(tmp_path, 1, os.getpid(), group="g2")
    other, _ = _join(tmp_path, 2, os.getppid(), group="g2")
    other.idle(T0)
    assert unbounded.busy(T0 + HOLD) == 3  # max_threads 0: no bound


def test_a_dead_peer_is_borrowed_at_once(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    gone = int(dead.stdout)
    a, _ = _join(tmp_path, 1, os.getpid())
    b, _ = _join(tmp_path, 2, gone)
    b.busy(T0)  # it crashed mid-step: its busy flag stays set
    assert a.busy(T0 + 1) == 3


def test_a_dead_peers_slot_is_claimed_again(tmp_path: Path) -> None:
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    stale, _ = _join(tmp_path, 1, gone)
    fresh, _ = _join(tmp_path, 1, os.getpid())
    assert fresh.slot == stale.slot


def test_no_borrowing_when_asked_not_to(tmp_path: Path, live_pids: list[int]) -> None:
    a, rec = _join(tmp_path, 1, live_pids[0])
    b, _ = _join(tmp_path, 1, live_pids[1])
    b.idle(T0)
    assert a.busy(T0 + HOLD, borrow=False) == 1
    assert a.busy(T0 + HOLD + 1) == 2
    assert a.busy(T0 + HOLD + 2, borrow=False) == 1  # more work came: back to its own share
    assert rec.calls == [2, 1]


def test_no_flapping_when_a_peer_pauses_shorter_than_the_hold(tmp_path: Path, live_pids: list[int]) -> None:
    a, rec_a = _join(tmp_path, 1, live_pids[0])
    b, rec_b = _join(tmp_path, 1, live_pids[1])
    a.busy(T0)
    b.busy(T0)
    now = T0
    for _ in range(200):  # b steps with 1 ms pauses; a keeps working
        now += 1_000_000
        b.idle(now)
        now += 1_000_000
        a.busy(now)
        b.busy(now)
    assert rec_a.calls == [] and rec_b.calls == []
    assert a.changes == 0


def test_idle_drops_back_only_after_the_hold(tmp_path: Path, live_pids: list[int]) -> None:
    a, rec = _join(tmp_path, 1, live_pids[0])
    b, _ = _join(tmp_path, 1, live_pids[1])
    b.idle(T0)
    assert a.busy(T0 + HOLD) == 2
    assert a.idle(T0 + HOLD + 1) == 2  # a short pause keeps the borrowed threads
    assert a.idle(T0 + 2 * HOLD + 1) == 1
    assert rec.calls == [2, 1]


def test_two_busy_engines_never_borrow_the_same_idle_share(tmp_path: Path) -> None:
    """3 engines x 2 threads on 6 cores, one idle: the first busy one borrows the idle share, the second
    finds it borrowed and runs with its own; the threads add up to the 6 cores."""
    third = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        a, _ = _join(tmp_path, 2, os.getpid())
        b, _ = _join(tmp_path, 2, os.getppid())
        c, _ = _join(tmp_path, 2, third.pid)
        assert len({a.slot, b.slot, c.slot}) == 3
        c.idle(T0)
        assert a.busy(T0 + HOLD) == 4
        assert b.busy(T0 + HOLD + 1) == 2
        a.idle(T0 + HOLD + 2)  # a short pause: a keeps its borrowed threads, still not lendable twice
        assert b.busy(T0 + HOLD + 3) == 2
        assert a.idle(T0 + 3 * HOLD) == 2  # a idle past the hold: back to its share, and lends it
        assert b.busy(T0 + 3 * HOLD + 1) == 2 + 2 + 2
    finally:
        third.kill()
        third.wait()


def test_lendable_threads_counts_only_idle_or_gone_peers() -> None:
    peers = [cs.Peer(pid=11, share=2, threads=2, busy=True, changed_ns=0),
             cs.Peer(pid=12, share=1, threads=1, busy=False, changed_ns=T0),
             cs.Peer(pid=13, share=4, threads=4, busy=True, changed_ns=0)]
    alive = {11: True, 12: True, 13: False}.__getitem__
    assert cs.lendable_threads(peers, T0 + HOLD, HOLD, alive) == 1 + 4
    assert cs.lendable_threads(peers, T0 + HOLD - 1, HOLD, alive) == 4
    borrower = cs.Peer(pid=14, share=1, threads=3, busy=True, changed_ns=0)  # took 2 of the idle ones
    alive_too = {11: True, 12: True, 13: False, 14: True}.__getitem__
    assert cs.lendable_threads([*peers, borrower], T0 + HOLD, HOLD, alive_too) == 1 + 4 - 2


def test_group_file_is_private_and_removed(tmp_path: Path) -> None:
    path = cs.create_group("up1-ab", tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == cs.FILE_BYTES
    with pytest.raises(cs.CoreShareError):
        cs.create_group("up1-ab", tmp_path)  # never reuses a file someone made
    cs.remove_group("up1-ab", tmp_path)
    assert not path.exists()
    cs.remove_group("up1-ab", tmp_path)  # gone already: nothing


def test_refuses_links_foreign_modes_and_bad_ids(tmp_path: Path) -> None:
    (tmp_path / "target").write_bytes(b"")
    (tmp_path / f"{cs.FILE_PREFIX}link").symlink_to(tmp_path / "target")
    with pytest.raises(cs.CoreShareError, match="symbolic link"):
        _join(tmp_path, 1, os.getpid(), group="link")
    loose = tmp_path / f"{cs.FILE_PREFIX}loose"
    loose.write_bytes(b"")
    loose.chmod(0o644)
    with pytest.raises(cs.CoreShareError, match="0600"):
        _join(tmp_path, 1, os.getpid(), group="loose")
    other = tmp_path / f"{cs.FILE_PREFIX}other"
    other.write_bytes(b"x" * 8)
    other.chmod(0o600)
    with pytest.raises(cs.CoreShareError, match="bytes"):
        _join(tmp_path, 1, os.getpid(), group="other")
    for bad in ("", "../etc", "a/b", "-x", "x" * 65):
        with pytest.raises(cs.CoreShareError):
            cs.check_group_id(bad)


def test_leave_frees_the_slot(tmp_path: Path, live_pids: list[int]) -> None:
    a, _ = _join(tmp_path, 1, live_pids[0])
    b, _ = _join(tmp_path, 1, live_pids[1])
    a.leave()
    assert [p.pid for p in b.peers()] == []


def test_engine_config_validates_the_group_id() -> None:
    from services.engine.config import EngineConfig, EngineConfigError

    assert EngineConfig(cpu_share_group="up12-abcd").cpu_share_group == "up12-abcd"
    with pytest.raises(EngineConfigError, match="PDSERVE_CPU_SHARE_GROUP"):
        EngineConfig(cpu_share_group="../x")


def test_an_engine_out_of_work_stays_busy_while_its_decode_compile_runs(tmp_path: Path,
                                                                        live_pids: list[int]) -> None:
    """A pending or compiling background compile works on the engine's share: a peer must not borrow it."""
    from services.engine.cpu.decode_compiler import DecodeCompiler
    from services.engine.step_loop import _out_of_work

    a, _ = _join(tmp_path, 1, live_pids[0])
    b, _ = _join(tmp_path, 1, live_pids[1])
    compiler = DecodeCompiler(None, 1)  # type: ignore[arg-type]  # never started: only its report is read
    eng = SimpleNamespace(runner=SimpleNamespace(decode_compiler=compiler))
    for status in ("pending", "compiling"):
        compiler.report.status = status
        assert _out_of_work(b, eng) == 1  # type: ignore[arg-type]
        assert a.busy(time.monotonic_ns() + 10 * HOLD) == 1  # b is marked busy: nothing lent
    compiler.awaiting_child = True  # compiling, but only waiting for the niced compile child: lendable
    _out_of_work(b, eng)  # type: ignore[arg-type]
    now = time.monotonic_ns()
    assert a.busy(now + 10 * HOLD) == 2
    compiler.awaiting_child = False
    assert _out_of_work(b, eng) == 1  # type: ignore[arg-type]  # building a variant here again: busy
    compiler.report.status = "done"
    _out_of_work(b, eng)  # type: ignore[arg-type]
    now = time.monotonic_ns()  # b marked its idle start before this
    assert a.busy(now + 10 * HOLD) == 2  # compile over: b idle, lent after the hold
    eng.runner.decode_compiler = None
    assert _out_of_work(b, eng) == 1  # type: ignore[arg-type]  # no compile (eager): idle as before


def test_a_compiled_engine_borrows_only_where_its_sizes_are_compiled_at_the_lent_count() -> None:
    """A step at a thread count without a compiled variant runs eager: with compiled sizes switched on, the
    engine borrows only if each of them is switched on at the lent count too."""
    from services.engine.step_loop import _may_borrow

    on: set[tuple[int, int]] = {(1, 1)}  # (batch, threads) switched on; own share 1, lent count 2
    compiled = SimpleNamespace(active=frozenset({1}),
                               sizes_at=lambda t: frozenset(b for b, th in on if th == t))
    sch = SimpleNamespace(num_running=1, num_waiting=0, num_waiting_for_kv=0)
    eng = SimpleNamespace(scheduler=sch, runner=SimpleNamespace(compiled_decode=compiled,
                                                                decode_compiler=SimpleNamespace(lent_threads=2)))
    assert not _may_borrow(eng)  # type: ignore[arg-type]  # batch 1 compiled at 1 thread only
    on.add((1, 2))
    assert _may_borrow(eng)  # type: ignore[arg-type]
    sch.num_waiting = 1
    assert not _may_borrow(eng)  # type: ignore[arg-type]  # two requests: keep the shares
    sch.num_waiting = 0
    eng.runner.decode_compiler = SimpleNamespace(lent_threads=0)  # not in a share group
    assert not _may_borrow(eng)  # type: ignore[arg-type]
