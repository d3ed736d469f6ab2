"""The Triton latent (MLA) decode kernel against its torch reference, and the reference against attention written
out on each sequence's contiguous latents: DeepSeek-V2's 512 + 64 latent and tiny odd ones, split-K, padding rows."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import assert_close, plain_attention, requires_cuda
from tests.kernels.mla_cases import TINY, V2, latent_query, make_latent_cache

pytest.importorskip("triton")

from services.kernels.mla_decode_attention import mla_decode_attention
from services.kernels.reference import ref_mla_decode_attention


def _run(device: torch.device, dtype: torch.dtype, heads: int, widths: tuple[int, int], block_size: int,
         contexts: list[int], index_dim: int = 0, pooled: bool = True, **kw: object) -> torch.Tensor:
    case = make_latent_cache(contexts, widths, block_size, dtype, device, index_dim=index_dim, pooled=pooled)
    kv = case.kv
    q = latent_query(len(contexts), heads, case.key_dim, dtype, device)
    scale = (case.key_dim - widths[0] + 128) ** -0.5  # DeepSeek's qk_head_dim ** -0.5 (nope 128)
    out = mla_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale, case.value_dim,
                               **kw)
    assert out.shape == (len(contexts), heads, case.value_dim) and out.dtype == dtype
    ref = ref_mla_decode_attention(q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables,
                                   kv.context_lens, scale, case.value_dim)
    assert_close(out, ref, dtype)
    for b, ctx in enumerate(contexts):
        lat = case.latents[b]
        if ctx == 0:
            continue
        plain = plain_attention(q[b:b + 1], lat[..., :case.key_dim], lat[..., :case.value_dim], scale, ctx - 1)
        torch.testing.assert_close(ref[b:b + 1], plain, atol=1e-4, rtol=1e-4)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v2_latent_one_program_per_row(device: torch.device, dtype: torch.dtype) -> None:
    # DeepSeek-V2-Lite: 16 heads (one head group), 512 + 64 latent over planes of 288; contexts off the block grid.
    _run(device, dtype, 16, V2, 16, [1, 37, 70], partition_size=1024)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v2_latent_split_k(device: torch.device, dtype: torch.dtype) -> None:
    # Partitions of 32 keys merged by the reduce kernel; one sequence shorter than one partition.
    _run(device, dtype, 16, V2, 16, [100, 5, 33], partition_size=32, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [4, 6, 20])
def test_tiny_latent_odd_heads(device: torch.device, dtype: torch.dtype, heads: int) -> None:
    # 4 and 6 heads: one part-masked group; 20 heads: two groups. 32 + 8 latent: the rope part straddles no plane
    # edge, the value part does (planes of 20).
    _run(device, dtype, heads, TINY, 16, [1, 13, 100, 16])


def test_odd_block_size_split_k_and_separate_planes(device: torch.device) -> None:
    # Block size 7, partitions of 32: and the K / V planes as two separate tensors (not views of one pool).
    _run(device, torch.float32, 6, (24, 10), 7, [1, 13, 100, 50], pooled=False, partition_size=32, block_n=16)


def test_index_key_after_the_latent_is_not_attended(device: torch.device) -> None:
    # DeepSeek-V3.2's page: latent then a 16-value index key (planes of 28); key = the first 40 values only.
    _run(device, torch.float32, 4, TINY, 16, [9, 40], index_dim=16, partition_size=32, block_n=16)


@pytest.mark.parametrize("split", [False, True])
def test_padding_rows_write_zeros(device: torch.device, split: bool) -> None:
    # A CUDA graph's padding rows have context 0 (and slot -1): their output is 0, the other rows unaffected.
    case = make_latent_cache([20, 1, 30], TINY, 16, torch.float32, device)
    kv = case.kv
    kv.context_lens[1] = 0
    q = latent_query(3, 4, case.key_dim, torch.float32, device)
    kw = {"partition_size": 16, "block_n": 16} if split else {}
    out = mla_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2, 32,
                               max_context_len=64, **kw)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = ref_mla_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2, 32)
    assert_close(out[[0, 2]], ref[[0, 2]], torch.float32)


def test_partitions_follow_each_sequence_not_the_bound(device: torch.device) -> None:
    """Default partitions are sized per sequence on the device: a launch with a CUDA graph's far larger bound on
    the contexts splits them as a launch with the step's own bound does (bit-equal), padding row included."""
    from services.kernels import paged_decode_attention as pda

    case = make_latent_cache([150, 200, 1, 0], TINY, 16, torch.float32, device)
    kv = case.kv
    q = latent_query(4, 4, case.key_dim, torch.float32, device)
    assert pda._spread(4, 1, device) > 1  # a split launch on this device (else nothing is tested)
    outs = [mla_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2, 32,
                                 max_context_len=bound) for bound in (200, 4096)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1][3], torch.zeros_like(outs[1][3]))
    ref = ref_mla_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2, 32)
    assert_close(outs[1][:3], ref[:3], torch.float32)


def test_empty_batch_and_bad_shapes(device: torch.device) -> None:
    case = make_latent_cache([3], TINY, 16, torch.float32, device)
    kv = case.kv
    q = torch.empty((0, 4, 40), device=device)
    out = mla_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables[:0], kv.context_lens[:0], 0.2, 32)
    assert out.shape == (0, 4, 32)
    with pytest.raises(AssertionError, match="value_dim"):
        mla_decode_attention(latent_query(1, 4, 41, torch.float32, device), kv.k_cache, kv.v_cache,
                             kv.block_tables, kv.context_lens, 0.2, 32)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_v2_lite_shapes(batch: int) -> None:
    gen = torch.Generator().manual_seed(batch)
    contexts = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    contexts[0] = 4096
    _run(torch.device("cuda"), torch.bfloat16, 16, V2, 16, contexts)


@pytest.mark.gpu
@requires_cuda
def test_gpu_v3_heads_and_graph_bound() -> None:
    # 128 heads (8 head groups); a fixed max_context_len far above the contexts, as under CUDA-graph capture.
    _run(torch.device("cuda"), torch.bfloat16, 128, V2, 16, [3000, 17, 900, 1], max_context_len=32768)
