"""``pdserve bench cluster``: a local P/D cluster measured through the router, in one run.

1. The same workload (streamed chat requests at a fixed concurrency) through three set-ups:
   disaggregated with chunked KV transfer, disaggregated with transfer after the last chunk, and
   colocated (one worker does both): client TTFT, TPOT and output throughput.
2. The KV stream on its own: one request's pages pushed to a decode through the PushKV stream (the
   grpc transport, pages written into decode's cache), beside a plain loopback TCP copy of the same
   bytes measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from services.common.cli_args import ArgParser
from services.common.grpc_util import create_channel, payload_budget
from services.common.kv_kinds import pool_id
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.engine.kv_transport import CLAIM_ACK
from services.engine.shared_kv import SharedKVPools, copy_pages
from services.launcher import LocalCluster, served_model

TOPIC = ("the history of bridges, from fallen logs across streams to stone arches, iron trusses and long "
         "suspension spans, and what each new material allowed engineers to build. ")


def _one(http: str, model: str, content: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT, e2e, output tokens) of one streamed chat request."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "stream": True,
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://{http}/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft or 0.0, time.perf_counter() - t0, tokens


def run_workload(tag: str, http: str, n: int, concurrency: int, prompt_words: int, max_tokens: int
                 ) -> dict[str, float]:
    """``tag`` starts every prompt, so no set-up reuses another's cached prefixes."""
    model = served_model(http)
    words = TOPIC.split()
    prompts = [f"{tag} {i}. " + " ".join((words * (prompt_words // len(words) + 1))[:prompt_words])
               for i in range(n)]
    _one(http, model, "warm up", 4)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: _one(http, model, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    tpots = [(r[1] - r[0]) / max(1, r[2] - 1) for r in results]
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": sorted(ttfts)[int(0.9 * (n - 1))],
            "tpot_p50_s": statistics.median(tpots), "output_tok_s": sum(r[2] for r in results) / wall,
            "requests": n}


async def kv_stream_bytes_per_s(decode: str, prompt_len: int, repeats: int, shm: bool = False,
                                fp8: bool = False) -> dict[str, float]:
    """Push a whole prompt's pages into a decode reservation through the PushKV stream: page bytes in
    the messages (grpc), or, with ``shm``, copied from a local cache into decode's shared pool the way a
    prefill does, with descriptor-only messages. With ``fp8`` the messages carry fp8-e4m3 pages (decode
    dequantizes them); MB/s then counts the cache's own page bytes delivered, the figure comparable with
    the others."""
    async with create_channel(decode) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        rates = []
        for r in range(repeats):
            ids = [(7 * r + 3 * shm + 5 * fp8 + i) % 30000 + 100 for i in range(prompt_len)]  # distinct: no prefix-cache skip
            resv = await stub.Reserve(decode_pb2.ReserveRequest(
                request_id=f"kvbench-{r}", token_ids=ids, params=common_pb2.SamplingParams(max_tokens=1)))
            page_bytes = resv.layout.page_bytes
            lay = resv.layout
            wire_bytes = (lay.num_layers * 2 * lay.block_size * lay.num_kv_heads * (lay.head_dim + 4) if fp8
                          else page_bytes)
            if fp8:
                assert resv.accepted_wire_fingerprints, "this decode accepts no fp8-e4m3 pages"
            fingerprint = resv.accepted_wire_fingerprints[0] if fp8 else lay.fingerprint
            n_pages = len(resv.block_ids) - resv.num_cached_blocks
            assert n_pages == len(resv.block_ids), "the decode already held these pages; the figure would be empty"
            pool = SharedKVPools().attach(resv.destination) if shm else None
            src = torch.randn(pool.shape[0], 2, len(resv.block_ids), *pool.shape[3:]).to(pool.dtype) if shm else None
            per_msg = max(1, min(16, payload_budget() // wire_bytes))
            payload = bytes(per_msg * wire_bytes) if fp8 else bytes(range(256)) * (per_msg * page_bytes // 256 + 1)
            msgs = []
            first = resv.num_cached_blocks
            while first < len(resv.block_ids):
                n = min(per_msg, len(resv.block_ids) - first)
                data = b"" if shm else payload[: n * wire_bytes]
                last = first + n == len(resv.block_ids)
                msgs.append(common_pb2.KVChunk(
                    reservation_id=resv.reservation_id, chunk_index=len(msgs), first_block=first, num_pages=n,
                    token_start=first * 16, token_end=min((first + n) * 16, prompt_len),
                    layout_fingerprint=fingerprint, payload=data, checksum=zlib.crc32(data),
                    transport="shm" if shm else "grpc", is_last=last, total_chunks=len(msgs) + 1 if last else 0,
                    first_token=1, reservation_token=resv.reservation_token))
                first += n

            calls: list = []

            async def gen(msgs=msgs, pool=pool, src=src, resv=resv, calls=calls):
                if pool is not None:  # a side-transport writer claims the reservation before any write
                    yield common_pb2.KVChunk(
                        reservation_id=resv.reservation_id, reservation_token=resv.reservation_token,
                        transport="shm", claim=common_pb2.KVClaim(transport="shm", dest_block_ids=resv.block_ids,
                                                                  pool_id=pool_id(resv.destination)))
                    md = await calls[0].initial_metadata()
                    assert all(kv in list(md or ()) for kv in CLAIM_ACK), "decode did not accept the claim"
                for m in msgs:
                    if pool is not None:  # what the prefill's engine thread does per chunk
                        blocks = list(range(m.first_block, m.first_block + m.num_pages))
                        copy_pages(src, blocks, pool, [resv.block_ids[b] for b in blocks])
                    yield m
            t0 = time.perf_counter()
            calls.append(stub.PushKV(gen()))
            await calls[0]
            rates.append(n_pages * page_bytes / (time.perf_counter() - t0))
            await stub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
        return {"MBps": statistics.median(rates) / 1e6, "bytes": n_pages * page_bytes}


def socket_copy_bytes_per_s(nbytes: int, repeats: int) -> float:
    """A plain loopback TCP copy of nbytes (sender and receiver threads in this process)."""
    rates = []
    chunk = b"\x5a" * (1 << 20)
    for _ in range(repeats):
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        got = [0]

        def receive(srv=srv, got=got):
            conn, _ = srv.accept()
            buf = bytearray(1 << 20)
            while got[0] < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                got[0] += n
            conn.close()

        t = threading.Thread(target=receive)
        t.start()
        c = socket.create_connection(("127.0.0.1", port))
        t0 = time.perf_counter()
        sent = 0
        while sent < nbytes:
            c.sendall(chunk[: min(len(chunk), nbytes - sent)])
            sent += min(len(chunk), nbytes - sent)
        t.join()
        rates.append(nbytes / (time.perf_counter() - t0))
        c.close()
        srv.close()
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="pdserve bench cluster", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=400, help="words per prompt (~1.3 tokens each)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-prefill-chunk", type=int, default=128, help="prefill chunk (tokens)")
    p.add_argument("--kv-prompt-tokens", type=int, default=4096, help="prompt length of the KV stream test")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--kv-transport", default="shm", choices=("shm", "grpc"),
                   help="how the disaggregated set-ups move pages (the KV stream test measures both with shm)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    kv = ["--kv-cache-bytes", str(512 << 20), "--max-prefill-chunk", str(args.max_prefill_chunk)]
    work = (args.requests, args.concurrency, args.prompt_words, args.max_tokens)
    results: dict[str, dict[str, float]] = {}
    with LocalCluster(prefill=1, decode=1, kvstore=None, dtype=args.dtype, quiet=True, kv_transport=args.kv_transport,
                      extra={"prefill": kv, "decode": kv}) as c:
        off = c._spawn("router-off", "router", [
            "--http-port", "0", "--port", "0", "--metrics-port", "0", "--no-chunked-transfer",
            "--prefill", c.get("prefill-0").ready["grpc"], "--decode", c.get("decode-0").ready["grpc"]])
        c._wait([off], 120)
        results["disaggregated, chunked transfer"] = run_workload("Alpha", c.router["http"], *work)
        results["disaggregated, transfer after last chunk"] = run_workload("Bravo", off.ready["http"], *work)
        decode = c.get("decode-0").ready["grpc"]
        kvres = {"grpc": asyncio.run(kv_stream_bytes_per_s(decode, args.kv_prompt_tokens, 3)),
                 "grpc+fp8": asyncio.run(kv_stream_bytes_per_s(decode, args.kv_prompt_tokens, 3, fp8=True))}
        if args.kv_transport == "shm":
            kvres["shm"] = asyncio.run(kv_stream_bytes_per_s(decode, args.kv_prompt_tokens, 3, shm=True))
    with LocalCluster(prefill=0, decode=1, kvstore=None, dtype=args.dtype, quiet=True, colocated=True,
                      extra={"decode": kv}) as c:
        results["colocated (1 worker)"] = run_workload("Charlie", c.router["http"], *work)
    nbytes = kvres["grpc"]["bytes"]
    sock = socket_copy_bytes_per_s(int(nbytes), 3) / 1e6

    print(f"\nworkload: {args.requests} streamed chat requests, concurrency {args.concurrency}, "
          f"~{args.prompt_words} words in, {args.max_tokens} tokens out, {args.dtype}, prefill chunk "
          f"{args.max_prefill_chunk}, KV transport {args.kv_transport}")
    print(f"{'set-up':44s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'TPOT p50':>9s} {'out tok/s':>10s}")
    for name, r in results.items():
        print(f"{name:44s} {r['ttft_p50_s']:9.3f} {r['ttft_p90_s']:9.3f} {r['tpot_p50_s']:9.4f} "
              f"{r['output_tok_s']:10.1f}")
    print(f"\nKV stream, {nbytes / 1e6:.1f} MB of pages into decode's cache; loopback socket copy of the same "
          f"bytes: {sock:.0f} MB/s (goal: >= 0.5x the socket)")
    for mode, r in kvres.items():
        r["ratio"] = r["MBps"] / sock
        print(f"  {mode:9s} {r['MBps']:8.0f} MB/s  {r['ratio']:.2f}x the socket")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"workload": results, "kv_stream": kvres, "socket_MBps": sock}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
