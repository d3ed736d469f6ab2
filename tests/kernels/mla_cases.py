"""Latent (MLA) caches for the latent attention kernel tests: the engine's two planes of one KV head each."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.kernels.kernel_cases import PagedKV, make_paged_kv

V2 = (512, 64)
"""DeepSeek-V2/V3's (kv_lora_rank, qk_rope_head_dim): a 576-value latent, planes of 288."""
TINY = (32, 8)
"""tiny-deepseek's: a 40-value latent, planes of 20."""


@dataclass
class LatentCase:
    kv: PagedKV
    """k_cache / v_cache [num_blocks, block_size, 1, half]: the planes (views of one pool when ``pooled``)."""
    latents: list[torch.Tensor]
    """Per sequence, contiguous [ctx, 1, 2 * half]: each token's cached values, K plane then V plane."""
    key_dim: int
    value_dim: int


def make_latent_cache(contexts: list[int], widths: tuple[int, int], block_size: int, dtype: torch.dtype,
                      device: torch.device, index_dim: int = 0, pooled: bool = True, seed: int = 0) -> LatentCase:
    """Random latents of kv_lora_rank + rope (+ index_dim, never read by attention) values per token, scattered
    into shuffled blocks of a cache whose other slots hold kernel_cases.JUNK. ``pooled``: the planes are
    pool[0] / pool[1] of one [2, ...] tensor, as the engine's kv_cache[layer] is."""
    lora, rope = widths
    cached = lora + rope + index_dim
    assert cached % 2 == 0
    kv = make_paged_kv(contexts, 1, cached // 2, block_size, dtype, device, seed=seed)
    if pooled:
        pool = torch.stack([kv.k_cache, kv.v_cache])
        kv.k_cache, kv.v_cache = pool[0], pool[1]
    latents = [torch.cat([k, v], dim=-1) for k, v in zip(kv.k_seqs, kv.v_seqs, strict=True)]
    return LatentCase(kv, latents, lora + rope, lora)


def latent_query(tokens: int, heads: int, key_dim: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 1) -> torch.Tensor:
    """[tokens, heads, key_dim] random absorbed queries."""
    q = torch.randn((tokens, heads, key_dim), generator=torch.Generator().manual_seed(seed))
    return q.to(dtype).to(device)
