"""Instance selection: round-robin, least-loaded, prefix-aware (block-hash overlap)."""

from __future__ import annotations

from services.router.instances import Instance, InstancePool

POLICIES = ("round_robin", "least_loaded", "prefix_aware")


class NoInstanceError(RuntimeError):
    pass


def choose(pool: InstancePool, policy: str, hashes: list[bytes], exclude: set[str] = frozenset()) -> Instance:
    """Pick a healthy instance. prefix_aware prefers the longest run of leading block hashes this router
    already sent there (the instance most likely to hold the prefix), then the least loaded."""
    cands = pool.healthy(exclude)
    if not cands:
        known = ", ".join(f"{a}{'' if i.healthy else ' (unhealthy)'}" for a, i in pool.instances.items()) or "none"
        raise NoInstanceError(f"no healthy {pool.role} instance (known: {known})")
    if policy == "round_robin":
        return cands[pool.next_rr() % len(cands)]
    if policy == "least_loaded":
        return min(cands, key=lambda i: (i.load_score(), i.address))
    if policy == "prefix_aware":
        return max(cands, key=lambda i: (i.prefix_match(hashes), -i.load_score(), i.address))
    raise ValueError(f"unknown routing policy {policy!r}; known: {POLICIES}")
