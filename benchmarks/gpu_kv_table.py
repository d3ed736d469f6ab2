"""The P/D TTFT table: client TTFT with prefill and decode as separate processes on one device,
per KV transport and with chunked transfer on and off, against a colocated worker and against the
in-process prefill compute of the same prompt, split into prefill compute (prefill's own histogram),
exposed transfer (decode's histogram: last chunk computed -> last chunk landed) and plumbing (the rest).

    python benchmarks/gpu_kv_table.py --model random:llama-3-8b --prompts 2000,8000 --transports grpc,cuda-ipc,mooncake

Every request has a prompt no earlier request shares (no prefix-cache reuse); each figure is the median
over ``--repeats`` requests after one warm-up request per set-up. The "KV via" column is the transport
prefill's bytes-sent counter grew under (a side transport that fell back to grpc shows as grpc, with
the fallback count). ``mooncake`` runs the Transfer Engine over loopback TCP (at --kv-mooncake-host
127.0.0.1); with the pools on a GPU it goes through pinned host staging on both sides.
``--kv-wire-codec fp8-e4m3`` has the prefills send fp8 pages where the transport carries a codec (grpc,
mooncake through host staging; shm / cuda-ipc write the pool's own dtype): "KV MB/req" shows the bytes moved.
A comma-separated list runs every transport once per codec against the same in-process and colocated figures.
``--kv-mooncake-engines`` is the transfer engines each side runs for mooncake (--kv-mooncake-engines).
``--prefill-tail-tokens`` is the prefills' tail floor (services/engine/prefill_tail.py; 0: off), a
comma-separated list runs every transport and codec once per value (before/after rows in one run; the
rule acts only on chunked-on rows).

    python benchmarks/gpu_kv_table.py --model random:llama-3-8b --prompts 2000,8000 --transports mooncake \
        --kv-wire-codec native,fp8-e4m3 --kv-mooncake-engines 8

``--kv-export-layer-group`` is the prefills' layers per export group of a streamed prompt's last chunk
(services/engine/layer_groups.py; 0: the chunk leaves once computed), a comma-separated list runs every
transport, codec and tail once per value (before/after rows in one run). ``--router-flags`` go to the P/D routers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.gpu_cluster_check import _generate
from services.common.cli_args import ArgParser
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.launcher import LocalCluster
from services.text.sampling_params import SamplingParams

COMPUTE = "pdserve_prefill_compute_seconds"
EXPOSED = "pdserve_decode_kv_transfer_exposed_seconds"
SENT = "pdserve_prefill_kv_sent_bytes_total"
FALLBACKS = "pdserve_prefill_kv_transport_fallbacks_total"


def _samples(address: str) -> list:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _hist(address: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram over every label set, scraped from ``address``/metrics."""
    total = count = 0.0
    for s in _samples(address):
        if s.name == f"{name}_sum":
            total += s.value
        elif s.name == f"{name}_count":
            count += s.value
    return total, count


def _kv_route(address: str) -> tuple[dict[str, float], float]:
    """(KV bytes prefill sent, by transport label; side-transport fallbacks) so far."""
    sent: dict[str, float] = {}
    fallbacks = 0.0
    for s in _samples(address):
        if s.name == SENT and s.value:
            sent[s.labels["transport"]] = sent.get(s.labels["transport"], 0.0) + s.value
        elif s.name == FALLBACKS:
            fallbacks += s.value
    return sent, fallbacks


class Prompts:
    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.n = 0

    def next(self, tokens: int) -> list[int]:
        """A prompt whose first token differs from every earlier one's: no shared prefix block."""
        self.n += 1
        k = self.n
        return [(k * 7919 + i * 131 + (i * i) % 97) % (self.vocab - 5) + 1 for i in range(tokens)]


CHECK_TOKENS = 16
"""Greedy tokens of one check prompt per length that every set-up must reproduce (the KV arrived intact)."""


def check_prompt(n: int) -> list[int]:
    return [(97 * n + 13 * i + (i * i) % 89) % 249 + 1 for i in range(n)]


