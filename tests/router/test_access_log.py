"""One access-log line per client request (pdserve.access), whatever ended it, and none when switched off."""

from __future__ import annotations

import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.common.logging import _KV_ATTR
from services.router.metering import RequestMeter
from services.router.openai_http import make_app
from services.router.pipeline import BackendError
from tests.router.harness import FakeBackend, fake_pipeline


async def _post(backend: FakeBackend, body: dict, *, access_log: bool = True) -> int:
    app = make_app(fake_pipeline(backend), meter=RequestMeter(None, "fake", access_log=access_log))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        r = await client.post("/v1/completions", json={"model": "fake", **body})
        await r.read()
        return r.status


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [getattr(r, _KV_ATTR) for r in caplog.records if r.name == "pdserve.access"]


async def test_a_completed_request_logs_its_tokens_and_times(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.access")
    assert await _post(FakeBackend("abc"), {"prompt": "hi", "max_tokens": 3}) == 200
    line, = _lines(caplog)
    assert line["id"].startswith("cmpl-") and line["api"] == "http" and line["wire"] == "200"
    assert (line["status"], line["code"], line["finish_reason"]) == ("ok", "-", "length")
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] == 3
    assert float(line["ttft_s"]) <= float(line["e2e_s"])


@pytest.mark.parametrize(("backend", "body", "want"), [
    (FakeBackend(error=BackendError("unavailable", "down")), {"prompt": "hi"}, ("503", "error", "unavailable")),
    (FakeBackend(), {"prompt": "hi", "n": 2}, ("400", "error", "invalid_argument")),
])
async def test_a_failed_request_logs_its_status(caplog: pytest.LogCaptureFixture, backend: FakeBackend, body: dict,
                                                want: tuple[str, str, str]) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.access")
    await _post(backend, body)
    line, = _lines(caplog)
    assert (line["wire"], line["status"], line["code"]) == want and line["ttft_s"] == "-"


async def test_switched_off_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.access")
    assert await _post(FakeBackend("abc"), {"prompt": "hi", "max_tokens": 3}, access_log=False) == 200
    assert _lines(caplog) == []
