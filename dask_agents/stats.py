"""Summary statistics the project reports, computed one way everywhere.

Percentiles are linear interpolation between order statistics (NumPy's default ``linear``
method, which pandas' ``quantile`` uses too), so a P99 in ``da.report``, the admission stats,
``whatif`` and every benchmark means the same thing. No data gives NaN, not an error: a table
with an empty column still prints.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``xs`` by linear interpolation; NaN for no data."""
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
        raise ValueError(f"percentile q must be a number in [0, 100], got {q!r}")
    a = np.asarray(list(xs), dtype=float)
    return float(np.percentile(a, q)) if a.size else math.nan


def percentiles(xs: Iterable[float], qs: Sequence[float]) -> list[float]:
    """:func:`percentile` at each of ``qs``."""
    a = np.asarray(list(xs), dtype=float)
    return [percentile(a, q) for q in qs]


__all__ = ["percentile", "percentiles"]
