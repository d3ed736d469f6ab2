"""``pdserve bench kv``: KV bytes/s of each transport against a loopback socket copy and a memcpy of the
same bytes, measured in one run.

The pages are a KV pool of a real model's shape (default SmolLM2-135M: 30 layers, 3 KV heads, head dim
64, 16-token pages) in the engine's pool layout [layers, 2, blocks, block_size, kv_heads, head_dim].
Every transport moves the same ``--mib`` of pages, chunk by chunk (``--chunk-pages``):

  memcpy    one torch copy of the pool's bytes (in-process)                      the shm ceiling
  socket    the bytes over a loopback TCP socket to another process              the network ceiling
  shm       copy_pages into a /dev/shm pool, run by run (what the shm transport does)
  grpc      prefill's real sender into a real decode service: the pages gathered straight into PushKV
            messages, checksummed, sent (gRPC copies them once), parsed header-only by decode, checked and
            copied into its KV pool (see kv_bench_grpc)
  grpc-bare the same message sizes as bare gRPC bytes to a sink that only counts them: the ceiling of
            Python gRPC on this box, measured in the same run
  grpc-tls  (--tls) grpc into a second decode service that runs mTLS, as `pdserve up` does by default:
            the TLS cost of the grpc path is grpc-tls / grpc, printed
  mooncake  the Mooncake Transfer Engine over loopback TCP writing each chunk's (layer, K|V) runs from
            this process's registered pool into another process's registered pool (what the mooncake
            transport does)

Goals (on a CPU box): grpc >= 0.5x socket, mooncake >= 0.7x socket, shm >= 0.5x memcpy.
The receiving side runs in a child process (no shared GIL); the grpc path's decode in a service process
of its own. Prints the CPU model and flags, and for grpc and grpc-bare the CPU-bound limit: this box's
cores over the CPU seconds per GB both processes spent, the most GB/s no pipelining could beat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import grpc
import torch

from benchmarks.kv_bench_grpc import MAX_MESSAGE_BYTES, DecodePeer, GrpcPaths, bare_handler
from services.common.cli_args import ArgParser
from services.common.grpc_util import server_options
from services.common.malloc_tuning import tune_malloc
from services.common.pb import decode_pb2
from services.common.tls import make_certs
from services.engine.cpu.cpu_features import host_cpu
from services.engine.kv_transport import KVPoll

GOALS = {"grpc": ("socket", 0.5), "mooncake": ("socket", 0.7), "shm": ("memcpy", 0.5)}


@dataclass
class Results:
    cpu_model: str
    cpu_flags: list[str]
    load_avg: float
    torch_threads: int
    pool_shape: list[int]
    dtype: str
    bytes: int
    chunk_pages: int
    streams: int
    gbps: dict[str, float] = field(default_factory=dict)
    """Median GB/s (10^9 bytes/s) of each path over the repeats."""
    best_gbps: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    """Of the medians: each goal's path against its baseline, and grpc-bare/socket, grpc/grpc-bare."""
    cpu_limit_gbps: dict[str, float] = field(default_factory=dict)
    """grpc and grpc-bare: the most GB/s their two processes' CPU cost allows on this box's cores
    (``cpu_bound_gbps``): what no pipelining could beat."""
    cpu_s_per_gb: dict[str, list[float]] = field(default_factory=dict)
    """[sending process, receiving process] CPU seconds per GB moved (every thread; the load of other
    processes on the box does not count here, unlike in the wall-clock rates)."""


# --- the receiving process ----------------------------------------------------------------------


def _sink_socket(sock: socket.socket, nbytes: int) -> None:
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    while True:
        conn, _ = sock.accept()
        with conn:
            left = nbytes
            while left:
                got = conn.recv_into(view[:min(len(view), left)])
                if not got:
                    break
                left -= got
            conn.sendall(b"k")


