from __future__ import annotations

import pytest
import torch

from tests.kernels import kernel_cases
from tests.kernels.kernel_cases import assert_close, make_paged_kv, plain_attention, requires_cuda

pytest.importorskip("triton")

from services.kernels.prefill_attention import prefill_attention
from services.kernels.reference import ref_prefill_attention

# (context_len, new tokens): pure prefill, extend after a cached prefix, single token, exact block.
SEQS = [(1, 1), (13, 13), (100, 37), (40, 1), (16, 16)]


def _run(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seqs: list[tuple[int, int]],
    block_m: int | None = None,
    block_n: int | None = None,
    window: int = 0,
    with_sinks: bool = False,
) -> None:
    contexts = [c for c, _ in seqs]
    q_lens = [n for _, n in seqs]
    kv = make_paged_kv(contexts, num_kv_heads, head_dim, block_size, dtype, device)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    cu = cu.to(device)
    total = int(cu[-1])
    q = (
        torch.randn((total, num_heads, head_dim), generator=torch.Generator().manual_seed(1))
        .to(dtype)
        .to(device)
    )
    scale = head_dim**-0.5
    sinks = None
    if with_sinks:
        sinks = (2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(2))).to(device)
    out = prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, scale,
        block_m=block_m, block_n=block_n, window=window, sinks=sinks,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype
    ref = ref_prefill_attention(
        q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, cu, kv.context_lens, scale,
        window=window, sinks=sinks,
    )  # fmt: skip
    assert_close(out, ref, dtype)
    for b, (ctx, n) in enumerate(seqs):
        q0 = int(cu[b])
        plain = plain_attention(
            q[q0 : q0 + n], kv.k_seqs[b], kv.v_seqs[b], scale, q_offset=ctx - n, window=window, sinks=sinks
        )
        torch.testing.assert_close(ref[q0 : q0 + n], plain, atol=1e-5, rtol=1e-5)


@kernel_cases.attention_cases([(2, 2), (3, 1), (4, 1)])
def test_prefill_matches_reference(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    _run(device, dtype, num_heads, num_kv_heads, head_dim, 16, SEQS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_small_tiles(device: torch.device, dtype: torch.dtype) -> None:
    _run(device, dtype, 3, 1, 64, 16, SEQS, block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_odd_block_size_and_head_dim_128(device: torch.device, dtype: torch.dtype) -> None:
    _run(device, dtype, 4, 1, 128, 7, [(1, 1), (13, 6), (100, 37)], block_m=32, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "with_sinks"), [(5, False), (16, True), (40, False), (40, True), (1000, True)])
def test_prefill_window_and_sinks(device: torch.device, dtype: torch.dtype, window: int, with_sinks: bool) -> None:
    # Windows smaller than a tile, one tile, several tiles (every loop of the kernel runs), beyond the context.
    _run(device, dtype, 4, 2, 64, 16, SEQS, block_m=16, block_n=16, window=window, with_sinks=with_sinks)


def test_prefill_window_default_tiles_and_sinks_alone(device: torch.device) -> None:
    _run(device, torch.float32, 3, 1, 64, 7, [(100, 37), (130, 130)], window=45)
    _run(device, torch.float32, 3, 1, 64, 16, SEQS, with_sinks=True)


def test_prefill_window_never_reads_outside_it(device: torch.device) -> None:
    # One new token at position 99 with window 20 after a 99-token prefix: keys 0..63 (four blocks)
    # hold NaN and must never be read.
    kv = make_paged_kv([100], 1, 64, 16, torch.float32, device)
    q = torch.randn((1, 2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, 0.125)
    clean = prefill_attention(*args, block_m=16, block_n=16, window=20)
    for blk in kv.block_tables[0, :4].tolist():
        kv.k_cache[blk] = float("nan")
        kv.v_cache[blk] = float("nan")
    assert torch.equal(prefill_attention(*args, block_m=16, block_n=16, window=20), clean)


def test_prefill_empty_sequence_in_batch(device: torch.device) -> None:
    _run(device, torch.float32, 2, 1, 64, 16, [(5, 5), (9, 0), (20, 3)])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prefill_gpu_llama_shapes(dtype: torch.dtype) -> None:
    seqs = [(2048, 2048), (3000, 1000), (517, 517), (1, 1)]
    _run(torch.device("cuda"), dtype, 32, 8, 128, 16, seqs)


@pytest.mark.gpu
@requires_cuda
def test_prefill_gpu_gpt_oss_window_and_sinks() -> None:
    seqs = [(2048, 2048), (3000, 1000), (517, 517), (1, 1)]
    _run(torch.device("cuda"), torch.bfloat16, 64, 8, 64, 16, seqs, window=128, with_sinks=True)
