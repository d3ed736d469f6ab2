"""The argument parser of every pdserve command: whole flag names only, and a mistake is one line.

argparse by default takes any unambiguous prefix of a flag (``--prefil 2`` silently becomes
``--prefill 2``) and answers an unknown flag with the whole usage text. :class:`ArgParser` refuses
prefixes (``allow_abbrev=False``, inherited by its subcommands' parsers) and reports every parse error
as ``PROG: error: MESSAGE`` on one line, an unknown flag with the closest real one::

    pdserve up: error: unrecognized argument --prefil (did you mean --prefill?); --help lists the flags
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterator
from typing import Any, NoReturn

__all__ = ["ArgParser", "suggest_flag", "unrecognized_message"]

_UNRECOGNIZED = "unrecognized arguments: "


class ArgParser(argparse.ArgumentParser):
    """argparse.ArgumentParser without prefix matching, whose errors are one line (exit status 2)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith(_UNRECOGNIZED):
            message = unrecognized_message(message[len(_UNRECOGNIZED):].split(" "), self.flags())
        else:
            message = message.replace("\n", " ")
        self.exit(2, f"{self.prog}: error: {message}; --help lists the flags\n")

    def flags(self) -> list[str]:
        """Every long flag of this parser and of its subcommands' parsers."""
        return sorted({f for f in _option_strings(self) if f.startswith("--")})


def _option_strings(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        yield from action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _option_strings(sub)


def suggest_flag(given: str, flags: list[str]) -> str | None:
    """The flag of ``flags`` closest to ``given`` (``--prefil`` -> ``--prefill``), None when none is close."""
    # Compared without the dashes every flag shares, which would make any two flags look alike.
    names = {f.lstrip("-"): f for f in flags}
    close = difflib.get_close_matches(given.split("=", 1)[0].lstrip("-"), list(names), n=1, cutoff=0.6)
    return names[close[0]] if close else None


def unrecognized_message(args: list[str], flags: list[str]) -> str:
    """One line for arguments no parser took: the first unknown flag, with the closest real one."""
    unknown = [a for a in args if a.startswith("-")]
    if not unknown:
        return f"unexpected argument{'s' if len(args) > 1 else ''} {' '.join(args)}"
    first = unknown[0]
    hint = suggest_flag(first, flags)
    more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
    return f"unrecognized argument {first.split('=', 1)[0]}{more}" + (f" (did you mean {hint}?)" if hint else "")

