"""Failures an operator fixes (bad input, a missing file, a busy port), told as one line.

:class:`OperatorError` marks the exceptions a command reports as one actionable line without a
traceback (with ValueError, OSError and ImportError, which bad settings, files and installs raise);
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno

__all__ = ["EXPECTED", "OperatorError", "one_line"]


class OperatorError(Exception):
    """An expected failure; the message is one actionable line: what, which setting, what to do."""


EXPECTED: tuple[type[BaseException], ...] = (OperatorError, ValueError, OSError, ImportError)
"""The exceptions a command turns into one line on stderr (the traceback only at --log-level DEBUG)."""


def one_line(e: BaseException) -> str:
    """A failure as one line: the first line of its message, with what to do for the usual suspects
    (a missing package, a busy port)."""
    if isinstance(e, ModuleNotFoundError) and e.name:
        top = e.name.split(".")[0]
        return (f"the Python package {top!r} is not installed (needed by {e.name}); install it "
                f"(pip install {top.replace('_', '-')}) or the pdserve extra that brings it")
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        return f"{e.strerror or e}: another process holds the port; choose another (0 picks a free one)"
    text = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, (OperatorError, ValueError, OSError)) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
