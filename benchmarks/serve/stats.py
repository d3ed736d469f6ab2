"""Percentiles, latency summaries and goodput of one measured run.

Percentiles use linear interpolation between closest ranks (numpy's default ``linear`` method, the
one vLLM's and SGLang's serving benchmarks report): for ``n`` sorted values and quantile ``q`` in
[0, 1], rank ``h = (n - 1) * q`` and the value is ``x[floor h] + (h - floor h) * (x[floor h + 1] -
x[floor h])``. So p50 of [1, 2, 3, 4] is 2.5 and p90 of 1..11 is exactly 10.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

QUANTILES = (0.5, 0.9, 0.99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation; NaN when empty."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    h = (len(xs) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


@dataclass(frozen=True)
class Dist:
    """Summary of one latency (seconds) over the requests of a run."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Dist:
        xs = sorted(values)
        if not xs:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(len(xs), sum(xs) / len(xs), percentile(xs, 0.5), percentile(xs, 0.9),
                   percentile(xs, 0.99), xs[0], xs[-1])

    def as_dict(self) -> dict[str, float]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class SLO:
    """Service-level objectives a request must meet to count towards goodput (seconds; 0: no bound)."""

    ttft_s: float = 0.0
    tpot_s: float = 0.0
    e2e_s: float = 0.0

    def met(self, ttft: float | None, tpot: float | None, e2e: float) -> bool:
        """A completed request's latencies against every bound that is set (TPOT of a one-token
        output is not defined and never fails the TPOT bound)."""
        if self.ttft_s > 0 and (ttft is None or ttft > self.ttft_s):
            return False
        if self.tpot_s > 0 and tpot is not None and tpot > self.tpot_s:
            return False
        return not (self.e2e_s > 0 and e2e > self.e2e_s)

    def describe(self) -> str:
        parts = [f"{name} <= {v * 1000:g} ms" for name, v in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s),
                                                             ("e2e", self.e2e_s)) if v > 0]
        return " and ".join(parts) or "none (every completed request counts)"
