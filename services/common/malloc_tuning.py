"""glibc malloc settings for a serving process.

A service allocates and frees buffers of megabytes all the time: gRPC messages (a PushKV chunk is up to
8 MiB, and gRPC Python turns each into a fresh ``bytes``), exported KV pages, CPU activations. With
glibc's defaults a buffer above the dynamic mmap threshold is mmap'd and unmapped every time, and freed
heap above the trim threshold goes back to the kernel, so the next buffer of that size is page-faulted
in anew, 4 KiB at a time (on a 2-core box, the faults were a third of decode's CPU time receiving KV over
grpc). :func:`tune_malloc` fixes the mmap threshold at 32 MiB (glibc's maximum: anything smaller comes
from the heap and is reused) and raises the trim threshold, so a process keeps up to
``TRIM_THRESHOLD_BYTES`` of freed heap for its next buffers instead of returning and faulting it again.
The cost is resident memory: a process holds on to the peak of its small-and-medium buffers.

It runs first in every service's ``main`` (:func:`services.common.server.run_main`). It changes nothing:

* when ``PDSERVE_MALLOC_TUNING`` is ``off`` (or ``0`` / ``false`` / ``no``);
* when the operator already set glibc's own knobs (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
  or ``glibc.malloc.mmap_threshold`` / ``glibc.malloc.trim_threshold`` in ``GLIBC_TUNABLES``): theirs win;
* off glibc (musl, macOS): there is no ``mallopt`` to call.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping

log = logging.getLogger(__name__)

ENV = "PDSERVE_MALLOC_TUNING"
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)."""
TRIM_THRESHOLD_BYTES = 512 << 20

_OFF = {"off", "0", "false", "no"}
_GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_GLIBC_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def skip_reason(env: Mapping[str, str] | None = None) -> str | None:
    """Why :func:`tune_malloc` would leave malloc alone in this process, or None."""
    env = os.environ if env is None else env
    if env.get(ENV, "on").strip().lower() in _OFF:
        return f"{ENV}={env[ENV]}"
    set_by_operator = [k for k in _GLIBC_ENV if k in env]
    set_by_operator += [t for t in _GLIBC_TUNABLES if t in env.get("GLIBC_TUNABLES", "")]
    if set_by_operator:
        return "set by the environment (" + ", ".join(set_by_operator) + ")"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    return None


def tune_malloc(env: Mapping[str, str] | None = None) -> bool:
    """Apply the settings above to this process; True when they were applied."""
    why = skip_reason(env)
    if why is not None:
        log.debug("malloc tuning skipped: %s", why)
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as e:  # a static or exotic libc
        log.debug("malloc tuning skipped: %s", e)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        log.warning("mallopt refused the malloc settings; allocation stays at glibc's defaults")
    return ok


def release_free_heap() -> int:
    """Give the heap this process freed back to the kernel now (glibc ``malloc_trim(0)``); returns the
    bytes of resident memory that went (0 off glibc, or when nothing was freed).

    For the end of start-up: loading and dequantizing weights, packing them and timing probes free
    hundreds of MB in buffers under the mmap threshold, which the raised trim threshold above would
    otherwise keep resident for the life of the process."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return 0
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    before = _rss_bytes()
    trim(0)
    return max(0, before - _rss_bytes())


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
