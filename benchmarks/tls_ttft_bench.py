"""``pdserve bench tls-ttft``: what mTLS between the services costs a request's TTFT, against plaintext, in
one run.

Two local 1P1D clusters run side by side on loopback, the same model, dtype and engine settings, KV by the
grpc transport (the one whose page bytes travel inside gRPC, so inside TLS; shm, cuda-ipc and mooncake
carry page bytes outside it): one with mTLS on every internal RPC (certificates made for the run, as
`pdserve up` does by default), one with `--insecure-internal`. The client sends the same streamed
completions to each, one request at a time, alternating which cluster goes first in each round, so both
see the same box. Every prompt is fresh token ids (no prefix reuse). Reported: TTFT median and p90 per
mode, the median of the per-round mTLS - plaintext differences, the ratio of medians, and the KV bytes one
prompt moves (from the prefill's own counter).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import tempfile
import time
import urllib.request

from services.common.cli_args import ArgParser
from services.common.tls import make_certs
from services.launcher import LocalCluster, served_model


def _ttft(http: str, model: str, ids: list[int], max_tokens: int) -> float:
    """Seconds from sending one streamed completion to its first chunk carrying a token."""
    body = json.dumps({"model": model, "prompt": ids, "stream": True, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://{http}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"{http}: the stream carried no token")
    return ttft


def _kv_bytes(metrics: str) -> float:
    """The prefill's pdserve_prefill_kv_sent_bytes_total, summed over its labels."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_prefill_kv_sent_bytes_total{"))


def main(argv: list[str]) -> int:
    p = ArgParser(prog="pdserve bench tls-ttft", description=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=12, help="requests per mode (one per round)")
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None, help="model spec (default: the embedded model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    kv = ["--kv-cache-bytes", str(512 << 20), "--max-prefill-chunk", "512"]
    extra = {"prefill": kv, "decode": kv}
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="pdserve-tls-ttft-") as certs:
        make_certs(certs)
        with LocalCluster(prefill=1, decode=1, kvstore=None, model=args.model, dtype=args.dtype, quiet=True,
                          kv_transport="grpc", tls_dir=certs, extra=extra) as tls, \
             LocalCluster(prefill=1, decode=1, kvstore=None, model=args.model, dtype=args.dtype, quiet=True,
                          kv_transport="grpc", extra=extra) as plain:
            modes = {"mtls": tls, "plaintext": plain}
            model = served_model(plain.router["http"])
            vocab = 1000   # ids 100..1099: ordinary tokens of any vocabulary this size or larger
            for c in modes.values():   # warm-up: first-request costs (channels, handshakes, allocations)
                _ttft(c.router["http"], model, [100 + rng.randrange(vocab) for _ in range(64)], 2)
            kv0 = {m: _kv_bytes(c.get("prefill-0").ready["metrics"]) for m, c in modes.items()}
            ttft: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(args.rounds):
                ids = [100 + rng.randrange(vocab) for _ in range(args.prompt_tokens)]
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for m in order:
                    # A fresh first token per mode: the same prompt otherwise, no prefix cached in either.
                    ttft[m].append(_ttft(modes[m].router["http"], model, [101 + order.index(m), *ids[1:]],
                                         args.max_tokens))
            kv_per_prompt = {m: (_kv_bytes(c.get("prefill-0").ready["metrics"]) - kv0[m]) / args.rounds
                             for m, c in modes.items()}
    diffs = [a - b for a, b in zip(ttft["mtls"], ttft["plaintext"], strict=True)]
    res = {m: {"ttft_p50_s": statistics.median(v), "ttft_p90_s": sorted(v)[math.ceil(0.9 * len(v)) - 1],
               "kv_bytes_per_prompt": kv_per_prompt[m]} for m, v in ttft.items()}
    summary = {"prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "modes": res,
               "paired_diff_p50_s": statistics.median(diffs),
               "ratio_of_medians": res["mtls"]["ttft_p50_s"] / res["plaintext"]["ttft_p50_s"]}
    print(f"\n{args.prompt_tokens}-token prompts, {args.rounds} rounds, 1P1D, KV transport grpc")
    print(f"{'mode':10s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'KV MB/prompt':>13s}")
    for m, r in res.items():
        print(f"{m:10s} {r['ttft_p50_s'] * 1e3:7.0f}ms {r['ttft_p90_s'] * 1e3:7.0f}ms "
              f"{r['kv_bytes_per_prompt'] / 1e6:13.1f}")
    print(f"mTLS - plaintext per round, median: {summary['paired_diff_p50_s'] * 1e3:+.0f} ms; "
          f"ratio of medians {summary['ratio_of_medians']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0
