"""A service's watch on the launcher that started it (``--parent-pid``): services run in their own
sessions, so a launcher killed by SIGKILL would otherwise leave them running."""

from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger(__name__)


async def wait_for_parent_exit(parent_pid: int, service: str) -> None:
    """Return once ``parent_pid`` exits (at once if it is not this process's parent any more). A pidfd
    becomes readable when the process exits; it is opened only while getppid() still names the parent,
    so a reused pid cannot fool it."""
    loop = asyncio.get_running_loop()
    gone = asyncio.Event()
    try:
        fd = os.pidfd_open(parent_pid)
    except OSError:  # already gone (or no such pid at all)
        fd = -1
    try:
        if fd >= 0 and os.getppid() == parent_pid:
            loop.add_reader(fd, gone.set)
            try:
                await gone.wait()
            finally:
                loop.remove_reader(fd)
    finally:
        if fd >= 0:
            os.close(fd)
    log.warning("%s: its launcher (pid %d) exited: shutting down", service, parent_pid)
