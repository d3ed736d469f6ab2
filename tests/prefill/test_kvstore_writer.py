"""The kvstore write-back through the writer process: pages cross a shared-memory ring and are put by a child
process (services/prefill/kvstore_writeback.py, writeback_ring.py, kvstore_writer.py).

Byte-identical pages in the store, a full ring that drops (counted) without blocking the engine thread, a
writer killed or frozen mid-run (requests served, skips counted, a new writer resumes), mTLS with the prefill's
own certificate, and shutdown leaving neither the child nor the /dev/shm file behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.common.config import ConfigError
from services.common.grpc_util import create_channel, server_options
from services.common.kvstore_client import KVStoreClient
from services.common.metrics import PREFILL_KVSTORE_ERRORS_TOTAL
from services.common.pb import kvstore_pb2_grpc
from services.common.tls import TLSConfig, make_certs
from services.engine.kv_pages import PageExport
from services.kvstore.embedded import EmbeddedBackend
from services.kvstore.servicer import KVStoreServicer
from services.prefill import kvstore_writeback as wb
from services.prefill import kvstore_writer as wire
from services.prefill import writeback_ring
from services.prefill.config import PrefillConfig
from services.prefill.kvstore_prefix import KVStorePrefix
from tests.grpc_server import loopback_server
from tests.prefill.conftest import PrefillRig, prefill_request
from tests.prefill.test_kvstore_outage import Store, _written

MiB = 1 << 20
RING = 16 * MiB


def _prompt(k: int, n: int = 70) -> list[int]:
    return [(i * 37 + 11 * k) % 500 + 2 for i in range(n)]  # 70 tokens: 4 full pages + 6


def _cfg(store: Store, **kw) -> PrefillConfig:
    return PrefillConfig(kvstore_address=f"127.0.0.1:{store.port}", kvstore_write_back_bytes=RING, **kw)


def _alive(pid: int) -> bool:
    """The process exists (a zombie too: only reaping removes /proc/<pid>)."""
    return os.path.exists(f"/proc/{pid}")


def _ring_files() -> list[str]:
    """This process's write-back ring files under /dev/shm."""
    return [n for n in os.listdir(writeback_ring.SHM_DIR) if n.startswith(f"pdserve-kvwb-{os.getpid()}-")]


def _mapped(pid: int, path: str) -> bool:
    """``pid`` maps ``path``, unlinked."""
    return f"{path} (deleted)" in Path(f"/proc/{pid}/maps").read_text()


def _errors(rig: PrefillRig, reason: str) -> float:
    return rig.metric(PREFILL_KVSTORE_ERRORS_TOTAL, reason=reason)


