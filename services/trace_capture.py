"""``pdserve trace``: one timed torch-profiler window on every prefill and decode, lined up.

    pdserve trace --after 5 --duration 2 --out /tmp/traces --targets 10.0.0.4:50061,10.0.0.7:50062

Every target (a prefill or decode gRPC address) gets one Admin.CaptureTrace call with the same
wall-clock start (now + ``--after``), so the windows cover the same requests on both sides of the KV
handoff. The calls run in parallel; the command returns once every target has answered (or the
deadline ``after + duration + --margin`` has passed), prints one line per captured trace

    <service> <instance> <path>

(a tensor-parallel instance answers once every rank wrote its trace: one more line per rank,
``<service> <instance>/rank<r> <path>``; a rank that wrote none fails the target, naming the rank)
and names every target that failed or did not answer on stderr, exiting 1 then. Each service writes
its trace under its own ``--trace-dir`` (the request names only a session, never a path); a trace
readable where the command runs (one host, or a shared volume) is copied into ``--out`` and that
copy is printed, otherwise the path on the service's host. Open them in chrome://tracing or
https://ui.perfetto.dev.
Exit status: 0 all captured, 1 some target failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import grpc

from services.common.cli_args import ArgParser
from services.common.grpc_util import create_channel, rpc_error_summary
from services.common.pb import common_pb2, common_pb2_grpc

MAX_DURATION_S = 600.0
"""The Admin service refuses longer windows."""
MAX_AFTER_S = 3600.0
"""The Admin service refuses starts more than an hour ahead."""
DEFAULT_MARGIN_S = 60.0
"""Time after the window for the profiler to stop and write its trace (large traces take seconds)."""


@dataclass(frozen=True)
class Target:
    address: str
    role: str | None
    """"prefill"/"decode" when given by --prefill/--decode (checked against the answer), else None."""


@dataclass
class Outcome:
    target: Target
    service: str = ""
    instance: str = ""
    path: str = ""
    error: str = ""
    rank_paths: list[str] = field(default_factory=list)
    """Traces of ranks 1..N-1 of a tensor-parallel target (rank 0's is ``path``)."""


class UsageError(ValueError):
    pass


def parse_address(value: str) -> str:
    """Validate ``host:port`` (``[v6]:port`` too); returns it stripped."""
    addr = value.strip()
    host, sep, port = addr.rpartition(":")
    if not sep or not host or host in ("[]",):
        raise UsageError(f"target {value!r}: expected host:port")
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise UsageError(f"target {value!r}: port must be an integer in [1, 65535]")
    return addr


def _split(value: str | None) -> list[str]:
    return [t for t in (value or "").split(",") if t.strip()]


def build_targets(targets: str | None, prefill: str | None, decode: str | None) -> list[Target]:
    out: list[Target] = []
    seen: set[str] = set()
    for raw, role in ([(t, None) for t in _split(targets)] + [(t, "prefill") for t in _split(prefill)]
                      + [(t, "decode") for t in _split(decode)]):
        addr = parse_address(raw)
        if addr in seen:
            raise UsageError(f"target {addr} is given twice")
        seen.add(addr)
        out.append(Target(addr, role))
    if not out:
        raise UsageError("no targets: give --targets host:port,... (or --prefill/--decode)")
    return out


def parser() -> ArgParser:
    p = ArgParser(
        prog="pdserve trace",
        description="Capture a torch-profiler trace for the same wall-clock window on every given prefill and "
                    "decode; print one line per service (service instance path); name those that failed.",
        epilog="Exit status: 0 every target wrote its trace, 1 some failed or did not answer, 2 bad arguments.")
    p.add_argument("--after", type=float, default=1.0, metavar="S",
                   help="start the window S seconds from now (default 1; >= 0)")
    p.add_argument("--duration", type=float, required=True, metavar="D", help="window length in seconds (0 < D <= 600)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory each service writes its trace into, on that service's host (made absolute here)")
    p.add_argument("--targets", metavar="HOST:PORT,...", help="prefill and decode gRPC addresses")
    p.add_argument("--prefill", metavar="HOST:PORT,...", help="prefill addresses (answer must come from a prefill)")
    p.add_argument("--decode", metavar="HOST:PORT,...", help="decode addresses (answer must come from a decode)")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN_S, metavar="S",
                   help=f"deadline after the window ends for a trace to be written (default {DEFAULT_MARGIN_S:g}s)")
    return p


