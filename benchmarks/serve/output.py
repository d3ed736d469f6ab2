"""The files of a report: report.json (everything, raw latencies included), report.md (tables, the
command that made it, host, plots) and the PNGs."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.serve.report import client_table, code_info, counters_table, host_info, server_table
from benchmarks.serve.sweep import SweepResult


@dataclass
class Side:
    """One server of a report: its sweep plus how it was deployed (None: an external URL)."""

    sweep: SweepResult
    setup: str
    """A line saying what served (recipe and deployment, or the URL)."""


@dataclass
class Report:
    title: str
    command: str
    workload: dict[str, Any]
    sides: list[Side]
    note: str = ""
    host_before: dict[str, Any] = field(default_factory=host_info)
    host_after: dict[str, Any] = field(default_factory=dict)
    code: dict[str, Any] = field(default_factory=code_info)
    comparison: dict[str, Any] = field(default_factory=dict)
    """A/B extras (token agreement of an accuracy workload)."""
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %Z"))

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "command": self.command, "created": self.created, "note": self.note,
                "host": {"before": self.host_before, "after": self.host_after}, "code": self.code,
                "workload": self.workload,
                "servers": [{"label": s.sweep.label, "setup": s.setup, "points": s.sweep.points,
                             "latencies": s.sweep.latencies, "accuracy": s.sweep.accuracy} for s in self.sides],
                "comparison": self.comparison}


def _clean(obj: Any) -> Any:
    """NaN -> None (strict JSON)."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    if isinstance(v, dict):
        return ", ".join(f"{k} {x:g}" if isinstance(x, float) else f"{k} {x}" for k, x in v.items())
    return str(v)


def markdown(rep: Report, plots: list[Path]) -> str:
    rows = [(f"{s.sweep.label}, {p['point']['label']}", p) for s in rep.sides for p in s.sweep.points]
    hb, ha = rep.host_before, rep.host_after or rep.host_before
    out = [f"# {rep.title}", "", f"Made {rep.created} by:", "", "```", rep.command, "```", ""]
    family = f" ({hb['cpu_family']})" if hb.get("cpu_family") else ""
    out += [f"Host: {hb['cpu']}{family}, {hb['cores']} cores; load average (1/5/15 min) {hb['loadavg_1_5_15']} at the start, "
            f"{ha['loadavg_1_5_15']} at the end."]
    if rep.code.get("commit"):
        state = "with uncommitted changes to tracked files" if rep.code["dirty"] else "clean checkout"
        out += ["", f"Code: commit `{rep.code['commit'][:12]}` ({state})."]
    if rep.note:
        out += ["", f"**Note:** {rep.note}"]
    out += ["", "## Servers", ""] + [f"- **{s.sweep.label}**: {s.setup}" for s in rep.sides]
    w = rep.workload
    out += ["", "## Workload", "", ", ".join(f"{k} {_fmt(v)}" for k, v in w.items() if v not in ("", None, (), {})), ""]
    out += ["## Client-side results", "",
            "Every request sent is counted (ok or an error kind). Throughput and latencies count completed "
            "requests; TPOT = (e2e - TTFT) / (output tokens - 1); ITL = gaps between streamed events. "
            "Goodput: completed requests meeting the SLO per second.", "", client_table(rows), ""]
    srv = server_table(rows)
    if srv:
        out += ["## pdserve's own timers over the same windows", "",
                "From each service's /metrics, scraped as each window opened and closed (warmup excluded); "
                "p50/p90 are interpolated within the histogram buckets, means are exact. docs/METRICS.md "
                "says what each timer measures.", "", srv, "", "Counters over the same windows:", "",
                counters_table(rows), ""]
    if any(s.sweep.accuracy for s in rep.sides):
        out += ["## Accuracy", "", "Greedy decoding; exact match of the extracted answer "
                "(benchmarks/serve/accuracy.py says how each grade extracts it).", ""]
        for s in rep.sides:
            for acc in s.sweep.accuracy:
                out.append(f"- {s.sweep.label}, {acc['point']}: {acc['correct']}/{acc['questions']} correct "
                           f"({(acc['accuracy'] or 0):.0%}); by grade: "
                           + ", ".join(f"{g} {v['correct']}/{v['questions']}" for g, v in acc["by_grade"].items()))
        out.append("")
    agree = rep.comparison.get("token_agreement")
    if agree:
        out += ["## Token agreement", ""]
        for name, a in agree.items():
            frac = a["identical_fraction"]
            out.append(f"- {name}: {a['identical']}/{a['compared']} outputs identical "
                       f"({'-' if frac is None else f'{frac:.0%}'}), matching-prefix share "
                       f"{(a['matching_prefix_fraction'] or 0):.1%} ({a['unit']})")
        out.append("")
    if plots:
        out += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(out)


def write(rep: Report, out_dir: str, plots: bool = True) -> list[Path]:
    """Write report.json, report.md and (if ``plots``) the PNGs into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs: list[Path] = []
    if plots:
        from benchmarks.serve.plots import write_all

        pngs = write_all([s.sweep for s in rep.sides], out)
    (out / "report.json").write_text(json.dumps(_clean(rep.as_json()), indent=1) + "\n")
    (out / "report.md").write_text(markdown(rep, pngs))
    return [out / "report.json", out / "report.md", *pngs]
