"""`get_model_class` picks the torch module of a `ModelArchConfig.architecture`."""

from __future__ import annotations

from services.engine.models.config import ModelConfigError
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
