"""``request_checks.problem`` over token ids: the range check names the offending id, both vocabulary ends pass."""

from __future__ import annotations

from services.common.pb import prefill_pb2
from services.prefill.request_checks import problem

LIMITS = dict(vocab_size=100, max_model_len=64, block_size=4)


def _req(ids: list[int]) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(request_id="r", decode_address="d:1", reservation_id="v", reservation_token=b"t",
                                      token_ids=ids)


def test_token_id_range_names_the_offending_id() -> None:
    assert problem(_req([0, 5, 99]), **LIMITS) is None
    assert problem(_req([3, 100, 7]), **LIMITS) == ("token_ids", "token id 100 is outside the vocabulary [0, 100)")
    assert problem(_req([3, -4, 7]), **LIMITS) == ("token_ids", "token id -4 is outside the vocabulary [0, 100)")
    assert problem(_req([]), **LIMITS) == ("token_ids", "must not be empty")
    assert problem(_req([1] * 64), **LIMITS)[0] == "token_ids"  # type: ignore[index]
    req = _req([1] * 9)
    req.dest_block_ids.extend([1, 2])
    assert problem(req, **LIMITS)[0] == "dest_block_ids"  # type: ignore[index]
