"""Disaggregated prefill/decode at different tensor-parallel degrees (real processes on loopback, gloo):
greedy tokens equal the colocated TP=1 engine's for (prefill TP, decode TP) in (1,2), (2,1), (2,2), (4,2),
with the pages written rank to rank over shm (every prefill rank into the decode ranks' own pools, nothing
gathered through rank 0); a claim for another reservation is refused; a prefill killed mid-transfer leaves
every decode block free."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from services.common.grpc_util import create_channel
from services.common.metrics import (
    DECODE_KV_RECEIVED_BYTES_TOTAL,
    PREFILL_KV_RANK_PAGES_TOTAL,
    PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL,
)
from services.common.pb import common_pb2, router_pb2, router_pb2_grpc
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.launcher import LocalCluster
from services.text.sampling_params import SamplingParams
from tests.e2e.cluster_util import metric_sum

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:tiny-qwen3"
PROMPTS = [[(7 * i + 3) % 250 for i in range(41)], [65, 66, 67, 10, 200, 201, 13, 40, 41, 42, 43, 44, 90]]
MAX_TOKENS = 6
ENGINE = ["--cpu-threads", "1", "--num-kv-blocks", "64"]


def _reference_tokens(prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the colocated TP=1 engine in this process."""
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_kv_blocks=64, cpu_threads=1))
    return eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _reference_tokens(PROMPTS)


def _children(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(int(x.split()[1]) for x in status.read_text().splitlines() if x.startswith("PPid:"))
        except (OSError, StopIteration):
            continue
        if ppid == pid:
            out.append(int(status.parent.name))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def _rank_processes(pid: int) -> int:
    """Processes that ``pid`` spawned as tensor-parallel ranks (multiprocessing spawn children)."""
    return sum(b"spawn_main" in _cmdline(p) for p in _children(pid))


async def _generate(addr: str, ids: list[int]) -> list[int]:
    async with create_channel(addr) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), params=common_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        out: list[int] = []
        async for msg in stub.Generate(req, timeout=120):
            out.extend(msg.token_ids)
        return out


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2), (4, 2)])
def test_disaggregated_tokens_equal_colocated_tp1(prefill_tp: int, decode_tp: int, reference, tmp_path: Path) -> None:
    # 32-token chunks: two pages per chunk, so replicated prefill ranks (TP=4 over 2 KV heads) both write.
    extra = {"prefill": [*ENGINE, "--max-prefill-chunk", "32", "--tensor-parallel-size", str(prefill_tp)],
             "decode": [*ENGINE, "--tensor-parallel-size", str(decode_tp)]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=MODEL, dtype="float32", extra=extra,
                      quiet=True, kv_transport="shm") as c:
        router = c.router["grpc"]
        for name, tp in (("prefill-0", prefill_tp), ("decode-0", decode_tp)):
            assert _rank_processes(c.get(name).popen.pid) == tp - 1, name
        for ids, want in zip(PROMPTS, reference, strict=True):
            assert asyncio.run(_generate(router, ids)) == want, (prefill_tp, decode_tp)
        _check_rank_to_rank(c, prefill_tp, decode_tp)
        if (prefill_tp, decode_tp) == (1, 2):
            _check_trace(c, tmp_path)


