"""`get_model_class` picks the torch module of a `ModelArchConfig.architecture`."""

from __future__ import annotations

from services.engine.models.deepseek import DeepseekForCausalLM
from services.engine.models.gpt_oss import GptOssForCausalLM
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.moe_model import (
    Glm4MoeForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from services.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from services.text.model.config import ModelConfigError

_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "deepseek": DeepseekForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
}


def get_model_class(arch: str) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[arch]
    except KeyError:
        raise ModelConfigError(f"architecture={arch!r}: supported are {sorted(_REGISTRY)}") from None
