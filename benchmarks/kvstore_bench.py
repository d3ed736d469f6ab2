"""kvstore throughput: Put and Get MiB/s through the gRPC service on loopback, per backend and page size,
beside a raw loopback TCP copy of the same bytes measured in the same run.

    pdserve bench kvstore                       # embedded + mooncake, 1 MiB and 64 MiB pages
    pdserve bench kvstore --backends embedded --sizes-mib 1 --total-mib 64 --json out.json
    pdserve bench kvstore --memory-check        # RSS under Put/Get churn vs tier + Put quota

Each backend runs as a real ``python -m services.kvstore`` process (Mooncake: plus a loopback
mooncake_master); the client streams pages with KVStoreClient (4 MiB pieces). Runtime is bounded by
``--total-mib`` per (backend, size, direction) and ``--deadline-s`` overall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from services.common.cli_args import ArgParser

MiB = 1 << 20


@dataclass
class Result:
    backend: str
    page_mib: float
    pages: int
    put_mib_s: float
    get_mib_s: float
    tcp_mib_s: float

    @property
    def put_ratio(self) -> float:
        return self.put_mib_s / self.tcp_mib_s if self.tcp_mib_s else 0.0

    @property
    def get_ratio(self) -> float:
        return self.get_mib_s / self.tcp_mib_s if self.tcp_mib_s else 0.0


def raw_tcp_mib_s(chunks: Sequence[bytes]) -> float:
    """Loopback TCP: send every chunk through one connection to a reader thread that discards them."""
    total = sum(len(c) for c in chunks)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got = 0

    def reader() -> None:
        nonlocal got
        conn, _ = srv.accept()
        buf = bytearray(4 * MiB)
        view = memoryview(buf)
        with conn:
            while got < total:
                n = conn.recv_into(view)
                if n == 0:
                    break
                got += n

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        for chunk in chunks:
            c.sendall(chunk)
        t.join()
        dt = time.perf_counter() - t0
    srv.close()
    assert got == total, f"raw TCP reader got {got} of {total} bytes"
    return total / MiB / dt


class ServiceProcess:
    """``python -m services.kvstore`` until its PDSERVE_READY line; stopped with SIGTERM by pid."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--host", "127.0.0.1",
                                      "--metrics-port", "-1", *args], stdout=subprocess.PIPE,
                                     stderr=self._log, stdin=subprocess.DEVNULL)
        self.address = ""

    def wait_ready(self, timeout_s: float = 30.0) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line:
                raise RuntimeError(f"kvstore exited ({self.proc.poll()}); see {self.log_path}")
            if line.startswith("PDSERVE_READY"):
                fields = dict(f.split("=", 1) for f in line.split()[1:])
                self.address = fields["grpc"]
                return self.address
        raise TimeoutError(f"kvstore not ready within {timeout_s}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


async def measure(address: str, backend: str, page_bytes: int, total_bytes: int) -> Result:
    from services.common.checksum import checksum
    from services.common.grpc_util import create_channel
    from services.common.kvstore_client import KVStoreClient

    n = max(2, total_bytes // page_bytes)
    fp = os.urandom(8).hex()
    base = os.urandom(page_bytes)
    # Distinct pages without n * page_bytes of urandom: vary the first 16 bytes.
    datas = [os.urandom(16) + base[16:] for _ in range(n)]
    pages = [(os.urandom(16), d, checksum(d)) for d in datas]
    async with create_channel(address) as channel:
        client = KVStoreClient(channel)
        warm = os.urandom(16)
        await client.put(fp, [(warm, b"w", checksum(b"w"))])
        await client.get(fp, [warm])
        t0 = time.perf_counter()
        resp = await client.put(fp, pages)
        put_s = time.perf_counter() - t0
        if resp.stored != n:
            raise RuntimeError(f"{backend}: stored {resp.stored} of {n} pages of {page_bytes} bytes")
        t0 = time.perf_counter()
        got = await client.get(fp, [h for h, _, _ in pages])
        get_s = time.perf_counter() - t0
        if len(got) != n or any(g.data != d for g, (_, d, _) in zip(got, pages, strict=False)):
            raise RuntimeError(f"{backend}: got back {len(got)} of {n} pages or wrong bytes")
        await client.delete(fp, all_for_layout=True)
    tcp = raw_tcp_mib_s(datas)
    mib = n * page_bytes / MiB
    return Result(backend, page_bytes / MiB, n, mib / put_s, mib / get_s, tcp)


async def run_backend(backend: str, sizes: list[int], total: int, workdir: Path) -> list[Result]:
    master = None
    args = ["--max-page-bytes", str(max(sizes)), "--max-inflight-put-bytes", str(max(max(sizes), 256 * MiB)),
            "--memory-bytes", str(total + 64 * MiB)]
    if backend == "mooncake":
        from services.kvstore.mooncake_master import MooncakeMaster, find_master_binary

        if find_master_binary() is None:
            print("mooncake: skipped (mooncake_master not installed)", file=sys.stderr)
            return []
        master = MooncakeMaster(log_path=workdir / "mooncake_master.log").start()
        args += ["--backend", "mooncake", "--mooncake-master", master.address,
                 "--mooncake-segment-bytes", str(total + 256 * MiB),
                 "--mooncake-buffer-bytes", str(max(sizes) * 2 + 64 * MiB)]
    svc = ServiceProcess(args, workdir / f"kvstore-{backend}.log")
    try:
        address = await asyncio.to_thread(svc.wait_ready)
        return [await measure(address, backend, size, total) for size in sizes]
    finally:
        svc.stop()
        if master is not None:
            master.stop()


async def memory_check(tier_mib: int, quota_mib: int, total_mib: int, streams: int, workdir: Path) -> dict[str, float]:
    """RSS of an embedded kvstore while ``streams`` concurrent Put streams push ``total_mib`` of distinct
    368 KiB pages (a SmolLM2 page) through a ``tier_mib`` memory tier, reading half of each batch back.
    The process may hold its start RSS + tier + Put quota (pages being assembled are not in the tier)."""
    import psutil

    from services.common.checksum import checksum
    from services.common.grpc_util import create_channel
    from services.common.kvstore_client import KVStoreClient

    page = 368640
    svc = ServiceProcess(["--memory-bytes", str(tier_mib * MiB), "--max-page-bytes", str(4 * MiB),
                          "--max-inflight-put-bytes", str(quota_mib * MiB)], workdir / "kvstore-memory.log")
    try:
        address = await asyncio.to_thread(svc.wait_ready)
        proc = psutil.Process(svc.proc.pid)
        first = peak = proc.memory_info().rss / MiB
        fp, base = os.urandom(8).hex(), os.urandom(page)
        batches = max(1, total_mib * MiB // (page * 64 * streams))
        async with create_channel(address) as channel:
            client = KVStoreClient(channel)

            async def stream() -> None:
                nonlocal peak
                for _ in range(batches):
                    datas = [os.urandom(16) + base[16:] for _ in range(64)]
                    pages = [(os.urandom(16), d, checksum(d)) for d in datas]
                    await client.put(fp, pages)
                    await client.get(fp, [h for h, _, _ in pages[:32]])
                    peak = max(peak, proc.memory_info().rss / MiB)

            await asyncio.gather(*(stream() for _ in range(streams)))
        end = proc.memory_info().rss / MiB
    finally:
        svc.stop()
    moved = batches * streams * 64 * page / MiB
    return {"first_mib": first, "peak_mib": peak, "end_mib": end, "bound_mib": first + tier_mib + quota_mib,
            "moved_mib": moved}


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgParser(prog="pdserve bench kvstore", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="embedded,mooncake", help="Comma-separated: embedded, mooncake.")
    p.add_argument("--sizes-mib", default="1,64", help="Page sizes (MiB), comma-separated.")
    p.add_argument("--total-mib", type=int, default=256, help="Bytes moved per (backend, size, direction) (MiB).")
    p.add_argument("--json", default=None, help="Also write the results here.")
    p.add_argument("--memory-check", action="store_true",
                   help="Instead: RSS of an embedded kvstore under Put/Get churn against tier + Put quota.")
    args = p.parse_args(argv)
    if args.memory_check:
        with tempfile.TemporaryDirectory(prefix="kvstore_mem_") as tmp:
            r = asyncio.run(memory_check(128, 32, 1024, 4, Path(tmp)))
        print("kvstore RSS, 128 MiB tier + 32 MiB Put quota: " + ", ".join(f"{k} {v:.0f}" for k, v in r.items()))
        return 0 if r["peak_mib"] <= r["bound_mib"] + 64 else 1
    sizes = [int(float(s) * MiB) for s in args.sizes_mib.split(",") if s]
    t_start = time.monotonic()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="kvstore_bench_") as tmp:
        for backend in [b for b in args.backends.split(",") if b]:
            results += asyncio.run(run_backend(backend, sizes, args.total_mib * MiB, Path(tmp)))
    print(f"{'backend':<10} {'page':>8} {'pages':>5} {'put MiB/s':>10} {'get MiB/s':>10} {'tcp MiB/s':>10} "
          f"{'put/tcp':>8} {'get/tcp':>8}")
    for r in results:
        print(f"{r.backend:<10} {r.page_mib:>6.0f}Mi {r.pages:>5} {r.put_mib_s:>10.0f} {r.get_mib_s:>10.0f} "
              f"{r.tcp_mib_s:>10.0f} {r.put_ratio:>8.2f} {r.get_ratio:>8.2f}")
    print(f"total {time.monotonic() - t_start:.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(r), "put_ratio": r.put_ratio, "get_ratio": r.get_ratio}
                                               for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