def _receiver(conn, nbytes: int, want_mooncake: int, threads: int) -> None:
    import warnings

    torch.set_num_threads(threads)
    tune_malloc()  # as in every service (run_main): the bare sink stands for decode's receiving side

    warnings.simplefilter("ignore", UserWarning)  # frombuffer of read-only message bytes (only read)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    threading.Thread(target=_sink_socket, args=(sock, nbytes), daemon=True).start()
    info: dict[str, object] = {"socket": sock.getsockname()[1]}
    keep: list[object] = []
    if want_mooncake:
        from services.engine.kv_transport.mooncake import MooncakeEngine

        eng = MooncakeEngine("127.0.0.1", count=want_mooncake)  # want_mooncake: transfer engines (0: none)
        pool = torch.empty(nbytes, dtype=torch.uint8)
        keep += [eng, pool]
        info["mooncake"] = (eng.segments, eng.register(pool))

    async def serve() -> None:
        server = grpc.aio.server(options=server_options(MAX_MESSAGE_BYTES))
        server.add_generic_rpc_handlers((bare_handler(),))
        info["grpc"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(info)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until the parent says stop
        await server.stop(None)

    asyncio.run(serve())


# --- the sending side ---------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used; NaN where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _time_all(paths: dict[str, Callable[[], object]], repeat: int, peers: dict[str, int]
              ) -> tuple[dict[str, list[float]], dict[str, tuple[float, float]]]:
    """Seconds of each run of each path (the float it returns, else its wall time), and the CPU seconds
    each path used over all its runs (this process, its receiving process ``peers[name]``); the paths
    take turns in every round, so a busy box's load swings hit all of them alike."""
    for fn in paths.values():
        fn()  # warm-up (connections, page faults)
    times: dict[str, list[float]] = {name: [] for name in paths}
    cpu = dict.fromkeys(paths, (0.0, 0.0))
    me = os.getpid()
    for _ in range(repeat):
        for name, fn in paths.items():
            peer = peers.get(name)
            c0, p0 = _cpu_s(me), _cpu_s(peer) if peer else 0.0
            t0 = time.perf_counter()
            secs = fn()
            times[name].append(secs if isinstance(secs, float) else time.perf_counter() - t0)
            sent, got = cpu[name]
            cpu[name] = (sent + _cpu_s(me) - c0, got + (_cpu_s(peer) - p0 if peer else 0.0))
    return times, cpu


def _runs_of(num_blocks: int, chunk: int) -> list[list[int]]:
    return [list(range(b, min(b + chunk, num_blocks))) for b in range(0, num_blocks, chunk)]


def _socket_copy(port: int, data: memoryview) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.recv(1)


class _Ready:
    def poll(self) -> KVPoll:
        return KVPoll.WAITING_FOR_INPUT


