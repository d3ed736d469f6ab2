"""kvstore fixtures: backends (embedded memory-only, embedded memory+disk, Mooncake on a real
loopback mooncake_master) and small page factories."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from services.common.checksum import checksum
from services.kvstore.backend import KVStoreBackend
from services.kvstore.embedded import EmbeddedBackend
from services.kvstore.mooncake_master import MooncakeMaster, find_master_binary

T = TypeVar("T")
KiB = 1 << 10
MiB = 1 << 20
BACKENDS = ("memory", "disk", "mooncake")


def mooncake_skip_reason() -> str | None:
    """Why Mooncake tests cannot run here, or None. Only a genuinely absent install skips."""
    if importlib.util.find_spec("mooncake") is None:
        return "pip package mooncake-transfer-engine-non-cuda is not installed (no module 'mooncake')"
    if importlib.util.find_spec("mooncake.store") is None:
        return "the installed mooncake package has no mooncake.store (Mooncake Store client)"
    if find_master_binary() is None:
        return "mooncake_master binary not found in the mooncake package or on PATH"
    return None


def new_fp() -> str:
    """A fresh layout fingerprint, so tests sharing a Mooncake cluster never see each other's keys."""
    return os.urandom(8).hex()


def new_hash() -> bytes:
    return os.urandom(16)


PageFactory = Callable[[int], tuple[bytes, bytes, int]]


@pytest.fixture
def page() -> PageFactory:
    """page(size) -> (hash, payload, crc32)."""
    def make(size: int = 4 * KiB) -> tuple[bytes, bytes, int]:
        data = os.urandom(size)
        return new_hash(), data, checksum(data)
    return make


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A private master (for tests that kill it)."""
    reason = mooncake_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    master = MooncakeMaster(log_path=tmp_path / "mooncake_master.log")
    master.start()
    try:
        yield master
    finally:
        master.stop()


def _run_on_fresh_loop(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run in a helper thread (the caller may itself be inside a running loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@pytest.fixture(scope="session")
def shared_mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVStoreBackend]:
    """One master and one client for the whole session (client close takes ~2 s, master stop ~1 s).

    Tests isolate themselves with fresh layout fingerprints. The backend holds no event-loop state, so
    it is opened and closed on throwaway loops.
    """
    reason = mooncake_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    master = MooncakeMaster(log_path=tmp_path_factory.mktemp("mooncake") / "mooncake_master.log")
    master.start()
    try:
        backend = _run_on_fresh_loop(open_mooncake(master))
        try:
            yield backend
        finally:
            _run_on_fresh_loop(backend.close())
    finally:
        master.stop()


async def open_mooncake(master: MooncakeMaster, segment_bytes: int = 64 * MiB,
                        op_timeout_s: float = 5.0) -> KVStoreBackend:
    from services.kvstore.mooncake_backend import MooncakeBackend, MooncakeSettings

    settings = MooncakeSettings(master_address=master.address, global_segment_bytes=segment_bytes,
                                local_buffer_bytes=64 * MiB, op_timeout_s=op_timeout_s)
    return await MooncakeBackend(settings).open()


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[KVStoreBackend]:
    """Every backend, each with room for a few hundred KiB of test pages."""
    kind = request.param
    if kind == "memory":
        b: KVStoreBackend = EmbeddedBackend(memory_bytes=8 * MiB)
    elif kind == "disk":
        # A memory tier smaller than most test workloads, so spilling and promotion are exercised.
        b = EmbeddedBackend(memory_bytes=64 * KiB, disk_dir=tmp_path / "pages", disk_bytes=16 * MiB)
    else:
        yield request.getfixturevalue("shared_mooncake")
        return
    try:
        yield b
    finally:
        await b.close()
