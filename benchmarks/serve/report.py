"""A run's figures (JSON-ready dicts) and the markdown report of one or more runs.

Counting rules: every request sent is in ``requests.sent``; it either completed or failed (by kind in
``requests.errors``); none is dropped. Token and throughput figures count completed requests, whose
``usage`` the server reported (``tokens.source`` = ``usage``), else the client's tokenizer counts
(``tokenizer``). Latencies: TTFT, TPOT (per request: (e2e - TTFT) / (output tokens - 1)), ITL (every
gap between streamed events, all requests pooled) and e2e, over completed requests. Rates divide by
the run's duration: first request sent -> last request finished.
"""

from __future__ import annotations

import math
import platform
from collections import Counter
from typing import Any

from benchmarks.serve.load import RunResult
from benchmarks.serve.stats import SLO, Dist


def summarize_run(run: RunResult, slo: SLO, num_gpus: int = 0) -> dict[str, Any]:
    done = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    dur = run.duration_s
    usage = bool(done) and all(r.prompt_tokens is not None and r.completion_tokens is not None for r in done)
    n_in = sum(r.input_tokens or 0 for r in done)
    n_out = sum(r.output_tokens or 0 for r in done)
    client_in = [r.client_prompt_tokens for r in done]
    client_out = [r.client_completion_tokens for r in done]
    good = [r for r in done if slo.met(r.ttft, r.tpot, r.e2e)]
    tput: dict[str, float] = {"requests_per_s": len(done) / dur, "input_tok_s": n_in / dur,
                              "output_tok_s": n_out / dur, "total_tok_s": (n_in + n_out) / dur}
    if num_gpus > 0:
        tput.update({f"{k}_per_gpu": v / num_gpus for k, v in list(tput.items()) if k.endswith("tok_s")})
    out: dict[str, Any] = {
        "point": {"label": run.point.label(), "concurrency": run.point.concurrency, "rate": run.point.rate},
        "window_unix": list(run.window),
        "duration_s": dur,
        "requests": {"sent": len(run.results), "completed": len(done), "failed": len(failed),
                     "not_sent": run.not_sent, "errors": dict(Counter(r.error for r in failed)),
                     "error_examples": {k: next(r.detail for r in failed if r.error == k)
                                        for k in sorted({r.error for r in failed})}},
        "tokens": {"input": n_in, "output": n_out, "source": "usage" if usage else "tokenizer",
                   "client_tokenizer_input": sum(client_in) if None not in client_in else None,
                   "client_tokenizer_output": sum(client_out) if None not in client_out else None},
        "throughput": tput,
        "ttft_s": Dist.of(r.ttft for r in done if r.ttft is not None).as_dict(),
        "tpot_s": Dist.of(t for r in done if (t := r.tpot) is not None).as_dict(),
        "itl_s": Dist.of(x for r in done for x in r.itls()).as_dict(),
        "e2e_s": Dist.of(r.e2e for r in done).as_dict(),
        "goodput": {"slo": slo.describe(), "requests": len(good), "requests_per_s": len(good) / dur,
                    "fraction_of_sent": len(good) / len(run.results) if run.results else None},
    }
    if num_gpus > 0:
        out["goodput"]["requests_per_s_per_gpu"] = len(good) / dur / num_gpus
    if run.server:
        out["server"] = run.server
    return out


def latencies(run: RunResult) -> dict[str, list[float]]:
    """Raw per-request latencies of completed requests (for CDF plots and the JSON)."""
    done = [r for r in run.results if r.ok]
    return {"ttft_s": [r.ttft for r in done if r.ttft is not None],
            "tpot_s": [t for r in done if (t := r.tpot) is not None],
            "e2e_s": [r.e2e for r in done]}


def host_info() -> dict[str, Any]:
    import os

    from services.engine.cpu.cpu_features import host_cpu

    cpu = host_cpu()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return {"cpu": cpu.model, "cpu_family": cpu.family, "cores": os.cpu_count(),
            "loadavg_1_5_15": [round(x, 2) for x in load], "python": platform.python_version(),
            "platform": platform.platform()}


def code_info() -> dict[str, Any]:
    """The git commit this checkout runs and whether tracked files differ from it (None outside git)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(dirty)}


def _ms(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1000:.0f}"


def _trio(d: dict[str, Any]) -> str:
    return " / ".join(_ms(d.get(k)) for k in ("p50", "p90", "p99"))


def _errors(s: dict[str, Any]) -> str:
    errs = s["requests"]["errors"]
    return ", ".join(f"{k} {v}" for k, v in sorted(errs.items())) or "0"


def client_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """Markdown table, one row per (label, summary)."""
    head = ("| run | sent | ok | req/s | in tok/s | out tok/s | total tok/s | TTFT p50/p90/p99 ms | "
            "TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | e2e p50/p90/p99 ms | goodput req/s (%) | errors |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, s in rows:
        t, g = s["throughput"], s["goodput"]
        frac = g["fraction_of_sent"]
        lines.append(
            f"| {label} | {s['requests']['sent']} | {s['requests']['completed']} | {t['requests_per_s']:.2f} | "
            f"{t['input_tok_s']:.0f} | {t['output_tok_s']:.1f} | {t['total_tok_s']:.0f} | {_trio(s['ttft_s'])} | "
            f"{_trio(s['tpot_s'])} | {_trio(s['itl_s'])} | {_trio(s['e2e_s'])} | "
            f"{g['requests_per_s']:.2f} ({'-' if frac is None else f'{frac:.0%}'}) | {_errors(s)} |")
    return "\n".join(lines)


SERVER_COLUMNS = (("router_ttft", "router TTFT"), ("prefill_queue", "prefill queue"),
                  ("prefill_compute", "prefill compute"), ("decode_kv_wait", "decode KV-wait"),
                  ("decode_kv_transfer_exposed", "exposed KV transfer"), ("decode_queue", "decode queue"))


def server_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """pdserve's own timers over the same windows: mean and p50 / p90 (bucket-interpolated), ms."""
    rows = [(label, s) for label, s in rows if s.get("server", {}).get("histograms")]
    if not rows:
        return ""
    head = "| run | " + " | ".join(f"{name} mean (p50/p90) ms" for _, name in SERVER_COLUMNS) + " |"
    lines = [head, "|---|" + "---|" * len(SERVER_COLUMNS)]
    for label, s in rows:
        h = s["server"]["histograms"]
        cells = []
        for key, _ in SERVER_COLUMNS:
            x = h.get(key)
            cells.append("-" if x is None else f"{_ms(x['mean'])} ({_ms(x['p50'])}/{_ms(x['p90'])})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def counters_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    rows = [(label, s) for label, s in rows if s.get("server", {}).get("counters")]
    if not rows:
        return ""
    keys = sorted({k for _, s in rows for k in s["server"]["counters"]})
    lines = ["| run | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for label, s in rows:
        c = s["server"]["counters"]
        lines.append(f"| {label} | " + " | ".join(f"{c.get(k, 0):.0f}" for k in keys) + " |")
    return "\n".join(lines)