def run(args: argparse.Namespace) -> Results:
    shape = [int(x) for x in args.page_shape.split(",")]  # layers, 2, block_size, kv_heads, head_dim
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    page_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    nblocks = max(1, (args.mib << 20) // page_bytes)
    pool_shape = [shape[0], 2, nblocks, *shape[2:]]
    src = torch.randn(pool_shape).to(dtype)
    nbytes = src.numel() * src.element_size()
    cpu = host_cpu()
    torch.set_num_threads(args.threads)
    r = Results(cpu.model, cpu.reported_flags(), os.getloadavg()[0], args.threads, pool_shape, args.dtype, nbytes,
                args.chunk_pages, args.streams)
    print(f"cpu: {r.cpu_model}; flags: {' '.join(r.cpu_flags) or '-'}; {os.cpu_count()} CPUs, load avg "
          f"{r.load_avg:.1f}; torch threads {args.threads}", flush=True)
    print(f"pool {pool_shape} {args.dtype}: {nbytes / 2**20:.0f} MiB, {page_bytes} B/page, {args.chunk_pages} "
          f"pages/chunk, grpc streams {args.streams}, median of {args.repeat}", flush=True)
    chunks = _runs_of(nblocks, args.chunk_pages)
    want_mc = not args.no_mooncake
    if want_mc:
        from services.engine.kv_transport import mooncake

        why = mooncake.available()
        if why is not None:
            print(f"mooncake: skipped ({why})")
            want_mc = False
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, nbytes, args.mooncake_engines if want_mc else 0, args.threads),
                       daemon=True)
    proc.start()
    info = parent.recv()
    decode: DecodePeer | None = None
    grpc_paths: GrpcPaths | None = None
    decode_tls: DecodePeer | None = None
    tls_paths: GrpcPaths | None = None
    certs_dir = tempfile.mkdtemp(prefix="pdserve-bench-tls-") if args.tls and not args.no_decode else None
    try:
        if not args.no_decode:
            decode = DecodePeer(args.decode_model, args.dtype, nblocks + 8, args.threads)
        if certs_dir is not None:
            certs = make_certs(certs_dir)
            decode_tls = DecodePeer(args.decode_model, args.dtype, nblocks + 8, args.threads, certs=certs)
        flat = src.view(-1).view(torch.uint8)
        dst = torch.empty_like(flat)
        paths: dict[str, Callable[[], object]] = {
            "memcpy": lambda: dst.copy_(flat),
            "socket": lambda: _socket_copy(int(info["socket"]), memoryview(flat.numpy())),
        }
        from services.engine.shared_kv import copy_pages, create_shared_kv, open_shm_pool

        _decode_pool, path, dest = create_shared_kv(tuple(pool_shape), dtype)
        opened = open_shm_pool(dest.shm)
        order = list(range(nblocks))
        paths["shm"] = lambda: [copy_pages(src, c, opened, c) for c in chunks]
        if decode is not None:
            grpc_paths = GrpcPaths(decode.address, f"127.0.0.1:{info['grpc']}", args.streams)
            paths["grpc"] = lambda: grpc_paths.decode(src, chunks)
            sizes = [len(c) * page_bytes for c in chunks]
            paths["grpc-bare"] = lambda: grpc_paths.bare_bytes(sizes)
        if decode_tls is not None:
            tls_paths = GrpcPaths(decode_tls.address, f"127.0.0.1:{info['grpc']}", args.streams, certs=certs)
            paths["grpc-tls"] = lambda: tls_paths.decode(src, chunks)
        if want_mc:
            from services.engine.kv_transport.mooncake import MooncakeEngine, MooncakeWriter

            eng = MooncakeEngine("127.0.0.1", count=args.mooncake_engines)
            segments, base = info["mooncake"]
            mdest = decode_pb2.KVDestination(mooncake=decode_pb2.MooncakePool(
                segment=segments[0], extra_segments=segments[1:], base_address=base, pool_bytes=nbytes,
                shape=pool_shape, dtype=args.dtype))
            writer = MooncakeWriter(eng, src, mdest, order)
            writer.sender = _Ready()  # type: ignore[assignment]

            def mooncake_write() -> None:
                handles = [writer.write(c[0], c) for c in chunks]  # several chunks in flight
                for h in handles:
                    writer.wait(h)

            paths["mooncake"] = mooncake_write
        peers = {"socket": proc.pid, "grpc-bare": proc.pid, "mooncake": proc.pid}
        if decode is not None:
            peers["grpc"] = decode.pid
        if decode_tls is not None:
            peers["grpc-tls"] = decode_tls.pid
        times, cpu = _time_all(paths, args.repeat, peers)
        for name, secs in times.items():
            r.gbps[name] = nbytes / statistics.median(secs) / 1e9
            r.best_gbps[name] = nbytes / min(secs) / 1e9
            gb = nbytes * args.repeat / 1e9
            r.cpu_s_per_gb[name] = [cpu[name][0] / gb, cpu[name][1] / gb]
            print(f"{name:>9}: {r.gbps[name]:6.2f} GB/s median, {r.best_gbps[name]:6.2f} best; CPU s/GB sending "
                  f"{r.cpu_s_per_gb[name][0]:.2f}, receiving {r.cpu_s_per_gb[name][1]:.2f}", flush=True)
        os.unlink(path)
    finally:
        for paths_ in (grpc_paths, tls_paths):
            if paths_ is not None:
                paths_.close()
        for peer in (decode, decode_tls):
            if peer is not None:
                peer.close()
        if certs_dir is not None:
            shutil.rmtree(certs_dir, ignore_errors=True)
        parent.send("stop")
        proc.join(10)
    for name, (base_name, goal) in GOALS.items():
        if name in r.gbps and base_name in r.gbps:
            r.ratios[name] = r.gbps[name] / r.gbps[base_name]
            ok = "meets" if r.ratios[name] >= goal else "MISSES"
            print(f"{name} / {base_name} = {r.ratios[name]:.2f}x median ({ok} the >= {goal}x goal), "
                  f"{r.best_gbps[name] / r.best_gbps[base_name]:.2f}x best")
    for name, base_name in (("grpc-bare", "socket"), ("grpc", "grpc-bare"), ("grpc-tls", "grpc")):
        if name in r.gbps and base_name in r.gbps:
            r.ratios[f"{name}/{base_name}"] = r.gbps[name] / r.gbps[base_name]
            print(f"{name} / {base_name} = {r.gbps[name] / r.gbps[base_name]:.2f}x median")
    cores = len(os.sched_getaffinity(0))
    for name in ("grpc", "grpc-tls", "grpc-bare"):
        if name in r.cpu_s_per_gb and "socket" in r.gbps:
            send, recv = r.cpu_s_per_gb[name]
            r.cpu_limit_gbps[name] = limit = cpu_bound_gbps(send, recv, cores)
            print(f"{name} CPU-bound limit: {cores} cores / ({send:.2f} + {recv:.2f}) CPU s/GB = {limit:.2f} GB/s "
                  f"= {limit / r.gbps['socket']:.2f}x socket")
    return r


