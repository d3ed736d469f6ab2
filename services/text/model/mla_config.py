"""Multi-head latent attention (MLA, DeepSeek-V2/V3) description, torch-free.

An MLA layer caches one latent per token instead of per-head K/V: ``c_kv`` (``kv_lora_rank`` values, after
``kv_a_layernorm``) and the rotated shared key ``k_pe`` (``qk_rope_head_dim`` values). Attention runs in the
latent space ("absorbed" form): each head's query ``q_nope`` is multiplied by that head's key up-projection, so
a query of ``kv_lora_rank + qk_rope_head_dim`` values meets the cached latent directly, and the weighted sum of
``c_kv`` is multiplied by the head's value up-projection afterwards. That is multi-query attention with one
key of ``latent_dim`` values whose first ``kv_lora_rank`` values are also the value.

The pool keeps the engine's K/V page shape with one KV "head" of ``latent_dim // 2`` values per plane: the K
plane holds the first half of the latent, the V plane the second half, so a page's target region holds exactly the
latent (no copy of c_kv, no zero padding) and every transport, the kvstore and the fp8 wire codec move it
unchanged. DeepSeek-V3.2's index key (``index_head_dim`` values per token and layer) is a page region of its own,
in its own pool and codec (engine/index_keys.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class MLAConfigError(ValueError):
    """An MLA configuration holds an invalid value (the message names the field)."""


@dataclass(frozen=True)
class MLAConfig:
    kv_lora_rank: int
    """Width of the compressed KV latent c_kv (512 in DeepSeek-V2/V3)."""
    qk_rope_head_dim: int
    """Width of the rotated part of each query head and of the shared rotated key k_pe (64)."""
    qk_nope_head_dim: int
    """Width of the unrotated part of each query/key head (128)."""
    v_head_dim: int
    """Width of each value head (128)."""
    q_lora_rank: int = 0
    """Width of the compressed query (q_a_proj -> q_a_layernorm -> q_b_proj); 0: one q_proj (DeepSeek-V2-Lite)."""
    rope_interleave: bool = True
    """RoPE pairs are adjacent values (x0, x1), (x2, x3), ... (DeepSeek's layout); False: rotate_half pairs."""
    softmax_scale: float = 0.0
    """Scale of the attention logits: qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2;
    0: the plain qk_head_dim ** -0.5."""
    index_n_heads: int = 0
    """Sparse attention (DeepSeek-V3.2's indexer): heads of the index query; 0: dense attention (no indexer)."""
    index_head_dim: int = 0
    """Width of the index key cached per token in its own region (its first qk_rope_head_dim values rotated)."""
    index_topk: int = 0
    """Keys each query attends to: the top index_topk by index score (all of them while fewer are cached)."""

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise MLAConfigError(f"{name}={value!r}: must be a positive integer")
        if self.q_lora_rank < 0:
            raise MLAConfigError(f"q_lora_rank={self.q_lora_rank!r}: must be >= 0")
        if self.qk_rope_head_dim % 2:
            raise MLAConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim}: RoPE needs an even width")
        if (self.index_n_heads > 0) != (self.index_head_dim > 0) or (self.index_n_heads > 0) != (self.index_topk > 0):
            raise MLAConfigError(f"index_n_heads={self.index_n_heads}, index_head_dim={self.index_head_dim}, "
                                 f"index_topk={self.index_topk}: an indexer needs all three positive (or none)")
        if self.index_head_dim and self.index_head_dim < self.qk_rope_head_dim:
            raise MLAConfigError(f"index_head_dim={self.index_head_dim} is narrower than qk_rope_head_dim="
                                 f"{self.qk_rope_head_dim} (its first qk_rope_head_dim values are rotated)")
        if self.index_n_heads and not self.q_lora_rank:
            raise MLAConfigError("an indexer reads the compressed query: q_lora_rank must be set")
        if self.latent_dim % 2:
            raise MLAConfigError(f"kv_lora_rank + qk_rope_head_dim = {self.latent_dim}: the cached latent is two "
                                 "equal halves (K and V planes), so it must be even")

    @property
    def latent_dim(self) -> int:
        """Cached values per token and layer: c_kv then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale or self.qk_head_dim ** -0.5


def yarn_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """DeepSeek's attention scale: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN
    with ``mscale_all_dim`` (0.1 * m * ln(factor) + 1 for factor > 1)."""
    scale = qk_head_dim ** -0.5
    if rope_scaling and rope_scaling.get("rope_type") == "yarn" and rope_scaling.get("mscale_all_dim"):
        factor = float(rope_scaling["factor"])
        if factor > 1:
            m = 0.1 * float(rope_scaling["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= m * m
    return scale