def _check_rank_to_rank(c: LocalCluster, prefill_tp: int, decode_tp: int) -> None:
    """Every page went over shm, written by every prefill rank itself: no page bytes in the stream (so no
    gather through prefill rank 0 nor a scatter from decode rank 0), no fallback."""
    prefill, decode = c.get("prefill-0").ready["metrics"], c.get("decode-0").ready["metrics"]
    pages = sum(-(-len(p) // 16) for p in PROMPTS)  # block size 16
    assert metric_sum(decode, DECODE_KV_RECEIVED_BYTES_TOTAL, transport="shm") > 0
    assert metric_sum(decode, DECODE_KV_RECEIVED_BYTES_TOTAL, transport="grpc") == 0
    assert metric_sum(prefill, PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL) == 0
    by_rank = [metric_sum(prefill, PREFILL_KV_RANK_PAGES_TOTAL, rank=str(r)) for r in range(prefill_tp)]
    assert all(by_rank), by_rank
    # Each page once per (prefill head group, decode rank) sharing a head: 2 such pairs for every pair of degrees
    # here (2 KV heads, both sides at most 2 head groups; prefill replicas split the pages, not duplicate them).
    assert sum(by_rank) == 2 * pages, by_rank


def _check_trace(c: LocalCluster, out: Path) -> None:
    """``pdserve trace`` on a TP=1 prefill and a TP=2 decode: one line per rank's trace, each copied."""
    prefill, decode = c.get("prefill-0").ready["grpc"], c.get("decode-0").ready["grpc"]
    proc = subprocess.run([sys.executable, "-m", "services.cli", "trace", "--after", "0.5", "--duration", "0.5",
                           "--out", str(out), "--prefill", prefill, "--decode", decode],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split(" ") for line in proc.stdout.splitlines()]
    assert [(svc, inst.endswith("/rank1")) for svc, inst, _ in lines] == [
        ("prefill", False), ("decode", False), ("decode", True)], proc.stdout
    for _, _, path in lines:
        with open(path) as f:
            assert "traceEvents" in json.load(f) and Path(path).parent == out


def test_a_killed_decode_rank_ends_the_request_and_takes_the_instance_down() -> None:
    # --restart-wait-s 0: should the rank die before the request reaches decode (a slow prefill on a busy
    # box), the router fails it at once instead of waiting, within the deadline, for a restart nobody makes.
    extra = {"prefill": ENGINE, "decode": [*ENGINE, "--tensor-parallel-size", "2"],
             "router": ["--restart-wait-s", "0"]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=MODEL, dtype="float32", extra=extra,
                      quiet=True) as c:
        decode = c.get("decode-0").popen
        (rank1,) = [p for p in _children(decode.pid) if b"spawn_main" in _cmdline(p)]

        async def run() -> grpc.StatusCode:
            async with create_channel(c.router["grpc"]) as ch:
                req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPTS[1]),
                                                 params=common_pb2.SamplingParams(max_tokens=900, temperature=0.0,
                                                                                  ignore_eos=True))
                call = router_pb2_grpc.RouterStub(ch).Generate(req, timeout=60)
                # Rank 1 frozen, then killed while the request is in flight: decode's next collective (its
                # page import or step) waits on rank 1 until the kill, then fails.
                os.kill(rank1, signal.SIGSTOP)
                killer = asyncio.get_running_loop().call_later(3.0, os.kill, rank1, signal.SIGKILL)
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as e:
                    return e.code()
                finally:
                    killer.cancel()
                raise AssertionError("the stream completed although a rank died")

        code = asyncio.run(run())
        assert code == grpc.StatusCode.UNAVAILABLE, code  # not a deadline: the death ended it
        assert decode.wait(60) == 3  # EXIT_ENGINE_DEAD: a supervisor restarts the instance


def test_kvstore_pages_are_reused_across_tp_degrees(reference) -> None:
    """prefill-0 at TP=2 and prefill-1 at TP=1 share the kvstore: each loads pages the other wrote."""
    long_a, long_d = PROMPTS[0] + PROMPTS[1] * 3, [(5 * i + 11) % 250 for i in range(60)]
    want = _reference_tokens([long_a, long_d])
    extra = {"router": ["--policy", "round_robin"], "prefill": ENGINE, "prefill-0": ["--tensor-parallel-size", "2"],
             "decode": ENGINE}
    with LocalCluster(prefill=2, decode=1, kvstore="embedded", model=MODEL, dtype="float32", extra=extra,
                      quiet=True) as c:
        router = c.router["grpc"]
        # Round-robin alternates prefills: A, A, filler, D, D makes each prefill load a prompt the other computed.
        for ids, expect in ((long_a, want[0]), (long_a, want[0]), (PROMPTS[1], reference[1]),
                            (long_d, want[1]), (long_d, want[1])):
            assert asyncio.run(_generate(router, ids)) == expect
            time.sleep(0.5)  # write-back to the kvstore is asynchronous: let it land before the next request
        for name in ("prefill-0", "prefill-1"):
            loaded = metric_sum(c.get(name).ready["metrics"], "pdserve_prefill_cached_prefix_tokens_total",
                                source="kvstore")
            assert loaded > 0, f"{name} loaded nothing from the kvstore"
