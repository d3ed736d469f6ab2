"""PNG plots of a report (matplotlib, Agg backend): TTFT and throughput vs concurrency (or rate), latency
CDFs, and A/B bars. Each function writes one file and returns its path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.serve.sweep import SweepResult


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` (110 dpi) and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _x(s: dict[str, Any]) -> float:
    p = s["point"]
    return p["rate"] if p["rate"] > 0 else p["concurrency"]


def _xlabel(sweeps: list[SweepResult]) -> str:
    rate = any(s["point"]["rate"] > 0 for sw in sweeps for s in sw.points)
    return "arrival rate (conversations/s)" if rate else "concurrency"


def _label(v: float) -> str:
    """A bar's value: whole numbers from 100 up, three significant digits below."""
    return "-" if v != v else f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _ms(v: float | None) -> float:
    return float("nan") if v is None else v * 1000


def vs_load(sweeps: list[SweepResult], path: Path) -> Path:
    """TTFT p50/p90 and output tok/s against the sweep's x (concurrency or rate), one line per server."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for sw in sweeps:
        xs = [_x(s) for s in sw.points]
        line, = ax1.plot(xs, [_ms(s["ttft_s"]["p50"]) for s in sw.points], "o-", label=f"{sw.label} p50")
        ax1.plot(xs, [_ms(s["ttft_s"]["p90"]) for s in sw.points], "o--", color=line.get_color(),
                 label=f"{sw.label} p90")
        ax2.plot(xs, [s["throughput"]["output_tok_s"] for s in sw.points], "o-", label=f"{sw.label} output")
        ax2.plot(xs, [s["throughput"]["total_tok_s"] for s in sw.points], "s:", color=line.get_color(),
                 label=f"{sw.label} total")
    for ax, title, unit in ((ax1, "TTFT", "ms"), (ax2, "Throughput", "tokens/s")):
        ax.set_xlabel(_xlabel(sweeps))
        ax.set_ylabel(unit)
        ax.set_title(title)
        xs_all = sorted({_x(s) for sw in sweeps for s in sw.points})
        if len(xs_all) > 2 and xs_all[0] > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all, [f"{x:g}" for x in xs_all])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def cdfs(sweeps: list[SweepResult], path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT and e2e, one line per (server, sweep point)."""
    plt = _plt()
    keys = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for sw in sweeps:
        for s, lat in zip(sw.points, sw.latencies, strict=True):
            for ax, (key, _) in zip(axes, keys, strict=True):
                xs = sorted(v * 1000 for v in lat[key])
                if xs:
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    ax.step(xs, ys, where="post", label=f"{sw.label}, {s['point']['label']}")
    for ax, (_, title) in zip(axes, keys, strict=True):
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def ab_bars(a: SweepResult, b: SweepResult, path: Path) -> Path:
    """Grouped bars per sweep point: TTFT/TPOT/e2e p50 (ms) and output tok/s, A beside B."""
    plt = _plt()
    panels = (("TTFT p50 (ms)", lambda s: _ms(s["ttft_s"]["p50"])),
              ("TPOT p50 (ms)", lambda s: _ms(s["tpot_s"]["p50"])),
              ("e2e p50 (ms)", lambda s: _ms(s["e2e_s"]["p50"])),
              ("output tokens/s", lambda s: s["throughput"]["output_tok_s"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8))
    labels = [s["point"]["label"] for s in a.points]
    width = 0.38
    for ax, (title, get) in zip(axes, panels, strict=True):
        xs = range(len(labels))
        for off, sw in ((-width / 2, a), (width / 2, b)):
            vals = [get(s) for s in sw.points]
            bars = ax.bar([x + off for x in xs], vals, width, label=sw.label)
            ax.bar_label(bars, labels=[_label(v) for v in vals], fontsize=7)
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def write_all(sweeps: list[SweepResult], out: Path) -> list[Path]:
    """Every plot that fits these sweeps: vs-load when a sweep has 2+ points, CDFs, A/B bars for two."""
    paths = []
    if any(len(sw.points) > 1 for sw in sweeps):
        paths.append(vs_load(sweeps, out / "vs_load.png"))
    paths.append(cdfs(sweeps, out / "latency_cdf.png"))
    if len(sweeps) == 2:
        paths.append(ab_bars(sweeps[0], sweeps[1], out / "ab_bars.png"))
    return paths
