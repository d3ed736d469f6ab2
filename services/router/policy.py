"""Instance selection: round-robin, least-loaded, prefix-aware (block-hash overlap weighed against load).

Every policy picks among :meth:`InstancePool.candidates`: healthy instances with room first, full or
suspect ones only when nothing else is alive. Ties go round-robin, so equal instances share work.
"""

from __future__ import annotations

from services.router.instances import Instance, InstancePool

POLICIES = ("round_robin", "least_loaded", "prefix_aware")

DEFAULT_PREFIX_CREDIT = 2.0
"""Load units (requests) a match of the whole prompt is worth under prefix_aware."""


class NoInstanceError(RuntimeError):
    pass


def prefix_score(inst: Instance, hashes: list[bytes], prefix_credit: float) -> float:
    """``prefix_credit * matched_fraction - load``. The matched fraction (leading blocks this router
    already sent there / the prompt's blocks) caps the preference: a cached prefix is worth at most
    ``prefix_credit`` queued requests, so a system prompt every request shares attracts work only
    until that instance has ``prefix_credit`` more in flight than another, which then learns the
    prefix too."""
    matched = inst.prefix_match(hashes) / len(hashes) if hashes else 0.0
    return prefix_credit * matched - inst.load_score()


def choose(pool: InstancePool, policy: str, hashes: list[bytes], exclude: set[str] = frozenset(), *,
           prefix_credit: float = DEFAULT_PREFIX_CREDIT) -> Instance:
    """Pick an instance for new work; raises NoInstanceError naming the known ones when none is alive."""
    cands = pool.candidates(exclude)
    if not cands:
        known = ", ".join(f"{a} ({i.state.value}: {i.why})" + (" (already tried)" if a in exclude else "")
                          for a, i in pool.instances.items()) or "none"
        raise NoInstanceError(f"no {pool.role} instance left to try (known: {known})")
    k = pool.next_rr() % len(cands)
    rotated = cands[k:] + cands[:k]  # max()/min() keep the first of equals: ties rotate
    if policy == "round_robin":
        return rotated[0]
    if policy == "least_loaded":
        return min(rotated, key=lambda i: i.load_score())
    if policy == "prefix_aware":
        return max(rotated, key=lambda i: prefix_score(i, hashes, prefix_credit))
    raise ValueError(f"unknown routing policy {policy!r}; known: {POLICIES}")
