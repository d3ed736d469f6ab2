"""Weight sources: GGUF files, HF safetensors directories and named random shapes."""

from __future__ import annotations

from services.text.model.errors import ModelLoadError

__all__ = ["ModelLoadError"]
