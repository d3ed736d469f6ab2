"""Engine settings that processes running no model take too, declared once and without torch.

The router reads its tokenizer and chat template from ``model``; ``pdserve up`` hands ``model`` and
``dtype`` on to every engine. EngineConfig, RouterConfig and UpConfig inherit or ``reuse`` these
declarations, so each setting has one flag, one ``PDSERVE_*`` env var and one help text.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""``--dtype`` values; every name but auto is a torch dtype (EngineConfig maps them)."""


@dataclass
class ModelConfig:
    """The model every service of a deployment serves."""

    model: str | None = opt(None, "Model: a .gguf file, a Hugging Face directory, or random:NAME. Default: the "
                                  "embedded SmolLM2-135M-Instruct GGUF. The router reads its tokenizer and chat "
                                  "template from it: give the router and every engine the same spec (pdserve up "
                                  "does).")


@dataclass
class DtypeConfig:
    """The dtype an engine runs in."""

    dtype: str = opt("auto", "Weights and KV dtype. auto: bfloat16 on GPU and on CPUs with native bf16 "
                             "(AMX-BF16 or AVX512-BF16), float32 on other CPUs (torch's bf16 matmuls there "
                             "run several times slower than fp32). Prefill and decode must agree: pin it on "
                             "mixed hosts.", choices=DTYPE_CHOICES)
