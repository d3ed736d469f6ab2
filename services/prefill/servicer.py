"""Prefill servicer: computes a prompt's KV in chunks and streams the pages to a reserved decode."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

import grpc
import torch

from services.common import tracing
from services.common.convert import params_from_pb
from services.common.grpc_util import KV_HANDOFF_FAILED, abort_if_draining, payload_budget
from services.common.metrics import PrefillMetrics
from services.common.pb import prefill_pb2, prefill_pb2_grpc
from services.engine.async_engine import AsyncEngine
from services.engine.kv_layout import FP8_CODEC
from services.engine.kv_transport import KVTransport, TransferError
from services.engine.sampling_params import InvalidRequestError, SamplingParams
from services.engine.scheduler import ScheduledChunk
from services.engine.shared_kv import SharedKVAttachError, SharedKVPools, copy_pages
from services.prefill.config import PrefillConfig
from services.prefill.kv_stream import RequestKVStream, pump
from services.prefill.kvstore_prefix import KVStorePrefix

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, config: PrefillConfig, metrics: PrefillMetrics, transport: KVTransport,
                 draining: asyncio.Event) -> None:
        self.config = config
        self.metrics = metrics
        self.transport = transport
        self.draining = draining
        self.engine: AsyncEngine = None  # type: ignore[assignment]  # bound once the model is loaded
        self.streams: dict[str, RequestKVStream] = {}
        self.inflight = 0
        self.kvstore: KVStorePrefix | None = None
        self.shm_pools = SharedKVPools()

    def bind(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.model = engine.engine.loaded.model_id
        self.layout = engine.engine.layout
        engine.engine.chunk_listeners.append(self._on_chunk)
        if self.config.kvstore_address:
            r = engine.engine.runner
            self.kvstore = KVStorePrefix(self.config.kvstore_address, self.layout,
                                         (r.num_layers, 2, r.block_size, r.num_kv_heads, r.head_dim), r.dtype)

    def _direct_writer(self, request: prefill_pb2.PrefillRequest):
        """With --kv-transport shm and a decode on this host that offers its pool: a function writing a
        chunk's pages straight into the reserved blocks (engine thread). Otherwise None (bytes in the stream)."""
        mode = self.config.kv_transport
        desc = request.dest_transport_info.get(mode)
        if mode == "grpc" or not desc:
            return None
        dest = list(request.dest_block_ids)
        try:
            pool = self.shm_pools.attach(desc)
        except SharedKVAttachError as e:
            log.warning("shm transport unavailable for %s (%s); sending pages in the stream", request.request_id, e)
            return None
        src = self.engine.engine.runner.kv_cache
        if pool.shape[:2] != src.shape[:2] or pool.shape[3:] != src.shape[3:] or pool.dtype != src.dtype:
            return None  # the fingerprint check refuses the mismatch; never reinterpret pages

        def write(first_block: int, src_blocks: list[int]) -> None:
            if first_block + len(src_blocks) > len(dest):
                raise ValueError(f"pages [{first_block}, {first_block + len(src_blocks)}) outside the "
                                 f"{len(dest)} reserved blocks")
            copy_pages(src, src_blocks, pool, dest[first_block:first_block + len(src_blocks)])
            if src.is_cuda:  # the pages must have landed before the descriptor tells decode they have
                torch.cuda.current_stream(src.device).synchronize()

        return write

    async def close(self) -> None:
        if self.kvstore is not None:
            await self.kvstore.close()

    async def _admit(self, rid: str, ids: list[int], params: SamplingParams, stream: RequestKVStream) -> int:
        """Load what the kvstore has beyond the local prefix, then admit the request (one engine-thread
        step, so the loaded pages cannot be evicted in between). Returns the blocks loaded."""
        eng = self.engine.engine
        pages = None
        first = 0
        if self.kvstore is not None:
            hashes = self.kvstore.hashes(ids)
            first = await self.engine.call(eng.cached_prefix_blocks, ids)
            present, pages = await self.kvstore.fetch(hashes, len(ids), first)
            if self.config.kvstore_write_back:
                stream.writeback_from = max(present, 0)
                stream.hashes = hashes

        def admit() -> int:
            loaded = eng.import_prefix_pages(ids, first, pages) if pages is not None else 0
            eng.add_request(rid, ids, params, False)
            return loaded

        return await self.engine.call(admit)

    def _on_chunk(self, ch: ScheduledChunk, sampled: tuple[int, float | None] | None) -> None:
        """Engine thread: route a computed chunk to its request's stream."""
        stream = self.streams.get(ch.seq.request_id)
        if stream is not None:
            stream.on_chunk(ch, sampled, self.engine.engine.last_step_start)
            if self.config.slowdown_ms_per_chunk:
                time.sleep(self.config.slowdown_ms_per_chunk / 1000.0)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> prefill_pb2.PrefillResponse:
        await abort_if_draining(context, self.draining, "prefill")
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill is still loading its model")
        for name in ("request_id", "decode_address", "reservation_id"):
            if not getattr(request, name):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: must not be empty")
        fp = self.layout.fingerprint
        if request.expected_layout_fingerprint and request.expected_layout_fingerprint != fp:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"KV layout fingerprint mismatch: decode expects {request.expected_layout_fingerprint}, "
                                f"this prefill produces {fp} ({self.layout.describe()})")
        try:
            params = params_from_pb(request.params)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # Prefill samples the first token only; stopping is decode's job.
        first_params = dataclasses.replace(params, max_tokens=1, stop=[], stop_token_ids=[], ignore_eos=True)
        chunked = request.chunked_transfer if request.HasField("chunked_transfer") else self.config.chunked_transfer
        rid = f"{request.request_id}/{uuid.uuid4().hex[:8]}"
        write_direct = self._direct_writer(request)
        runner = self.engine.engine.runner
        wire = self.layout
        read = runner.read_pages
        fp8 = self.engine.engine.fp8_layout
        if (write_direct is None and self.config.kv_wire_codec == FP8_CODEC
                and request.dest_transport_info.get("fp8") == fp8.fingerprint):
            wire = fp8

            def read(ids: list[int]) -> torch.Tensor:
                return runner.read_pages(ids, FP8_CODEC)

        stream = RequestKVStream(asyncio.get_running_loop(), read, self.layout.block_size, request.num_skip_blocks,
                                 chunked, time.monotonic(), write_direct, runner.read_pages)
        transport = self.config.kv_transport if write_direct is not None else self.transport.name
        self.streams[rid] = stream
        self.inflight += 1
        sender = None
        added = False
        with tracing.span_from_metadata("prefill.request", context.invocation_metadata(),
                                        request_id=request.request_id, prompt_tokens=len(request.token_ids)) as sp:
            try:
                sender = self.transport.open(request.decode_address, rid, metadata=tuple(tracing.inject_metadata()))
                try:
                    loaded = await self._admit(rid, list(request.token_ids), first_params, stream)
                except InvalidRequestError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                except ValueError as e:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                added = True
                last, page_bytes = await pump(stream, sender, request.request_id, request.reservation_id,
                                              wire, payload_budget(self.config.max_message_bytes), transport)
                with tracing.span("prefill.kv_finish"):
                    await sender.finish()
                if last.writeback is not None and self.kvstore is not None:
                    self.kvstore.write_back(stream.hashes, *last.writeback)
            except TransferError as e:
                self.metrics.kv_transfer_failures_total.labels(transport, e.code.lower()).inc()
                await self._cleanup(rid, sender, added, str(e))
                code = getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNAVAILABLE)
                await context.abort(code, f"{KV_HANDOFF_FAILED} {request.decode_address} failed: {e}")
            except BaseException:
                await self._cleanup(rid, sender, added, "cancelled")
                raise
            finally:
                self.streams.pop(rid, None)
                self.inflight -= 1
            sp.set_attribute("chunks", stream.num_chunks_computed)
        queue_s = (stream.first_scheduled or stream.arrival) - stream.arrival
        compute_s = (stream.last_computed or time.monotonic()) - (stream.first_scheduled or stream.arrival)
        m = self.metrics
        m.queue_seconds.labels(self.model).observe(max(0.0, queue_s))
        m.compute_seconds.labels(self.model).observe(max(0.0, compute_s))
        m.chunks_total.labels(self.model).inc(stream.num_chunks_computed)
        m.computed_tokens_total.labels(self.model).inc(stream.num_computed_tokens)
        from_store = min(stream.num_cached_tokens, loaded * self.layout.block_size)
        if from_store:
            m.cached_prefix_tokens_total.labels(self.model, "kvstore").inc(from_store)
        if stream.num_cached_tokens > from_store:
            m.cached_prefix_tokens_total.labels(self.model, "local").inc(stream.num_cached_tokens - from_store)
        if request.num_skip_blocks:
            m.cached_prefix_tokens_total.labels(self.model, "decode").inc(request.num_skip_blocks * self.layout.block_size)
        m.kv_sent_bytes_total.labels(transport).inc(page_bytes)
        m.kv_chunks_sent_total.labels(transport).inc(sender.chunks_sent)
        return prefill_pb2.PrefillResponse(
            first_token=last.first_token, first_logprob=last.first_logprob,
            num_prompt_tokens=len(request.token_ids), num_cached_tokens=stream.num_cached_tokens,
            num_chunks=sender.chunks_sent, kv_bytes_sent=page_bytes, queue_s=queue_s, compute_s=compute_s)

    async def _cleanup(self, rid: str, sender, added: bool, reason: str) -> None:
        if added:
            await asyncio.shield(self.engine.abort(rid))
        if sender is not None:
            await sender.abort(reason)

    async def drain(self) -> None:
        while self.inflight:  # noqa: ASYNC110 (bounded by the server's drain timeout)
            await asyncio.sleep(0.05)
