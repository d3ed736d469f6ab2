"""The Mooncake KV-transport settings prefill and decode share (declared once; both configs inherit them), and the
lifetime rule of Mooncake's native engines (:func:`keep_for_process_life`)."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass

from services.common.config import opt, require
from services.common.tracing import shutdown_tracing

MAX_ENGINES = 16
_kept = False  # whether this process holds a native Mooncake object (keep_for_process_life)


@dataclass
class MooncakeTransportConfig:
    kv_mooncake_engines: int = opt(4, "Mooncake Transfer Engines this process runs for KV (count, 1-16): decode "
                                      "registers its pool (or landing area) with each and offers them all; a "
                                      "prefill spreads every chunk's writes over as many as both sides have. One "
                                      "TCP engine moves its bytes on one I/O thread, so more engines move more "
                                      "bytes/s on a host with cores to spare (--kv-transport mooncake).")

    def check_mooncake(self) -> None:
        """Validation of these fields; called from the inheriting config's ``__post_init__``."""
        require(1 <= self.kv_mooncake_engines <= MAX_ENGINES, self, "kv_mooncake_engines",
                f"must be in [1, {MAX_ENGINES}], got {self.kv_mooncake_engines}")


def keep_for_process_life(native: object) -> None:
    """Never free ``native``, a Mooncake TransferEngine or MooncakeDistributedStore (which holds one): the native
    destructor joins the engine's socket handshake listener thread, and that thread can sit in accept() for good, so
    the join never returns. Freed by the garbage collector on an event loop's thread, the whole process hangs there
    (a test process once hung 25 minutes in gc_collect_main under ~TransferEngine). A serving process makes its
    engines once; they live as long as it does, and the OS reclaims them at exit (the reference taken here is never
    dropped, so interpreter shutdown does not run the destructor either)."""
    global _kept
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(native))
    _kept = True


def leave_process(code: int) -> int:
    """End a serving process that holds native Mooncake objects with ``os._exit(code)`` once its tracing, logs
    and stdio are flushed; ``code`` back where it holds none. Mooncake Store's client registers a cleanup that
    runs at process exit and unmounts the segment from the master: with the master gone (its pod deleted beside
    this one) it retries for 10 s and more, and the kubelet's SIGKILL then ends a shutdown that was clean. Skipping
    the C++ exit-time destructors is safe here: the process has already left the cluster (or found the master
    gone), and the OS reclaims the memory and sockets."""
    if not _kept:
        return code
    shutdown_tracing()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
