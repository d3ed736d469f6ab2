"""Process checks shared by tests that start services as real processes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def live_processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name: state, ppid, pgrp, session, ...) of every
    live process (zombies and processes gone while read are skipped)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[0] != "Z":
                yield int(d.name), fields


def launched_by(pid: int) -> list[int]:
    """pids of live services that the launcher ``pid`` started (each is told ``--parent-pid PID``)."""
    out = []
    for child, _ in live_processes():
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if any(a == b"--parent-pid" and b == str(pid).encode() for a, b in itertools.pairwise(argv)):
            out.append(child)
    return out
