"""The decode reservation lease, one setting for the router (which asks for it) and decode (which grants it)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt


@dataclass
class LeaseConfig:
    """How long a decode reservation waits for its KV before its blocks are freed."""

    lease_ms: int = opt(30_000, "Decode reservation lease (ms): how long reserved KV blocks wait for their KV "
                                "before they are freed. The router asks each Reserve for this lease (never past "
                                "the request's deadline) and renews it every lease/3 while the prefill runs, so "
                                "it lapses this long after a router disappears; decode grants it to a Reserve "
                                "that asks for none and caps every ask at --max-lease-ms. Give both the same "
                                "value (pdserve up does).")
