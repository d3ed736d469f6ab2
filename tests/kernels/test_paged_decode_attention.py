from __future__ import annotations

import pytest
import torch

from tests.kernels import kernel_cases
from tests.kernels.kernel_cases import assert_close, make_paged_kv, plain_attention, requires_cuda

pytest.importorskip("triton")

from services.kernels.paged_decode_attention import paged_decode_attention
from services.kernels.reference import ref_paged_decode_attention

CONTEXTS = [1, 13, 100, 16]


def _run(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    contexts: list[int],
    partition_size: int | None = None,
    block_n: int | None = None,
    window: int = 0,
    with_sinks: bool = False,
) -> None:
    kv = make_paged_kv(contexts, num_kv_heads, head_dim, block_size, dtype, device)
    q = torch.randn((len(contexts), num_heads, head_dim), generator=torch.Generator().manual_seed(1)).to(
        dtype
    )
    q = q.to(device)
    scale = head_dim**-0.5
    sinks = None
    if with_sinks:
        sinks = (2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(2))).to(device)
    out = paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale,
        partition_size=partition_size, block_n=block_n, window=window, sinks=sinks,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype
    ref = ref_paged_decode_attention(
        q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, kv.context_lens, scale,
        window=window, sinks=sinks,
    )  # fmt: skip
    assert_close(out, ref, dtype)
    # The reference itself against attention written out on each sequence's contiguous K/V.
    for b, ctx in enumerate(contexts):
        plain = plain_attention(
            q[b : b + 1], kv.k_seqs[b], kv.v_seqs[b], scale, q_offset=ctx - 1, window=window, sinks=sinks
        )
        torch.testing.assert_close(ref[b : b + 1], plain, atol=1e-5, rtol=1e-5)


@kernel_cases.attention_cases([(4, 4), (6, 2), (8, 2)])
def test_decode_matches_reference(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    _run(device, dtype, num_heads, num_kv_heads, head_dim, 16, CONTEXTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_size", [32, 64])
def test_decode_split_k(device: torch.device, dtype: torch.dtype, partition_size: int) -> None:
    _run(device, dtype, 8, 2, 64, 16, CONTEXTS, partition_size=partition_size, block_n=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_odd_block_size_and_head_dim_128(device: torch.device, dtype: torch.dtype) -> None:
    _run(device, dtype, 6, 2, 128, 7, [1, 13, 100], partition_size=32, block_n=16)
    _run(device, dtype, 4, 1, 128, 7, [5, 29])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "with_sinks"), [(5, False), (16, True), (40, False), (40, True), (1000, True)])
def test_decode_window_and_sinks(device: torch.device, dtype: torch.dtype, window: int, with_sinks: bool) -> None:
    # Windows smaller than a block, exactly one block, spanning several blocks, beyond every context; GQA.
    _run(device, dtype, 8, 2, 64, 16, CONTEXTS, window=window, with_sinks=with_sinks)


@pytest.mark.parametrize("window", [0, 7, 50])
def test_decode_window_and_sinks_split_k(device: torch.device, window: int) -> None:
    _run(device, torch.float32, 6, 2, 64, 7, [1, 13, 100, 150], partition_size=32, block_n=16, window=window,
         with_sinks=True)


def test_decode_window_never_reads_outside_it(device: torch.device) -> None:
    # Keys before the window hold NaN: any read of them (even masked to -inf, NaN * 0) would show.
    kv = make_paged_kv([100], 2, 64, 16, torch.float32, device)
    q = torch.randn((1, 4, 64), generator=torch.Generator().manual_seed(1)).to(device)
    clean = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125, window=20)
    for blk in kv.block_tables[0, :4].tolist():  # keys 0..63: wholly before the window 80..99
        kv.k_cache[blk] = float("nan")
        kv.v_cache[blk] = float("nan")
    out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125, window=20)
    assert torch.equal(out, clean)


@pytest.mark.parametrize("window", [0, 200])
def test_decode_partitions_follow_each_sequence_not_the_bound(device: torch.device, window: int) -> None:
    """Default partitions are sized from each sequence's own length on the device: a launch with a far larger
    bound on the contexts (a CUDA graph's, captured for the longest context) splits them exactly as a launch with
    the step's own bound does, so both give bit-equal outputs, and both match the reference."""
    from services.kernels import paged_decode_attention as pda

    contexts = [150, 200, 1]
    assert pda._spread(len(contexts), 1, device) > 1  # a split launch on this device (else nothing is tested)
    kv = make_paged_kv(contexts, 1, 64, 16, torch.float32, device)
    q = torch.randn((len(contexts), 4, 64), generator=torch.Generator().manual_seed(3)).to(device)
    outs = [paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125,
                                   max_context_len=bound, window=window)
            for bound in (200, 4096)]
    assert torch.equal(outs[0], outs[1])
    ref = ref_paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125,
                                     window=window)
    assert_close(outs[1], ref, torch.float32)


def test_decode_empty_batch(device: torch.device) -> None:
    kv = make_paged_kv([3], 1, 64, 16, torch.float32, device)
    q = torch.empty((0, 2, 64), device=device)
    out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables[:0], kv.context_lens[:0], 0.125)
    assert out.shape == (0, 2, 64)


def test_decode_rejects_bad_gqa(device: torch.device) -> None:
    kv = make_paged_kv([3], 2, 64, 16, torch.float32, device)
    q = torch.randn((1, 3, 64), device=device)
    with pytest.raises(AssertionError, match="num_heads"):
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_decode_gpu_llama_shapes(dtype: torch.dtype, batch: int) -> None:
    gen = torch.Generator().manual_seed(batch)
    contexts = torch.randint(1, 2049, (batch,), generator=gen).tolist()
    contexts[0] = 2048
    _run(torch.device("cuda"), dtype, 32, 8, 128, 16, contexts)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 64])
def test_decode_gpu_gpt_oss_window_and_sinks(batch: int) -> None:
    # gpt-oss-20b's sliding layers: 64 query heads over 8 kv heads, head_dim 64, window 128, sinks.
    gen = torch.Generator().manual_seed(batch)
    contexts = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    contexts[0] = 4096
    _run(torch.device("cuda"), torch.bfloat16, 64, 8, 64, 16, contexts, window=128, with_sinks=True)
