"""Engine settings ``pdserve up`` takes too, declared once and without torch.

``pdserve up`` hands ``dtype`` and ``device`` on to every engine (and ``model``, declared with the settings of
processes that run no model: services/text/model/settings.py). EngineConfig and UpConfig inherit or ``reuse``
these declarations, so each setting has one flag, one ``PDSERVE_*`` env var and one help text.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""``--dtype`` values; every name but auto is a torch dtype (EngineConfig maps them)."""


@dataclass
class DeviceConfig:
    """The device an engine runs on (``pdserve up --device`` hands it to every engine it starts)."""

    device: str = opt("cpu", "Torch device (cpu, cuda, cuda:N).")


@dataclass
class DtypeConfig:
    """The dtype an engine runs in."""

    dtype: str = opt("auto", "Weights and KV dtype. auto: bfloat16 on GPU and on CPUs with native bf16 "
                             "(AMX-BF16 or AVX512-BF16), float32 on other CPUs (torch's bf16 matmuls there "
                             "run several times slower than fp32). Prefill and decode must agree: pin it on "
                             "mixed hosts.", choices=DTYPE_CHOICES)


@dataclass
class CompileDecodeConfig:
    """The compiled CPU decode step of an engine (EngineConfig inherits it; ``pdserve up`` reuses it with the
    default it gives its decode and colocated engines)."""

    cpu_compile_decode: int = opt(0, "CPU: run pure-decode steps of 1..N sequences through one torch.compile'd "
                                     "forward (inductor; needs a C++ compiler). The engine serves eager steps "
                                     "from the start; a low-priority child process compiles each batch size into "
                                     "the on-disk cache (--cpu-compile-cache-dir; 2-5 min per size on 2 cores the "
                                     "first time, paused while the engine serves but a tenth of the time; "
                                     "seconds after), the engine builds it from there, checks it against the "
                                     "eager step and switches it on if it measured faster (2: sizes 1-2, "
                                     "measured 1.27x / 1.10x). 0: eager steps only (the default of a bare "
                                     "engine; pdserve up gives its decode and colocated engines 2).")
