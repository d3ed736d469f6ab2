"""`pdserve bench serve --logprobs`: every request of a random workload asks for the chosen token's logprob."""

from __future__ import annotations

from benchmarks.serve.config import TargetConfig, WorkloadConfig
from benchmarks.serve.sweep import make_target


def test_logprobs_flag_reaches_every_request() -> None:
    t = TargetConfig(base_url="http://127.0.0.1:1/v1", api="completions")
    assert make_target(t, WorkloadConfig(), "m").body("hi", 4).get("logprobs") is None
    on = make_target(t, WorkloadConfig(logprobs=True), "m")
    assert on.body("hi", 4)["logprobs"] == 1
    chat = make_target(TargetConfig(base_url="http://127.0.0.1:1/v1"), WorkloadConfig(logprobs=True), "m")
    assert chat.body([{"role": "user", "content": "hi"}], 4)["logprobs"] is True
