"""The ``pdserve`` command: generate, up (local P/D cluster), certs, health, bench, trace, and the services."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from services.common.cli_args import ArgParser
from services.common.config import ConfigError, add_dataclass_args, from_args
from services.common.errors import EXPECTED, one_line
from services.common.logging import LoggingConfig


def _generate(argv: list[str]) -> int:
    # deferred: a subcommand imports only what it runs (start-up time; tools that talk to the router never load torch)
    from services.engine.cli_generate import main

    return main(argv)


def _up(argv: list[str]) -> int:
    # deferred: a subcommand imports only what it runs (start-up time; tools that talk to the router never load torch)
    from services.up import main

    return main(argv)


def _certs(argv: list[str]) -> int:
    """Write a CA and one certificate per role for mTLS (local clusters, Kubernetes Secrets)."""
    from pathlib import Path

    # deferred: a subcommand imports only what it runs (start-up time; tools that talk to the router never load torch)
    from services.common.tls import ROLES, make_certs

    p = ArgParser(prog="pdserve certs", description=_certs.__doc__)
    p.add_argument("--out", required=True, help="directory to write ca.pem and <role>.pem/<role>-key.pem into "
                                                "(created mode 0700)")
    p.add_argument("--hosts", default="localhost,127.0.0.1",
                   help="comma-separated DNS names / IPs every certificate is valid for (besides pdserve.internal)")
    p.add_argument("--days", type=int, default=365, help="validity (days)")
    p.add_argument("--force", action="store_true", help="replace an existing CA in --out")
    p.add_argument("--namespace", default="pdserve", help="namespace in the printed kubectl commands")
    args = p.parse_args(argv)
    out = Path(args.out)
    if (out / "ca.pem").exists() and not args.force:
        print(f"pdserve certs: {out / 'ca.pem'} exists; --force replaces the CA (and breaks every certificate "
              "it signed)", file=sys.stderr)
        return 2
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip())
    make_certs(out, hosts=hosts, days=args.days)
    print(f"wrote {out}/ca.pem and a certificate + key for each of {', '.join((*ROLES, 'client'))} "
          f"(keys mode 0600). The Secrets the Kubernetes base (deploy/k8s) mounts:")
    for role in ROLES:
        print(f"  kubectl -n {args.namespace} create secret generic pdserve-tls-{role} "
              f"--from-file=tls.crt={out}/{role}.pem --from-file=tls.key={out}/{role}-key.pem "
              f"--from-file=ca.crt={out}/ca.pem")
    return 0


def health_parser() -> ArgParser:
    """Flags of ``pdserve health`` (the deploy tests parse the probes' commands with it)."""
    # deferred: a subcommand imports only what it runs (start-up time; tools that talk to the router never load torch)
    from services.common.tls import TLSConfig

    p = ArgParser(prog="pdserve health", description=_health.__doc__, exit_on_error=False)
    p.add_argument("--address", required=True, help="host:port of the service's gRPC server")
    p.add_argument("--service", default="", help="health service name; empty: the whole server")
    p.add_argument("--timeout-s", type=float, default=3.0, help="RPC deadline (seconds)")
    add_dataclass_args(p, TLSConfig)
    return p


def _health(argv: list[str]) -> int:
    """grpc.health.v1 check of one service, over mTLS when PDSERVE_TLS_* / --tls-* are set: the
    Kubernetes probe under mTLS (the kubelet's own grpc: probe speaks no TLS). Exit 0 when SERVING."""
    import asyncio

    # deferred: a subcommand imports only what it runs (start-up time; tools that talk to the router never load torch)
    from services.common.grpc_util import check_health, create_channel
    from services.common.tls import TLSConfig

    args = health_parser().parse_args(argv)
    try:
        tls = from_args(TLSConfig, args)
    except ConfigError as e:
        print(f"pdserve health: {e}", file=sys.stderr)
        return 2

    async def check() -> int:
        async with create_channel(args.address, tls=tls if tls.tls_enabled else None) as ch:
            return await check_health(ch, args.service, timeout_s=args.timeout_s)

    import grpc
    from grpc_health.v1 import health_pb2

    try:
        status = asyncio.run(check())
    except grpc.aio.AioRpcError as e:
        print(f"pdserve health: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.address}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def _bench(argv: list[str]) -> int:
    from benchmarks.cli import main

    return main(argv)


def _trace(argv: list[str]) -> int:
    # deferred: a subcommand imports only what it runs (start-up time; tools that talk to the router never load torch)
    from services.trace_capture import main

    return main(argv)


def _service(module: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        return importlib.import_module(f"services.{module}.__main__").main(argv)

    return run


COMMANDS = {
    "generate": (_generate, "generate text with the engine in this process"),
    "up": (_up, "start router + prefill + decode (+ kvstore) as local processes, restarted when they exit"),
    "certs": (_certs, "write a CA and per-role certificates for mTLS"),
    "health": (_health, "grpc.health.v1 check of a service (mTLS aware; the Kubernetes probe under mTLS)"),
    "bench": (_bench, "benchmarks (engine, cluster, kvstore, kernels; serve: any OpenAI server or a recipe; "
                        "ab: two recipes, one report)"),
    "trace": (_trace, "capture a timed torch-profiler trace on every prefill and decode"),
    "router": (_service("router"), "run the router service"),
    "prefill": (_service("prefill"), "run a prefill service"),
    "decode": (_service("decode"), "run a decode service"),
    "kvstore": (_service("kvstore"), "run the kvstore service"),
}


def _debug(argv: list[str]) -> bool:
    """Whether the command runs at --log-level DEBUG: its flag (the services, up, generate), else
    PDSERVE_LOG_LEVEL (every command, bench, certs and trace included)."""
    p = ArgParser(add_help=False)
    add_dataclass_args(p, LoggingConfig)
    try:
        return from_args(LoggingConfig, p.parse_known_args(argv)[0]).log_level == "DEBUG"
    except (SystemExit, ConfigError):  # a malformed --log-level: the command itself said so
        return False


def main(argv: list[str] | None = None) -> int:
    """Run one command. An expected failure (bad input, a missing file or package, a busy port) is one
    line on stderr and exit 1, its traceback only at --log-level DEBUG; anything else is a bug and keeps
    its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        p = ArgParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving")
        sub = p.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, help_) in COMMANDS.items():
            sub.add_parser(name, help=help_)
        if argv and argv[0] not in ("-h", "--help"):
            p.error(f"unknown command {argv[0]!r}")
        p.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    try:
        return COMMANDS[name][0](rest) or 0
    except KeyboardInterrupt:
        return 130
    except EXPECTED as e:
        debug = _debug(rest)
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--log-level DEBUG shows the traceback)"
        print(f"pdserve {name}: error: {one_line(e)}{hint}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
