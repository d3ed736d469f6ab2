"""Which HF config.json keys each architecture implements; every other math-changing key is refused.

A config.json key is in one of three states for a ``model_type``:

- **read**: the parser of that model_type turns it into a ``ModelArchConfig`` field, and refuses the values
  it does not implement (a rope type, an activation, ...) with a ``ModelConfigError`` naming the value;
- **no math** (``NO_MATH``): names, ids, dtypes, output flags, training-only settings, ``generate()``
  defaults: the engine's numbers are the same whatever the value;
- anything else: a key the engine does not implement. Its value must be inert (absent, ``None`` or
  ``False``); any other value is refused at load with one line naming the key, the value and the model_type.

An architecture module registers itself with :func:`register_architecture` (its family, the keys it reads
and, optionally, a parser adding its own ``ModelArchConfig`` fields), so a new architecture adds entries
here instead of editing the dense parser. This module imports nothing of the repository's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

NO_MATH: frozenset[str] = frozenset({
    # identity and bookkeeping
    "transformers_version", "architectures", "_name_or_path", "name_or_path", "model_type", "auto_map",
    "_commit_hash", "_attn_implementation_autoset", "attn_implementation", "_attn_implementation",
    "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "prefix",
    "tokenizer_class",
    # dtype of the stored weights (the engine picks its own compute dtype)
    "dtype", "torch_dtype", "use_bfloat16",
    # what forward() returns, not what it computes
    "output_hidden_states", "output_attentions", "return_dict", "torchscript", "use_return_dict",
    "output_router_logits",
    # training only: initialisation, dropout (never applied at inference), feed-forward chunking and the
    # pretraining tensor-parallel degree (both split the same matmuls, same sums)
    "initializer_range", "attention_dropout", "hidden_dropout", "dropout", "embd_pdrop", "resid_pdrop",
    "chunk_size_feed_forward", "pretraining_tp", "tf_legacy_loss", "gradient_checkpointing",
    # KV cache switch of transformers' generate()
    "use_cache",
    # tokenizer ids that the model's math never reads (bos/eos are read: they end generation)
    "pad_token_id", "sep_token_id", "unk_token_id", "decoder_start_token_id",
    # defaults of transformers' generate(); the engine takes sampling from each request
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens",
})
"""config.json keys that never change the engine's numbers, whatever their value."""

DENSE_READS: frozenset[str] = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "quantization_config",
})
"""Keys the shared dense parser (``ModelArchConfig.from_hf_config``) reads for every architecture."""

KNOWN_UNIMPLEMENTED: frozenset[str] = frozenset({
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "pruned_heads", "mlp_bias", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "attention_bias",
})
"""Keys known to change the math that an architecture may leave unimplemented: like any key outside its reads
and ``NO_MATH`` they are refused unless inert. Listed so the test that walks transformers' own config fields
tells a key someone decided about from a new one."""

ExtraParser = Callable[[Mapping[str, Any]], dict[str, Any]]
"""config.json dict -> extra ``ModelArchConfig`` keyword arguments (e.g. ``{"moe": MoEConfig(...)}``);
raises ``ModelConfigError`` for a value it does not implement."""


@dataclass(frozen=True)
class ArchSpec:
    family: str
    """``ModelArchConfig.architecture`` the model_type loads as (picks the torch module)."""
    reads: frozenset[str]
    """config.json keys this model_type implements, beyond ``DENSE_READS``."""
    parse: ExtraParser | None = None
    """Adds this model_type's own fields after the dense ones; None: the dense fields only."""


ARCH_SPECS: dict[str, ArchSpec] = {}
"""HF ``model_type`` -> what loading it reads. Filled by :func:`register_architecture`."""


def register_architecture(model_type: str, spec: ArchSpec) -> None:
    if model_type in ARCH_SPECS:
        raise ValueError(f"model_type {model_type!r} is already registered")
    ARCH_SPECS[model_type] = spec


def families() -> tuple[str, ...]:
    """Every registered ``ModelArchConfig.architecture`` (sorted)."""
    return tuple(sorted({s.family for s in ARCH_SPECS.values()}))


def _show(value: Any) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def unimplemented_field(model_type: str, cfg: Mapping[str, Any]) -> str | None:
    """One line naming the first key of ``cfg`` that ``model_type`` does not implement and whose value is not
    inert (None / False); None when there is none. ``model_type`` must be registered."""
    reads = ARCH_SPECS[model_type].reads | DENSE_READS
    for key in sorted(cfg):
        value = cfg[key]
        if key in reads or key in NO_MATH or value is None or value is False:
            continue
        return (f"config.json field {key}={_show(value)} is not implemented for model_type={model_type!r} "
                "(it changes the model's math)")
    return None


def refuse_value(key: str, value: Any, model_type: str, supported: str) -> str:
    """The one-line refusal of a read key's unsupported value."""
    return f"config.json field {key}={_show(value)} is not supported for model_type={model_type!r}: {supported}"


GGUF_NO_MATH_PREFIXES = ("GGUF.", "general.", "tokenizer.", "quantize.")
"""GGUF metadata namespaces that never change the math: file bookkeeping, names and licence, the tokenizer
(read by the tokenizer), the importance matrix a quantizer used. Tensor storage types come with the tensors."""

GGUF_DENSE_READS: frozenset[str] = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
    "attention.value_length", "rope.dimension_count", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
})
"""``{architecture}.*`` keys the GGUF loader reads for the dense architectures (without the prefix)."""

GGUF_MOE_READS: frozenset[str] = frozenset({
    "expert_count", "expert_used_count", "expert_gating_func", "expert_weights_scale", "expert_weights_norm",
    "expert_feed_forward_length", "expert_shared_feed_forward_length",
})
"""``{architecture}.*`` keys the GGUF loader's MoE part (moe_config.moe_from_gguf) reads."""

GGUF_GPT_OSS_READS: frozenset[str] = GGUF_DENSE_READS | {
    "expert_count", "expert_used_count", "expert_gating_func", "expert_feed_forward_length",
    "attention.sliding_window",
}
"""gpt-oss's keys (gguf_meta.GGUFMetadata and moe_config's gpt-oss part): no expert_weights_scale / _norm."""

GGUF_READS: dict[str, frozenset[str]] = {"llama": GGUF_DENSE_READS | GGUF_MOE_READS, "qwen2": GGUF_DENSE_READS,
                                         "qwen3": GGUF_DENSE_READS, "qwen2moe": GGUF_DENSE_READS | GGUF_MOE_READS,
                                         "qwen3moe": GGUF_DENSE_READS | GGUF_MOE_READS,
                                         "gpt-oss": GGUF_GPT_OSS_READS}
"""GGUF ``general.architecture`` -> the ``{architecture}.*`` keys its loader reads; other modules add theirs."""


def gguf_unimplemented_field(metadata: Mapping[str, Any]) -> str | None:
    """One line naming the first GGUF metadata key the loader of the file's architecture does not read, outside
    the no-math namespaces, whose value is not inert (None / False / 0); None when there is none."""
    arch = str(metadata.get("general.architecture"))
    reads = GGUF_READS.get(arch, frozenset())
    for key in sorted(metadata):
        value = metadata[key]
        if key.startswith(GGUF_NO_MATH_PREFIXES) or key.removeprefix(arch + ".") in reads:
            continue
        if value is None or value is False or (type(value) in (int, float) and value == 0):
            continue
        return f"GGUF metadata {key}={_show(value)} is not implemented for architecture {arch!r} (it changes the math)"
    return None
