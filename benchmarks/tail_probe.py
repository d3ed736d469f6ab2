"""Why do a streamed prompt's tail pieces compute slowly? One in-process engine, per-step timings.

An LLMEngine runs each prompt alone, as a prefill with chunked transfer on does: uncut (``one``: chunks of
``--chunk``) or cut by the prefill tail rule (``pieces-F``: each ``--tail`` floor F, forced on even for a prompt of
one chunk). A chunk listener does what a variant says with each chunk's pages, the way services/prefill/kv_stream.py
does (``write`` / ``export`` on the engine thread, the wait in a worker thread):

  none          nothing (the model alone: does a piece with a cached prefix compute slowly by itself?)
  export        KVPages.export into a pinned host buffer, waited for in a worker thread
  export-sync   export, then the listener synchronizes the compute stream (what cuda-ipc's write does)
  gil           export, then a worker holds the GIL (a native sleep through ctypes.PyDLL) for as long as the
                pages would take at --gil-gbps: a transfer engine call that kept the GIL
  burn          export, then --burn-threads native threads (zlib, GIL released) keep CPUs busy for as long:
                transfer-engine I/O threads contending for the engine thread's CPU
  mooncake      the real host-staged write (StagedWriter into a HostLanding of this process over loopback
                TCP, --engines transfer engines per side), native pages
  mooncake-fp8  the same with fp8-e4m3 pages

Per request: compute ms (first step start -> the last chunk's listener, what prefill's compute histogram
measures), drained ms (-> the last worker's wait returned; exposed = drained - compute), and per step the
engine thread's time in the model call and in the listener, and the GPU time between CUDA events recorded
around the model call (``gap``: GPU time between one step's end and the next one's start, i.e. a compute
stream that waited). Also a GIL check: Python iterations a thread makes while another thread settles a
transfer-engine batch, against the same thread alone.

    python -m benchmarks.tail_probe --model random:llama-3-8b --device cuda:0 --prompts 2000,8000 --json out.json
    python -m benchmarks.tail_probe --model random:tiny-llama --device cpu --prompts 300,900 --chunk 256 --tail 32,128
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from services.common.cli_args import ArgParser
from services.engine import scheduler as scheduler_module
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_layout import FP8_CODEC, PageLayout
from services.engine.kv_pages import PageExport, pages_of
from services.engine.kv_transport import mooncake
from services.engine.kv_transport.base import KVPoll
from services.engine.kv_transport.mooncake_staged import HostLanding, StagedWriter, StagingRing
from services.text.sampling_params import SamplingParams

VARIANTS = ("none", "export", "export-sync", "gil", "burn", "mooncake", "mooncake-fp8")
_LIBC = ctypes.PyDLL(None)
"""libc through PyDLL: its calls keep the GIL (what a native call without a GIL release does)."""


class _Open:
    """The request's KV stream as a writer sees it: open (a StagedWriter writes only while it is)."""

    def poll(self) -> KVPoll:
        return KVPoll.TRANSFERRING


class _Step:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.cpu_model_s = 0.0
        self.cpu_listener_s = 0.0
        self.t0 = self.t1 = 0.0
        self.ev0 = self.ev1 = None

    def row(self, prev: _Step | None) -> dict[str, float]:
        r = {"tokens": self.tokens, "cpu_model_ms": self.cpu_model_s * 1e3, "cpu_listener_ms": self.cpu_listener_s * 1e3}
        if self.ev0 is not None:
            r["gpu_ms"] = self.ev0.elapsed_time(self.ev1)
            r["gap_ms"] = prev.ev1.elapsed_time(self.ev0) if prev is not None else 0.0
        return r