async def _until(cond, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _sent_pages(rig: PrefillRig, request_id: str, page_bytes: int) -> dict[int, bytes]:
    """Block index -> page bytes the request's KV stream carried to decode (the engine's pages)."""
    pages: dict[int, bytes] = {}
    for c in rig.receiver.chunks:
        if c.request_id == request_id and c.payload:
            for i in range(c.num_pages):
                pages[c.first_block + i] = c.payload[i * page_bytes:(i + 1) * page_bytes]
    return pages


async def _store_pages(store: Store, fp: str, hashes: list[bytes]) -> list[bytes]:
    async with create_channel(f"127.0.0.1:{store.port}") as ch:
        got = await KVStoreClient(ch).get(fp, hashes)
    return [p.data for p in got]


@pytest.fixture
async def store():
    s = Store()
    await s.start()
    yield s
    if s.server is not None:
        await s.stop()
    await s.backend.close()


@pytest.fixture
def no_put_here(monkeypatch) -> list[str]:
    """Every Put this (the prefill's) process makes: none may happen, the writer process puts the pages."""
    calls: list[str] = []

    async def refuse(self, *args, **kwargs):
        calls.append("put")
        raise AssertionError("a kvstore Put from the prefill's own process")

    monkeypatch.setattr(KVStoreClient, "put_serialized", refuse)
    monkeypatch.setattr(KVStoreClient, "put", refuse)
    return calls


async def test_pages_written_back_are_the_engines_bytes(make_prefill, store, no_put_here) -> None:
    rig = await make_prefill(config=_cfg(store))
    kv = rig.servicer.kvstore
    assert await kv.writer.wait_up() and kv.writer.pid not in (None, os.getpid())
    fp, pb = rig.servicer.layout.fingerprint, rig.servicer.layout.page_bytes
    for k in range(3):
        await rig.stub.Prefill(prefill_request(_prompt(k), request_id=f"r{k}"))
    for k in range(3):
        await _written(store, rig, _prompt(k))
        hashes = kv.hashes(_prompt(k))
        stored = await _store_pages(store, fp, hashes)
        sent = _sent_pages(rig, f"r{k}", pb)
        assert len(stored) == len(hashes) == 4 and all(len(p) == pb for p in stored)
        assert stored == [sent[i] for i in range(4)], f"prompt {k}: the store's pages differ from the engine's"
    assert not no_put_here
    await _until(lambda: kv.writer.ring.free_bytes == kv.writer.ring.capacity, what="every span back")
    assert _errors(rig, "put") == _errors(rig, "writer") == _errors(rig, "write_back_dropped") == 0


async def test_full_ring_drops_counted_and_never_blocks_the_engine_thread(make_prefill, store) -> None:
    rig = await make_prefill(config=_cfg(store))
    kv = rig.servicer.kvstore
    assert await kv.writer.wait_up()
    ring = kv.writer.ring
    held = ring.try_take(ring.capacity)  # the whole ring is out: no span for anyone
    assert held is not None
    calls: list[tuple[str, float, object]] = []
    real_begin = kv.write_back_begin

    def timed_begin(block_ids):
        t0 = time.perf_counter()
        got = real_begin(block_ids)
        calls.append((threading.current_thread().name, time.perf_counter() - t0, got))
        return got

    kv.write_back_begin = timed_begin
    waits = ring.waits
    dropped = _errors(rig, "write_back_dropped")
    resp = await asyncio.wait_for(rig.stub.Prefill(prefill_request(_prompt(0), request_id="full")), 10.0)
    assert resp.num_prompt_tokens == 70
    ((thread, seconds, got),) = calls
    assert got == "write_back_dropped" and thread != threading.main_thread().name
    assert seconds < 0.05, f"the engine thread spent {seconds:.3f} s on a full ring"
    assert ring.waits == waits + 1
    assert _errors(rig, "write_back_dropped") == dropped + 1
    assert not await store.backend.locate(rig.servicer.layout.fingerprint, kv.hashes(_prompt(0)))

    ring.give(held, ring.capacity)  # room again: the next prompt is written
    await rig.stub.Prefill(prefill_request(_prompt(1), request_id="room"))
    await _written(store, rig, _prompt(1))
    assert not isinstance(calls[-1][2], str)


async def test_write_back_larger_than_the_ring_is_dropped(make_prefill, store) -> None:
    rig = await make_prefill(config=PrefillConfig(kvstore_address=f"127.0.0.1:{store.port}",
                                                  kvstore_write_back_bytes=4096))
    kv = rig.servicer.kvstore
    assert await kv.writer.wait_up() and kv.layout.page_bytes * 4 > 4096
    await rig.stub.Prefill(prefill_request(_prompt(0), request_id="big"))
    assert _errors(rig, "write_back_dropped") == 1
    assert not await store.backend.locate(kv.layout.fingerprint, kv.hashes(_prompt(0)))


async def test_killed_writer_requests_served_skips_counted_new_writer_resumes(make_prefill, store, monkeypatch
                                                                             ) -> None:
    monkeypatch.setattr(wb, "RESTART_BACKOFF_S", (3.0, 3.0))  # a down window a request fits in
    rig = await make_prefill(config=_cfg(store, slowdown_ms_per_chunk=10))  # ~0.1 s a request: killed mid-run
    kv = rig.servicer.kvstore
    assert await kv.writer.wait_up()
    first_pid = kv.writer.pid
    expected = {k: (await rig.stub.Prefill(prefill_request(_prompt(k), request_id=f"ref{k}"))).first_token
                for k in range(100, 106)}

    # Mid-run: requests in flight while the writer is killed.
    calls = [asyncio.ensure_future(rig.stub.Prefill(prefill_request(_prompt(k), request_id=f"m{k}")))
             for k in range(100, 106)]
    await asyncio.sleep(0.05)
    os.kill(first_pid, signal.SIGKILL)
    for k, call in zip(range(100, 106), calls, strict=True):
        assert (await asyncio.wait_for(call, 20.0)).first_token == expected[k]
    await _until(lambda: kv.writer.state == "down", what="the death seen")

    # Down: write-backs are skipped, counted, and requests are served.
    writer_skips = _errors(rig, "writer")
    resp = await rig.stub.Prefill(prefill_request(_prompt(1), request_id="down"))
    assert resp.num_prompt_tokens == 70 and kv.writer.state == "down"
    assert _errors(rig, "writer") == writer_skips + 1
    assert not await store.backend.locate(kv.layout.fingerprint, kv.hashes(_prompt(1)))
    assert not _alive(first_pid), "the dead writer was not reaped"

    # Restarted: a new process, and writes land again.
    assert await kv.writer.wait_up(20.0) or await _until_up(kv)
    assert kv.writer.pid != first_pid and kv.writer.restarts >= 1
    await rig.stub.Prefill(prefill_request(_prompt(2), request_id="back"))
    await _written(store, rig, _prompt(2))
    await _until(lambda: kv.writer.ring.free_bytes == kv.writer.ring.capacity, what="every span back")


async def _until_up(kv: KVStorePrefix) -> bool:
    await _until(lambda: kv.writer.state == "up", what="a new writer")
    return True


async def test_frozen_writer_is_replaced_and_its_write_counted(make_prefill, store, monkeypatch) -> None:
    """A writer that stops answering (SIGSTOP) with a write-back under way: the health check kills it, the write
    is counted as skipped, its span goes back, and the next writer puts new pages."""
    monkeypatch.setattr(wb, "HEALTH_EVERY_S", 0.1)
    monkeypatch.setattr(wb, "HEALTH_TIMEOUT_S", 1.0)
    monkeypatch.setattr(wb, "RESTART_BACKOFF_S", (0.1, 0.1))
    rig = await make_prefill(config=_cfg(store, kvstore_max_pending_writes=1))
    kv = rig.servicer.kvstore
    assert await kv.writer.wait_up()
    frozen = kv.writer.pid
    os.kill(frozen, signal.SIGSTOP)
    try:
        skips = _errors(rig, "writer")
        await rig.stub.Prefill(prefill_request(_prompt(0), request_id="stuck"))  # its write-back waits on the writer
        # The bound holds while it waits: the next write-back is dropped on the engine thread.
        await rig.stub.Prefill(prefill_request(_prompt(1), request_id="second"))
        assert _errors(rig, "write_back_dropped") == 1
        await _until(lambda: kv.writer.pid not in (None, frozen), what="a new writer")
    finally:
        if _alive(frozen):
            os.kill(frozen, signal.SIGCONT)
    assert not _alive(frozen), "the frozen writer was not killed"
    assert _errors(rig, "writer") == skips + 1
    assert not await store.backend.locate(kv.layout.fingerprint, kv.hashes(_prompt(0)))
    await _until(lambda: kv.writer.ring.free_bytes == kv.writer.ring.capacity, what="the span back")
    await rig.stub.Prefill(prefill_request(_prompt(2), request_id="after"))
    await _written(store, rig, _prompt(2))


async def test_shutdown_stops_the_writer_and_leaves_no_shm_file(make_prefill, store) -> None:
    rig = await make_prefill(config=_cfg(store))
    kv = rig.servicer.kvstore
    assert await kv.writer.wait_up()
    pid, path, fd = kv.writer.pid, kv.writer.ring.path, kv.writer.ring.fd
    # Unlinked once mapped: while serving, the ring lives only in the two processes' mappings.
    assert not _ring_files() and _mapped(os.getpid(), path)
    assert _mapped(pid, path), "the writer has not mapped the ring"
    await rig.stub.Prefill(prefill_request(_prompt(0), request_id="one"))
    await _written(store, rig, _prompt(0))

    for close in rig.closers:
        await close()
    rig.closers.clear()
    assert not _alive(pid), "the writer process outlived the prefill's shutdown"
    assert kv.writer.state == "closed" and kv.writer.ring.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)
    assert not _ring_files() and not _mapped(os.getpid(), path)


