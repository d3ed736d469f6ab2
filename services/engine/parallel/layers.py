"""Tensor-parallel layers and the factories the model code builds through.

Each factory reads :func:`building_group`: outside a tensor-parallel build it returns the plain torch
module the model has always used (TP=1 is bit-identical), inside one the sharded module below.
- column-parallel linear: this rank's output rows (q/k/v heads, gate/up slice); no communication.
- row-parallel linear: this rank's input columns, then one all-reduce (the end of a block half).
- vocab-parallel embedding: this rank's vocab rows (padded to a multiple of N); ids outside give 0,
  one all-reduce sums the ranks.
- LM head: this rank's vocab rows; logits are all-gathered and the padding cut.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.parallel.group import TPGroup, building_group
from services.engine.parallel.split import HeadSplit, TensorParallelError, padded_range
from services.text.model.config import ModelArchConfig


def head_split(arch: ModelArchConfig) -> HeadSplit:
    """This rank's heads for the model being built (all of them at TP=1)."""
    g = building_group()
    return HeadSplit(arch.num_heads, arch.num_kv_heads, g.size if g else 1, g.rank if g else 0)


def local_intermediate(inter: int) -> int:
    g = building_group()
    if g is None:
        return inter
    if inter % g.size:
        raise TensorParallelError(f"tensor-parallel size {g.size} does not divide intermediate_size {inter}")
    return inter // g.size


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) (+ bias once, after the sum)."""

    def __init__(self, in_local: int, out_features: int, bias: bool, group: TPGroup) -> None:
        super().__init__(in_local, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int, group: TPGroup) -> None:
        self.start, self.end, rows = padded_range(vocab, group.size, group.rank)
        super().__init__(rows, hidden)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        h = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        return self.group.all_reduce(h * mine.unsqueeze(-1).to(h.dtype))


def column_linear(in_features: int, out_local: int, bias: bool) -> nn.Linear:
    """Output rows already local (the caller sized them from head_split / local_intermediate)."""
    return nn.Linear(in_features, out_local, bias=bias)


def row_linear(in_local: int, out_features: int, bias: bool) -> nn.Linear:
    g = building_group()
    return nn.Linear(in_local, out_features, bias=bias) if g is None else RowParallelLinear(
        in_local, out_features, bias, g)


def vocab_embedding(vocab: int, hidden: int) -> nn.Embedding:
    g = building_group()
    return nn.Embedding(vocab, hidden) if g is None else VocabParallelEmbedding(vocab, hidden, g)


def lm_head(hidden: int, vocab: int) -> nn.Linear:
    g = building_group()
    rows = vocab if g is None else padded_range(vocab, g.size, g.rank)[2]
    return nn.Linear(hidden, rows, bias=False)


class LogitsGather:
    """Local-vocab logits [N, V/N padded] -> full logits [N, V] (the identity at TP=1)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.group = building_group()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return logits
        return self.group.all_gather_last(logits)[..., : self.vocab]
