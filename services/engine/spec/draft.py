"""Draft models for speculative decoding, and the draft KV region they write.

``--draft-model`` names one of:
  * ``layers:N``: the target's own first N decoder layers, sharing its embeddings, final norm and LM
    head (self-speculation; no second model needed, so the embedded default can speculate);
  * a ``.gguf`` file or a Hugging Face directory: a separate small model with the target's vocabulary;
  * ``random:NAME``: random weights of a named shape (benchmarks).

Design choice: the draft always has its OWN KV region ``[draft layers, 2, num_blocks, block_size,
draft kv heads, draft head dim]`` indexed by the target's block ids, even for ``layers:N`` (whose draft
KV at committed positions equals the target's first N layers' KV). One code path for all three kinds;
the draft's speculative writes never touch the target's cache; a page (block id) is "target region +
draft region" everywhere: in the prefix cache, on the wire and in the kvstore.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.attention import ForwardContext
from services.engine.kv_layout import Region, region_bytes
from services.engine.model_loader import LoadedModel, load_model
from services.engine.models.llama import LlamaForCausalLM

LAYERS_PREFIX = "layers:"


class DraftConfigError(ValueError):
    """A draft model that cannot pair with the target (the message names the flag)."""


class LayerSkipDraft(torch.nn.Module):
    """The target's first ``num_layers`` layers + its final norm and LM head (shared parameters)."""

    def __init__(self, target: LlamaForCausalLM, num_layers: int) -> None:
        super().__init__()
        self.target = [target]  # a list: not a submodule, the parameters stay the target's
        self.num_layers = num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = self.target[0]
        h = t.model.embed_tokens(input_ids)
        for layer in t.model.layers[: self.num_layers]:
            h = layer(h, positions, t.rotary, ctx)
        return t.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target[0].compute_logits(hidden)


@dataclass
class Draft:
    model: torch.nn.Module
    """forward(ids, positions, ctx) -> hidden; compute_logits(hidden) -> fp32 logits [N, target vocab]."""
    model_id: str
    """Names the draft in the layout fingerprint: "layers:N of <target>" or the draft's own model id."""
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def region(self, block_size: int, codec: str) -> Region:
        """The draft region of a page: its name carries the draft's identity and shape."""
        name = f"draft[{self.model_id} L{self.num_layers} kvh{self.num_kv_heads} d{self.head_dim}]"
        return Region(name, codec, region_bytes(self.num_layers, self.num_kv_heads, self.head_dim, block_size,
                                                codec))

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * elem


def _refuse_indexer(spec: str, arch) -> None:
    """A draft whose layers run DeepSeek-V3.2's sparse attention would need index keys of its own (a pool and a page
    region the draft does not have): refused at start rather than failing in its first forward."""
    if arch.mla is not None and arch.mla.index_head_dim:
        raise DraftConfigError(f"--draft-model / PDSERVE_DRAFT_MODEL: {spec!r}: a draft with DeepSeek-V3.2's sparse "
                               "attention (an indexer, index_head_dim) is not supported (a draft has no index-key "
                               "pool); use a draft model without an indexer")


def load_draft(spec: str, target: LoadedModel, dtype: torch.dtype, device: str | torch.device) -> Draft:
    """The draft ``spec`` names (see the module docstring); DraftConfigError when it cannot pair."""
    arch = target.arch
    if spec.startswith(LAYERS_PREFIX):
        _refuse_indexer(spec, arch)
        try:
            n = int(spec.removeprefix(LAYERS_PREFIX))
        except ValueError:
            raise DraftConfigError(f"--draft-model / PDSERVE_DRAFT_MODEL: {spec!r}: layers:N needs an integer N") \
                from None
        if not 1 <= n <= arch.num_layers:
            raise DraftConfigError(f"--draft-model / PDSERVE_DRAFT_MODEL: {spec!r}: N must be in "
                                   f"[1, {arch.num_layers}] (the target's layers)")
        return Draft(LayerSkipDraft(target.model, n), f"{spec} of {target.model_id}", n, arch.num_kv_heads,
                     arch.head_dim)
    loaded = load_model(spec, dtype, device)
    if loaded.arch.vocab_size != arch.vocab_size:
        raise DraftConfigError(f"--draft-model / PDSERVE_DRAFT_MODEL: {spec!r} has a vocabulary of "
                               f"{loaded.arch.vocab_size} tokens, the target {target.model_id} has "
                               f"{arch.vocab_size}: a draft must share the target's tokenizer")
    a = loaded.arch
    _refuse_indexer(spec, a)
    loaded.model.rotary.ensure(target.max_model_len)  # positions up to the target's context
    return Draft(loaded.model, loaded.model_id, a.num_layers, a.num_kv_heads, a.head_dim)
