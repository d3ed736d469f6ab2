"""benchmarks/cpu_serving_probe.py: per-thread CPU, run-queue wait and switches per token, from /proc."""

from __future__ import annotations

import os
import threading

import pytest

from benchmarks.cpu_serving_probe import ThreadStat, per_token, read_threads, thread_names


def test_per_token_sums_threads_of_one_name_and_divides_by_tokens() -> None:
    before = {1: ThreadStat(1_000_000, 0, 10, 1), 2: ThreadStat(0, 0, 0, 0)}
    after = {1: ThreadStat(21_000_000, 4_000_000, 50, 5),  # 20 ms CPU, 4 ms waiting, 40 + 4 switches
             2: ThreadStat(10_000_000, 2_000_000, 30, 0),  # same name as 1: summed
             3: ThreadStat(5_000_000, 0, 2, 0),  # started after `before`: counted from zero
             4: ThreadStat(1_000, 0, 0, 0)}  # ~idle: left out
    names = {1: "omp", 2: "omp", 3: "loop", 4: "idle"}
    rows = per_token(before, after, names, tokens=10)
    assert rows["omp"] == {"cpu_ms": 3.0, "wait_ms": 0.6, "vol": 7.0, "invol": 0.4}
    assert rows["loop"] == {"cpu_ms": 0.5, "wait_ms": 0.0, "vol": 0.2, "invol": 0.0}
    assert "idle" not in rows


def test_read_threads_sees_a_busy_thread_of_this_process() -> None:
    if not os.path.exists(f"/proc/{os.getpid()}/task"):
        pytest.skip("no /proc")
    done = threading.Event()
    tids: list[int] = []

    def spin() -> None:
        tids.append(threading.get_native_id())
        x = 0
        while not done.is_set():
            x += 1

    t = threading.Thread(target=spin, name="probe-spin")
    t.start()
    try:
        while not tids:
            pass
        first = read_threads(os.getpid())
        done.wait(0.2)
        second = read_threads(os.getpid())
        names = thread_names(os.getpid())  # while the thread lives
    finally:
        done.set()
        t.join()
    tid = tids[0]
    assert tid in first and tid in second
    assert second[tid].cpu_ns > first[tid].cpu_ns  # it ran meanwhile
    assert names.get(tid) in ("probe-spin", "comm:probe-spin")  # py-spy's name, or the kernel's
