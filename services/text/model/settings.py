"""The model setting every service of a deployment takes, declared once and without torch.

The router reads its tokenizer and chat template from ``model``; ``pdserve up`` hands it on to every engine.
RouterConfig and EngineConfig inherit ModelConfig and UpConfig ``reuse``s it, so the setting has one flag, one
``PDSERVE_*`` env var and one help text (the engine's own shared settings: engine/model_settings.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt


@dataclass
class ModelConfig:
    """The model every service of a deployment serves."""

    model: str | None = opt(None, "Model: a .gguf file, a Hugging Face directory, or random:NAME. Default: the "
                                  "embedded SmolLM2-135M-Instruct GGUF. The router reads its tokenizer and chat "
                                  "template from it: give the router and every engine the same spec (pdserve up "
                                  "does).")
