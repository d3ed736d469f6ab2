"""What one decode Reserve costs as the prompt grows (the Reserve leg of P/D TTFT).

    python -m benchmarks.reserve_path_bench --sizes 32,2000,8000 --rounds 40

An in-process decode servicer (random smollm2-135m shape, bf16, CPU) on a real grpc.aio server on
127.0.0.1, called by a client on the same event loop the way the router calls it: the router's own work
(``block_hashes`` of the prompt, building the ReserveRequest), then Reserve, then Abort (so every round
starts from the same free pool). Prompts are fresh per call (no prefix hit). Per size, the median over
rounds (sizes interleaved within a round), and the minimum, of: router hashing, request building, the Reserve RPC as the
client sees it, and the servicer's handler time (its ``Reserve`` coroutine, engine-thread hop included).
To compare two trees, run this file with ``PYTHONPATH`` set to each tree's root, alternating.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
from prometheus_client import CollectorRegistry

from services.common.block_hash import block_hashes
from services.common.cli_args import ArgParser
from services.common.metrics import DecodeMetrics
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.decode.config import DecodeConfig
from services.decode.pushkv_wire import add_decode_servicer
from services.decode.servicer import DecodeServicer
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.cpu.cpu_features import host_cpu
from services.text.sampling_params import SamplingParams
from services.text.sampling_pb import params_to_pb

BLOCK = 16


def _prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids in [1, 40000] sharing no leading block with another seed's."""
    return [(seed * 101 + i * 37) % 40000 + 1 for i in range(n)]


async def run(sizes: list[int], rounds: int, warmup: int) -> dict[int, dict[str, tuple[float, float]]]:
    """Per size, per figure: (median, minimum) over rounds in ms (the minimum is the least disturbed by
    other work on a shared box)."""
    servicer = DecodeServicer(DecodeConfig(host="127.0.0.1", port=0, metrics_port=-1),
                              DecodeMetrics(CollectorRegistry()), asyncio.Event())
    blocks = 2 * -(-max(sizes) // BLOCK) + 16
    servicer.bind(await asyncio.to_thread(AsyncEngine, EngineConfig(
        model="random:smollm2-135m", dtype="bfloat16", num_kv_blocks=blocks, block_size=BLOCK)))
    handler_s: list[float] = []
    reserve = servicer.Reserve

    async def timed(request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                    ) -> decode_pb2.ReserveResponse:
        t = time.perf_counter()
        try:
            return await reserve(request, context)
        finally:
            handler_s.append(time.perf_counter() - t)

    servicer.Reserve = timed  # type: ignore[method-assign]
    server = grpc.aio.server()
    add_decode_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = decode_pb2_grpc.DecodeStub(channel)
    params = params_to_pb(SamplingParams(max_tokens=8, temperature=0))
    rows: dict[int, list[tuple[float, float, float, float]]] = {n: [] for n in sizes}
    seed = 0
    try:
        for r in range(warmup + rounds):
            for n in sizes:
                seed += 1
                ids = _prompt(seed, n)
                t0 = time.perf_counter()
                block_hashes(ids, BLOCK)
                t1 = time.perf_counter()
                req = decode_pb2.ReserveRequest(request_id=f"r{seed}", token_ids=ids, params=params, lease_ms=30000)
                t2 = time.perf_counter()
                handler_s.clear()
                resv = await stub.Reserve(req)
                t3 = time.perf_counter()
                await stub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
                if r >= warmup:
                    rows[n].append((t1 - t0, t2 - t1, t3 - t2, handler_s[0]))
    finally:
        await channel.close()
        await server.stop(None)
        await servicer.close()
        servicer.engine.shutdown()
    names = ("router_hash", "request_build", "reserve_rpc", "decode_handler")
    return {n: {k: (statistics.median(c) * 1e3, min(c) * 1e3) for k, c in zip(names, zip(*rows[n], strict=True),
                                                                             strict=True)} for n in sizes}


def main() -> None:
    ap = ArgParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="32,2000,8000", help="prompt lengths (tokens), comma-separated")
    ap.add_argument("--rounds", type=int, default=40, help="measured rounds (each calls every size once)")
    ap.add_argument("--warmup", type=int, default=5, help="rounds not measured")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    cpu = host_cpu()
    print(f"cpu: {cpu.model}; flags: {' '.join(cpu.reported_flags()) or '-'}")
    for n, r in asyncio.run(run(sizes, args.rounds, args.warmup)).items():
        print(f"{n:6d} tokens: " + "  ".join(f"{k} {p50:.3f}/{lo:.3f}" for k, (p50, lo) in r.items())
              + " ms (median/min)")


if __name__ == "__main__":
    main()
