"""``pdserve bench serve`` and ``pdserve bench ab``.

``serve``: measure any OpenAI-compatible server (``--base-url``), or a deployment a recipe describes
(``--recipe``: started as local processes, measured, stopped), over a sweep of concurrency levels or
Poisson rates. ``ab RECIPE_A RECIPE_B``: both deployments, one after the other, on the same workload
and sweep (RECIPE_A's, command-line flags override), in one report. Flags override a recipe's values;
each is also a PDSERVE_BENCH_* env var. Prints the table; ``--out DIR`` writes report.json, report.md
and PNG plots.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import sys
from collections.abc import Iterator
from typing import Any

from benchmarks.serve import accuracy
from benchmarks.serve.config import LoadConfig, ReportConfig, TargetConfig, WorkloadConfig
from benchmarks.serve.output import Report, Side, markdown, write
from benchmarks.serve.recipes import Recipe, RecipeError, load_recipe
from benchmarks.serve.report import client_table, host_info
from benchmarks.serve.sweep import SweepResult, run_sweep
from benchmarks.serve.workload import TraceError
from services.common.cli_args import ArgParser
from services.common.config import ConfigError, add_dataclass_args, config_dict, from_args

START_TIMEOUT_S = 600.0  # a busy CPU host loads several engines at once


class DeployError(RuntimeError):
    """A recipe's deployment did not start (the message holds the failing service's output tail)."""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _failed(prog: str, e: Exception) -> int:
    """Say why on stderr; exit 1 when a deployment failed, 2 for a bad flag, recipe or trace."""
    print(f"{prog}: {e}", file=sys.stderr)
    return 1 if isinstance(e, DeployError) else 2


def _parser(prog: str, ab: bool) -> argparse.ArgumentParser:
    p = ArgParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if ab:
        p.add_argument("recipe_a", help="YAML recipe of server A (its workload, load and report sections are used)")
        p.add_argument("recipe_b", help="YAML recipe of server B (only its deployment is used)")
    else:
        p.add_argument("--recipe", default="", help="YAML recipe (recipes/*.yaml): start its deployment and run "
                                                    "its workload and sweep instead of --base-url")
    for cls in (TargetConfig, WorkloadConfig, LoadConfig, ReportConfig):
        add_dataclass_args(p, cls)
    return p


def _configs(ns: argparse.Namespace, recipe: Recipe | None) -> tuple[Any, ...]:
    given = {k: v for k, v in vars(ns).items() if v is not None}
    out: list[Any] = [from_args(TargetConfig, given)]
    for name, cls in (("workload", WorkloadConfig), ("load", LoadConfig), ("report", ReportConfig)):
        out.append(from_args(cls, {**(recipe.sections[name] if recipe else {}), **given}))
    return tuple(out)


@contextlib.contextmanager
def deployed(recipe: Recipe) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Start a recipe's deployment; yields (OpenAI base URL, every service's metrics address)."""
    from services.launcher import LocalCluster

    _say(f"[{recipe.name}] starting {recipe.deployment.describe()} ...")
    cluster = LocalCluster(**recipe.deployment.cluster_kwargs(), quiet=True)
    try:
        cluster.start(START_TIMEOUT_S)
    except RuntimeError as e:  # start() has stopped whatever it had started
        raise DeployError(f"{recipe.path}: the deployment did not start: {e}") from None
    try:
        metrics = tuple(info["metrics"] for info in cluster.endpoints().values() if "metrics" in info)
        yield f"http://{cluster.router['http']}/v1", metrics
    finally:
        _say(f"[{recipe.name}] stopping")
        cluster.stop()


def _sweep_recipe(recipe: Recipe, t: TargetConfig, w: WorkloadConfig, load: LoadConfig, rep: ReportConfig,
                  label: str) -> SweepResult:
    with deployed(recipe) as (base, metrics):
        t = dataclasses.replace(t, base_url=base, model="", metrics_urls=metrics)
        return run_sweep(label, t, w, load, rep, say=_say)


def _workload_info(w: WorkloadConfig, load: LoadConfig, rep: ReportConfig) -> dict[str, Any]:
    keep = {"workload", "input_tokens", "input_spread", "output_tokens", "output_spread", "seed", "ignore_eos",
            "temperature", "logprobs", "tokenizer"}
    if w.workload == "multi_turn":
        keep |= {"turns", "shared_prefix_tokens", "turn_gap_s"}
    if w.workload in ("trace", "accuracy"):  # lengths come from the file or the question set
        keep = {"workload", "trace", "seed", "tokenizer"} | ({"accuracy_items"} if w.workload == "accuracy" else set())
    info = {k: v for k, v in config_dict(w).items() if k in keep}
    info.update({k: v for k, v in config_dict(load).items()})
    info["slo"] = {k: v for k, v in config_dict(rep).items() if k.startswith("slo_") and v}
    return info


