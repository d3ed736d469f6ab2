"""The synchronous engine core: admission, one step at a time, output processing.

Not thread-safe: one thread drives it (see :mod:`services.engine.async_engine`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.common.malloc_tuning import release_free_heap
from services.engine.block_manager import BlockManager, NoFreeBlocksError
from services.engine.config import EngineConfig
from services.engine.kv_layout import FP8_CODEC, PageLayout
from services.engine.kv_pages import KVPages, pages_of
from services.engine.layer_groups import LayerListener, plan
from services.engine.model_loader import LoadedModel, load_model
from services.engine.model_runner import ModelRunner
from services.engine.models.cpu_fast import install as install_cpu_fast_paths
from services.engine.models.quant_linear import install as install_weight_format
from services.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from services.engine.sequence import FinishReason, Sequence, SequenceStatus
from services.engine.step_launch import LaunchedStep, collect
from services.text.detokenizer import IncrementalDetokenizer, StopChecker
from services.text.sampling_params import InvalidRequestError, Sampled, SamplingParams, TopLogprobs

if TYPE_CHECKING:
    from services.engine.parallel.launch import RankSet

log = logging.getLogger(__name__)

ChunkListener = Callable[[ScheduledChunk, "Sampled | None"], None]
"""Called after the model computed a chunk, before the scheduler updates (blocks still held):
(chunk, Sampled(token, logprob, top) or None). seq.num_computed_tokens is still the chunk's start."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[float | None] = field(default_factory=list)
    new_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    """Alternatives at each of new_token_ids (entries None unless params.top_logprobs > 0)."""
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    first_token_time: float | None = None
    spec_proposed: int = 0
    """Speculative decoding: drafts proposed in the step that made new_token_ids (0: no speculation)."""
    spec_accepted: int = 0
    """Drafts of that step accepted and emitted (new_token_ids less the one token every step makes)."""
    spec_synthetic: bool = False
    """True when acceptance was synthetic (--spec-synthetic-acceptance): the tokens are NOT the model's."""


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer | None
    stop: StopChecker | None
    first_token_time: float | None = None


