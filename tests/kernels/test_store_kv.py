from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import requires_cuda

pytest.importorskip("triton")

from services.kernels.reference import ref_store_kv
from services.kernels.store_kv import store_kv


def _run(
    device: torch.device,
    dtype: torch.dtype,
    num_tokens: int,
    kvh: int,
    hd: int,
    block_size: int,
    num_blocks: int,
) -> None:
    gen = torch.Generator().manual_seed(0)
    # k/v as strided views of a fused qkv projection, the way the model produces them.
    qkv = torch.randn((num_tokens, (4 + 2 * kvh) * hd), generator=gen).to(dtype).to(device)
    k = qkv[:, 4 * hd : (4 + kvh) * hd].view(num_tokens, kvh, hd)
    v = qkv[:, (4 + kvh) * hd :].view(num_tokens, kvh, hd)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[:: max(1, num_tokens // 3)] = -1
    slots = slots.to(device)
    kv_cache = torch.randn((1, 2, num_blocks, block_size, kvh, hd), generator=gen).to(dtype).to(device)
    expected = kv_cache.clone()
    store_kv(k, v, kv_cache[0, 0], kv_cache[0, 1], slots)
    ref_store_kv(k, v, expected[0, 0], expected[0, 1], slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_tokens", "kvh", "hd", "block_size"), [(1, 1, 64, 16), (13, 3, 64, 7), (100, 2, 128, 16)]
)
def test_store_kv_matches_reference(
    device: torch.device, dtype: torch.dtype, num_tokens: int, kvh: int, hd: int, block_size: int
) -> None:
    _run(device, dtype, num_tokens, kvh, hd, block_size, num_blocks=-(-num_tokens // block_size) + 4)


def test_store_kv_all_skipped_and_empty(device: torch.device) -> None:
    kv_cache = torch.zeros((1, 2, 2, 16, 1, 64), device=device)
    k = torch.ones((3, 1, 64), device=device)
    store_kv(k, k, kv_cache[0, 0], kv_cache[0, 1], torch.full((3,), -1, dtype=torch.int64, device=device))
    store_kv(k[:0], k[:0], kv_cache[0, 0], kv_cache[0, 1], torch.empty(0, dtype=torch.int64, device=device))
    assert not kv_cache.any()


def test_store_kv_rejects_int32_slots(device: torch.device) -> None:
    kv_cache = torch.zeros((1, 2, 2, 16, 1, 64), device=device)
    k = torch.ones((3, 1, 64), device=device)
    with pytest.raises(AssertionError):
        store_kv(k, k, kv_cache[0, 0], kv_cache[0, 1], torch.zeros(3, dtype=torch.int32, device=device))


@pytest.mark.gpu
@requires_cuda
def test_store_kv_gpu_llama_shapes() -> None:
    _run(torch.device("cuda"), torch.bfloat16, 8192, 8, 128, 16, num_blocks=1024)
