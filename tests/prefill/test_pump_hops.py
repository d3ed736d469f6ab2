"""The sender task waits for a chunk's page export in a worker thread only while the copy is in flight:
a CPU export (or a GPU copy already done) is read at once, without a thread hand-off on the TTFT path."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.engine.kv_pages import PageExport
from services.prefill import kv_stream


class _Copy:
    """Stands for the CUDA event recorded after an export's device-to-host copy."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1


@pytest.fixture
def hops(monkeypatch) -> list[object]:
    """Every function the code under test handed to a worker thread."""
    calls: list[object] = []
    real = asyncio.to_thread

    async def to_thread(fn, *args):
        calls.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(kv_stream.asyncio, "to_thread", to_thread)
    return calls


@pytest.mark.parametrize("done", [None, _Copy(True)], ids=["cpu", "gpu-copy-done"])
async def test_a_landed_export_is_read_without_a_thread(hops, done) -> None:
    pages = torch.arange(8, dtype=torch.float32)
    assert await kv_stream._landed(PageExport(pages, done)) is pages
    assert hops == []


async def test_an_export_in_flight_is_waited_for_in_a_worker_thread(hops) -> None:
    copy = _Copy(False)
    pages = torch.arange(8, dtype=torch.float32)
    export = PageExport(pages, copy)
    assert await kv_stream._landed(export) is pages
    assert hops == [export.wait] and copy.synchronized == 1
