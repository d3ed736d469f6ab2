"""Mooncake backend against a real mooncake_master on loopback: silent eviction, corrupt values,
a killed master, and the master's sockets staying on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from services.kvstore.backend import KVStoreBackend, key_str
from services.kvstore.mooncake_master import MooncakeMaster, free_port
from services.kvstore.page_record import HEADER_SIZE
from tests.kvstore.conftest import KiB, MiB, PageFactory, new_fp, open_mooncake


def _listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            if v6:
                addr = "::" if int(addr_hex, 16) == 0 else addr_hex
            else:
                addr = ".".join(str(b) for b in struct.pack("<I", int(addr_hex, 16)))
            found.append((addr, int(port_hex, 16)))
    return found


def test_master_listens_only_on_loopback(mooncake_master: MooncakeMaster) -> None:
    assert mooncake_master.proc is not None
    sockets = _listening_sockets(mooncake_master.proc.pid)
    assert (("127.0.0.1", mooncake_master.rpc_port)) in sockets
    assert all(addr == "127.0.0.1" for addr, _ in sockets), sockets


async def test_corrupt_values_are_misses(shared_mooncake: KVStoreBackend, page: PageFactory) -> None:
    store = shared_mooncake._store  # type: ignore[attr-defined]
    fp = new_fp()
    (h1, data, crc), (h2, _, _), (h3, _, _) = page(4 * KiB), page(4 * KiB), page(4 * KiB)
    assert await shared_mooncake.put(fp, h1, data, crc)
    good = store.get(key_str(fp, h1))
    assert len(good) == HEADER_SIZE + len(data)
    # Same header, one payload bit flipped: CRC failure.
    bad = bytearray(good)
    bad[HEADER_SIZE + 7] ^= 1
    assert store.put(key_str(fp, h2), bytes(bad).replace(h1, h2, 1)) == 0
    # A value written by someone else (no header).
    assert store.put(key_str(fp, h3), b"not a pdserve page") == 0
    before = shared_mooncake.stats().tier("mooncake").corrupt
    assert await shared_mooncake.get(fp, h2) is None
    assert await shared_mooncake.get(fp, h3) is None
    assert shared_mooncake.stats().tier("mooncake").corrupt == before + 2
    assert await shared_mooncake.lookup(fp, [h2]) == 0  # the corrupt value was removed
    assert await shared_mooncake.get(fp, h1) == data


async def test_silent_eviction_surfaces_as_misses(mooncake_master: MooncakeMaster, page: PageFactory) -> None:
    b = await open_mooncake(mooncake_master, segment_bytes=16 * MiB)
    try:
        fp = new_fp()
        pages = [page(1 * MiB) for _ in range(40)]
        for p in pages:
            await b.put(fp, *p)  # may be refused (False) when the segment is full: never raises
        got = [await b.get(fp, h) for h, _, _ in pages]
        assert all(g is None or g == p[1] for g, p in zip(got, pages, strict=True))
        assert 0 < sum(g is not None for g in got) < len(pages)
        assert b.stats().tier("mooncake").misses >= sum(g is None for g in got)
    finally:
        await b.close()


async def test_master_killed_gives_misses_not_exceptions(mooncake_master: MooncakeMaster,
                                                         page: PageFactory) -> None:
    b = await open_mooncake(mooncake_master, op_timeout_s=1.0)
    fp = new_fp()
    h, data, crc = page(8 * KiB)
    assert await b.put(fp, h, data, crc)
    assert await b.get(fp, h) == data
    mooncake_master.kill()
    t0 = time.monotonic()
    assert await b.get(fp, h) is None
    assert await b.lookup(fp, [h]) == 0
    h2, data2, crc2 = page(8 * KiB)
    assert await b.put(fp, h2, data2, crc2) is False
    assert await b.delete(fp, [h]) == 0
    assert await b.delete_layout(fp) == 0
    for _ in range(20):  # after the first failure, calls fail fast
        assert await b.get(fp, h) is None
    elapsed = time.monotonic() - t0
    assert elapsed < 6, f"calls against a dead master took {elapsed:.1f}s"
    stats = b.stats().tier("mooncake")
    assert stats.errors >= 1 and stats.misses >= 21
    # Closing a client whose master is gone blocks the whole process (~10 s, GIL held in native code);
    # a fresh master on the same port lets it unmount and close at once.
    with MooncakeMaster(rpc_port=mooncake_master.rpc_port):
        assert await b.get(fp, h) is None  # the new master knows nothing: still a miss, never old bytes
        await b.close()


def test_a_kvstore_whose_master_is_gone_stops_cleanly_without_the_native_unmount(
        mooncake_master: MooncakeMaster, tmp_path: Path) -> None:
    """A kvstore pod deleted beside the master's (every pod of a namespace gets SIGTERM together): the
    master is gone by the time the kvstore leaves. The native unmount (in close and in Mooncake's exit-time
    cleanup) would retry for 10 s and more holding the GIL, past a kubelet's grace: the service dials the
    master, skips it, and leaves with exit 0."""
    log_path = tmp_path / "kvstore.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.kvstore", "--host=127.0.0.1", f"--port={free_port()}",
             f"--metrics-port={free_port()}", "--backend=mooncake", f"--mooncake-master={mooncake_master.address}",
             "--mooncake-local-hostname=127.0.0.1", f"--mooncake-segment-bytes={16 * MiB}",
             f"--mooncake-buffer-bytes={16 * MiB}", f"--max-page-bytes={8 * MiB}", "--grace-s=0"],
            stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    try:
        deadline = time.monotonic() + 120  # a busy box: slow start is not a failure
        while b"PDSERVE_READY" not in log_path.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        mooncake_master.kill()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert "does not answer; leaving without unmounting" in text, text[-3000:]
    assert "Failed to unmount segment" not in text, text[-3000:]