def test_orphaned_ring_files_are_removed_at_start(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"pdserve-kvwb-{dead.pid}-{'a' * 12}"
    live = tmp_path / f"pdserve-kvwb-{os.getpid()}-{'b' * 12}"
    other = tmp_path / "pdserve-kv-1-abc"
    for p in (orphan, live, other):
        p.write_bytes(b"x")
    ring = writeback_ring.ShmRing(1 * MiB, torch.device("cpu"), str(tmp_path))
    try:
        assert not orphan.exists() and live.exists() and other.exists()
        assert not Path(ring.path).exists()
    finally:
        ring.close()


def test_ring_larger_than_memory_is_refused_in_one_line(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path)
    mem = writeback_ring.host_memory()
    assert mem is not None
    huge = max(free.f_bavail * free.f_frsize, mem.available_bytes) + (1 << 30)
    with pytest.raises(writeback_ring.RingError, match="--kvstore-write-back-bytes") as e:
        writeback_ring.ShmRing(huge, torch.device("cpu"), str(tmp_path))
    assert "\n" not in str(e.value) and "memfd" in str(e.value)
    assert not list(tmp_path.iterdir())


async def test_small_dev_shm_falls_back_to_a_memfd(make_prefill, store, monkeypatch) -> None:
    """A /dev/shm smaller than the ring (a container's 64 MiB) gives an anonymous memfd: pages still go through
    the writer process, byte for byte."""
    real = os.statvfs

    def tiny(path):
        st = real(path)
        return SimpleNamespace(f_bavail=1, f_frsize=st.f_frsize) if str(path) == writeback_ring.SHM_DIR else st

    monkeypatch.setattr(writeback_ring.os, "statvfs", tiny)
    rig = await make_prefill(config=_cfg(store))
    kv = rig.servicer.kvstore
    assert await kv.writer.wait_up()
    assert kv.writer.ring.path == "/memfd:pdserve-kvwb" and not _ring_files()
    assert _mapped(kv.writer.pid, kv.writer.ring.path)
    await rig.stub.Prefill(prefill_request(_prompt(0), request_id="memfd"))
    await _written(store, rig, _prompt(0))
    stored = await _store_pages(store, kv.layout.fingerprint, kv.hashes(_prompt(0)))
    sent = _sent_pages(rig, "memfd", kv.layout.page_bytes)
    assert stored == [sent[i] for i in range(4)]


def test_write_back_bytes_option() -> None:
    assert PrefillConfig().write_back_bytes("cuda") == 1 << 30
    assert PrefillConfig().write_back_bytes("cpu") == 256 * MiB
    assert PrefillConfig(kvstore_write_back_bytes=64 * MiB).write_back_bytes("cuda") == 64 * MiB
    with pytest.raises(ConfigError) as e:
        PrefillConfig(kvstore_write_back_bytes=-1)
    assert "--kvstore-write-back-bytes" in str(e.value) and "\n" not in str(e.value)


def test_writer_process_loads_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, services.prefill.kvstore_writer; "
                          "print(sorted(m for m in ('torch', 'triton', 'services.engine') if m in sys.modules))"],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


