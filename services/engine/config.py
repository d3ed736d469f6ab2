"""Engine configuration: one dataclass, validated in one place."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.common.config import ContextConfig, opt
from services.engine.cpu.core_share import CoreShareError, check_group_id
from services.engine.cpu.cpu_features import (
    DTYPE_REASONS,
    apply_cpu_threads,
    available_cpus,
    bf16_cross_check,
    host_cpu,
    parse_cpu_list,
    resolve_dtype,
    torch_cpu_capability,
)
from services.engine.device_defaults import (
    CPU_KV_CACHE_BYTES,
    CPU_KV_SHARE,
    batch_defaults,
    cpu_kv_pool_bytes,
    host_memory,
)
from services.engine.model_settings import DTYPE_CHOICES, CompileDecodeConfig, DeviceConfig, DtypeConfig
from services.engine.models.quant_linear import WEIGHT_FORMATS
from services.text.model.settings import ModelConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert DTYPE_CHOICES == ("auto", *_DTYPES), "model_settings.DTYPE_CHOICES must name the torch dtypes above"


class EngineConfigError(ValueError):
    pass


@dataclass
class EngineConfig(ContextConfig, ModelConfig, DeviceConfig, DtypeConfig, CompileDecodeConfig):
    cpu_threads: int = opt(0, "Torch intra-op threads of this engine process; 0: one per CPU the process may "
                              "run on (its affinity mask). pdserve up gives each engine its share of the host.")
    cpu_affinity: str = opt("", "Pin this engine process to these CPUs at start (Linux cpulist, e.g. 0-3,8); "
                                "empty: keep the inherited affinity.")
    cpu_share_group: str = opt("", "Core lending (CPU): engine processes of one host given the same id lend each "
                                   "other their --cpu-threads through /dev/shm/pdserve-cores-<id> (mode 0600): "
                                   "before each step an engine serving one request runs with its own threads plus "
                                   "those of peers idle for 3 ms or gone (not with a compiled decode step on), "
                                   "and drops back when it has no work. pdserve up sets it "
                                   "for the engines it starts (--no-lend-cores: off). Empty: off; no effect "
                                   "with --cpu-affinity or at --tensor-parallel-size > 1.")
    block_size: int = opt(16, "Tokens per KV page.")
    num_kv_blocks: int = opt(0, "KV pages to allocate; 0 sizes the pool from kv_cache_bytes.")
    kv_cache_bytes: int = opt(0, "Bytes for the KV pool when num_kv_blocks is 0. 0: on CPU a quarter of the "
                                 "memory available at start (MemAvailable, or the cgroup's limit less its use), "
                                 "at most 1 GiB; on CUDA what --gpu-memory-utilization leaves after weights, "
                                 "graphs and activations (1 GiB at --tensor-parallel-size > 1, on either).")
    gpu_memory_utilization: float = opt(0.9, "CUDA, no KV size given: the share of the device's memory this engine "
                                             "may fill (weights, KV pool, graphs, activations), in (0, 1]; engines "
                                             "sharing one GPU each take their own share.")
    max_num_seqs: int = opt(0, "Most sequences in one batch; 0: the device's default (64 on CPU, 256 on CUDA).")
    max_num_batched_tokens: int = opt(0, "Token budget of one step (decode tokens + prefill chunks); 0: the "
                                         "device's default (2048 on CPU, 16384 on CUDA).")
    mixed_step_interval: int = opt(1, "While sequences decode, prompt chunks join at most one step in this many; "
                                      "the steps between are pure decode (CUDA-graphed on GPU), prompts wait up "
                                      "to N-1 steps for their next chunk. 1: every step may mix prompts and "
                                      "decodes (eager on GPU).")
    max_prefill_chunk: int = opt(0, "Most prompt tokens of one sequence computed in one step; 0: the device's "
                                    "default (512 on CPU, 8192 on CUDA).")
    prefill_tail_tokens: int = opt(256, "Prefill engines whose KV streams out per chunk over mooncake (prefill "
                                        "service, chunked transfer on; prompts over one chunk): a prompt's last tokens are computed in pieces that halve "
                                        "what remains down to this many tokens, so the KV still to send when "
                                        "compute ends is small (services/engine/prefill_tail.py). Decode and "
                                        "colocated engines never split. 0: off.")
    kv_export_layer_group: int = opt(4, "GPU prefill: a streamed prompt's last chunk leaves decode-bound layer group "
                                        "by layer group while it computes (mooncake through host staging, native "
                                        "codec): after every this many layers the group's pages are gathered, copied "
                                        "to the staging ring and sent (services/engine/layer_groups.py). 0: off (the "
                                        "chunk leaves once computed).")
    kv_export_layer_group_cpu: bool = opt(False, "Also use --kv-export-layer-group on CPU (tests: the CPU forward is "
                                                 "synchronous, so only the network start moves earlier).")
    enable_prefix_caching: bool = opt(True, "Reuse KV pages of identical prompt prefixes.")
    attention_backend: str = opt("auto", "auto: Triton kernels on CUDA; on CPU the decode rows through C kernels "
                                           "built at start with the host's C compiler (torch's kernels where there "
                                           "is none, with a warning), the rest torch. torch: torch's kernels only.",
                                 choices=("auto", "torch"))
    kv_cache_shared: bool = opt(False, "Share the KV pool with prefills on this host so they write pages straight "
                                       "into it: a /dev/shm file on CPU (prefill --kv-transport shm), a CUDA IPC "
                                       "handle on GPU (prefill --kv-transport cuda-ipc).")
    cuda_graphs: bool = opt(True, "Capture CUDA graphs for decode batch sizes (GPU only).")
    async_scheduling: str = opt("auto", "Schedule and prepare step N+1 while step N runs; step N's tokens reach "
                                        "the host one step later (same tokens as off). auto: off (not yet measured "
                                        "faster served); on: CUDA (eager and graphed steps) and CPU eager steps "
                                        "(needs --cpu-compile-decode 0); off: never.",
                                choices=("auto", "on", "off"))
    tensor_parallel_size: int = opt(1, "Ranks (processes; GPUs on CUDA: cuda:0..N-1 of this host) one instance "
                                       "runs the model on: heads, MLP and vocab split N ways, gloo on CPU, NCCL "
                                       "on GPU. The service starts ranks 1..N-1 itself; any prefill and decode "
                                       "TP degrees hand KV to each other.")
    tp_fast_allreduce: bool = opt(False, "At --tensor-parallel-size > 1 on GPUs that reach each other peer-to-peer "
                                         "(NVLink): all-reduces up to 4 MiB (decode steps) go one-shot through "
                                         "symmetric memory, larger ones (prefill) through NCCL (off: NCCL only). "
                                         "Off by default until a two-GPU run has verified it.")
    seed: int = opt(0, "Seed of the sampler's generator for requests without their own seed.")
    weight_format: str = opt("auto", "Linear weights of decode-sized steps (CPU, GGUF Q4_1 tensors): int4 reads the "
                                     "Q4_1 blocks packed for torch's int4 GEMM, dequantized reads the dense weights; "
                                     "prefill-sized steps always use the dense ones. auto: int4 where it measures "
                                     "faster at start.", choices=WEIGHT_FORMATS)
    cpu_compile_cache_dir: str = opt("", "CPU, --cpu-compile-decode: the on-disk compile cache (inductor's) a "
                                         "low-priority child process fills with the decode-step variants before "
                                         "the engine builds them from it in seconds. Empty: "
                                         "~/.cache/pdserve/torch-compile.")
    cpu_kernel_dir: str = opt("", "CPU: where the decode-attention C kernel is built at start and kept (one small "
                                  "shared object per CPU model and compiler). Empty: ~/.cache/pdserve/cpu-kernels.")
    draft_model: str = opt("", "Draft model of speculative decoding: layers:N (the target's first N layers, "
                               "sharing its embeddings, final norm and LM head), a .gguf file, an HF directory, or "
                               "random:NAME. Set it on prefill AND decode: pages then carry a draft KV region. "
                               "Empty: no draft.")
    spec_tokens: int = opt(0, "Draft tokens proposed per decode step (K) and verified in one target forward; "
                              "0: no speculative decoding. Needs --draft-model.")
    draft_kv_codec: str = opt("fp8-e4m3", "Codec of the draft KV region on the wire and in the kvstore: fp8-e4m3 "
                                          "(per-token-per-head scales) or native (the cache's dtype).",
                              choices=("fp8-e4m3", "native"))
    index_kv_codec: str = opt("native", "Codec of DeepSeek-V3.2's index-key region (its own pool and page region): "
                                        "native (the cache's dtype) or fp8-e4m3 (e4m3 values and one fp32 scale "
                                        "per token and layer, as DeepSeek-V3.2 caches them). Only for a model with "
                                        "an indexer.", choices=("native", "fp8-e4m3"))
    mla_prefill: str = opt("auto", "How a latent-attention model (DeepSeek-V2/V3) attends prompts: expanded "
                                    "(per-head K/V expanded from the prompt's latents, a cached prefix's included, "
                                    "SDPA: fewer multiply-adds per query-key pair; a step holding a short chunk after "
                                    "a prefix stays latent), absorbed (in the latent space, as decode rows always "
                                    "are), or auto: expanded (measured faster on CPU and on a GPU). Only for a "
                                    "latent-attention model without an indexer.",
                           choices=("auto", "absorbed", "expanded"))
    spec_synthetic_acceptance: float = opt(0.0, "Benchmarks only: accept this mean number of draft tokens per "
                                                "step without checking them (output is NOT the model's; metrics "
                                                "carry acceptance=\"synthetic\"). 0: real verification.")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise EngineConfigError(f"dtype: must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        if not 0 <= self.cpu_compile_decode <= 8:
            raise EngineConfigError("--cpu-compile-decode / PDSERVE_CPU_COMPILE_DECODE: must be 0..8 (compiled batch "
                                    f"sizes), got {self.cpu_compile_decode}")
        if self.cpu_threads < 0:
            raise EngineConfigError(f"--cpu-threads / PDSERVE_CPU_THREADS: must be >= 0, got {self.cpu_threads}")
        if self.cpu_share_group:
            try:
                check_group_id(self.cpu_share_group)
            except CoreShareError as e:
                raise EngineConfigError(f"--cpu-share-group / PDSERVE_CPU_SHARE_GROUP: {e}") from None
        try:
            self.cpu_affinity_list: list[int] = parse_cpu_list(self.cpu_affinity)
        except ValueError as e:
            raise EngineConfigError(f"--cpu-affinity / PDSERVE_CPU_AFFINITY: {e}") from None
        # The dtype the engine runs in, and why (a DTYPE_REASONS code); fixed for the config's life.
        flags = host_cpu().flags if self.dtype == "auto" else frozenset()
        self.resolved_dtype, self.dtype_reason = resolve_dtype(self.dtype, self.device, flags)
        # Set by the engine once its weights are loaded (quant_linear.install); "pending" until then.
        self.resolved_weight_format, self.weight_format_reason = "pending", "pending"
        defaults = batch_defaults(self.device)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) == 0:  # 0: the device's default (device_defaults.BATCH_DEFAULTS)
                setattr(self, name, getattr(defaults, name))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EngineConfigError("--gpu-memory-utilization / PDSERVE_GPU_MEMORY_UTILIZATION: must be in (0, 1], "
                                    f"got {self.gpu_memory_utilization}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk",
                     "mixed_step_interval"):
            if getattr(self, name) <= 0:
                raise EngineConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.tensor_parallel_size not in (1, 2, 4, 8):
            raise EngineConfigError("--tensor-parallel-size / PDSERVE_TENSOR_PARALLEL_SIZE: must be 1, 2, 4 or 8, "
                                    f"got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.draft_model:
            raise EngineConfigError("--tensor-parallel-size / PDSERVE_TENSOR_PARALLEL_SIZE > 1 runs no draft model: "
                                    f"unset --draft-model / PDSERVE_DRAFT_MODEL (got {self.draft_model!r})")
        if self.num_kv_blocks < 0 or self.kv_cache_bytes < 0:
            raise EngineConfigError("num_kv_blocks and kv_cache_bytes must be >= 0")
        if self.spec_tokens < 0 or (self.spec_tokens and not self.draft_model):
            raise EngineConfigError(f"--spec-tokens / PDSERVE_SPEC_TOKENS: must be >= 0 and needs --draft-model / "
                                    f"PDSERVE_DRAFT_MODEL, got {self.spec_tokens} with draft {self.draft_model!r}")
        if not 0 <= self.spec_synthetic_acceptance <= max(self.spec_tokens, 0):
            raise EngineConfigError("--spec-synthetic-acceptance / PDSERVE_SPEC_SYNTHETIC_ACCEPTANCE: must be in "
                                    f"[0, --spec-tokens={self.spec_tokens}], got {self.spec_synthetic_acceptance}")
        if self.async_scheduling == "on" and (self.draft_model or self.tensor_parallel_size > 1 or (
                self.cpu_compile_decode and not self.device.startswith("cuda"))):
            raise EngineConfigError("--async-scheduling / PDSERVE_ASYNC_SCHEDULING on: not with --draft-model, "
                                    "--tensor-parallel-size > 1 or (CPU) --cpu-compile-decode > 0; use auto or off")
        if self.prefill_tail_tokens < 0:
            raise EngineConfigError("--prefill-tail-tokens / PDSERVE_PREFILL_TAIL_TOKENS: must be >= 0, "
                                    f"got {self.prefill_tail_tokens}")
        if self.kv_export_layer_group < 0:
            raise EngineConfigError("--kv-export-layer-group / PDSERVE_KV_EXPORT_LAYER_GROUP: must be >= 0, "
                                    f"got {self.kv_export_layer_group}")
        if self.max_model_len < 0:
            raise EngineConfigError(f"max_model_len: must be >= 0, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.resolved_dtype]

    @property
    def resolved_cpu_threads(self) -> int:
        """The torch thread count apply_host sets: cpu_threads, or one per CPU the process may use."""
        return self.cpu_threads or len(self.cpu_affinity_list or available_cpus())

    def info_labels(self) -> dict[str, str]:
        """Labels of the ``pdserve_<service>_engine_info`` gauge (services/common/metrics.py)."""
        return {"dtype": self.resolved_dtype, "dtype_reason": self.dtype_reason, "device": self.device,
                "cpu_model": host_cpu().model, "cpu_threads": str(self.resolved_cpu_threads),
                "weight_format": self.resolved_weight_format, "weight_format_reason": self.weight_format_reason}

    def apply_host(self) -> None:
        """At engine start, before the first op: pin (cpu_affinity), set torch's threads, log the choices."""
        threads = apply_cpu_threads(self.cpu_threads, self.cpu_affinity_list)
        cpu = host_cpu()
        capability = torch_cpu_capability()
        log.info("engine: dtype %s (%s), device %s, %d torch threads on CPUs %s; CPU %s [%s], torch ISA %s",
                 self.resolved_dtype, DTYPE_REASONS[self.dtype_reason], self.device, threads,
                 self.cpu_affinity or "inherited", cpu.model, " ".join(cpu.reported_flags()) or "-", capability)
        warning = bf16_cross_check(self.resolved_dtype, self.dtype_reason, capability)
        if warning:
            log.warning("engine: %s", warning)

    @property
    def async_steps(self) -> bool:
        """Whether the engine may launch steps ahead of their tokens (async_scheduling resolved)."""
        if self.async_scheduling == "off" or self.draft_model or self.tensor_parallel_size > 1:
            return False
        return self.async_scheduling == "on"

    @property
    def sizes_kv_from_device(self) -> bool:
        """Whether the KV pool is sized from free device memory (CUDA, no KV size given, one rank)."""
        return (self.device.startswith("cuda") and not self.num_kv_blocks and not self.kv_cache_bytes
                and self.tensor_parallel_size == 1)

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """Pages of a pool sized by num_kv_blocks or kv_cache_bytes; neither given: sized to the host's
        available memory (device_defaults.cpu_kv_pool_bytes), or 1 GiB at tensor-parallel size > 1."""
        if self.num_kv_blocks:
            return self.num_kv_blocks
        size = self.kv_cache_bytes or self._default_pool_bytes()
        n = size // bytes_per_block
        if n < 2:
            raise EngineConfigError(f"kv_cache_bytes={size} holds fewer than 2 pages of {bytes_per_block} bytes")
        return int(n)

    def _default_pool_bytes(self) -> int:
        if self.tensor_parallel_size > 1:   # ranks must agree: never from memory each reads on its own
            return CPU_KV_CACHE_BYTES
        mem = host_memory()
        if mem is None:
            log.info("kv cache: host memory unknown (no /proc/meminfo): the default pool of %d MiB",
                     CPU_KV_CACHE_BYTES >> 20)
            return CPU_KV_CACHE_BYTES
        try:
            size = cpu_kv_pool_bytes(mem.available_bytes)
        except ValueError as e:
            raise EngineConfigError(f"--kv-cache-bytes / PDSERVE_KV_CACHE_BYTES: {e}") from None
        log.info("kv cache sized to the host: %d MiB (%g of %d MiB available by %s, at most %d MiB)",
                 size >> 20, CPU_KV_SHARE, mem.available_bytes >> 20, mem.bound, CPU_KV_CACHE_BYTES >> 20)
        return size