def validate(ns: argparse.Namespace) -> list[Target]:
    if not 0 <= ns.after <= MAX_AFTER_S:
        raise UsageError(f"--after must be in [0, {MAX_AFTER_S:g}] seconds, got {ns.after:g}")
    if not 0 < ns.duration <= MAX_DURATION_S:
        raise UsageError(f"--duration must be in (0, {MAX_DURATION_S:g}] seconds, got {ns.duration:g}")
    if not ns.margin > 0:
        raise UsageError(f"--margin must be > 0 seconds, got {ns.margin:g}")
    if not ns.out.strip():
        raise UsageError("--out must not be empty")
    return build_targets(ns.targets, ns.prefill, ns.decode)


async def _capture_one(target: Target, req: common_pb2.CaptureTraceRequest, deadline: float) -> Outcome:
    out = Outcome(target)
    try:
        async with create_channel(target.address) as ch:
            resp = await common_pb2_grpc.AdminStub(ch).CaptureTrace(req, timeout=max(0.1, deadline - time.time()))
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            out.error = f"no answer before the deadline ({rpc_error_summary(e)})"
        else:
            out.error = rpc_error_summary(e)
        return out
    out.service, out.instance, out.path = resp.service, resp.instance, resp.path
    out.rank_paths = list(resp.rank_paths)
    if not resp.path:
        out.error = "answered without a trace path"
    elif target.role is not None and resp.service != target.role:
        out.error = f"given as a {target.role} but answered as {resp.service or 'an unnamed service'} (trace {resp.path})"
    return out


async def capture(targets: list[Target], after_s: float, duration_s: float, out_dir: str,
                  margin_s: float = DEFAULT_MARGIN_S) -> list[Outcome]:
    """Ask every target for the same window; returns one Outcome per target, in order. Traces readable
    here are copied into ``out_dir`` (the Outcome's path is then the copy)."""
    start = time.time() + after_s
    session = f"trace-{int(start * 1000)}"
    req = common_pb2.CaptureTraceRequest(start_unix=start, duration_s=duration_s, out_dir=session)
    deadline = start + duration_s + margin_s
    outcomes = list(await asyncio.gather(*(_capture_one(t, req, deadline) for t in targets)))
    await asyncio.to_thread(_collect, outcomes, out_dir)
    return outcomes


def _collect(outcomes: list[Outcome], out_dir: str) -> None:
    """Copy each trace readable on this host into ``out_dir``; the outcome's path becomes the copy."""
    for o in outcomes:
        if not o.error:
            o.path, *o.rank_paths = [_copy(p, out_dir) for p in (o.path, *o.rank_paths)]


def _copy(path: str, out_dir: str) -> str:
    """The copy of ``path`` in ``out_dir`` when it is readable here, else ``path``."""
    if not os.path.isfile(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    return shutil.copy2(path, os.path.join(out_dir, os.path.basename(path)))


def main(argv: list[str] | None = None) -> int:
    p = parser()
    ns = p.parse_args(argv)
    try:
        targets = validate(ns)
    except UsageError as e:
        print(f"pdserve trace: error: {e}; --help lists the flags", file=sys.stderr)
        return 2
    out_dir = os.path.abspath(os.path.expanduser(ns.out))
    print(f"pdserve trace: {len(targets)} target(s), window of {ns.duration:g}s starting in {ns.after:g}s, "
          f"traces into {out_dir}", file=sys.stderr, flush=True)
    outcomes = asyncio.run(capture(targets, ns.after, ns.duration, out_dir, ns.margin))
    for o in outcomes:
        if not o.error:
            print(f"{o.service} {o.instance} {o.path}", flush=True)
            for rank, path in enumerate(o.rank_paths, start=1):
                print(f"{o.service} {o.instance}/rank{rank} {path}", flush=True)
    failed = [o for o in outcomes if o.error]
    for o in failed:
        role = f" ({o.target.role})" if o.target.role else ""
        print(f"pdserve trace: FAILED {o.target.address}{role}: {o.error}", file=sys.stderr, flush=True)
    if failed:
        print(f"pdserve trace: {len(failed)} of {len(outcomes)} target(s) wrote no trace: "
              f"{', '.join(o.target.address for o in failed)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
