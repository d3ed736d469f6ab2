"""Early Prefill with mooncake layer-group export: a prompt of one chunk waits for its reservation before it is
admitted, so its writer exists when the chunk's step starts and the chunk leaves layer group by layer group
while it computes (otherwise the step would begin before the attach and the whole chunk go after it). Longer
prompts and other transports are admitted at once (tests/prefill/test_early_attach.py). Real servicers, real
gRPC, loopback Mooncake, real CPU engines with the group path forced on."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from services.common.grpc_util import detail_of
from services.engine.kv_transport import mooncake
from tests.prefill.test_claim_overlap import HANG_GUARD, _computed, _want
from tests.prefill.test_early_attach import _attach, _early, _refused
from tests.prefill.test_mooncake_layer_groups import _grouped, _record_groups
from tests.prefill.test_mooncake_staging import _offer_landing
from tests.prefill.test_transports import PROMPTS, _assert_freed, _generate, _reserve, _until, pair

NO_MOONCAKE = mooncake.available()
pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")
__all__ = ["pair"]
ONE_CHUNK = 64
"""max_prefill_chunk: PROMPTS[0] (45 tokens) is one chunk."""


async def test_an_early_one_chunk_prompt_is_admitted_with_its_reservation_and_goes_by_layer_group(
        pair, monkeypatch) -> None:
    made = _record_groups(monkeypatch)
    p = await pair("mooncake", prefill_engine=dataclasses.replace(_grouped(3), max_prefill_chunk=ONE_CHUNK))
    _offer_landing(p)
    ids = PROMPTS[0]
    call = asyncio.ensure_future(p.pstub.Prefill(_early(p, ids)))
    await _until(lambda: bool(p.prefill.attachments.waiting), HANG_GUARD)
    await asyncio.sleep(0.3)  # time enough to admit and compute a 45-token prompt, had it been admitted
    s = await p.prefill.engine.stats()
    assert s["running"] + s["waiting"] == 0 and _computed(p) == 0  # waits for its reservation first
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.AttachReservation(_attach(p, resv, ids))
    resp = await call
    assert resp.num_prompt_tokens == len(ids)
    assert await consume == _want(ids)
    layers = p.prefill.engine.engine.runner.num_layers
    assert len(made) == 1 and made[0].groups_sent == -(-layers // 3)  # the chunk went group by group
    assert not p.prefill.attachments.waiting and not p.prefill.streams
    await _assert_freed(p.prefill.engine)


async def test_an_early_one_chunk_prompt_without_an_attach_fails_retryable_having_computed_nothing(pair) -> None:
    p = await pair("mooncake", prefill_engine=dataclasses.replace(_grouped(3), max_prefill_chunk=ONE_CHUNK))
    _offer_landing(p)
    p.prefill.config.claim_wait_s = 0.3
    err = await _refused(p.pstub.Prefill(_early(p, PROMPTS[0])))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and detail_of(err).retryable
    assert "no AttachReservation" in err.details() and "nothing was computed" in err.details()
    assert not p.prefill.attachments.waiting and not p.prefill.streams
    assert _computed(p) == 0
    await _assert_freed(p.prefill.engine)