def test_put_frames_outside_the_ring_are_refused() -> None:
    h = bytes(16)
    assert wire.put_problem([wire.PUT, 1, 0, 2, 100, [h, h]], 4096, 100) is None
    assert "not inside" in wire.put_problem([wire.PUT, 1, 4000, 2, 100, [h, h]], 4096, 100)
    assert "not inside" in wire.put_problem([wire.PUT, 1, -1, 1, 100, [h]], 4096, 100)
    assert "200 bytes" in wire.put_problem([wire.PUT, 1, 0, 1, 200, [h]], 4096, 100)
    assert "hash" in wire.put_problem([wire.PUT, 1, 0, 2, 100, [h]], 4096, 100)
    assert "integers" in wire.put_problem([wire.PUT, 1, "0", 1, 100, [h]], 4096, 100)


# --- mTLS: the writer presents the prefill's own certificate ----------------------------------------


def _tls(d: Path, role: str) -> TLSConfig:
    return TLSConfig(tls_cert=str(d / f"{role}.pem"), tls_key=str(d / f"{role}-key.pem"), tls_ca=str(d / "ca.pem"))


@pytest.mark.parametrize("role", ["prefill", "router"])
async def test_writer_puts_with_the_prefills_certificate(tmp_path: Path, role: str) -> None:
    certs = make_certs(tmp_path / "certs", roles=("kvstore", "prefill", "router"))
    backend = EmbeddedBackend(memory_bytes=64 * MiB)
    servicer = KVStoreServicer(backend, max_page_bytes=4 * MiB, tls_on=True)
    server, address = await loopback_server(lambda s: kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, s),
                                            _tls(certs, "kvstore"), options=server_options())
    page_bytes, n = 8192, 5
    layout = SimpleNamespace(fingerprint="0123456789abcdef", page_bytes=page_bytes, block_size=16)
    errors: list[str] = []
    kv = KVStorePrefix(address, layout, (page_bytes,), torch.uint8, tls=_tls(certs, role),  # type: ignore[arg-type]
                       on_error=errors.append)
    pages = torch.randint(0, 256, (n, page_bytes), dtype=torch.uint8)

    def export(block_ids: list[int], out: torch.Tensor) -> PageExport:
        out.copy_(pages[block_ids])
        return PageExport(out)

    try:
        assert kv.start_writer(export, torch.device("cpu"), RING) and await kv.writer.wait_up()
        hashes = [bytes([i]) * 16 for i in range(n)]
        span = kv.write_back_begin(list(range(n)))
        assert not isinstance(span, str)
        kv.write_back(hashes, 0, span)
        await _until(lambda: kv.writer.ring.free_bytes == kv.writer.ring.capacity, what="the writer's answer")
        present = await backend.locate(layout.fingerprint, hashes)
        if role == "prefill":
            assert len(present) == n and not errors
            for i, h in enumerate(hashes):
                got = await backend.get(layout.fingerprint, h)
                assert got is not None and bytes(got) == pages[i].numpy().tobytes()
        else:  # a router's certificate may not Put: refused, counted, nothing stored
            assert not present and errors == ["put"]
    finally:
        await kv.close()
        await server.stop(None)
        await backend.close()
