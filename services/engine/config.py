"""Engine configuration: one dataclass, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.config import opt

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineConfigError(ValueError):
    pass


@dataclass
class EngineConfig:
    model: str | None = opt(None, "Model: a .gguf file, a Hugging Face directory, or random:NAME. "
                                   "Default: the embedded SmolLM2-135M-Instruct GGUF.")
    dtype: str = opt("bfloat16", "Weights and KV dtype.", choices=tuple(_DTYPES))
    device: str = opt("cpu", "Torch device (cpu, cuda, cuda:N).")
    block_size: int = opt(16, "Tokens per KV page.")
    num_kv_blocks: int = opt(0, "KV pages to allocate; 0 sizes the pool from kv_cache_bytes.")
    kv_cache_bytes: int = opt(1 << 30, "Bytes for the KV pool when num_kv_blocks is 0.")
    max_num_seqs: int = opt(64, "Most sequences in one batch.")
    max_num_batched_tokens: int = opt(2048, "Token budget of one step (decode tokens + prefill chunks).")
    max_prefill_chunk: int = opt(512, "Most prompt tokens of one sequence computed in one step.")
    max_model_len: int = opt(0, "Longest sequence (prompt + output); 0 takes the model's own limit.")
    enable_prefix_caching: bool = opt(True, "Reuse KV pages of identical prompt prefixes.")
    attention_backend: str = opt("auto", "auto (Triton on CUDA, torch on CPU) or torch.", choices=("auto", "torch"))
    kv_cache_shared: bool = opt(False, "Share the KV pool with prefills on this host so they write pages straight "
                                       "into it: a /dev/shm file on CPU (prefill --kv-transport shm), a CUDA IPC "
                                       "handle on GPU (prefill --kv-transport cuda-ipc).")
    cuda_graphs: bool = opt(True, "Capture CUDA graphs for decode batch sizes (GPU only).")
    seed: int = opt(0, "Seed of the sampler's generator for requests without their own seed.")

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise EngineConfigError(f"dtype: must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) <= 0:
                raise EngineConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.num_kv_blocks < 0 or self.kv_cache_bytes <= 0:
            raise EngineConfigError("num_kv_blocks must be >= 0 and kv_cache_bytes > 0")
        if self.max_model_len < 0:
            raise EngineConfigError(f"max_model_len: must be >= 0, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        if self.num_kv_blocks:
            return self.num_kv_blocks
        n = self.kv_cache_bytes // bytes_per_block
        if n < 2:
            raise EngineConfigError(f"kv_cache_bytes={self.kv_cache_bytes} holds fewer than 2 pages of "
                                    f"{bytes_per_block} bytes")
        return int(n)
