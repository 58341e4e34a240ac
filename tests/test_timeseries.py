"""The Agents page's time series, sampled in the scheduler (scheduler_plugin/timeseries.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from dask_agents.scheduler_plugin.timeseries import COLUMNS, TimeSeries


def _plugin():
    state = SimpleNamespace(sessions_seen=0, sessions_completed=0)
    agg = SimpleNamespace(tokens={}, engines={})
    return SimpleNamespace(state=state, aggregates=agg, admission=SimpleNamespace(held={}))


def test_samples_rates_percentiles_and_the_window():
    p = _plugin()
    ts = TimeSeries(p, interval_s=1.0, window_s=3.0, latency_window_s=10.0)
    first = ts.sample(100.0)
    assert set(first) == set(COLUMNS) and math.isnan(first["completions_per_s"])  # no previous sample
    # a second later: 5 sessions seen, 2 completed (latencies 1 s and 3 s), 300 tokens of which 100 cached
    p.state.sessions_seen, p.state.sessions_completed = 5, 2
    for created, done in ((99.0, 100.0), (98.0, 101.0)):
        ts.on_session_completed(SimpleNamespace(created=created, completed_at=done))
    p.aggregates.tokens = {("w", "m"): [3, 250, 100, 50]}
    p.aggregates.engines = {"w": {"models": {"m": {"running": 2, "waiting": 1, "kv_bytes": {"device": 4096}}}}}
    p.admission.held = {"k": object()}
    row = ts.sample(101.0)
    assert row["live_sessions"] == 3 and row["completions_per_s"] == 2.0 and row["tokens_per_s"] == 300.0
    assert row["hit_rate"] == 100 / 250 and row["latency_p50_s"] == 2.0 and row["latency_p99_s"] > 2.9  # (interpolated)
    assert (row["engine_running"], row["engine_waiting"], row["kv_device_bytes"], row["admission_waiting"]) == \
        (2, 1, 4096, 1)
    # latencies leave with the window; the series keeps window / interval + 1 samples
    for t in (102.0, 103.0, 104.0, 120.0):
        last = ts.sample(t)
    assert math.isnan(last["latency_p99_s"]) and len(ts.samples) == 4 and ts.samples[0]["time"] == 102.0


def test_a_page_gets_the_kept_window_then_each_new_sample():
    ts = TimeSeries(_plugin(), interval_s=1.0, window_s=2.0)
    for t in range(5):
        ts.sample(float(t))
    seen, rows = ts.since(0)  # a page opened late: what is kept
    assert seen == 5 and [r["time"] for r in rows] == [2.0, 3.0, 4.0]
    assert ts.since(seen) == (5, [])
    ts.sample(5.0)
    seen, rows = ts.since(seen)
    assert seen == 6 and [r["time"] for r in rows] == [5.0]
