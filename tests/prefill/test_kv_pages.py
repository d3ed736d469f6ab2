"""The engine's page API (services/engine/kv_pages.py): export gathers exactly the requested pages, import
puts them back; on GPU the export runs on a side stream that later work on the compute stream cannot
overtake (a block reused right after its export still exports its old contents)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.engine.kv_pages import KVPages

SHAPE = (3, 2, 12, 4, 2, 8)  # [layers, 2, blocks, block_size, kv_heads, head_dim]


def _runner(cache: torch.Tensor) -> SimpleNamespace:
    def write_pages(block_ids, pages, codec=None):
        from kernels import unpack_pages

        unpack_pages(pages.to(cache.device), cache, torch.tensor(block_ids, dtype=torch.int64, device=cache.device))

    return SimpleNamespace(kv_cache=cache, device=cache.device, kv_destination=None, num_layers=SHAPE[0],
                           block_size=SHAPE[3], num_kv_heads=SHAPE[4], head_dim=SHAPE[5], dtype=cache.dtype, spec=None,
                           write_pages=write_pages)


def _expected(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.stack([cache[:, :, b] for b in ids]).cpu()


def test_export_then_import_moves_exactly_the_pages() -> None:
    src = torch.randn(SHAPE)
    pages = KVPages(_runner(src))
    ids = [5, 6, 7, 1, 9]
    got = pages.export(ids).wait()
    assert got.shape == (len(ids), SHAPE[0], 2, *SHAPE[3:])
    assert torch.equal(got, _expected(src, ids))
    dst = torch.zeros(SHAPE)
    KVPages(_runner(dst)).import_pages([0, 2, 3, 4, 11], got)
    for a, b in zip(ids, [0, 2, 3, 4, 11], strict=True):
        assert torch.equal(dst[:, :, b], src[:, :, a])
    assert pages.page_shape == (SHAPE[0], 2, *SHAPE[3:]) and pages.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_export_is_ordered_before_later_compute_that_reuses_the_blocks() -> None:
    cache = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    pages = KVPages(_runner(cache))
    ids = [2, 3, 4, 10]
    want = _expected(cache, ids)
    torch.cuda._sleep(50_000_000)  # the "step" is still running on the compute stream when export is called
    exp = pages.export(ids)
    assert exp.done is not None and exp.host.is_pinned()
    cache[:, :, ids] = 0  # the next step reuses the blocks: it must run after the gather
    got = exp.wait()
    assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert not cache[:, :, ids].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_back_to_back_exports_into_one_staging_buffer_each_get_their_pages() -> None:
    """Gathers and host copies run on separate side streams (a gather never queues behind an earlier copy):
    two exports issued while the step still runs, then the blocks reused, each land their own old pages."""
    cache = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    pages = KVPages(_runner(cache))
    out = torch.empty((8, SHAPE[0], 2, *SHAPE[3:]), dtype=cache.dtype, pin_memory=True)
    first, second = [1, 2, 3], [7, 8]
    want_first, want_second = _expected(cache, first), _expected(cache, second)
    torch.cuda._sleep(50_000_000)
    a = pages.export(first, out=out[:3])
    b = pages.export(second, out=out[3:5])
    cache[:, :, first + second] = 0
    assert torch.equal(b.wait(), want_second) and torch.equal(a.wait(), want_first)
    assert out[:5].data_ptr() == a.host.data_ptr()  # written in place: the staging view, no copy of it
