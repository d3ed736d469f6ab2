"""Router start-up: how long ``import services.router.__main__`` takes, and how long ``pdserve router``
takes from exec to its ready line, for one or more checkouts measured in the same run.

    python -m benchmarks.startup_bench                                   # this checkout
    git worktree add /tmp/wt-before <commit>                             # the tree before a change
    python -m benchmarks.startup_bench --repo before=/tmp/wt-before --repo after=. --runs 7 --json out.json

Each run is a fresh interpreter (cwd and PYTHONPATH = the checkout). "import" runs
``python -c "import services.router.__main__"`` and reports the time inside the interpreter, the whole
process' wall time, the modules loaded and whether torch was one of them. "ready" starts
``python -m services.router`` (gRPC and HTTP on free ports, no metrics endpoint, the default model's
tokenizer) against a fake prefill and a fake decode that answer health and load at once
(tests/router/fake_peers.py, served by this process), and times exec -> the PDSERVE_READY line. Runs
of the checkouts alternate so a busy host slows each alike; medians and minima are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.common.cli_args import ArgParser

_IMPORT = """
import json, sys, time
t0 = time.perf_counter()
import services.router.__main__
dt = time.perf_counter() - t0
print(json.dumps({"import_s": dt, "modules": len(sys.modules), "torch": "torch" in sys.modules}))
"""
READY_PREFIX = "PDSERVE_READY"


@dataclass
class Samples:
    label: str
    repo: str
    import_s: list[float] = field(default_factory=list)
    """Seconds spent inside ``import services.router.__main__``."""
    import_process_s: list[float] = field(default_factory=list)
    """Wall seconds of the whole ``python -c "import services.router.__main__"`` process."""
    ready_s: list[float] = field(default_factory=list)
    """Wall seconds from exec of ``python -m services.router`` to its ready line."""
    modules: int = 0
    torch: bool = False


def _env(repo: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(repo)}


async def _import_once(repo: Path, s: Samples) -> None:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _IMPORT, cwd=repo, env=_env(repo),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{s.label}: import failed: {err.decode()[-2000:]}")
    got = json.loads(out.decode().strip().splitlines()[-1])
    s.import_s.append(got["import_s"])
    s.import_process_s.append(wall)
    s.modules, s.torch = got["modules"], got["torch"]


async def _ready_once(repo: Path, s: Samples, prefill: str, decode: str, timeout_s: float) -> None:
    args = ["-m", "services.router", "--port", "0", "--http-port", "0", "--metrics-port", "-1",
            "--prefill", prefill, "--decode", decode, "--health-interval-s", "0.2", "--log-level", "WARNING"]
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(sys.executable, *args, cwd=repo, env=_env(repo),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
            if not line:
                raise RuntimeError(f"{s.label}: the router exited (rc={await proc.wait()}) before its ready line")
            if line.startswith(READY_PREFIX.encode()):
                s.ready_s.append(time.perf_counter() - t0)
                return
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def measure(repos: Sequence[tuple[str, Path]], runs: int, timeout_s: float) -> list[Samples]:
    from tests.router.fake_peers import FakeCluster  # served by this process, from this checkout

    samples = [Samples(label, str(path)) for label, path in repos]
    cluster = await FakeCluster.start(n_decode=1, n_prefill=1)
    try:
        for _ in range(runs):
            for (_, path), s in zip(repos, samples, strict=True):
                await _import_once(path, s)
                await _ready_once(path, s, cluster.prefill_addr(0), cluster.decode_addr(0), timeout_s)
    finally:
        await cluster.stop()
    return samples


def _row(s: Samples) -> str:
    def stat(xs: list[float]) -> str:
        return f"{statistics.median(xs):6.2f} / {min(xs):5.2f}"

    return (f"{s.label:<10} {stat(s.import_s)}   {stat(s.import_process_s)}   {stat(s.ready_s)}   "
            f"{s.modules:>7}  {'yes' if s.torch else 'no':<5}")


def report(samples: Sequence[Samples]) -> str:
    lines = [f"{'checkout':<10} {'import s':>14}   {'import proc s':>14}   {'ready s':>14}   {'modules':>7}  torch",
             f"{'':<10} {'median / min':>14}   {'median / min':>14}   {'median / min':>14}"]
    lines += [_row(s) for s in samples]
    return "\n".join(lines)


def _repo_arg(value: str) -> tuple[str, Path]:
    label, sep, path = value.partition("=")
    if not sep:
        label, path = Path(value).resolve().name, value
    root = Path(path).resolve()
    if not (root / "services" / "router" / "__main__.py").is_file():
        raise argparse.ArgumentTypeError(f"{root} is not a pdserve checkout (no services/router/__main__.py)")
    return label, root


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgParser(prog="pdserve bench startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", action="append", type=_repo_arg, metavar="[LABEL=]PATH",
                   help="checkout to measure (repeatable; default: this one)")
    p.add_argument("--runs", type=int, default=5, help="runs per checkout (default 5)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="longest wait for one ready line (seconds)")
    p.add_argument("--json", type=Path, help="write the samples here")
    args = p.parse_args(argv)
    repos = args.repo or [_repo_arg(f"this={Path(__file__).resolve().parents[1]}")]
    samples = asyncio.run(measure(repos, args.runs, args.timeout_s))
    print(f"router start-up, {args.runs} runs each ({os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the end)")
    print(report(samples))
    if args.json:
        args.json.write_text(json.dumps([asdict(s) for s in samples], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
