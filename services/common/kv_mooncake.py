"""The Mooncake KV-transport settings prefill and decode share (declared once; both configs inherit them), and the
lifetime rule of Mooncake's native engines (:func:`keep_for_process_life`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from services.common.config import opt, require

MAX_ENGINES = 16


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
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(native))
