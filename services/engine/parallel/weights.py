"""HF-named tensors, sharded for one rank (and the inverse, for tests and random models).

Row (output) shards: q_proj -> this rank's q heads, k_proj/v_proj -> its KV heads (a replicated head is
copied whole), gate_proj/up_proj -> its intermediate slice, embed_tokens/lm_head -> its vocab rows
(zero rows pad the last share). Column (input) shards: o_proj -> its q heads, down_proj -> its
intermediate slice. Everything else (norms, q/k norms) is replicated. The model's ``load_weights`` then
fills the fused qkv_proj / gate_up_proj rows from the local sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from services.engine.parallel.split import HeadSplit, even_range, padded_range
from services.text.model.config import ModelArchConfig

_FUSED = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."), ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


def _shard(name: str, t: torch.Tensor, arch: ModelArchConfig, split: HeadSplit) -> torch.Tensor:
    d = arch.head_dim
    if ".q_proj." in name or ".o_proj." in name:
        a, b = split.q_range
        return t[a * d:b * d] if ".q_proj." in name else t[:, a * d:b * d]
    if ".k_proj." in name or ".v_proj." in name:
        a, b = split.kv_range
        return t[a * d:b * d]
    if ".gate_proj." in name or ".up_proj." in name or ".down_proj." in name:
        a, b = even_range(arch.intermediate_size, split.tp_size, split.rank)
        return t[:, a:b] if ".down_proj." in name else t[a:b]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        a, b, rows = padded_range(arch.vocab_size, split.tp_size, split.rank)
        part = t[a:b]
        if rows > b - a:
            part = torch.cat([part, part.new_zeros(rows - (b - a), *t.shape[1:])])
        return part
    return t


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], arch: ModelArchConfig, split: HeadSplit
                  ) -> Iterable[tuple[str, torch.Tensor]]:
    """This rank's slices of HF-named tensors; ``weights`` itself at TP=1."""
    if split.tp_size == 1:
        return weights
    return ((name, _shard(name, t, arch, split)) for name, t in weights)


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A TP=1 model's parameters under HF names (fused qkv_proj / gate_up_proj split back)."""
    for name, p in model.named_parameters():
        frag = next((f for f in _FUSED if f in name), None)
        if frag is None:
            yield name, p.detach()
            continue
        if frag == ".qkv_proj.":
            arch = model.arch  # type: ignore[attr-defined]
            sizes = [arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim,
                     arch.num_kv_heads * arch.head_dim]
        else:
            sizes = [p.shape[0] // 2, p.shape[0] // 2]
        for part, hf in zip(p.detach().split(sizes, dim=0), _FUSED[frag], strict=True):
            yield name.replace(frag, hf), part
