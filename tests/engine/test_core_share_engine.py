"""The engine loop's core lending: AsyncEngine with --cpu-share-group borrows an idle peer's share while it
steps, keeps to its own while the peer works, and exports what it runs with (the cpu_threads stat)."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.cpu import core_share as cs
from services.text.sampling_params import SamplingParams


@pytest.fixture
def group() -> Iterator[str]:
    name = f"test{os.getpid()}-{secrets.token_hex(4)}"
    threads = torch.get_num_threads()
    cs.create_group(name)
    try:
        yield name
    finally:
        cs.remove_group(name)
        torch.set_num_threads(threads)  # the engine thread set the process-wide count


async def _threads_while_generating(engine: AsyncEngine, prompt: list[int]) -> set[float]:
    """The cpu_threads stat read at each output after the first (the first may still see the snapshot
    published before the engine's first step)."""
    seen: set[float] = set()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    n = 0
    async for _ in engine.generate(prompt, params, request_id=secrets.token_hex(4)):
        n += 1
        if n > 1:
            seen.add(engine.published_stats()["cpu_threads"])
    return seen


async def test_engine_borrows_an_idle_peer_and_not_a_busy_one(our_gguf_model: Any, group: str) -> None:
    peer = cs.CoreShare.join(group, 1, lambda n: None, pid=os.getppid())  # a live process: the test's parent
    peer.idle(time.monotonic_ns() - 10 * cs.HOLD_NS)
    engine = AsyncEngine(EngineConfig(dtype="float32", num_kv_blocks=64, cpu_threads=1, cpu_share_group=group,
                                      cpu_compile_decode=0),  # a compiled step never borrows (async_engine)
                         loaded=our_gguf_model)
    try:
        prompt = list(range(100, 140))
        assert await asyncio.wait_for(_threads_while_generating(engine, prompt), 120) == {2.0}
        deadline = time.monotonic() + 10
        while engine.published_stats()["cpu_threads"] != 1.0:  # idle past the hold: back to its share
            assert time.monotonic() < deadline, "the idle engine kept the borrowed thread"
            await asyncio.sleep(0.02)
        peer.busy()
        assert await asyncio.wait_for(_threads_while_generating(engine, prompt), 120) == {1.0}
        assert [p.pid for p in peer.peers()] == [os.getpid()]
    finally:
        engine.shutdown()
    try:
        assert peer.peers() == []  # shutdown freed the engine's slot
    finally:
        peer.leave()