def _latent_widths(arch) -> tuple[int, ...]:
    """PageLayout.latent of a latent-attention model: (kv_lora_rank, rope dims); () otherwise (DeepSeek-V3.2's
    index keys are a region of their own)."""
    mla = arch.mla
    if mla is None:
        return ()
    return (mla.kv_lora_rank, mla.qk_rope_head_dim)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        torch.set_grad_enabled(False)
        config.apply_host()  # pin, torch threads, log the dtype choice: before the first op
        t0 = time.monotonic()
        if loaded is None:
            log.info("engine: loading weights (%s) as %s on %s", config.model or "embedded default",
                     config.resolved_dtype, config.device)
        self.ranks: RankSet | None = None
        """Ranks 1..N-1 of this instance, started and watched by this (rank 0) process; None at TP=1."""
        if config.tensor_parallel_size > 1 and loaded is None:
            from services.engine.parallel.launch import RankSet  # imports async_engine, which imports this

            self.ranks = RankSet(config)
        self.loaded = loaded or (load_model(config.model, config.torch_dtype, config.device) if self.ranks is None
                                 else self.ranks.load_model())
        if loaded is None:
            params = list(self.loaded.model.parameters())
            log.info("engine: weights of %s loaded in %.1f s: %.1fM parameters, %.0f MiB", self.loaded.model_id,
                     time.monotonic() - t0, sum(p.numel() for p in params) / 1e6,
                     sum(p.numel() * p.element_size() for p in params) / 2**20)
        config.resolved_weight_format, config.weight_format_reason = install_weight_format(
            self.loaded.model, config.model, config.weight_format, config.device, config.torch_dtype,
            preloaded=loaded is not None)
        if torch.device(config.device).type == "cpu":
            install_cpu_fast_paths(self.loaded.model)  # same numbers, fewer ops per decode layer
        t1 = time.monotonic()
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(config.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)
        self.runner = ModelRunner(self.loaded, config) if self.ranks is None else self.ranks.make_runner(self.loaded)
        self.kv_pages = KVPages(self.runner)
        """The pool's page API (export, import, shard writes; kv_pages.py)."""
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_prefill_chunk=config.max_prefill_chunk,
            max_model_len=self.max_model_len,
            spec_tokens=config.spec_tokens if self.runner.spec is not None else 0,
            prefill_tail_tokens=config.prefill_tail_tokens,
            mixed_step_interval=config.mixed_step_interval,
        )
        self.scheduler = Scheduler(sched_cfg, self.block_manager, set(self.tokenizer.eos_token_ids))
        self.requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._held: dict[str, int] = {}
        """request_id -> seq_id of sequences marked by ``hold_blocks`` (blocks kept past the end)."""
        self.async_steps = config.async_steps and self.ranks is None and self.runner.spec is None and \
            getattr(self.runner, "compiled_decode", None) is None
        """Steps launch ahead of their tokens (config.async_scheduling; not with a compiled CPU decode step)."""
        self._inflight: tuple[SchedulerOutput, LaunchedStep | None, list[int]] | None = None
        """Async scheduling: the step launched last (its chunks, its launch, its placeholder slots)."""
        self.chunk_listeners: list[ChunkListener] = []
        self.layer_listeners: list[LayerListener] = []
        """Asked before each step's model call which chunks' pages leave layer group by layer group (layer_groups)."""
        self.last_step_start = 0.0
        self.last_step_tokens = 0
        """Tokens the latest step ran through the model (prefill chunks and decode rows; count)."""
        self.last_step_sequences = 0
        """Sequences in the latest step (count; 0: it scheduled nothing)."""
        """monotonic time the current/last step's model call began (chunk listeners read it)."""
        self.layer_group = config.kv_export_layer_group if (
            self.runner.device.type == "cuda" or config.kv_export_layer_group_cpu) and \
            pages_of(self).exports_layers else 0
        """Layers per export group of a layer listener's chunk (0: no layer listener is asked; also when the page
        API cannot export a layer range: tensor-parallel ranks, a draft region)."""
        self.vocab_size = self.loaded.arch.vocab_size
        arch = self.loaded.arch
        attn = dict(layer_windows=arch.layer_windows, attention_sinks=arch.attention_sinks,
                    latent=_latent_widths(arch))
        self.layout = PageLayout.for_model(self.loaded.model_id, arch.num_layers, arch.num_kv_heads, arch.head_dim,
                                           config.block_size, PageLayout.codec_for_dtype(config.torch_dtype), **attn)
        self.fp8_layout = PageLayout.for_model(self.loaded.model_id, arch.num_layers, arch.num_kv_heads,
                                               arch.head_dim, config.block_size, FP8_CODEC, **attn)
        """The same pages on the wire as fp8-e4m3 with per-token-per-head scales (half the bytes of bf16)."""
        # Every page also carries DeepSeek-V3.2's index keys and the draft's KV, each in its own codec (the fp8 wire
        # codec of fp8_layout re-encodes the target region only: page_regions.py).
        for region in [r for r, _ in self.kv_pages.region_pools]:
            self.layout = self.layout.with_region(region)
            self.fp8_layout = self.fp8_layout.with_region(region)
        log.info("engine: KV cache of %d pages x %d tokens (%.0f MiB), context %d tokens, ready in %.1f s "
                 "(%.1f s since loading began)", self.runner.num_blocks, config.block_size,
                 self.runner.num_blocks * self.layout.page_bytes / 2**20, self.max_model_len,
                 time.monotonic() - t1, time.monotonic() - t0)
        self.warmed_up: dict[str, float] | None = None
        """What the start-up warm-up took (`warm_up`; None: not run, CPU or tensor-parallel ranks)."""
        if self.runner.device.type == "cuda" and self.ranks is None:
            self.warmed_up = self.warm_up()
        freed = release_free_heap()  # start-up's temporaries (dequantized tensors, probes): not kept resident
        if freed:
            log.info("engine: start-up freed %.0f MiB of heap, returned to the system", freed / 2**20)

    # --- warm-up ---

    WARM_UP_TAIL = 40
    """Tokens of the warm-up prompt that continue after its first chunk (the chunk-after-a-prefix kernels)."""

    def warm_up(self) -> dict[str, float]:
        """Run a few requests through the whole step path once, before any real one (on CUDA at start): prompts
        alone at odd and whole-page lengths, one of a full chunk beside decode rows, a prompt continued after its
        first chunk, graphed decode of several rows, logprobs and a sampled row. The kernels Triton compiles on
        first use (one variant per shape class) and the libraries' first-call costs are paid here instead of by
        the first requests (H100, random Llama-3-8B: a first 64-request point's prompt steps took 6.0 s cold,
        3.9 s after this, 1.6 s once its shapes had been met; compositions met later still pay their own first
        calls). Leaves nothing behind: the prefix cache is off meanwhile, every block comes back free, no
        counter moves. Returns the requests, steps and seconds it took (logged)."""
        t0 = time.monotonic()
        bm, cfg = self.block_manager, self.config
        vocab = max(2, min(self.vocab_size, 30000))
        room = max(0, bm.num_free_blocks // 2) * cfg.block_size  # tokens the warm-up may hold at once
        last = self.max_model_len - 8  # prompt + outputs must fit the context

        def prompt(n: int, salt: int) -> list[int]:
            return [(7 * i + salt) % vocab for i in range(n)]

        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with_lp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=1)
        sampled = SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True)
        first = [(n, sp) for n, sp in ((37, with_lp), (64, greedy), (129, sampled)) if n + 8 <= min(last, room)]
        room -= sum(n + 8 for n, _ in first)
        big = min(cfg.max_num_batched_tokens - len(first), cfg.max_prefill_chunk, last, room - 8)
        later = [big] if big > 16 else []
        chunked = cfg.max_prefill_chunk + self.WARM_UP_TAIL
        if later and chunked <= min(last, room - big - 16):
            later.append(chunked)
        caching, bm.enable_prefix_caching = bm.enable_prefix_caching, False
        ids: list[str] = []
        steps = 0
        try:
            for i, (n, sp) in enumerate(first):
                ids.append(f"__warm-up-{i}")
                self.add_request(ids[-1], prompt(n, i), sp, detokenize=False)
            if first:
                self.step()  # prompts alone
                steps += 1
            for j, n in enumerate(later):  # beside the first ones' decode rows
                ids.append(f"__warm-up-{len(first) + j}")
                self.add_request(ids[-1], prompt(n, 100 + j), greedy, detokenize=False)
            while self.has_work():
                self.step()
                steps += 1
        finally:
            for rid in ids:
                self.abort(rid)  # a no-op for the finished ones
            bm.enable_prefix_caching = caching
        self.last_step_tokens = self.last_step_sequences = 0
        out = {"requests": float(len(ids)), "steps": float(steps), "seconds": time.monotonic() - t0}
        log.info("engine: warmed the step path in %.1f s (%d requests, %d steps, prompts of %s tokens)",
                 out["seconds"], len(ids), steps, [n for n, _ in first] + later)
        return out

    # --- admission ---

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"{len(prompt_token_ids)} tokens do not fit the context of {self.max_model_len} "
                          "tokens (one position must remain for the output)")
        in_vocab = min(prompt_token_ids) >= 0 and max(prompt_token_ids) < self.vocab_size  # C scans
        bad = None if in_vocab else next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("prompt", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        params.validate()

    def _track(self, seq: Sequence, detokenize: bool) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids[: seq.num_prompt_tokens]) if detokenize else None
        stop = StopChecker(seq.params.stop) if detokenize and seq.params.stop else None
        req = _Request(seq, detok, stop)
        self.requests[seq.request_id] = req
        self._by_seq[seq.seq_id] = req

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    detokenize: bool = True, stream_kv: bool = False) -> Sequence:
        """``stream_kv``: the prompt's KV leaves per chunk (prefill, chunked transfer on): its tail is split."""
        self._validate(prompt_token_ids, params, request_id)
        seq = Sequence(list(prompt_token_ids), params, request_id=request_id, arrival_time=time.monotonic())
        self.scheduler.add(seq, stream_kv)
        self._track(seq, detokenize)
        return seq

    def add_kv_import(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      detokenize: bool = True) -> tuple[Sequence, int]:
        """Decode side: reserve blocks for a prompt whose KV a prefill will send.

        Returns the sequence and how many leading blocks already hold valid KV (prefix cache)."""
        self._validate(prompt_token_ids, params, request_id)
        seq = Sequence(list(prompt_token_ids), params, request_id=request_id, arrival_time=time.monotonic())
        num_cached = self.scheduler.add_kv_import(seq)
        self._track(seq, detokenize)
        return seq, num_cached

    def kv_import_done(self, request_id: str, first_token: int, logprob: float | None,
                       top: TopLogprobs | None = None) -> list[RequestOutput] | None:
        """Every page of a reserved prompt landed: the request joins the batch with ``first_token``.

        Returns None (and changes nothing) when the request is no longer waiting for its KV (it expired
        or was aborted while the last chunk landed). Raises InvalidRequestError for a token id outside
        the vocabulary, before touching any state."""
        if not 0 <= first_token < self.vocab_size:
            raise InvalidRequestError("first_token", f"{first_token} is outside the vocabulary [0, {self.vocab_size})")
        req = self.requests.get(request_id)
        if req is None or req.seq.status != SequenceStatus.WAITING_FOR_KV:
            return None
        self.scheduler.kv_import_done(req.seq.seq_id, first_token, logprob)
        req.first_token_time = time.monotonic()
        return [self._emit(req, [first_token], [logprob], [top])]

    def hold_blocks(self, seq: Sequence) -> None:
        """Engine thread (a chunk listener): keep seq's KV blocks after it finishes, until
        ``release_held(request_id)`` or ``abort(request_id)`` (a KV hand-off still reads them). Counted as used."""
        self.scheduler.hold(seq.seq_id)
        self._held[seq.request_id] = seq.seq_id

    def release_held(self, request_id: str) -> bool:
        """Free the blocks ``hold_blocks`` kept (True if it freed any); idempotent."""
        seq_id = self._held.pop(request_id, None)
        return seq_id is not None and self.scheduler.release_held(seq_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request in any state and free its blocks (held ones too); returns its final (ABORT)
        output, None when it is no longer running."""
        self.release_held(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._by_seq.pop(req.seq.seq_id, None)
        self.scheduler.abort(req.seq.seq_id)
        seq = req.seq
        return RequestOutput(request_id=request_id, finished=True, finish_reason=FinishReason.ABORT,
                             num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                             num_output_tokens=seq.num_output_tokens, first_token_time=req.first_token_time)

    # --- prefix pages from elsewhere (kvstore) ---

    def cached_prefix_blocks(self, prompt_token_ids: list[int]) -> int:
        """Leading full blocks of a prompt this engine's prefix cache holds (capped so one token remains)."""
        seq = Sequence(list(prompt_token_ids), SamplingParams(max_tokens=1))
        return len(self.block_manager.get_computed_prefix(seq)[0])

    def import_prefix_pages(self, prompt_token_ids: list[int], first_block: int, pages: torch.Tensor) -> int:
        """Put pages for the leading full blocks [first_block, first_block + P) of a prompt into the prefix
        cache, as if computed here, so the next request with that prefix hits them.

        Blocks [0, first_block) must already be cached here; if they were evicted meanwhile nothing is
        imported. Returns the number of blocks the cache gained."""
        bs = self.config.block_size
        n = first_block + pages.shape[0]
        seq = Sequence(list(prompt_token_ids[: n * bs]), SamplingParams(max_tokens=1))
        try:
            held = self.block_manager.allocate_for_kv_import(seq)
        except NoFreeBlocksError:
            return 0
        try:
            if held < first_block:
                return 0  # the local prefix was evicted: the pages would not chain onto anything
            if held < n:
                self.runner.write_pages(seq.block_table[held:n], pages[held - first_block:])
                seq.num_computed_tokens = n * bs
                self.block_manager.mark_computed(seq, n * bs)
            return max(0, n - held)
        finally:
            self.block_manager.free(seq)

    # --- stepping ---

    def has_work(self) -> bool:
        if self.ranks is not None:
            self.ranks.check_idle()  # a dead rank kills the engine loop (the service goes NOT_SERVING)
        return self.scheduler.has_work or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """One step. With async scheduling, the outputs are those of the step launched by the previous call
        (this call's step runs meanwhile; see `_step_async`)."""
        if self._inflight is not None or (self.async_steps and not self.chunk_listeners and not self.layer_listeners):
            return self._step_async()
        return self._step_sync()

    def _step_async(self) -> list[RequestOutput]:
        """Schedule step N (step N-1's tokens still placeholders), launch it, then wait for step N-1's tokens,
        resolve and emit them, and advance step N's bookkeeping. A sequence step N-1 ends was also scheduled in
        step N: its step-N token is dropped (never emitted; its blocks were freed at once, the in-flight writes to
        them come before any later step's in stream order). Listeners need synchronous steps: once one is added,
        the step in flight is drained and steps run synchronously."""
        prev = self._inflight
        sync_next = bool(self.chunk_listeners or self.layer_listeners or not self.async_steps)
        out = self.scheduler.schedule() if not sync_next else None
        launched = None
        if out is not None and out.chunks:
            self.last_step_start = time.monotonic()
            launched = self.runner.launch(out, prev[1] if prev is not None and prev[1] is not None else None)
        outputs = self._resolve(*prev) if prev is not None else []
        self._inflight = None
        if out is not None and out.chunks:
            self._inflight = (out, launched, self.scheduler.advance(out))
        return outputs

    def _resolve(self, out: SchedulerOutput, launched: LaunchedStep | None, slots: list[int]) -> list[RequestOutput]:
        sampled = collect(self.runner, launched) if launched is not None else {}
        self.scheduler.resolve(out, slots, sampled)
        now = time.monotonic()
        outputs = []
        for ch in out.chunks:
            # A request that ended (a token, a stop string, an abort) left _by_seq then: its later tokens drop.
            req = self._by_seq.get(ch.seq.seq_id)
            if req is None or not ch.sample or ch.seq.seq_id not in sampled:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            s = sampled[ch.seq.seq_id]
            outputs.append(self._emit(req, [s.token], [s.logprob], [s.top]))
        return outputs

    def _step_sync(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self.last_step_sequences = len(out.chunks)
        self.last_step_tokens = sum(c.num_new_tokens for c in out.chunks)
        if not out.chunks:
            return []
        self.last_step_start = time.monotonic()
        groups = plan(self.layer_listeners, out.chunks, self.runner.num_layers, self.layer_group)
        sampled = self.runner.execute(out) if groups is None else self.runner.execute(out, groups)
        if self.chunk_listeners:
            for ch in out.chunks:
                s = sampled.get(ch.seq.seq_id) if ch.sample else None
                for listener in self.chunk_listeners:
                    listener(ch, s)
        self.scheduler.update_from_output(out, sampled)
        now = time.monotonic()
        outputs = []
        for ch in out.chunks:
            req = self._by_seq.get(ch.seq.seq_id)
            if req is None or not ch.sample or ch.seq.seq_id not in sampled:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            result = sampled[ch.seq.seq_id]
            run = result if isinstance(result, list) else [result]  # a list: speculation's accepted run
            o = self._emit(req, [s.token for s in run], [s.logprob for s in run], [s.top for s in run])
            if ch.spec_tokens:
                o.spec_proposed, o.spec_accepted = ch.spec_tokens, len(run) - 1
                o.spec_synthetic = self.config.spec_synthetic_acceptance > 0
            outputs.append(o)
        return outputs

    def _emit(self, req: _Request, tokens: list[int], logprobs: list[float | None],
              tops: list[TopLogprobs | None]) -> RequestOutput:
        seq = req.seq
        text = ""
        if req.detok is not None:
            end_ids = self.scheduler.eos_token_ids | set(seq.params.stop_token_ids)
            for i, t in enumerate(tokens):
                ends = seq.is_finished and seq.finish_reason == FinishReason.STOP and i == len(tokens) - 1
                if ends and t in end_ids and not seq.params.ignore_eos:
                    continue  # EOS / a stop token ends the text; it is not part of it
                text += req.detok.add(t)
            if seq.is_finished:
                text += req.detok.flush()
            if req.stop is not None:
                text = req.stop.feed(text)
                if req.stop.stopped:
                    if not seq.is_finished:
                        self.scheduler.finish(seq.seq_id, FinishReason.STOP)
                elif seq.is_finished:
                    text += req.stop.flush()
        ro = RequestOutput(
            request_id=seq.request_id, new_token_ids=tokens, new_text=text, new_logprobs=logprobs,
            new_top_logprobs=tops,
            finished=seq.is_finished, finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens, first_token_time=req.first_token_time,
        )
        if seq.is_finished:
            self.requests.pop(seq.request_id, None)
            self._by_seq.pop(seq.seq_id, None)
        return ro

    # --- introspection ---

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        cd = getattr(self.runner, "compiled_decode", None)  # a tensor-parallel runner has none
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "waiting_for_kv": self.scheduler.num_waiting_for_kv,
            "free_blocks": bm.num_free_blocks,
            "total_blocks": self.runner.num_blocks,
            "kv_usage": bm.usage,
            # --cpu-compile-decode: batch sizes whose step runs compiled now, seconds spent compiling (0: off)
            "compiled_step_batch_sizes": float(len(cd.active)) if cd is not None else 0.0,
            "step_compile_seconds": cd.compile_seconds if cd is not None else 0.0,
        }

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[int]]:
        """Run prompts to completion in one batch (offline use and tests): output tokens per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        ids = []
        for i, (p, sp) in enumerate(zip(prompt_token_ids, plist, strict=True)):
            ids.append(f"offline-{id(self)}-{i}")
            self.add_request(ids[-1], p, sp, detokenize=False)
        results: dict[str, list[int]] = {r: [] for r in ids}
        while self.has_work():
            for o in self.step():
                results[o.request_id].extend(o.new_token_ids)
        return [results[r] for r in ids]
