"""Arithmetic, not a measurement: exposed KV transfer of one streamed prefill with and without the tail
rule (services/engine/prefill_tail.py), for a compute rate and a link bandwidth you give.

Model: pieces are computed back to back at ``--compute-us`` per token plus ``--step-ms`` per step; each
piece's KV (``--kb-per-token``) enters one serial link of ``--gbs`` GB/s when its compute ends. Exposed =
the link's finish minus the last piece's compute end. Defaults: random Llama-3-8B on one H200
(docs/reports/performance-history-2026-12-01.md: 248 ms of prefill compute for 8000 tokens -> 31 us/token; fp8-e4m3 KV 540.7 MB per
8000 tokens -> 67.6 KB/token; bf16 131 KB/token).

    python -m benchmarks.prefill_tail_model --prompts 2000,8000 --gbs 1.9,3.2,6.4,12.8 --floors 0,256
"""

from __future__ import annotations

import argparse

from services.common.cli_args import ArgParser
from services.engine.prefill_tail import prefill_pieces


def exposed_ms(pieces: list[int], compute_s: float, transfer_s: float, step_s: float) -> tuple[float, float]:
    """(exposed transfer, total compute) in ms; ``compute_s`` / ``transfer_s``: seconds per token."""
    computed = link = 0.0
    for n in pieces:
        computed += n * compute_s + step_s
        link = max(link, computed) + n * transfer_s
    return (link - computed) * 1e3, computed * 1e3


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="2000,8000", help="prompt lengths (tokens), comma-separated")
    p.add_argument("--chunk", type=int, default=2048, help="max_prefill_chunk (tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--floors", default="0,256", help="--prefill-tail-tokens values, comma-separated (0: off)")
    p.add_argument("--gbs", default="1.9,3.2,6.4,12.8", help="link bandwidths (GB/s), comma-separated")
    p.add_argument("--kb-per-token", type=float, default=67.6, help="KV bytes per token on the wire (KB)")
    p.add_argument("--compute-us", type=float, default=31.0, help="prefill compute per token (us)")
    p.add_argument("--step-ms", type=float, default=0.0, help="fixed cost of one step (ms)")
    args = p.parse_args(argv)
    floors = [int(x) for x in args.floors.split(",")]
    print(f"{args.kb_per_token} KB/token, {args.compute_us} us/token compute, {args.step_ms} ms/step, "
          f"chunk {args.chunk}\n")
    print("| prompt | GB/s | " + " | ".join(f"floor {f}: pieces / exposed ms / compute ms" for f in floors) + " |")
    print("|---|---|" + "---|" * len(floors))
    for n in (int(x) for x in args.prompts.split(",")):
        for gbs in (float(x) for x in args.gbs.split(",")):
            cells = []
            for f in floors:
                pieces = prefill_pieces(n, args.chunk, f, args.block_size)
                exp, comp = exposed_ms(pieces, args.compute_us * 1e-6, args.kb_per_token * 1e3 / (gbs * 1e9),
                                       args.step_ms * 1e-3)
                cells.append(f"{len(pieces)} / {exp:.1f} / {comp:.0f}")
            print(f"| {n} | {gbs} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
