"""P/D with the prefill tail rule on: the streamed prompt's last tokens are computed in smaller pieces
(services/engine/prefill_tail.py), every piece's pages reach decode, and decode's greedy tokens equal the
in-process engine's. Reuses the in-process servicer pair of tests/prefill/test_transports.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.engine.engine import LLMEngine
from services.engine.prefill_tail import prefill_pieces
from services.text.sampling_params import SamplingParams
from tests.prefill.test_transports import (
    ENGINE,
    NO_MOONCAKE,
    PROMPTS,
    _assert_freed,
    _generate,
    _request,
    _reserve,
    pair,  # noqa: F401  (the fixture)
)

TAIL = dataclasses.replace(ENGINE, max_prefill_chunk=64, prefill_tail_tokens=16)


@pytest.mark.parametrize(("transport", "cut"), [
    pytest.param("mooncake", True, marks=pytest.mark.skipif(
        NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")),
    ("grpc", False),  # PageWriter.overlaps_compute: the cut pays only on mooncake (measured)
])
async def test_tail_split_prefill_gives_the_in_process_engines_tokens(pair, transport: str,  # noqa: F811
                                                                        cut: bool) -> None:
    p = await pair(transport, prefill_engine=TAIL)
    ids = PROMPTS[1]  # 130 tokens: 64, 48, 16, 2 with the tail rule (64, 64, 2 without)
    pieces = prefill_pieces(len(ids), TAIL.max_prefill_chunk, TAIL.prefill_tail_tokens, TAIL.block_size)
    assert pieces == [64, 48, 16, 2]
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    resp = await p.pstub.Prefill(_request(p, resv, ids))
    assert await consume == LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert resp.num_chunks == (len(pieces) if cut else 3)  # each piece's pages left as their own chunk
    assert resp.kv_bytes_sent == len(resv.block_ids) * p.prefill.layout.page_bytes
    await _assert_freed(p.decode.engine, p.prefill.engine)
