"""One way to compute percentiles across the project (dask_agents.stats)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dask_agents.stats import percentile, percentiles


def test_percentile_interpolates_as_pandas_and_numpy_do():
    xs = [4.0, 1.0, 3.0, 2.0, 10.0]
    for q in (0, 25, 50, 90, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(pd.Series(xs).quantile(q / 100))
    assert percentile(xs, 50) == 3.0 and percentile(iter(xs), 100) == 10.0
    assert percentiles(xs, [0, 50, 100]) == [1.0, 3.0, 10.0]


def test_percentile_of_nothing_is_nan_and_q_is_checked():
    assert math.isnan(percentile([], 99)) and all(map(math.isnan, percentiles([], [50, 99])))
    for q in (-1, 101, "50", True, float("nan")):
        with pytest.raises(ValueError, match="percentile q must be a number in"):
            percentile([1.0], q)
