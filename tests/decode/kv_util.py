"""Helpers for decode tests: a reference prefill's KV pages, chunk streams, RPC outcomes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import torch

from services.common.grpc_util import detail_of
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_layout import checksum
from services.text.sampling_params import SamplingParams

ENGINE = dict(model="random:tiny-llama", dtype="float32", num_kv_blocks=64, max_prefill_chunk=16)
BLOCK = 16
PROMPT = [(i * 37) % 250 + 1 for i in range(45)]  # 45 tokens: 3 pages of 16, the last partial


def ecfg(**kw: object) -> EngineConfig:
    return EngineConfig(**{**ENGINE, **kw})  # type: ignore[arg-type]


def prompt(seed: int, n: int = 45) -> list[int]:
    """A prompt of ``n`` tokens in [1, 250] that shares no leading block with another seed's."""
    return [(seed * 101 + i * 37) % 250 + 1 for i in range(n)]


@dataclass
class Reference:
    pages: torch.Tensor
    """The prompt's KV pages as a colocated engine computed them: [P, layers, 2, block, kv_heads, head_dim]."""
    first_token: int
    tokens: list[int]
    """Greedy output of an uninterrupted colocated run (first token included)."""


_REFS: dict[tuple[tuple[int, ...], int], Reference] = {}


def reference(ids: list[int], max_tokens: int) -> Reference:
    key = (tuple(ids), max_tokens)
    if key not in _REFS:
        eng = LLMEngine(ecfg())
        tables: list[list[int]] = []
        eng.chunk_listeners.append(lambda ch, _s: tables.append(list(ch.seq.block_table)))
        first = eng.generate([ids], SamplingParams(max_tokens=1, temperature=0))[0][0]
        nblocks = (len(ids) + BLOCK - 1) // BLOCK
        pages = eng.runner.read_pages(tables[-1][:nblocks])
        tokens = LLMEngine(ecfg()).generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0]
        _REFS[key] = Reference(pages, first, tokens)
    return _REFS[key]


def chunks(resv: decode_pb2.ReserveResponse, ids: list[int], ref: Reference, *, token: bytes | None = None,
           first_token: int | None = None) -> list[common_pb2.KVChunk]:
    """One chunk per page the reservation needs (skipping the pages decode already caches)."""
    out = []
    pages = range(resv.num_cached_blocks, len(resv.block_ids))
    for i, b in enumerate(pages):
        payload = ref.pages[b].contiguous().numpy().tobytes()
        c = common_pb2.KVChunk(request_id="r", reservation_id=resv.reservation_id, chunk_index=i,
                               token_start=b * BLOCK, token_end=min((b + 1) * BLOCK, len(ids)), first_block=b,
                               num_pages=1, layout_fingerprint=resv.layout.fingerprint, payload=payload,
                               checksum=checksum(payload), transport="grpc",
                               reservation_token=resv.reservation_token if token is None else token)
        if i == len(pages) - 1:
            c.is_last = True
            c.total_chunks = i + 1
            c.first_token = ref.first_token if first_token is None else first_token
        out.append(c)
    return out


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    detail: common_pb2.ErrorDetail


def outcome_of(e: grpc.aio.AioRpcError) -> Outcome:
    return Outcome(e.code(), e.details() or "", detail_of(e))


OK = Outcome(grpc.StatusCode.OK, "", common_pb2.ErrorDetail())


async def push(stub: decode_pb2_grpc.DecodeStub, msgs: list[common_pb2.KVChunk]) -> Outcome:
    async def gen() -> AsyncIterator[common_pb2.KVChunk]:
        for c in msgs:
            yield c
    return await refused(stub.PushKV(gen(), timeout=30))


async def reserve(stub: decode_pb2_grpc.DecodeStub, ids: list[int] = PROMPT, max_tokens: int = 6, *,
                  ignore_eos: bool = False, **kw: object) -> decode_pb2.ReserveResponse:
    return await stub.Reserve(decode_pb2.ReserveRequest(
        request_id=kw.pop("request_id", "r"), token_ids=ids,  # type: ignore[arg-type]
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos), **kw),
        timeout=30)


async def reserved(rig, ids: list[int] = PROMPT, max_tokens: int = 6, **kw: object
                   ) -> tuple[dict[str, float], Reference, decode_pb2.ReserveResponse]:
    """(stats of the idle engine before, the reference run of ``ids`` for ``max_tokens``, a reservation for
    them on ``rig``'s decode; ``kw`` go to :func:`reserve`)."""
    base = await idle(rig.engine)
    return base, reference(ids, max_tokens), await reserve(rig.stub, ids, max_tokens, **kw)


async def refused(call: object) -> Outcome:
    """The outcome of an awaitable RPC (expected to fail; OK if it did not)."""
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as e:
        return outcome_of(e)
    return OK


async def generate(stub: decode_pb2_grpc.DecodeStub, req: decode_pb2.DecodeGenerateRequest
                   ) -> tuple[list[int], int, Outcome]:
    """(tokens, last finish_reason, outcome) of a Generate stream."""
    tokens: list[int] = []
    reason = 0
    try:
        async for m in stub.Generate(req, timeout=60):
            tokens += m.token_ids
            reason = m.finish_reason
    except grpc.aio.AioRpcError as e:
        return tokens, reason, outcome_of(e)
    return tokens, reason, OK


async def run_to_end(stub: decode_pb2_grpc.DecodeStub, resv: decode_pb2.ReserveResponse) -> list[int]:
    """The tokens of ``resv``'s Generate stream, which must finish (length or stop) with status OK."""
    tokens, reason, out = await generate(stub, decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id))
    assert out.code == grpc.StatusCode.OK, out
    assert reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    return tokens


async def delivered(stub: decode_pb2_grpc.DecodeStub, resv: decode_pb2.ReserveResponse, ids: list[int],
                    ref: Reference) -> list[int]:
    """Push ``ref``'s pages into ``resv`` (accepted), then :func:`run_to_end`."""
    assert (await push(stub, chunks(resv, ids, ref))).code == grpc.StatusCode.OK
    return await run_to_end(stub, resv)


def slow_steps(monkeypatch, llm, before_step: Callable[[], object]) -> None:
    """Every step of engine ``llm`` (an LLMEngine) first calls ``before_step`` (a sleep, a gate's wait)."""
    step = llm.step

    def slow_step():
        before_step()
        return step()

    monkeypatch.setattr(llm, "step", slow_step)


async def idle(engine, timeout_s: float = 10.0) -> dict[str, float]:
    """Wait until the engine holds nothing (every block free, no request); returns its stats."""
    s: dict[str, float] = {}
    for _ in range(int(timeout_s / 0.05)):
        s = await engine.stats()
        if s["free_blocks"] == s["total_blocks"] and not (s["running"] + s["waiting"] + s["waiting_for_kv"]):
            return s
        await asyncio.sleep(0.05)
    return s
