"""The Mooncake KV-transport settings prefill and decode share (declared once; both configs inherit them)."""

from __future__ import annotations

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
