"""Model specs moved to services/text/model/source.py (torch-free, read by the router too); these names stay
importable here for the modules and benchmarks that still import them from the engine."""

from __future__ import annotations

from services.text.model.source import (
    RANDOM_PREFIX,
    ModelSource,
    TokenizerInfo,
    gguf_tokenizer,
    hf_tokenizer,
    load_tokenizer,
    resolve,
)

__all__ = ["RANDOM_PREFIX", "ModelSource", "TokenizerInfo", "gguf_tokenizer", "hf_tokenizer", "load_tokenizer",
           "resolve"]
