"""Throughput per GPU against TPOT from ``h200_served.json`` (benchmarks/h200_served.py), one line per
(mode, shape, logprobs), points labelled by concurrency; the in-process engine's points as crosses.

    python3 benchmarks/h200_served_plot.py h200_served.json docs/reports/<run>/throughput_vs_tpot.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(argv[0]).read_text())
    lines: dict[tuple[str, str, bool], list[tuple[float, float, int]]] = defaultdict(list)
    for p in data.get("served", []):
        if "throughput" in p and p["tpot_s"].get("p50"):
            key = (p["mode"], p["shape"], p["logprobs"])
            lines[key].append((p["tpot_s"]["p50"] * 1e3, p["throughput"]["output_tok_s"], p["concurrency"]))
    fig, ax = plt.subplots(figsize=(9, 6))
    for (mode, shape, lp), pts in sorted(lines.items()):
        pts.sort(key=lambda t: t[2])
        line, = ax.plot([t[0] for t in pts], [t[1] for t in pts], "o-" if not lp else "s--",
                        label=f"{mode} {shape}{' logprobs' if lp else ''}")
        for x, y, c in pts:
            ax.annotate(f"C{c}", (x, y), fontsize=7, color=line.get_color(), xytext=(3, 3), textcoords="offset points")
    eng = data.get("engine", {}).get("points", [])
    for p in eng:
        if "output_tok_s" in p:
            tpot_ms = (p["full_batch_decode_step_ms"] or 0.0)
            if tpot_ms:
                ax.plot([tpot_ms], [p["output_tok_s"]], "kx")
    ax.set_xlabel("TPOT p50 (ms)  [engine crosses: full-batch decode step]")
    ax.set_ylabel("output tokens/s per GPU (1 GPU)")
    ax.set_title(f"{data.get('model', '')} on one GPU: throughput per GPU vs TPOT")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    out = Path(argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