def in_process(args: argparse.Namespace, prompts: Prompts) -> tuple[dict[int, float], dict[int, list[int]]]:
    eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                 kv_cache_bytes=args.kv_cache_bytes, max_prefill_chunk=args.chunk))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    want = {n: eng.generate([check_prompt(n)], SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0,
                                                               ignore_eos=True))[0] for n in args.prompt_lens}
    out: dict[int, float] = {}
    for n in args.prompt_lens:
        eng.generate([prompts.next(n)], one)  # warm-up
        times = []
        for _ in range(args.repeats):
            ids = prompts.next(n)
            if args.device.startswith("cuda"):
                import torch

                torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.generate([ids], one)
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times)
        print(f"in-process prefill, {n} tokens: {out[n] * 1000:.1f} ms", flush=True)
    del eng
    if args.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # the clusters' processes need the memory
    return out, want


def _ttft(addr: str, ids: list[int]) -> float:
    return asyncio.run(_generate(addr, ids, 2))[1]


def colocated(args: argparse.Namespace, prompts: Prompts, dev: list[str]) -> dict[int, float]:
    out: dict[int, float] = {}
    with LocalCluster(prefill=0, decode=1, kvstore=None, model=args.model, dtype=args.dtype, quiet=True,
                      colocated=True, extra={"decode": dev}) as c:
        addr = c.router["grpc"]
        for n in args.prompt_lens:
            _ttft(addr, prompts.next(n))
            out[n] = statistics.median(_ttft(addr, prompts.next(n)) for _ in range(args.repeats))
            print(f"colocated TTFT, {n} tokens: {out[n] * 1000:.1f} ms", flush=True)
    return out


