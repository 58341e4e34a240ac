"""Tool latency priors: how long a tool call of each kind takes, as a distribution.

The numbers are SAGA's published percentiles (P50/P95/P99, in ms) per tool kind:

=========  =====  =====  ======
kind        P50    P95     P99
=========  =====  =====  ======
file_io       45    320    1200
code_exec    180   2400   28000
web_api      850   4500   45000
db_query     120    890    3500
custom       100    800    3000   (our default for tools of no known kind; not from SAGA)
=========  =====  =====  ======

Distribution. Three percentiles do not pin down a distribution, and the tails are far heavier
than a log-normal through P50 and P95 would give (code_exec: P99/P95 = 11.7). We use the
simplest distribution that reproduces all three *exactly*: a piecewise log-linear inverse CDF
through the knots ``(0, floor), (0.5, P50), (0.95, P95), (0.99, P99), (1, cap)``; between two
knots ``log(latency)`` is linear in the quantile (a log-uniform piece). ``floor`` extends the
P50..P95 slope down to q=0 and ``cap`` extends the P95..P99 slope up to q=1, so the body and the
tail keep the shape the data show, and the support is bounded (``floor > 0``, ``cap`` finite:
e.g. code_exec ≈ 52 s, web_api ≈ 80 s). Real tails go further (Nalar reports calls beyond 5
minutes); a bounded cap keeps emulations finite and is the documented simplification.

Everything here is pure and exact: ``quantile`` and ``cdf`` are inverse functions of each other
(up to floating point), and ``quantile(0.95)`` returns P95 itself, which the tool-aware KV TTL
relies on. All values are in seconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Quantile levels of the knots between floor and cap.
_LEVELS = (0.0, 0.5, 0.95, 0.99, 1.0)


@dataclass(frozen=True)
class ToolLatency:
    """A tool-latency distribution through P50 < P95 < P99 (seconds); see the module docstring."""

    p50: float
    p95: float
    p99: float

    def __post_init__(self) -> None:
        if not (0 < self.p50 < self.p95 < self.p99) or not math.isfinite(self.p99):
            raise ValueError(f"need 0 < p50 < p95 < p99 (finite), got {self.p50}, {self.p95}, {self.p99}")

    @classmethod
    def from_ms(cls, p50: float, p95: float, p99: float) -> "ToolLatency":
        """From percentiles in milliseconds (as papers publish them)."""
        return cls(p50 / 1000.0, p95 / 1000.0, p99 / 1000.0)

    @property
    def floor(self) -> float:
        """Smallest latency: the P50..P95 log-slope extended down to q=0."""
        return self.p50 * (self.p50 / self.p95) ** (0.5 / 0.45)

    @property
    def cap(self) -> float:
        """Largest latency: the P95..P99 log-slope extended up to q=1."""
        return self.p99 * (self.p99 / self.p95) ** (0.01 / 0.04)

    @property
    def knots(self) -> tuple[tuple[float, float], ...]:
        """``(quantile, latency)`` points the inverse CDF goes through."""
        return tuple(zip(_LEVELS, (self.floor, self.p50, self.p95, self.p99, self.cap)))

    def quantile(self, q: float) -> float:
        """Latency (s) at quantile ``q`` in [0, 1]; exact at 0.5, 0.95 and 0.99."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q!r}")
        knots = self.knots
        for (q0, x0), (q1, x1) in zip(knots, knots[1:]):
            if q <= q1:
                if q == q1:  # exact at the knots (no round trip through log/exp)
                    return x1
                return math.exp(math.log(x0) + (q - q0) / (q1 - q0) * math.log(x1 / x0))
        return knots[-1][1]  # unreachable: q <= 1

    def cdf(self, x: float) -> float:
        """P(latency <= x) for ``x`` in seconds: 0 below ``floor``, 1 from ``cap`` on."""
        knots = self.knots
        if x <= knots[0][1]:
            return 0.0
        for (q0, x0), (q1, x1) in zip(knots, knots[1:]):
            if x <= x1:
                if x == x1:
                    return q1
                return q0 + (q1 - q0) * math.log(x / x0) / math.log(x1 / x0)
        return 1.0

    def mean(self) -> float:
        """Expected latency (s): each log-uniform piece from a to b with mass w adds w*(b-a)/ln(b/a)."""
        knots = self.knots
        return sum((q1 - q0) * (x1 - x0) / math.log(x1 / x0) for (q0, x0), (q1, x1) in zip(knots, knots[1:]))

    def sample(self, rng: random.Random) -> float:
        """One latency (s) drawn with ``rng`` (inverse-CDF sampling: deterministic for a seeded rng)."""
        return self.quantile(rng.random())


PRIORS: dict[str, ToolLatency] = {
    "file_io": ToolLatency.from_ms(45, 320, 1200),
    "code_exec": ToolLatency.from_ms(180, 2400, 28000),
    "web_api": ToolLatency.from_ms(850, 4500, 45000),
    "db_query": ToolLatency.from_ms(120, 890, 3500),
    # Not published: a default for tools of unknown kind, between file_io and db_query.
    "custom": ToolLatency.from_ms(100, 800, 3000),
}
"""Latency prior per tool kind (the kinds of ``dask_agents.hints.ToolKind``)."""


def prior(kind: str) -> ToolLatency:
    """The latency prior of tool ``kind``; ValueError naming the known kinds otherwise."""
    try:
        return PRIORS[kind]
    except KeyError:
        raise ValueError(f"unknown tool kind {kind!r} (known: {', '.join(PRIORS)})") from None


def scaled_prior(kind: str, scale: float = 1.0) -> ToolLatency:
    """The latency prior of tool ``kind`` (``custom``'s for a kind with none), its latencies
    times ``scale`` (emulated tools that sleep ``scale`` times their latency)."""
    p = PRIORS.get(kind, PRIORS["custom"])
    return p if scale == 1.0 else ToolLatency(p.p50 * scale, p.p95 * scale, p.p99 * scale)
