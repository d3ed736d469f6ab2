"""A P/D cluster on one GPU box: prefill and decode processes on CUDA (random Llama weights), requests
through the router's gRPC API; greedy tokens must equal an in-process GPU engine's, and TTFT is printed.

    python benchmarks/gpu_cluster_check.py --model random:smollm2-135m
"""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request

from services.common.cli_args import ArgParser
from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, router_pb2, router_pb2_grpc
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.launcher import LocalCluster
from services.text.sampling_params import SamplingParams


async def _generate(addr: str, ids: list[int], n: int) -> tuple[list[int], float]:
    async with create_channel(addr) as ch:
        await ch.channel_ready()  # TTFT as a client with an open connection sees it (no TCP/HTTP2 set-up)
        t0 = time.perf_counter()
        ttft, out = None, []
        req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), stream=True,
                                         params=common_pb2.SamplingParams(max_tokens=n, temperature=0.0,
                                                                          ignore_eos=True))
        async for msg in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=300):
            if msg.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            out += msg.token_ids
        return out, ttft or 0.0


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:smollm2-135m")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-transport", default="grpc", choices=("grpc", "cuda-ipc"))
    p.add_argument("--prefill-engine-core", default="auto", choices=("auto", "thread", "process"),
                   help="the prefill's --engine-core (auto: its step loop in an engine-core process)")
    args = p.parse_args(argv)
    prompts = [[(97 * k + 13 * i) % 250 + 1 for i in range(args.prompt_tokens + 37 * k)] for k in range(4)]
    # Same chunking and one request at a time, as the cluster will run them: same kernels, same numerics.
    ref = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", device="cuda", kv_cache_bytes=1 << 30,
                                 max_prefill_chunk=256))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    want = [ref.generate([ids], params)[0] for ids in prompts]
    del ref
    dev = ["--device", "cuda", "--kv-cache-bytes", str(4 << 30), "--max-prefill-chunk", "256"]
    ok = True
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=args.model, dtype="bfloat16", quiet=True,
                      extra={"prefill": [*dev, "--engine-core", args.prefill_engine_core], "decode": dev},
                      kv_transport=args.kv_transport) as c:
        for k, ids in enumerate(prompts):
            got, ttft = asyncio.run(_generate(c.router["grpc"], ids, args.max_tokens))
            same = sum(a == b for a, b in zip(got, want[k], strict=False))
            ok &= got[0] == want[k][0]
            print(f"prompt {k}: {len(ids)} tokens, TTFT {ttft * 1000:.1f} ms, {same}/{len(want[k])} tokens equal "
                  f"the in-process engine")
        pm = c.get("prefill-0").ready["metrics"]
        with urllib.request.urlopen(f"http://{pm}/metrics", timeout=10) as r:
            sent = [ln for ln in r.read().decode().splitlines() if ln.startswith("pdserve_prefill_kv_sent_bytes_total")]
        print("prefill KV bytes by transport:", sent)
    print("first tokens equal:", ok, f"(KV transport {args.kv_transport}, prefill --engine-core "
                                     f"{args.prefill_engine_core})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