def _finish(rep_cfg: ReportConfig, report: Report) -> int:
    report.host_after = host_info()
    rows = [(f"{s.sweep.label}, {p['point']['label']}", p) for s in report.sides for p in s.sweep.points]
    print(client_table(rows))
    if rep_cfg.out:
        for path in write(report, rep_cfg.out, plots=rep_cfg.plots):
            _say(f"wrote {path}")
    else:
        _say("(--out DIR writes report.json, report.md and plots)")
        if any(s.sweep.accuracy for s in report.sides) or report.comparison:
            md = markdown(report, [])
            print(md[md.index("## Accuracy"):] if "## Accuracy" in md else md)
    # Failed requests are data (counted in the report); a point where nothing completed is a failed run.
    return 1 if any(p["requests"]["completed"] == 0 for s in report.sides for p in s.sweep.points) else 0


def serve_main(argv: list[str]) -> int:
    p = _parser("pdserve bench serve", ab=False)
    ns = p.parse_args(argv)
    try:
        recipe = load_recipe(ns.recipe) if ns.recipe else None
        t, w, load, rep = _configs(ns, recipe)
        if (recipe is None) == (not t.base_url):
            raise ConfigError("give --base-url URL (any OpenAI-compatible server) or --recipe FILE (one of them)")
        command = "pdserve bench serve " + shlex.join(argv)
        host = host_info()
        if recipe is not None:
            label = rep.label or recipe.name
            sweep = _sweep_recipe(recipe, t, w, load, rep, label)
            sides = [Side(sweep, f"recipe `{recipe.path}` ({recipe.description or recipe.name}): "
                                 f"{recipe.deployment.describe()}")]
        else:
            label = rep.label or t.base_url
            sides = [Side(run_sweep(label, t, w, load, rep, say=_say), f"`{t.base_url}`")]
        comparison: dict[str, Any] = {}
        if t.reference_url and w.workload == "accuracy":
            ref_t = dataclasses.replace(t, base_url=t.reference_url, model="", metrics_urls=())
            ref = run_sweep("reference", ref_t, w, load, rep, say=_say)
            sides.append(Side(ref, f"reference `{t.reference_url}`"))
            comparison["token_agreement"] = {f"{label} vs reference": accuracy.token_agreement(
                sides[0].sweep.results[0], ref.results[0])}
    except (ConfigError, RecipeError, TraceError, FileNotFoundError, DeployError) as e:
        return _failed("pdserve bench serve", e)
    report = Report(f"pdserve bench serve: {label}", command, _workload_info(w, load, rep), sides,
                    note=rep.note, host_before=host, comparison=comparison)
    return _finish(rep, report)


def ab_main(argv: list[str]) -> int:
    p = _parser("pdserve bench ab", ab=True)
    ns = p.parse_args(argv)
    try:
        a, b = load_recipe(ns.recipe_a), load_recipe(ns.recipe_b)
        host = host_info()
        t, w, load, rep = _configs(ns, a)
        differs = [s for s in ("workload", "load") if b.sections[s] and b.sections[s] != a.sections[s]]
        if differs:
            _say(f"note: {b.path}'s {' and '.join(differs)} section(s) differ from {a.path}'s; both run "
                 f"{a.path}'s (plus command-line flags)")
        sides = []
        for r in (a, b):
            sweep = _sweep_recipe(r, t, w, load, rep, r.name)
            sides.append(Side(sweep, f"recipe `{r.path}` ({r.description or r.name}): {r.deployment.describe()}"))
    except (ConfigError, RecipeError, TraceError, FileNotFoundError, DeployError) as e:
        return _failed("pdserve bench ab", e)
    comparison: dict[str, Any] = {}
    if w.workload == "accuracy":
        comparison["token_agreement"] = {
            f"{a.name} vs {b.name}, {pt['point']['label']}": accuracy.token_agreement(ra, rb)
            for pt, ra, rb in zip(sides[0].sweep.points, sides[0].sweep.results, sides[1].sweep.results, strict=True)}
    command = "pdserve bench ab " + shlex.join(argv)
    report = Report(f"pdserve bench ab: {a.name} vs {b.name}", command, _workload_info(w, load, rep), sides,
                    note=rep.note, host_before=host, comparison=comparison)
    return _finish(rep, report)
