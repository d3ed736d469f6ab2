"""Model architectures, one module per family; `get_model_class` picks one by `ModelArchConfig.architecture`."""

from __future__ import annotations

from services.engine.models.config import ARCHITECTURES, ModelArchConfig, ModelConfigError
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def get_model_class(arch: str) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[arch]
    except KeyError:
        raise ModelConfigError(f"architecture={arch!r}: supported are {sorted(_REGISTRY)}") from None


__all__ = ["ARCHITECTURES", "LlamaForCausalLM", "ModelArchConfig", "ModelConfigError",
           "Qwen2ForCausalLM", "Qwen3ForCausalLM", "get_model_class"]
