"""Factories and tolerances shared by the kernel tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

TOL: dict[torch.dtype, tuple[float, float]] = {  # (atol, rtol) vs an fp32 reference
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}

#: Cache slots that belong to no sequence hold this value, so a leak past a mask shows up.
JUNK = 100.0

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

def llama_packed(pack: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor], num_ids: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache, page ids, packed buffer): a Llama-8B-shaped bf16 paged KV cache on CUDA ([32 layers, K/V, 300
    pages, 16 tokens, 8 kv heads, 128]), ``num_ids`` random pages, packed by ``pack`` exactly as by
    ``reference``."""
    kv_cache = torch.randn((32, 2, 300, 16, 8, 128), dtype=torch.bfloat16, device=torch.device("cuda"))
    ids = torch.randperm(kv_cache.shape[2], device=kv_cache.device)[:num_ids]
    buf = pack(kv_cache, ids)
    assert torch.equal(buf, reference(kv_cache, ids))
    return kv_cache, ids, buf


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)


def attention_cases(heads: list[tuple[int, int]]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Parametrize an attention kernel test over dtype x (num_heads, num_kv_heads) in ``heads`` x head_dim."""

    def mark(test: Callable[..., None]) -> Callable[..., None]:
        test = pytest.mark.parametrize("head_dim", HEAD_DIMS)(test)
        test = pytest.mark.parametrize(("num_heads", "num_kv_heads"), heads)(test)
        return pytest.mark.parametrize("dtype", FLOAT_DTYPES)(test)

    return mark


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [NB, bs, kvh, hd]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, W], padded with 0
    context_lens: torch.Tensor  # int32 [B]
    k_seqs: list[torch.Tensor]  # per sequence, contiguous [ctx, kvh, hd]
    v_seqs: list[torch.Tensor]


def make_paged_kv(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedKV:
    """Random contiguous K/V per sequence, scattered into randomly chosen (shuffled) cache blocks."""
    gen = torch.Generator().manual_seed(seed)
    nblk = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(nblk) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, JUNK, dtype=dtype)
    v_cache = torch.full(shape, JUNK, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(nblk) + 1  # one padded column beyond the longest sequence
    block_tables = torch.zeros((len(context_lens), width), dtype=torch.int32)
    k_seqs, v_seqs = [], []
    for b, ctx in enumerate(context_lens):
        k = torch.randn((ctx, num_kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((ctx, num_kv_heads, head_dim), generator=gen).to(dtype)
        blocks = [perm.pop() for _ in range(nblk[b])]
        block_tables[b, : nblk[b]] = torch.tensor(blocks, dtype=torch.int32)
        for i, blk in enumerate(blocks):
            n = min(block_size, ctx - i * block_size)
            k_cache[blk, :n] = k[i * block_size : i * block_size + n]
            v_cache[blk, :n] = v[i * block_size : i * block_size + n]
        k_seqs.append(k.to(device))
        v_seqs.append(v.to(device))
    return PagedKV(
        k_cache.to(device),
        v_cache.to(device),
        block_tables.to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
        k_seqs,
        v_seqs,
    )


def plain_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int, window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention on contiguous K/V of one sequence, written out by hand: q [n, nh, hd], k/v
    [ctx, kvh, hd]; query i at q_offset + i sees key j iff 0 <= q_offset + i - j (< window if window);
    sinks [nh]: one more logit per head whose value is zero."""
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [nh, ctx, hd]
    vv = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    qpos = torch.arange(q.shape[0], device=q.device) + q_offset
    dist = qpos[:, None] - torch.arange(k.shape[0], device=q.device)[None, :]
    mask = (dist >= 0) & ((dist < window) if window else True)
    logits = (q.float().transpose(0, 1) @ kk.transpose(1, 2)) * scale  # [nh, n, ctx]
    logits = logits.masked_fill(~mask, float("-inf"))
    weights = logits.exp()
    denom = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + sinks.float().exp()[:, None, None]
    return ((weights / denom) @ vv).transpose(0, 1)