def disaggregated(args: argparse.Namespace, prompts: Prompts, dev: list[str], transport: str, codec: str,
                  want: dict[int, list[int]], tail: int = 0, group: int = 0) -> dict[tuple[str, int], dict[str, float]]:
    rows: dict[tuple[str, int], dict[str, float]] = {}
    engines = ["--kv-mooncake-engines", str(args.kv_mooncake_engines)]
    prefill = [*dev, *engines, "--kv-wire-codec", codec, "--prefill-tail-tokens", str(tail),
               "--kv-export-layer-group", str(group)]
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=args.model, dtype=args.dtype, quiet=True,
                      extra={"prefill": prefill, "decode": [*dev, *engines], "router": shlex.split(args.router_flags)},
                      kv_transport=transport) as c:
        pm, dm = c.get("prefill-0").ready["metrics"], c.get("decode-0").ready["metrics"]
        off = c._spawn("router-off", "router", [
            "--http-port", "0", "--port", "0", "--metrics-port", "0", "--no-chunked-transfer",
            "--prefill", c.get("prefill-0").ready["grpc"], "--decode", c.get("decode-0").ready["grpc"],
            "--model", args.model])
        c._wait([off], 120)
        for chunked, addr in (("on", c.router["grpc"]), ("off", off.ready["grpc"])):
            for n in args.prompt_lens:
                _ttft(addr, prompts.next(n))
                sent0, fb0 = _kv_route(pm)
                ttft, compute, exposed = [], [], []
                for _ in range(args.repeats):
                    c0, e0 = _hist(pm, COMPUTE), _hist(dm, EXPOSED)
                    ttft.append(_ttft(addr, prompts.next(n)))
                    c1, e1 = _hist(pm, COMPUTE), _hist(dm, EXPOSED)
                    compute.append((c1[0] - c0[0]) / max(1.0, c1[1] - c0[1]))
                    exposed.append((e1[0] - e0[0]) / max(1.0, e1[1] - e0[1]))
                r = {"ttft": statistics.median(ttft), "compute": statistics.median(compute),
                     "exposed": statistics.median(exposed)}
                r["plumbing"] = r["ttft"] - r["compute"] - r["exposed"]
                sent1, fb1 = _kv_route(pm)
                via = sorted(k for k, v in sent1.items() if v > sent0.get(k, 0.0))
                r["via"], r["fallbacks"] = "+".join(via) or "-", fb1 - fb0  # type: ignore[assignment]
                r["kv_mb"] = sum(v - sent0.get(k, 0.0) for k, v in sent1.items()) / args.repeats / 1e6
                got = asyncio.run(_generate(addr, check_prompt(n), CHECK_TOKENS))[0]
                r["tokens_equal"] = sum(a == b for a, b in zip(got, want[n], strict=False))
                rows[(chunked, n)] = r
                print(f"{transport} {codec} tail {tail} groups {group}, chunked transfer {chunked}, {n} tokens: TTFT {r['ttft'] * 1000:.1f} ms, compute "
                      f"{r['compute'] * 1000:.1f}, exposed {r['exposed'] * 1000:.1f}, KV via {r['via']} "
                      f"{r['kv_mb']:.3f} MB/req "
                      f"({r['fallbacks']:.0f} fallbacks), tokens equal to in-process {r['tokens_equal']}/"
                      f"{CHECK_TOKENS}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--prompts", default="2000,8000", help="prompt lengths (tokens), comma-separated")
    p.add_argument("--transports", default="grpc,cuda-ipc,mooncake")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument("--kv-cache-bytes", type=int, default=4 << 30,
                   help="each engine's KV pool (an 8K-token prompt of a 16B latent model needs 0.25 GB; two 31 GB "
                        "engines with 8 GiB each, the bench's context and a prefill front's did not fit on 80 GB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-wire-codec", default="native",
                   help="the prefills' --kv-wire-codec, comma-separated: native, fp8-e4m3 (decode accepts fp8-e4m3 "
                        "always)")
    p.add_argument("--kv-mooncake-engines", type=int, default=4, help="transfer engines per side (mooncake)")
    p.add_argument("--prefill-tail-tokens", default="256",
                   help="the prefills' --prefill-tail-tokens, comma-separated (0,256: without and with the tail rule)")
    p.add_argument("--kv-export-layer-group", default="4",
                   help="the prefills' --kv-export-layer-group, comma-separated (0,4: without and with layer groups)")
    p.add_argument("--router-flags", default="", help="extra flags of the P/D routers, e.g. --no-early-prefill")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    args.prompt_lens = [int(x) for x in args.prompts.split(",")]
    dev = ["--device", args.device, "--kv-cache-bytes", str(args.kv_cache_bytes), "--max-prefill-chunk",
           str(args.chunk)]
    prompts = Prompts(250)  # ids the router's tokenizer accepts for every model (random models: bytes)
    base, want = in_process(args, prompts)
    col = colocated(args, prompts, dev)
    codecs = args.kv_wire_codec.split(",")
    bad = sorted(set(codecs) - {"native", "fp8-e4m3"})
    if bad:
        p.error(f"--kv-wire-codec: unknown {bad} (native, fp8-e4m3)")
    tails = [int(x) for x in args.prefill_tail_tokens.split(",")]
    groups = [int(x) for x in args.kv_export_layer_group.split(",")]
    pd = {f"{t} {codec} tail {tail} groups {g}": disaggregated(args, prompts, dev, t, codec, want, tail, g)
          for g in groups for tail in tails for codec in codecs for t in args.transports.split(",")}
    print(f"\n{args.model} {args.dtype} on {args.device}, prefill chunk {args.chunk}, KV wire codec "
          f"{args.kv_wire_codec}, mooncake engines {args.kv_mooncake_engines}, prefill tail tokens "
          f"{args.prefill_tail_tokens}, layer groups {args.kv_export_layer_group}, median of {args.repeats}\n")
    print("| transport codec tail groups | KV via | KV MB/req | chunked | prompt | TTFT ms | x colocated | prefill compute ms | "
          f"x in-process | exposed ms | exposed / compute | plumbing ms | tokens = in-process (of {CHECK_TOKENS}) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.prompt_lens:
        print(f"| colocated | - | - | - | {n} | {col[n] * 1000:.1f} | 1.00 | {base[n] * 1000:.1f} (in-process) | 1.00 | - "
              "| - | - | - |")
    for t, rows in pd.items():
        for (chunked, n), r in rows.items():
            via = r["via"] if not r["fallbacks"] else f"{r['via']} ({r['fallbacks']:.0f} fallbacks)"
            print(f"| {t} | {via} | {r['kv_mb']:.3f} | {chunked} | {n} | {r['ttft'] * 1000:.1f} | {r['ttft'] / col[n]:.2f} | "
                  f"{r['compute'] * 1000:.1f} | {r['compute'] / base[n]:.2f} | {r['exposed'] * 1000:.1f} | "
                  f"{r['exposed'] / max(r['compute'], 1e-9):.3f} | {r['plumbing'] * 1000:.1f} | "
                  f"{r['tokens_equal']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"in_process": base, "colocated": col, "args": vars(args),
                       "pd": {t: {f"{k[0]}-{k[1]}": v for k, v in rows.items()} for t, rows in pd.items()}}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