def cpu_bound_gbps(send_cpu_s_per_gb: float, recv_cpu_s_per_gb: float, cores: int) -> float:
    """GB/s a path cannot exceed when its two processes share ``cores`` and spend these CPU seconds per GB
    between them: every core busy the whole time, nothing else running."""
    total = send_cpu_s_per_gb + recv_cpu_s_per_gb
    return cores / total if total > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="pdserve bench kv", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="KV bytes each transport moves (MiB).")
    p.add_argument("--chunk-pages", type=int, default=32, help="Pages per chunk (one message / one batch).")
    p.add_argument("--page-shape", default="30,2,16,3,64",
                   help="layers,2,block_size,kv_heads,head_dim of a page (default: SmolLM2-135M).")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeat", type=int, default=5, help="Timed runs per path (median reported).")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of both processes (copies).")
    p.add_argument("--streams", type=int, default=1,
                   help="grpc: concurrent requests (each its own reservation and PushKV stream, one channel each) "
                        "sharing the bytes.")
    p.add_argument("--no-mooncake", action="store_true", help="Skip the Mooncake path.")
    p.add_argument("--mooncake-engines", type=int, default=4,
                   help="Transfer engines per side for the Mooncake path (the transport's --kv-mooncake-engines).")
    p.add_argument("--no-decode", action="store_true", help="Skip the grpc paths (no decode service).")
    p.add_argument("--decode-model", default="random:smollm2-135m",
                   help="grpc: the decode service's model (random weights; its pages must be --page-shape's).")
    p.add_argument("--tls", action="store_true",
                   help="Also time grpc-tls: the grpc path into a second decode service running mTLS (what "
                        "`pdserve up` runs by default), and print grpc-tls / grpc.")
    p.add_argument("--json", default="", help="Also write the results to this file.")
    args = p.parse_args(argv)
    tune_malloc()  # this process is prefill's sending side; services tune malloc in run_main
    r = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(r), f, indent=2)
    return 0
