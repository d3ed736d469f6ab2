"""The ``pdserve`` command: generate, up (local P/D cluster), bench, trace, and the services."""

from __future__ import annotations

import argparse
import sys


def _generate(argv: list[str]) -> int:
    from services.engine.cli_generate import main

    return main(argv)


def _up(argv: list[str]) -> int:
    from services.launcher import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from benchmarks.cli import main

    return main(argv)


def _trace(argv: list[str]) -> int:
    from services.trace_capture import main

    return main(argv)


def _service(module: str) -> callable:
    def run(argv: list[str]) -> int:
        import importlib

        return importlib.import_module(f"services.{module}.__main__").main(argv)

    return run


COMMANDS = {
    "generate": (_generate, "generate text with the engine in this process"),
    "up": (_up, "start router + prefill + decode (+ kvstore) as local processes"),
    "bench": (_bench, "benchmarks (engine, cluster, kvstore)"),
    "trace": (_trace, "capture a timed torch-profiler trace on every prefill and decode"),
    "router": (_service("router"), "run the router service"),
    "prefill": (_service("prefill"), "run a prefill service"),
    "decode": (_service("decode"), "run a decode service"),
    "kvstore": (_service("kvstore"), "run the kvstore service"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        p = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving")
        sub = p.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, help_) in COMMANDS.items():
            sub.add_parser(name, help=help_)
        if argv and argv[0] not in ("-h", "--help"):
            p.error(f"unknown command {argv[0]!r}")
        p.print_help()
        return 0 if argv else 2
    return COMMANDS[argv[0]][0](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
