"""Rotary position embedding (neox / HF "rotate_half" style) with plain, llama3, linear and YaRN scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from services.engine.cpu import native


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies (radians per position), bit-equal to transformers'
    `_compute_default/linear/llama3_parameters`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, factor, scaling)
    if kind != "llama3":
        raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, theta: float, factor: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies rotating fewer than beta_slow times over the original context are interpolated
    (divided by factor), those rotating more than beta_fast times kept, a linear ramp between (in dims)."""
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)
    old_ctx = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """Scale of the cos/sin tables: 1 except for YaRN (its attention_factor, else 0.1 ln(factor) + 1, or the
    mscale / mscale_all_dim ratio of that form when both are given)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, KVH, D] at integer positions [T]. ``head_dim`` is the width it
    rotates: heads wider than it (GLM's partial rotary) have their first ``head_dim`` values rotated and the rest
    passed through.

    The cos/sin cache is fp32 [max_positions, D] (both halves repeated, HF layout), built once so the
    forward never syncs with the device; callers keep positions < max_positions (or call `ensure`).
    It is a non-persistent buffer: it follows `.to(device)` but never appears in a state dict.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.attention_factor = attention_factor(scaling)
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, theta, scaling), persistent=False)
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self._build(max_positions)

    def _build(self, n: int) -> None:
        with torch.device(self.inv_freq.device):
            pos = torch.arange(n, dtype=torch.float32)
            # Outer product in fp32, matching transformers' `inv_freq @ position_ids` under autocast off.
            freqs = pos[:, None] * self.inv_freq.float()[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = emb.cos() * self.attention_factor if self.attention_factor != 1.0 else emb.cos()
        self.sin_cache = emb.sin() * self.attention_factor if self.attention_factor != 1.0 else emb.sin()

    def ensure(self, max_positions: int) -> None:
        """Grow the cache to cover positions [0, max_positions)."""
        if max_positions > self.cos_cache.shape[0]:
            self._build(max_positions)

    def native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``forward`` by the CPU C kernels where they apply (the same numbers; whole heads only), else None."""
        if (kern := native.active(q)) is not None and q.dim() == 3 and k.dim() == 3 and q.shape[-1] == self.head_dim:
            qo = kern.rope(q, positions, self.cos_cache, self.sin_cache)
            ko = kern.rope(k, positions, self.cos_cache, self.sin_cache) if qo is not None else None
            if qo is not None and ko is not None:
                return qo, ko
        return None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if (r := self.native(positions, q, k)) is not None:
            return r
        if (rot := self.head_dim) != q.shape[-1]:  # partial: rotate the first rot values, pass the rest
            q_rot, k_rot = self.forward(positions, q[..., :rot], k[..., :rot])
            return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)
        cos = self.cos_cache[positions][:, None, :]  # [T, 1, D] fp32
        sin = self.sin_cache[positions][:, None, :]
        q_out = (q * cos.to(q.dtype)) + (rotate_half(q) * sin.to(q.dtype))
        k_out = (k * cos.to(k.dtype)) + (rotate_half(k) * sin.to(k.dtype))
        return q_out, k_out
