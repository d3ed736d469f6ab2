"""The model runner: owns the KV tensors and device memory, prepares inputs, runs the model, samples.

It is the only engine part that touches tensors. The scheduler hands it a
:class:`SchedulerOutput`; it returns ``{seq_id: Sampled(token, logprob, top)}`` for the chunks that sample.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
from collections.abc import Callable

import numpy as np
import torch

from services.common.pb import decode_pb2
from services.engine.attention import AttentionMetadata, ForwardContext, TorchPagedAttention
from services.engine.config import EngineConfig, EngineConfigError
from services.engine.cpu import native, trace_fence
from services.engine.device_defaults import kv_pool_pages, step_activation_bytes
from services.engine.index_keys import IndexKeys
from services.engine.kv_layout import FP8_CODEC
from services.engine.layer_groups import LayerGroups
from services.engine.model_loader import LoadedModel
from services.engine.page_regions import KVRegion, PageRegion, pack_regions, regions_nbytes, unpack_regions
from services.engine.region_pools import with_region_pool
from services.engine.sampler import Sampled, Sampler, SamplingRow
from services.engine.scheduler import ScheduledChunk, SchedulerOutput
from services.engine.shared_kv import allocate_kv
from services.engine.spec.decoder import SpecDecoder
from services.engine.step_inputs import device_scope, prepare_rows, sampled_rows
from services.engine.step_launch import LaunchedStep
from services.engine.step_launch import launch as launch_step
from services.kernels import pack_pages, pack_pages_fp8, unpack_pages, unpack_pages_fp8

log = logging.getLogger(__name__)


def _index_codec(arch, config: EngineConfig) -> str | None:
    """The index-key region's codec (--index-kv-codec) of a model with an indexer, None without one; a codec
    other than native for a model without an indexer is refused."""
    if arch.mla is not None and arch.mla.index_head_dim:
        return IndexKeys.resolve_codec(config.index_kv_codec, config.torch_dtype)
    if config.index_kv_codec != "native":
        raise EngineConfigError(f"--index-kv-codec / PDSERVE_INDEX_KV_CODEC={config.index_kv_codec}: this model "
                                f"({arch.architecture}) has no indexer (DeepSeek-V3.2 index keys); leave it native")
    return None


CPU_MIN_EXPANDED_CHUNK = 1
"""On CPU every prompt chunk after a prefix takes the expanded form (measured faster from 2 new tokens after a
2048-token prefix, 2.5x, to 512, 2.1x: PERFORMANCE.md, latent attention); a GPU keeps the multiply-add rule of
``MLAAttention.flop_min_expanded_chunk``."""


def _mla_prefill(model, arch, config: EngineConfig) -> str | None:
    """Set and return the prompt attention form of a latent-attention model (--mla-prefill; auto: expanded, the
    faster on CPU and GPU alike); None for another model, which refuses a form other than auto in one line. A model with an
    indexer (V3.2) keeps its sparse latent path whatever the form."""
    if arch.mla is None or arch.mla.index_head_dim:
        if config.mla_prefill != "auto":
            raise EngineConfigError(f"--mla-prefill / PDSERVE_MLA_PREFILL={config.mla_prefill}: this model "
                                    f"({arch.architecture}) has no latent attention without an indexer; leave it auto")
        return None
    form = "expanded" if config.mla_prefill == "auto" else config.mla_prefill
    model.set_prefill_form(form, CPU_MIN_EXPANDED_CHUNK if torch.device(config.device).type == "cpu" else None)
    return form


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" = the current GPU, named by index
            self.device = torch.device("cuda", torch.cuda.current_device())  # (set_device needs one)
        self.dtype = config.torch_dtype
        arch = loaded.arch
        self.num_layers = arch.num_layers
        self.num_kv_heads = loaded.model.tp_split.local_kv_heads  # this rank's KV shard (all heads at TP=1)
        self.head_dim = arch.head_dim
        self.block_size = config.block_size
        self.spec = None
        """Speculative decoding's draft and its KV region (services/engine/spec), when --draft-model is set."""
        if config.draft_model:
            self.spec = SpecDecoder(loaded, config)
        draft_bytes = self.spec.bytes_per_block() if self.spec is not None else 0
        self.index_codec = _index_codec(arch, config)
        """Codec of DeepSeek-V3.2's index-key region (index_keys.py); None without an indexer."""
        self.mla_prefill = _mla_prefill(self.model, arch, config)
        """How a latent-attention model attends prompts (--mla-prefill; ``expanded_prompts`` says which steps);
        None otherwise."""
        index_bytes = self._index_bytes_per_block(arch)
        self.num_blocks = self._num_blocks(loaded, self.bytes_per_block + index_bytes + draft_bytes)
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_shm_path: str | None = None
        """The /dev/shm file backing the pool when it is shared (removed by release())."""
        self.kv_destination: decode_pb2.KVDestination | None = None
        """The pool as a same-host prefill may write it (shm file or CUDA IPC handle); None when private."""
        self.kv_cache, self.kv_shm_path, self.kv_destination = allocate_kv(shape, self.dtype, self.device,
                                                                           config.kv_cache_shared, "KV pool")
        if self.kv_shm_path is not None:
            atexit.register(self.release)
        self.index_keys: IndexKeys | None = None
        """DeepSeek-V3.2's index keys, a pool of their own with the target pool's block ids (None: no indexer)."""
        self.index_shm_path: str | None = None
        if self.index_codec is not None:
            self._allocate_index_keys(arch)
        self.attn_backend = self._make_backend(self.kv_cache, self.head_dim, self.index_keys)
        self.page_regions: list[PageRegion] = [KVRegion("target", self.kv_cache)]
        """Every region of a page in layout order (page_regions.py): target, index keys, draft."""
        if self.index_keys is not None:
            self.page_regions.append(self.index_keys)
        if self.spec is not None:
            self.spec.allocate(self.num_blocks, self._make_backend)
            self.page_regions.append(self.spec.page_region())
            self.kv_destination = self.spec.offer(self.kv_destination)  # + the draft pool when it is shared
        self.sampler = Sampler(config.seed)
        self.graphs = None
        self.graphed_steps = 0
        """Steps replayed in a captured CUDA graph so far (count)."""
        if self.device.type == "cuda":
            self._init_gpu(loaded)
        self.compiled_decode = None
        """CPU pure-decode steps through one compiled forward (--cpu-compile-decode); None: eager. Its
        variants are compiled by ``decode_compiler`` in the background and switched on once checked."""
        self.decode_compiler = None
        if config.cpu_compile_decode and self.device.type == "cpu" and self.spec is None:
            # deferred: the CPU compile machinery (torch._dynamo, inductor), only with --cpu-compile-decode
            from services.engine.cpu.compiled_decode import CompiledDecode
            from services.engine.cpu.decode_compiler import DecodeCompiler

            if CompiledDecode.supported(self.model):
                self.compiled_decode = CompiledDecode(self.model, self.kv_cache, config.cpu_compile_decode)
                # the C decode attention the eager steps take, where it serves this model (CPU: TorchPagedAttention)
                self.compiled_decode.eager_kernels = self.attn_backend.native_for(self.kv_cache.dtype,
                                                                                  loaded.arch.num_heads)
                self.decode_compiler = DecodeCompiler(self.compiled_decode, config.resolved_cpu_threads,
                                                     config)
                self.decode_compiler.start()
            else:
                log.warning("--cpu-compile-decode is off for this model (tensor-parallel, sliding-window or sink "
                            "attention): decode steps run eagerly")
        log.info("kv cache: %d blocks x %d tokens (%.1f MiB, %s)", self.num_blocks, self.block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20, self.dtype)

    def release(self) -> None:
        """Free what outlives the process otherwise: the shared-memory pool files (target and draft); stop
        the background compile (a variant being compiled finishes on its thread, which is not a daemon)."""
        if self.decode_compiler is not None:
            self.decode_compiler.stop()
        if self.spec is not None:
            self.spec.release()
        if self.index_shm_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.index_shm_path)
            self.index_shm_path = None
        if self.kv_shm_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.kv_shm_path)
            self.kv_shm_path = None
            self.kv_destination = None

    def _num_blocks(self, loaded: LoadedModel, page_bytes: int) -> int:
        """Pages of the pool: from the KV settings, or (CUDA, none given) from the device memory left after the
        weights (already loaded), the decode graphs and one full step's activations (device_defaults.py)."""
        cfg = self.config
        if not cfg.sizes_kv_from_device:
            return cfg.resolve_num_blocks(page_bytes)
        arch = loaded.arch
        elem = torch.empty((), dtype=self.dtype).element_size()
        split = loaded.model.tp_split
        act = step_activation_bytes(cfg.max_num_batched_tokens, max(cfg.max_num_seqs, 1), arch.hidden_size,
                                    arch.intermediate_size, arch.num_heads, split.local_kv_heads, arch.head_dim,
                                    arch.vocab_size, elem)
        # The decode graphs' pool holds one bucket's activations at a time (the largest: max_num_seqs rows).
        graphs = step_activation_bytes(cfg.max_num_seqs, cfg.max_num_seqs, arch.hidden_size, arch.intermediate_size,
                                       arch.num_heads, split.local_kv_heads, arch.head_dim, arch.vocab_size, elem)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        own = torch.cuda.memory_reserved(self.device)
        try:
            sizing = kv_pool_pages(free, total, cfg.gpu_memory_utilization, own, act + graphs, page_bytes)
        except ValueError as e:
            raise EngineConfigError(f"--gpu-memory-utilization / PDSERVE_GPU_MEMORY_UTILIZATION: {e}") from None
        log.info("kv cache sized from device memory: %d pages of %d KiB = %.1f GiB (--gpu-memory-utilization %g of "
                 "%.1f GiB, %.1f GiB free, %.2f GiB weights, %.2f GiB kept for activations and graphs; bound: %s)",
                 sizing.pages, page_bytes // 1024, sizing.pool_bytes / 2**30, cfg.gpu_memory_utilization,
                 total / 2**30, free / 2**30, own / 2**30, (act + graphs) / 2**30, sizing.limit)
        return sizing.pages

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one page: all layers' K and V for block_size tokens."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _index_bytes_per_block(self, arch) -> int:
        """Bytes of one page of the index-key region (0 without an indexer)."""
        if self.index_codec is None:
            return 0
        return math.prod(IndexKeys.pool_shape(self.num_layers, 1, self.block_size, arch.mla.index_head_dim,
                                              self.index_codec, self.dtype))

    def _allocate_index_keys(self, arch) -> None:
        """The index-key pool beside the target pool (same block ids; shared like it with --kv-cache-shared)."""
        assert self.index_codec is not None
        dim = arch.mla.index_head_dim
        shape = IndexKeys.pool_shape(self.num_layers, self.num_blocks, self.block_size, dim, self.index_codec,
                                     self.dtype)
        pool, self.index_shm_path, dest = allocate_kv(shape, torch.uint8, self.device, self.config.kv_cache_shared,
                                                      "index-key pool")
        self.index_keys = IndexKeys(self.num_layers, self.num_blocks, self.block_size, dim, self.index_codec,
                                    self.dtype, pool)
        if self.kv_destination is not None and dest is not None:
            self.kv_destination = with_region_pool(self.kv_destination, dest, self.index_keys.region())

    def _make_backend(self, kv_cache: torch.Tensor, head_dim: int, index_keys: IndexKeys | None = None):
        """The attention backend over ``kv_cache`` (and ``index_keys``, the target's with an indexer)."""
        scale = head_dim ** -0.5
        if self.device.type == "cuda" and self.config.attention_backend != "torch":
            # deferred: Triton kernel modules, on the CUDA path only (triton is optional)
            from services.engine.cuda.gpu_attention import TritonPagedAttention

            return TritonPagedAttention(kv_cache, scale, index_keys)
        use_native = self.device.type == "cpu" and self.config.attention_backend == "auto"
        kernels = native.load(self.config.cpu_kernel_dir) if use_native else None
        if kernels is not None:
            native.activate(kernels)  # the layers' norms, SiLU*mul and RoPE on CPU too
        return TorchPagedAttention(kv_cache, scale, kernels, index_keys)

    def _prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        rows = []
        for ch in chunks:
            start = ch.seq.num_computed_tokens
            rows.append((ch.seq.token_ids[start:start + ch.num_new_tokens], start, ch.seq.block_table))
        return prepare_rows(rows, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, groups: LayerGroups | None = None) -> dict[int, Sampled]:
        """``groups``: sinks the forward hands each computed layer group to (layer_groups.py; eager steps)."""
        if not out.chunks:
            return {}
        if groups is not None:
            with groups.hooked(self.model):
                return self.execute(out)
        if self.spec is not None:  # draft mirror + speculation (its own CUDA graphs on GPU)
            with device_scope(self.device):
                return self.spec.execute(self, out)  # type: ignore[return-value]
        if self.device.type == "cuda":
            with device_scope(self.device):
                return self._execute_gpu(out)
        with trace_fence.fence():  # no FX tracer patch window while the model runs (a background compile)
            return self._execute_cpu(out)

    def _execute_cpu(self, out: SchedulerOutput) -> dict[int, Sampled]:
        if self.compiled_decode is not None and self.compiled_decode.accepts(out.chunks):
            logits = self.compiled_decode.step(out.chunks)
            ends, rows, seq_ids = sampled_rows(out.chunks)
            return dict(zip(seq_ids, self.sampler.sample(logits[ends] if len(ends) < len(out.chunks) else logits,
                                                         rows), strict=True)) if ends else {}
        # One-token chunks first: the attention backend batches them as decode.
        chunks = sorted(out.chunks, key=lambda c: c.num_new_tokens != 1)
        ids, pos, meta = self._prepare(chunks)
        hidden = self.model(ids, pos, ForwardContext(self.attn_backend, meta))
        ends, rows, seq_ids = sampled_rows(chunks)
        if not ends:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(ends, device=hidden.device)])
        return dict(zip(seq_ids, self.sampler.sample(logits, rows), strict=True))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep | None:
        """Async scheduling: start ``out`` without waiting for its tokens (step_launch.py); ``prev``: the step
        still in flight, whose device tokens feed this one's placeholders."""
        if self.device.type == "cuda":
            with device_scope(self.device):
                return launch_step(self, out, prev)
        with trace_fence.fence():
            return launch_step(self, out, prev)

    # --- GPU path (CUDA only; the CPU path above never reaches it) ---

    def _init_gpu(self, loaded: LoadedModel) -> None:
        """Max model length, and decode CUDA graphs when enabled with the Triton backend."""
        # deferred: Triton kernel modules, on the CUDA path only (triton is optional)
        from services.engine.cuda.gpu_attention import TritonPagedAttention

        self.max_model_len = min(self.config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        # What follows launches on the current device (device_scope says why); the building thread's own current
        # device is left as it was (a guard, not set_device: a process may build engines on several GPUs).
        with device_scope(self.device):
            self.model.rotary.ensure(self.max_model_len)
            if self.config.cuda_graphs and self.spec is not None and isinstance(self.attn_backend,
                                                                                TritonPagedAttention):
                if self.config.spec_tokens:  # the whole speculative step, per batch bucket (spec/graphs.py)
                    self.spec.capture_graphs(self)
            elif self.config.cuda_graphs and isinstance(self.attn_backend, TritonPagedAttention):
                # deferred: CUDA graphs, on the CUDA path only
                from services.engine.cuda.cuda_graphs import DecodeGraphs

                self.graphs = DecodeGraphs(self.model, self.attn_backend, self.config.max_num_seqs,
                                           self.max_model_len, self.block_size, self.device)
                self.graphs.capture()

    def _prepare_gpu(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Like `_prepare`, but all index tensors travel in ONE pinned host->device copy.

        Layout of the buffer (bytes): int64 [ids T | positions T | slots T], then int32
        [block_tables B*MB | context_lens B | cu_seqlens_q B+1]; the device tensors are views of it.
        """
        bs = self.block_size
        n_tok = sum(ch.num_new_tokens for ch in chunks)
        nseq = len(chunks)
        query_lens = [ch.num_new_tokens for ch in chunks]
        context_lens = [ch.seq.num_computed_tokens + ch.num_new_tokens for ch in chunks]
        max_blocks = max((c + bs - 1) // bs for c in context_lens)
        n64, n32 = 3 * n_tok, nseq * max_blocks + 2 * nseq + 1
        host = torch.empty(8 * n64 + 4 * n32, dtype=torch.uint8, pin_memory=True)
        h64 = host[: 8 * n64].view(torch.int64).numpy()
        h32 = host[8 * n64:].view(torch.int32).numpy()
        ids, pos, slots = h64[:n_tok], h64[n_tok:2 * n_tok], h64[2 * n_tok:]
        bt = h32[: nseq * max_blocks].reshape(nseq, max_blocks)
        bt[:] = 0
        t = 0
        for i, ch in enumerate(chunks):
            seq = ch.seq
            start, end = seq.num_computed_tokens, context_lens[i]
            n = end - start
            table = np.asarray(seq.block_table[: (end + bs - 1) // bs], dtype=np.int64)
            bt[i, : len(table)] = table
            p = np.arange(start, end, dtype=np.int64)
            ids[t:t + n] = seq.token_ids[start:end]
            pos[t:t + n] = p
            slots[t:t + n] = table[p // bs] * bs + p % bs
            t += n
        off = nseq * max_blocks
        h32[off:off + nseq] = context_lens
        h32[off + nseq] = 0
        np.cumsum(query_lens, out=h32[off + nseq + 1:])
        dev = host.to(self.device, non_blocking=True)
        d64 = dev[: 8 * n64].view(torch.int64)
        d32 = dev[8 * n64:].view(torch.int32)
        num_decode = 0
        while num_decode < nseq and query_lens[num_decode] == 1:
            num_decode += 1
        meta = AttentionMetadata(
            slot_mapping=d64[2 * n_tok:],
            block_tables=d32[:off].view(nseq, max_blocks),
            context_lens=d32[off:off + nseq],
            query_lens=query_lens,
            context_lens_host=context_lens,
            num_decode=num_decode,
            cu_seqlens_q=d32[off + nseq:],
        )
        return d64[:n_tok], d64[n_tok:2 * n_tok], meta

    def _execute_gpu(self, out: SchedulerOutput) -> dict[int, Sampled]:
        chunks = sorted(out.chunks, key=lambda c: c.num_new_tokens != 1)
        if self.graphs is not None and all(c.num_new_tokens == 1 for c in chunks):
            bucket = self.graphs.bucket_for(len(chunks), max(c.seq.num_computed_tokens + 1 for c in chunks))
            if bucket is not None:
                return self._execute_graph(chunks, bucket)
        if self.graphs is not None:
            self.graphs.invalidate_rows()
        ids, pos, meta = self._prepare_gpu(chunks)
        hidden = self.model(ids, pos, ForwardContext(self.attn_backend, meta))
        ends, rows, seq_ids = sampled_rows(chunks)
        if not ends:
            return {}
        if len(ends) < hidden.shape[0]:
            hidden = hidden[torch.tensor(ends).to(self.device, non_blocking=True)]
        return self._sample_gpu(self.model.compute_logits(hidden), None, rows, seq_ids)

    def _execute_graph(self, chunks: list[ScheduledChunk], bucket: int) -> dict[int, Sampled]:
        """A pure-decode step replayed in a CUDA graph that also holds the LM head and greedy argmax.

        The host builds the sampling rows while the GPU runs; a per-instance `compute_logits` (a test
        or benchmark hook) is honoured by computing the logits outside the graph from its hidden state.
        """
        assert self.graphs is not None
        self.graphed_steps += 1
        hidden, logits, tokens = self.graphs.run_host(bucket, [ch.seq for ch in chunks])
        rows, seq_ids, keep = [], [], []
        for i, ch in enumerate(chunks):
            if ch.sample:
                keep.append(i)
                rows.append(SamplingRow(ch.seq.params, ch.seq.num_output_tokens))
                seq_ids.append(ch.seq.seq_id)
        if not keep:
            return {}
        hooked = "compute_logits" in vars(self.model)
        if logits is None or tokens is None or hooked or len(keep) < len(chunks):
            if len(keep) < len(chunks):
                hidden = hidden[torch.tensor(keep).to(self.device, non_blocking=True)]
            return self._sample_gpu(self.model.compute_logits(hidden), None, rows, seq_ids)
        graphs = self.graphs
        return self._sample_gpu(logits, tokens, rows, seq_ids, lambda t: graphs.logprob_table(bucket, t))

    def _sample_gpu(self, logits: torch.Tensor, greedy_tokens: torch.Tensor | None, rows: list[SamplingRow],
                    seq_ids: list[int], table_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None
                    ) -> dict[int, Sampled]:
        """Tokens on the device (``greedy_tokens``: the argmax already computed, used when every row is greedy);
        ``table_of(tokens)``: the logprob table a CUDA graph computes for them (None: computed here)."""
        if greedy_tokens is not None and all(r.params.greedy for r in rows):
            tokens = greedy_tokens
        else:
            tokens = self.sampler.tokens(logits, rows)
        table = table_of(tokens) if table_of is not None and any(r.params.logprobs for r in rows) else None
        return dict(zip(seq_ids, self.sampler.results(logits, tokens, rows, table), strict=True))

    # --- page access for KV handoff (prefill packs, decode unpacks) ---

    @property
    def composite(self) -> bool:
        """Pages carry more than the target region (index keys, draft KV): they cross as uint8 [P, page bytes]."""
        return len(self.page_regions) > 1

    def page_nbytes(self, codec: str | None = None) -> int:
        """Bytes of one page of every region, the target's in ``codec`` (None: the cache's dtype)."""
        return regions_nbytes(self.page_regions, codec)

    def read_pages(self, block_ids: list[int], codec: str | None = None) -> torch.Tensor:
        """Pages of ``block_ids`` on the host: [P, layers, 2, block_size, kv_heads, head_dim] in the cache's
        dtype, or with ``codec="fp8-e4m3"`` uint8 [P, fp8 page bytes] (values then per-token-per-head scales);
        with more regions than the target uint8 [P, page bytes] of every region in layout order."""
        if self.composite:
            with device_scope(self.device):  # the pack kernels launch on the pools' device
                return pack_regions(self.page_regions, block_ids, codec).cpu()
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        pack = pack_pages_fp8 if codec == FP8_CODEC else pack_pages
        with device_scope(self.device):
            return pack(self.kv_cache, idx).cpu()

    def write_pages(self, block_ids: list[int], pages: torch.Tensor, codec: str | None = None) -> None:
        """The inverse of read_pages (fp8 pages are dequantized into the cache's dtype)."""
        if self.composite:
            with device_scope(self.device):
                unpack_regions(pages, self.page_regions, block_ids, codec)
            return
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        unpack = unpack_pages_fp8 if codec == FP8_CODEC else unpack_pages
        with device_scope(self.device):
            unpack(pages.to(self.device, non_blocking=True), self.kv_cache, idx)
