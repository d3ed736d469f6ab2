"""The Triton latent (MLA) extend kernel against its torch reference, and the reference against causal attention
written out on each sequence's contiguous latents: chunks with and without a cached prefix, odd head counts."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import assert_close, plain_attention, requires_cuda
from tests.kernels.mla_cases import TINY, V2, latent_query, make_latent_cache

pytest.importorskip("triton")

from services.kernels.mla_prefill_attention import mla_prefill_attention
from services.kernels.reference import ref_mla_prefill_attention


def _run(device: torch.device, dtype: torch.dtype, heads: int, widths: tuple[int, int], block_size: int,
         contexts: list[int], q_lens: list[int], index_dim: int = 0, **kw: object) -> None:
    case = make_latent_cache(contexts, widths, block_size, dtype, device, index_dim=index_dim)
    kv = case.kv
    q = latent_query(sum(q_lens), heads, case.key_dim, dtype, device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    scale = (case.key_dim - widths[0] + 128) ** -0.5
    out = mla_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, scale,
                                case.value_dim, max_seqlen_q=max(q_lens), **kw)
    assert out.shape == (sum(q_lens), heads, case.value_dim) and out.dtype == dtype
    ref = ref_mla_prefill_attention(q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, cu,
                                    kv.context_lens, scale, case.value_dim)
    assert_close(out, ref, dtype)
    start = 0
    for b, (ctx, n) in enumerate(zip(contexts, q_lens, strict=True)):
        lat = case.latents[b]
        plain = plain_attention(q[start:start + n], lat[..., :case.key_dim], lat[..., :case.value_dim], scale,
                                ctx - n)
        torch.testing.assert_close(ref[start:start + n], plain, atol=1e-4, rtol=1e-4)
        start += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v2_latent_chunks(device: torch.device, dtype: torch.dtype) -> None:
    # A whole prompt (no prefix) and a chunk after a 30-token prefix; 16 heads x 512 + 64 latent.
    _run(device, dtype, 16, V2, 16, [21, 45], [21, 15])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [4, 6, 20])
def test_tiny_latent_odd_heads(device: torch.device, dtype: torch.dtype, heads: int) -> None:
    # Tiles of several tokens x heads (4: 4 tokens a tile in fp32, 8 in bf16), part-masked heads (6), two head
    # groups (20); one-token chunk, chunks inside and across blocks.
    _run(device, dtype, heads, TINY, 16, [37, 5, 70, 16], [37, 1, 29, 16])


def test_odd_block_size_small_key_tiles_and_index_key(device: torch.device) -> None:
    _run(device, torch.float32, 4, TINY, 7, [50, 13], [20, 13], index_dim=16, block_n=16)


@pytest.mark.gpu
@requires_cuda
def test_gpu_v2_lite_prefill_chunks() -> None:
    # A 512-token chunk after a 1000-token prefix, a whole 300-token prompt, a one-token chunk.
    _run(torch.device("cuda"), torch.bfloat16, 16, V2, 16, [1512, 300, 77], [512, 300, 1])
