"""Real local clusters (processes on loopback) shared by the e2e tests of a module."""

from __future__ import annotations

import pytest

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.launcher import LocalCluster

SMALL_KV = ["--kv-cache-bytes", str(192 << 20)]


@pytest.fixture(scope="session")
def reference_engine() -> LLMEngine:
    """The engine in this process, fp32: what a colocated deployment computes."""
    return LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=128 << 20))


@pytest.fixture(scope="session")
def pd_cluster():
    """2 prefill x 2 decode, fp32, round-robin; prefill-0 sends KV after the last chunk (chunked
    transfer off), prefill-1 after every chunk; prefill chunks of 37 tokens divide no test prompt."""
    extra = {
        "prefill": ["--max-prefill-chunk", "37", *SMALL_KV],
        "prefill-0": ["--no-chunked-transfer"],
        "decode": SMALL_KV,
        "router": ["--policy", "round_robin", "--lease-ms", "60000"],
    }
    with LocalCluster(prefill=2, decode=2, kvstore=None, dtype="float32", extra=extra, quiet=True) as c:
        yield c
