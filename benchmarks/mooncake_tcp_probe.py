"""Mooncake Transfer Engine over loopback TCP against a loopback socket copy, measured in one run: what
limits the ``mooncake`` KV transport's bytes/s, and how steady it is.

One registered buffer of ``--mib`` is written into another process's registered buffer, split into
``--entries`` equal transfer-engine entries, under each set of the engine's own TCP settings
(``--variants``: the native engine reads them from the environment at start, so each variant runs in a
fresh pair of processes). ``--engines K`` also spreads the entries round-robin over K transfer engines on
each side (one batch per engine, all in flight at once): each engine moves its TCP bytes on its own I/O
thread, so this is what several engines per process buy. Every round times the socket copy and each
entry split back to back, so a busy
box's load swings hit them alike; medians and spreads are printed with the CPU model and the load.

    python benchmarks/mooncake_tcp_probe.py --mib 256 --entries 1,16,64 --repeat 7 \\
        --variants 'default;MC_TCP_ENABLE_CONNECTION_POOL=1,MC_TCP_LANES_PER_PEER=8'
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

from services.common.cli_args import ArgParser


def _receiver(conn, nbytes: int, engines: int) -> None:
    import torch

    from benchmarks.kv_bench import _sink_socket
    from services.engine.kv_transport.mooncake import MooncakeEngine

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    threading.Thread(target=_sink_socket, args=(sock, nbytes), daemon=True).start()
    engs = [MooncakeEngine("127.0.0.1") for _ in range(engines)]
    buf = torch.empty(nbytes, dtype=torch.uint8)
    addr, = {e.register(buf) for e in engs}  # one address, registered with every engine
    conn.send((sock.getsockname()[1], [e.segment for e in engs], addr))
    conn.recv()  # until the sender is done
    os._exit(0)  # skip the engines' teardown (~1 s each, serial): nothing is left to flush


def sender(mib: int, entries: list[int], repeat: int, engines: list[int]) -> dict[str, list[float]]:
    """Seconds per run of the socket copy and of each (entry split, engine count), in this process's environment."""
    import torch

    from benchmarks.kv_bench import _socket_copy
    from services.engine.kv_transport.mooncake import MooncakeEngine

    nbytes = mib << 20
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_receiver, args=(child, nbytes, max(engines)), daemon=True)
    proc.start()
    port, segments, dst = parent.recv()
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    engs = [MooncakeEngine("127.0.0.1") for _ in range(max(engines))]
    base, = {e.register(src) for e in engs}
    data = memoryview(src.numpy())

    def te(n: int, k: int) -> None:
        step = -(-nbytes // n)
        offs = list(range(0, nbytes, step))
        batches = []
        for i in range(min(k, len(offs))):  # engine i takes entries i, i+k, ... into its own peer segment
            mine = offs[i::k]
            batches.append((engs[i], engs[i].te.batch_transfer_async_write(
                segments[i], [base + o for o in mine], [dst + o for o in mine], [min(step, nbytes - o) for o in mine])))
        for e, b in batches:
            assert b > 0 and e.te.get_batch_transfer_status([b]) == 0, b

    paths = {"socket": lambda: _socket_copy(port, data),
             **{f"te x{n}" + (f" e{k}" if k > 1 else ""): (lambda n=n, k=k: te(n, k))
                for k in engines for n in entries}}
    times: dict[str, list[float]] = {k: [] for k in paths}
    try:
        for fn in paths.values():
            fn()  # warm-up: connections, page faults
        for _ in range(repeat):
            for k, fn in paths.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    finally:
        parent.send("stop")
        proc.join(10)
    return times


def _cpu() -> str:
    from services.engine.cpu.cpu_features import host_cpu

    c = host_cpu()
    return f"{c.model}; flags: {' '.join(c.reported_flags()) or '-'}; {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--entries", default="1,16,64", help="transfer-engine entries the bytes are split into")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--engines", default="1", help="transfer engines per side the entries are spread over")
    p.add_argument("--variants", default="default;MC_TCP_ENABLE_CONNECTION_POOL=1,MC_TCP_LANES_PER_PEER=8",
                   help="';'-separated sets of the engine's TCP settings (NAME=VALUE,...; 'default': none)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    entries = [int(x) for x in args.entries.split(",")]
    engines = [int(x) for x in args.engines.split(",")]
    if args.child:
        print(json.dumps(sender(args.mib, entries, args.repeat, engines)), flush=True)
        os._exit(0)  # as the receiver: no engine teardown
    print(f"cpu: {_cpu()}; load avg {os.getloadavg()[0]:.1f}; {args.mib} MiB per run, median of {args.repeat}",
          flush=True)
    results: dict[str, dict[str, list[float]]] = {}
    for variant in args.variants.split(";"):
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "2"}
        if variant != "default":
            env.update(kv.split("=", 1) for kv in variant.split(","))
        out = subprocess.run([sys.executable, __file__, "--child", "--mib", str(args.mib), "--entries", args.entries,
                              "--repeat", str(args.repeat), "--engines", args.engines], env=env, capture_output=True, text=True,
                             timeout=600)
        line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
        if line is None:
            print(f"{variant}: failed\n{out.stderr[-2000:]}")
            continue
        results[variant] = json.loads(line)
    gb = (args.mib << 20) / 1e9
    print("\n| settings | path | median GB/s | min-max GB/s | x socket (medians) |\n|---|---|---|---|---|")
    for variant, times in results.items():
        sock = gb / statistics.median(times["socket"])
        for k, secs in times.items():
            med = gb / statistics.median(secs)
            print(f"| {variant} | {k} | {med:.2f} | {gb / max(secs):.2f}-{gb / min(secs):.2f} | {med / sock:.2f} |")
    print(f"\nload avg after: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu(), "mib": args.mib, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