class Probe:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                          kv_cache_bytes=args.kv_cache_bytes, max_prefill_chunk=args.chunk,
                                          max_num_batched_tokens=args.chunk))
        self.cuda = args.device.startswith("cuda")
        self.pages = pages_of(self.eng)
        r = self.eng.runner
        self.page_shape = (r.num_layers, 2, r.block_size, r.num_kv_heads, r.head_dim)
        self.block_size = r.block_size
        self.fp8 = PageLayout.for_model("probe", r.num_layers, r.num_kv_heads, r.head_dim, r.block_size, FP8_CODEC)
        max_blocks = -(-max(args.prompt_lens) // r.block_size) + 1
        self.host = torch.empty((max_blocks, *self.page_shape), dtype=r.dtype, pin_memory=self.cuda)
        self.workers = ThreadPoolExecutor(8)
        self.steps: list[_Step] = []
        self.n = 0
        self.variant = "none"
        self.writer: StagedWriter | None = None
        self.futures: list[Future] = []
        self.next_block = 0
        self.last_listener = 0.0
        self._mc: tuple[mooncake.MooncakeEngine, mooncake.MooncakeEngine, StagingRing, HostLanding] | None = None
        model = r.execute

        def timed(out):
            step = _Step(sum(c.num_new_tokens for c in out.chunks))
            if self.cuda:
                step.ev0, step.ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                step.ev0.record()
            step.t0 = time.perf_counter()
            result = model(out)
            step.t1 = time.perf_counter()
            if step.ev1 is not None:
                step.ev1.record()
            step.cpu_model_s = step.t1 - step.t0
            self.steps.append(step)
            return result

        r.execute = timed
        self.eng.chunk_listeners.append(self._on_chunk)

    # --- transfer set-up ---

    def mooncake_pair(self) -> tuple[mooncake.MooncakeEngine, mooncake.MooncakeEngine, StagingRing, HostLanding]:
        if self._mc is None:
            r = self.eng.runner
            send = mooncake.MooncakeEngine("127.0.0.1", count=self.args.engines)
            recv = mooncake.MooncakeEngine("127.0.0.1", count=self.args.engines)
            blocks = self.host.shape[0] + 1
            pool = torch.empty((r.num_layers, 2, blocks, r.block_size, r.num_kv_heads, r.head_dim), dtype=r.dtype,
                               device="meta")  # decode's pool: its shape is all the landing area needs
            landing = HostLanding(recv, pool, lambda *a: None)  # decode's import is another process's work
            ring = StagingRing(send, 2 * self.host.numel() * self.host.element_size())
            self._mc = (send, recv, ring, landing)
        return self._mc

    def gil_check(self, mib: int = 256) -> dict[str, float]:
        """Python loop iterations per ms of one thread alone, and while another settles a TE batch of ``mib``."""
        send, _, ring, landing = self.mooncake_pair()
        nbytes = min(mib << 20, ring.capacity)
        entry = 4 << 20
        srcs = [ring.base + o for o in range(0, nbytes, entry)]
        dsts = [landing.destination.mooncake.base_address + o for o in range(0, nbytes, entry)]
        lens = [min(entry, nbytes - o) for o in range(0, nbytes, entry)]

        def spin(stop: threading.Event, out: list[float]) -> None:
            n, t0 = 0, time.perf_counter()
            while not stop.is_set():
                n += 1
            out.append(n / ((time.perf_counter() - t0) * 1e3))

        rates = {}
        for mode in ("alone", "settling"):
            stop, out = threading.Event(), []
            th = threading.Thread(target=spin, args=(stop, out))
            t0 = time.perf_counter()
            th.start()
            if mode == "alone":
                time.sleep(0.1)
            else:
                mooncake.settle(send.submit(mooncake.segments_of(landing.destination.mooncake), srcs, dsts, lens))
            stop.set()
            th.join()
            rates[mode] = out[0]
            rates[f"{mode}_ms"] = (time.perf_counter() - t0) * 1e3
        rates["ratio"] = rates["settling"] / max(rates["alone"], 1e-9)
        return rates

    # --- engine thread ---

    def _export(self, ids: list[int], codec: str | None = None, out: torch.Tensor | None = None) -> PageExport:
        return self.pages.export(ids, codec, out)

    def _on_chunk(self, ch, sampled) -> None:
        t0 = time.perf_counter()
        seq = ch.seq
        end = seq.num_computed_tokens + ch.num_new_tokens
        bs = self.block_size
        limit = -(-end // bs) if ch.sample else end // bs
        first, v = self.next_block, self.variant
        n = max(0, limit - first)
        if n and v != "none":
            ids = seq.block_table[first:limit]
            if v.startswith("mooncake"):
                assert self.writer is not None
                self.futures.append(self.workers.submit(self._timed, self.writer.wait, self.writer.write(first, ids)))
            else:
                e = self._export(ids, None, self.host[first:limit])
                if v == "export-sync" and self.cuda:
                    torch.cuda.current_stream().synchronize()
                nbytes = n * self.host[0].numel() * self.host.element_size()
                work = {"gil": self._hold_gil, "burn": self._burn}.get(v)
                self.futures.append(self.workers.submit(self._timed, work, e, nbytes) if work else
                                    self.workers.submit(self._timed, PageExport.wait, e))
        self.next_block = max(self.next_block, limit)
        if self.steps:
            self.steps[-1].cpu_listener_s = time.perf_counter() - t0
        self.last_listener = t0

    # --- worker threads ---

    @staticmethod
    def _timed(fn, *a) -> float:
        fn(*a)
        return time.perf_counter()

    def _hold_gil(self, e: PageExport, nbytes: int) -> None:
        e.wait()
        _LIBC.usleep(int(nbytes / (self.args.gil_gbps * 1e9) * 1e6))

    def _burn(self, e: PageExport, nbytes: int) -> None:
        e.wait()
        until = time.perf_counter() + nbytes / (self.args.gil_gbps * 1e9)
        buf = bytes(1 << 20)

        def one() -> None:
            while time.perf_counter() < until:
                zlib.crc32(buf)

        threads = [threading.Thread(target=one) for _ in range(self.args.burn_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # --- one request ---

    def prompt(self, tokens: int) -> list[int]:
        """Ids no earlier prompt shares a first block with (no prefix-cache hit)."""
        self.n += 1
        k, vocab = self.n, min(250, self.eng.vocab_size)
        return [(k * 7919 + i * 131 + (i * i) % 97) % (vocab - 5) + 1 for i in range(tokens)]

    def run(self, tokens: int, tail: int, variant: str) -> dict[str, object]:
        self.eng.scheduler.config.prefill_tail_tokens = tail
        self.variant, self.steps, self.futures, self.next_block = variant, [], [], 0
        self.writer = None
        if variant.startswith("mooncake"):
            send, _, ring, landing = self.mooncake_pair()
            blocks = -(-tokens // self.block_size)
            self.writer = StagedWriter(send, ring, self.page_shape, self.eng.runner.dtype, self._export,
                                       landing.destination, list(range(blocks)))
            self.writer.sender = _Open()  # type: ignore[assignment]
            if variant.endswith("fp8"):
                assert self.writer.carry(self.fp8)
        if self.cuda:
            torch.cuda.synchronize()
        self.eng.add_request(f"probe-{self.n}", self.prompt(tokens),
                             SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), detokenize=False,
                             stream_kv=True)
        while self.eng.has_work():
            self.eng.step()
        start = self.steps[0].t0
        compute = self.last_listener - start
        drained = max([f.result() for f in self.futures], default=self.last_listener) - start
        if self.cuda:
            torch.cuda.synchronize()
        rows = [s.row(self.steps[i - 1] if i else None) for i, s in enumerate(self.steps)]
        out: dict[str, object] = {"compute_ms": compute * 1e3, "exposed_ms": max(0.0, drained - compute) * 1e3,
                                  "steps": len(rows), "per_step": rows}
        for k in ("cpu_model_ms", "cpu_listener_ms", "gpu_ms", "gap_ms"):
            if k in rows[0]:
                out[k] = sum(r[k] for r in rows)
        return out


def _median(runs: list[dict[str, object]]) -> dict[str, object]:
    keys = [k for k, v in runs[0].items() if isinstance(v, float | int)]
    med: dict[str, object] = {k: statistics.median(float(r[k]) for r in runs) for k in keys}  # type: ignore[arg-type]
    med["per_step"] = runs[len(runs) // 2]["per_step"]
    return med


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", default="2000,8000")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--tail", default="256", help="tail floors of the pieces rows (tokens), comma-separated")
    p.add_argument("--kv-cache-bytes", type=int, default=8 << 30)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--engines", type=int, default=8, help="transfer engines per side (mooncake variants)")
    p.add_argument("--gil-gbps", type=float, default=5.0, help="the rate gil / burn stand for (GB/s)")
    p.add_argument("--burn-threads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    args.prompt_lens = [int(x) for x in args.prompts.split(",")]
    args.tails = [int(x) for x in args.tail.split(",")]
    variants = args.variants.split(",")
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        p.error(f"--variants: unknown {bad} ({', '.join(VARIANTS)})")
    scheduler_module.applies = lambda *_: True  # pieces rows cut one-chunk prompts too
    probe = Probe(args)
    result: dict[str, object] = {"args": {k: v for k, v in vars(args).items()}, "rows": {}}
    if any(v.startswith("mooncake") for v in variants) and mooncake.available() is None:
        result["gil_check"] = probe.gil_check()
        print(f"GIL check (Python iterations/ms of a thread alone vs while another settles a TE batch): "
              f"{result['gil_check']}", flush=True)
    print("| prompt | split | variant | steps | compute ms | exposed ms | model-call CPU ms | listener CPU ms | "
          "GPU step ms | GPU gap ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens in args.prompt_lens:
        for tail in [0, *args.tails]:
            for v in variants:
                if v.startswith("mooncake") and mooncake.available() is not None:
                    continue
                probe.run(tokens, tail, v)  # warm-up
                med = _median([probe.run(tokens, tail, v) for _ in range(args.repeats)])
                split = f"pieces-{tail}" if tail else "one"
                result["rows"][f"{tokens}-{split}-{v}"] = med  # type: ignore[index]
                print(f"| {tokens} | {split} | {v} | {med['steps']:.0f} | {med['compute_ms']:.1f} | "
                      f"{med['exposed_ms']:.1f} | {med['cpu_model_ms']:.1f} | {med['cpu_listener_ms']:.1f} | "
                      f"{med.get('gpu_ms', float('nan')):.1f} | {med.get('gap_ms', float('nan')):.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    probe.workers.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skips the transfer engines' teardown (~1 s each), nothing else is left to run
