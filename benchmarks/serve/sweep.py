"""One server, one workload, every sweep point: the runs behind ``bench serve`` and each side of ``bench ab``."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from benchmarks.serve import accuracy
from benchmarks.serve.client import RequestResult, Target
from benchmarks.serve.config import LoadConfig, ReportConfig, TargetConfig, WorkloadConfig
from benchmarks.serve.load import TRACE_RATE, LoadPoint, Runner, wait_ready
from benchmarks.serve.report import latencies, summarize_run
from benchmarks.serve.server_metrics import Window, expand_targets
from benchmarks.serve.stats import SLO
from benchmarks.serve.tokens import TokenCounter, WordText, load_tokenizer
from benchmarks.serve.workload import (
    MultiTurnSpec,
    RandomSpec,
    Workload,
    multi_turn_workload,
    random_workload,
    read_trace,
    trace_workload,
    write_trace,
)
from services.common.config import ConfigError


@dataclass
class SweepResult:
    """Every point of one server's sweep: summaries (JSON-ready) and raw per-request results."""

    label: str
    points: list[dict[str, Any]] = field(default_factory=list)
    latencies: list[dict[str, list[float]]] = field(default_factory=list)
    results: list[list[RequestResult]] = field(default_factory=list)
    accuracy: list[dict[str, Any]] = field(default_factory=list)
    """accuracy workload: the grading of each point (its ``point`` key names it)."""


def served_model(target: TargetConfig) -> str:
    base = Target(target.base_url, "").base
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    with urllib.request.urlopen(urllib.request.Request(base + "/models", headers=headers), timeout=30) as r:
        return str(json.load(r)["data"][0]["id"])


def build_workload(w: WorkloadConfig, texts: WordText, point: int) -> Workload:
    """The workload of sweep point ``point``: generated ones open every prompt with the point's
    index, so no point reuses another's cached prompts (a trace is the same at every point)."""
    if w.workload == "random":
        spec = RandomSpec(w.input_tokens, w.output_tokens, w.input_spread, w.output_spread)
        return random_workload(spec, texts, requests=None, seed=w.seed, tag=f"Run {point} request")
    if w.workload == "multi_turn":
        mt = MultiTurnSpec(w.turns, w.input_tokens, w.output_tokens, w.input_spread, w.output_spread,
                           w.shared_prefix_tokens)
        return multi_turn_workload(mt, texts, conversations=None, seed=w.seed, tag=f"Run {point} conversation")
    if w.workload == "trace":
        return trace_workload(read_trace(w.trace))
    convs = accuracy.read_questions(w.trace) if w.trace else accuracy.builtin_set(w.accuracy_items, w.seed)
    return trace_workload(convs, "accuracy")


def sweep_points(load: LoadConfig, seed: int, turn_gap_s: float, whole_set: bool = False) -> list[LoadPoint]:
    """One LoadPoint per rate (if any) or concurrency level; ``whole_set``: no request limit (accuracy
    asks every question)."""
    common = {"requests": None if whole_set else load.requests, "duration_s": load.duration_s, "warmup": load.warmup, "seed": seed,
              "turn_gap_s": turn_gap_s}
    if load.rate:
        cap = load.concurrency[0]
        return [LoadPoint(cap, TRACE_RATE if r == "trace" else float(r), **common) for r in load.rate]
    return [LoadPoint(c, **common) for c in load.concurrency]


def make_target(t: TargetConfig, w: WorkloadConfig, model: str) -> Target:
    acc = w.workload == "accuracy"
    return Target(t.base_url, model, t.api, t.api_key, temperature=0.0 if acc else w.temperature,
                  ignore_eos=False if acc else w.ignore_eos, logprobs=acc or w.logprobs, timeout_s=t.timeout_s)


def run_sweep(label: str, t: TargetConfig, w: WorkloadConfig, load: LoadConfig, rep: ReportConfig,
              *, say: Any = print) -> SweepResult:
    """Run every sweep point against ``t``; the workload is rebuilt from the seed for each point, so
    every point (and every server of an A/B) gets the same requests."""
    tokenizer = load_tokenizer(w.tokenizer)
    counter, texts = TokenCounter(tokenizer), WordText(tokenizer)
    model = t.model or served_model(t)
    target = make_target(t, w, model)
    asyncio.run(wait_ready(target))
    slo = SLO(rep.slo_ttft_ms / 1000, rep.slo_tpot_ms / 1000, rep.slo_e2e_ms / 1000)
    out = SweepResult(label)
    try:
        targets = expand_targets(list(t.metrics_urls))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--metrics-urls: {e}") from None
    warm_spec = RandomSpec(min(w.input_tokens, 64), min(w.output_tokens, 4))
    for i, point in enumerate(sweep_points(load, w.seed, w.turn_gap_s, whole_set=w.workload == "accuracy")):
        workload = build_workload(w, texts, i)
        warm = random_workload(warm_spec, texts, requests=None, seed=w.seed, tag=f"Warmup {label} {point.label()}")
        window = Window(targets)
        runner = Runner(target, counter, progress=rep.progress)
        say(f"[{label}] {point.label()}: {workload.name} workload, "
            f"{'every' if point.requests is None else f'up to {point.requests}'} request(s)"
            + (f" or {point.duration_s:g} s" if point.duration_s else "") + f", warmup {point.warmup}")
        run = asyncio.run(runner.run(workload, point, warm, window if targets else None))
        if targets:
            run.server = window.result()
        summary = summarize_run(run, slo, rep.num_gpus)
        summary["label"] = label
        out.points.append(summary)
        out.latencies.append(latencies(run))
        out.results.append(run.results)
        if w.save_trace and i == 0:
            write_trace(w.save_trace, run.conversations)
        if workload.name == "accuracy":
            out.accuracy.append({"point": point.label(), **accuracy.grade(run.conversations, run.results)})
        s = summary
        say(f"[{label}] {point.label()}: {s['requests']['completed']}/{s['requests']['sent']} ok, "
            f"{s['throughput']['requests_per_s']:.2f} req/s, {s['throughput']['output_tok_s']:.1f} out tok/s, "
            f"TTFT p50 {_ms(s['ttft_s']['p50'])} ms, TPOT p50 {_ms(s['tpot_s']['p50'])} ms"
            + (f", errors {s['requests']['errors']}" if s['requests']['failed'] else ""))
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"
