"""Prefill compute of a tensor-parallel prefill with its rank-to-rank page writes inside the compute window
(chunked transfer on: each chunk's writes start while the next chunk computes) against the same prompts with
the writes after it (chunked transfer off: only the last chunk's step writes, after its compute ended).

One LocalCluster per mode: a TP=``--tp`` prefill and decode (real processes, gloo) over ``--transport``
(mooncake: each rank's own transfer engines; shm: every rank copies into decode's pools). Compute is the
prefill's ``pdserve_prefill_compute_seconds`` (first scheduled -> last chunk computed) summed over the
requests, read from its metrics; the ratio on / off is what the writes add to compute.

    python -m benchmarks.tp_rank_writes_bench --tp 2 --transport mooncake --prompt-tokens 960 --chunk 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from services.common.cli_args import ArgParser
from services.common.grpc_util import create_channel
from services.common.metrics import (
    PREFILL_COMPUTE_SECONDS,
    PREFILL_KV_RANK_PAGES_TOTAL,
    PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL,
)
from services.common.pb import common_pb2, router_pb2, router_pb2_grpc
from services.launcher import LocalCluster


def _metric(address: str, name: str) -> float:
    """Sum of a metric's samples named ``name`` (e.g. a histogram's ``_sum``) on one service."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


async def _generate(router: str, ids: list[int]) -> float:
    """One request through the router (2 output tokens); its wall seconds."""
    start = time.monotonic()
    async with create_channel(router) as ch:
        req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), params=common_pb2.SamplingParams(
            max_tokens=2, temperature=0.0, ignore_eos=True))
        async for _ in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=600):
            pass
    return time.monotonic() - start


def run_mode(args: argparse.Namespace, chunked: bool) -> dict[str, float]:
    tp = ["--tensor-parallel-size", str(args.tp), "--cpu-threads", "1", "--num-kv-blocks", str(args.kv_blocks)]
    extra = {"prefill": [*tp, "--max-prefill-chunk", str(args.chunk), "--chunked-transfer", str(chunked).lower(),
                         "--prefill-tail-tokens", "0"],  # the same pieces in both modes (no tail cut)
             "decode": tp}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=args.model, dtype="float32", extra=extra, quiet=True,
                      kv_transport=args.transport) as c:
        metrics = c.get("prefill-0").ready["metrics"]
        walls = []
        for i in range(args.warmup + args.requests):
            ids = [(13 * j + 7 * i + 1) % 250 for j in range(args.prompt_tokens)]  # distinct: no prefix reuse
            if i == args.warmup:
                base_s = _metric(metrics, PREFILL_COMPUTE_SECONDS + "_sum")
                base_n = _metric(metrics, PREFILL_COMPUTE_SECONDS + "_count")
            wall = asyncio.run(_generate(c.router["grpc"], ids))
            if i >= args.warmup:
                walls.append(wall)
        compute = _metric(metrics, PREFILL_COMPUTE_SECONDS + "_sum") - base_s
        n = _metric(metrics, PREFILL_COMPUTE_SECONDS + "_count") - base_n
        pages = _metric(metrics, PREFILL_KV_RANK_PAGES_TOTAL)
        fallbacks = _metric(metrics, PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL)
    return {"compute_ms_per_request": 1000 * compute / max(n, 1), "requests": n,
            "wall_ms_p50": 1000 * statistics.median(walls), "rank_page_slices": pages,
            "fallbacks": fallbacks}


def main() -> None:
    p = ArgParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--transport", default="mooncake", choices=["mooncake", "shm"])
    p.add_argument("--model", default="random:tiny-qwen3")
    p.add_argument("--prompt-tokens", type=int, default=960)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--kv-blocks", type=int, default=256)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    out = {mode: run_mode(args, chunked) for mode, chunked in (("writes_in_compute", True),
                                                                ("writes_after_compute", False))}
    on, off = out["writes_in_compute"], out["writes_after_compute"]
    out["compute_ratio_on_off"] = on["compute_ms_per_request"] / off["compute_ms_per_request"]
    out["args"] = vars(args)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
