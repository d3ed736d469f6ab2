"""Helpers for e2e tests: clients for a LocalCluster's services and /metrics scraping."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, common_pb2_grpc, router_pb2, router_pb2_grpc

CHAT_PROMPTS = [
    "What is the capital of France?",
    "List three colours of the rainbow.",
    "Write one sentence about the sea and the wind and the boats that sail on it at night.",
]


def metrics_text(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


def metric_sum(address: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples (counters: the _total sample) whose labels match."""
    total = 0.0
    for fam in text_string_to_metric_families(metrics_text(address)):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def load(address: str) -> common_pb2.LoadReport:
    async with create_channel(address) as ch:
        return await common_pb2_grpc.AdminStub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=10)


def load_sync(address: str) -> common_pb2.LoadReport:
    return asyncio.run(load(address))


def wait_idle(address: str, timeout: float = 20.0) -> common_pb2.LoadReport:
    """Poll until nothing runs or waits there; returns the last report."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        rep = load_sync(address)
        busy = rep.running + rep.waiting + rep.waiting_for_kv
        if (busy == 0 and rep.free_blocks == rep.total_blocks) or time.monotonic() > deadline:
            return rep
        time.sleep(0.2)


def post_json(http: str, path: str, body: dict | bytes, timeout: float = 120.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{http}{path}", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def rpc_code(coro) -> tuple[grpc.StatusCode, str]:
    """Run an RPC expected to fail; returns (code, details)."""
    async def run():
        try:
            await coro()
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    return asyncio.run(run())


async def stream_tokens(router: str, text: str, max_tokens: int, after: int | None = None, action=None
                        ) -> list[int]:
    """Token ids of a greedy, ignore-EOS router gRPC stream (it must end with finish LENGTH); after
    ``after`` tokens, ``await action()`` once (a fault injected mid-stream)."""
    got: list[int] = []
    async with create_channel(router) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            text=text, stream=True, params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True)), timeout=120)
        done = False
        async for msg in call:
            got += list(msg.token_ids)
            if after is not None and not done and len(got) >= after:
                done = True
                await action()
            if msg.finish_reason:
                assert msg.finish_reason == common_pb2.FINISH_REASON_LENGTH
    return got


async def generate_ids(router: str, ids: list[int], max_tokens: int,
                       deadline_s: float = 180.0) -> list[common_pb2.GenerateResponse]:
    """Every response of one greedy, ignore-EOS router gRPC Generate over prompt token ids (``deadline_s``: the
    RPC deadline, seconds)."""
    async with create_channel(router) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=ids),
            params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)),
            timeout=deadline_s)
        return [r async for r in call]
