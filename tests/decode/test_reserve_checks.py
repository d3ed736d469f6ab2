"""Reserve's prompt check takes a C scan (min/max) when every id is in the vocabulary and still names the
first bad id and its position when one is not; the engine's own check agrees."""

from __future__ import annotations

import grpc
import pytest

from services.common.grpc_util import Reason
from services.common.pb import common_pb2, decode_pb2
from services.text.sampling_params import InvalidRequestError, SamplingParams
from tests.decode.kv_util import PROMPT, refused, reserve


async def test_reserve_names_the_first_out_of_vocabulary_id_and_its_position(decode_rig):
    rig = await decode_rig()
    vocab = rig.servicer.vocab_size
    for ids, pos in (([*PROMPT[:7], vocab, *PROMPT[7:], -3], 7), ([-1, *PROMPT], 0), ([*PROMPT, vocab + 9], 45)):
        out = await refused(rig.stub.Reserve(decode_pb2.ReserveRequest(
            request_id="x", token_ids=ids, params=common_pb2.SamplingParams(max_tokens=4))))
        assert out.code == grpc.StatusCode.INVALID_ARGUMENT and out.detail.field == "token_ids", out
        assert out.detail.reason == Reason.ERROR_REASON_INVALID_INPUT
        assert f"token id {ids[pos]} at position {pos} " in out.details, out.details
    edge = [0, *PROMPT, vocab - 1]  # both ends of the vocabulary are valid
    resv = await reserve(rig.stub, edge)
    assert len(resv.block_ids) == -(-len(edge) // resv.block_size)
    await rig.stub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
    assert len(rig.servicer.table) == 0


async def test_engine_validate_names_the_first_out_of_vocabulary_id(decode_rig):
    rig = await decode_rig()
    eng = rig.engine.engine
    p = SamplingParams(max_tokens=4)
    for ids, bad in (([*PROMPT, eng.vocab_size, -1], eng.vocab_size), ([3, -2, eng.vocab_size], -2)):
        with pytest.raises(InvalidRequestError, match=f"token id {bad} is outside the vocabulary"):
            eng._validate(ids, p, "fresh")
    eng._validate([0, *PROMPT, eng.vocab_size - 1], p, "fresh")
