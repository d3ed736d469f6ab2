"""CPU step overhead: post-load swaps that compute the same numbers with fewer torch ops per layer.

A CPU decode step of a small model is bound by per-op dispatch (tens of ops per layer, each a few
microseconds), not by arithmetic. :class:`StepCachedRotary` builds a step's cos/sin rows once for all
layers (the model runner hands every layer the same ``positions`` tensor) and applies RoPE with a flip
of the two halves instead of slice/neg/cat: ``rotate_half(x) * sin == flip_halves(x) * [-sin1, sin2]``
exactly (negation is exact in IEEE arithmetic), so outputs are bit-identical to RotaryEmbedding's. Where the
engine built its C kernels (``cpu/native.py``) the rotation is their one pass instead, with the same numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.models.rope import RotaryEmbedding


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return x * cos + x.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2) * signed_sin


class StepCachedRotary(RotaryEmbedding):
    """RotaryEmbedding whose per-position rows are reused while ``positions`` is the same, unmodified tensor."""

    _key: tuple[torch.Tensor, torch.Tensor, torch.dtype] | None = None
    _rows: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if (r := self.native(positions, q, k)) is not None:  # the C kernels' one pass, where the engine has them
            return r
        key = self._key
        # Same tensor object, same values (a reused buffer may be rewritten in place; inference tensors keep
        # no version counter) and same dtype; anything else recomputes.
        if (key is None or key[0] is not positions or key[2] != q.dtype
                or not torch.equal(key[1], positions)):
            half = self.head_dim // 2
            cos = self.cos_cache[positions][:, None, :]  # [T, 1, D] fp32
            sin = self.sin_cache[positions][:, None, :]
            signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            self._rows = (cos.to(q.dtype), signed.to(q.dtype))
            self._key = (positions, positions.clone(), q.dtype)
        cos, signed = self._rows
        return _rope(q, cos, signed), _rope(k, cos, signed)


def install(model: nn.Module) -> bool:
    """Swap the model's RotaryEmbedding for a StepCachedRotary (same tables); False if it has none."""
    old = getattr(model, "rotary", None)
    arch = getattr(model, "arch", None)
    if type(old) is not RotaryEmbedding or arch is None or arch.rotary_dim is not None:  # whole heads only
        return False
    new = StepCachedRotary(old.head_dim, arch.rope_theta, arch.rope_scaling, old.cos_cache.shape[0])
    model.rotary = new.to(old.inv_freq.device)
    return True
