"""The Agents page's time series: one sample of the cluster's state every
``agents.dashboard.timeseries-interval``, the last ``agents.dashboard.timeseries-window`` kept
in the scheduler (whether or not a page is open), so a page opened late shows the last minutes.

Each sample is O(engines + sessions completed since the last one): counters the plugin keeps
already (sessions seen and completed, LLM tokens per worker, the engines' latest reports,
admission's held calls), differenced against the previous sample for the rates.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from dask_agents.stats import percentile
from dask_agents.scheduler_plugin.metrics import engine_records

if TYPE_CHECKING:
    from dask_agents.scheduler_plugin.plugin import AgentsSchedulerPlugin

COLUMNS = ("time", "live_sessions", "completions_per_s", "latency_p50_s", "latency_p95_s", "latency_p99_s",
           "tokens_per_s", "engine_running", "engine_waiting", "kv_device_bytes", "kv_referenced_blocks",
           "kv_retained_blocks", "kv_evictable_blocks", "kv_host_bytes", "hit_rate", "admission_waiting",
           "control_pass_p50_ms", "control_pass_max_ms")
"""The columns of a sample (``time``: POSIX seconds; latencies over the sessions completed in
the last ``latency-window``; ``hit_rate``: cached / prompt tokens of the LLM calls since the
previous sample, NaN without any; the KV columns: summed over the engines' latest reports,
device blocks referenced (running requests and retained sessions), retained by KV directives,
and cached but unreferenced (evictable), and bytes in host memory; ``control_pass_*_ms``: the control loop's passes since the previous
sample, median and longest, NaN without any)."""


class TimeSeries:
    """Samples of one plugin (see the module docstring)."""

    def __init__(self, plugin: "AgentsSchedulerPlugin", interval_s: float, window_s: float, latency_window_s: float = 30.0):
        self.plugin = plugin
        self.interval_s = interval_s
        self.samples: deque[dict] = deque(maxlen=max(2, int(window_s / interval_s) + 1))
        self.latency_window_s = latency_window_s
        self._latencies: deque[tuple[float, float]] = deque()  # (completed at, latency), latest window
        self._last: tuple[float, int, int, int, int] | None = None  # time, completed, prompt, cached, output
        self._passes = 0  # control-loop passes seen so far
        self.taken = 0

    def on_session_completed(self, session: Any) -> None:
        """Note a completed session's latency (called by the plugin as it completes)."""
        if session.completed_at is not None:
            self._latencies.append((session.completed_at, max(session.completed_at - session.created, 0.0)))

    def sample(self, now: float | None = None) -> dict:
        """Take one sample (the periodic callback); returns it."""
        now = time.time() if now is None else now
        plugin = self.plugin
        state, agg = plugin.state, plugin.aggregates
        completed = state.sessions_completed
        prompt = cached = output = 0
        for _, p, c, o in agg.tokens.values():
            prompt, cached, output = prompt + p, cached + c, output + o
        running = waiting = kv = host = referenced = retained = evictable = 0
        for _, _, st in engine_records(agg):
            running += st.get("running") or 0
            waiting += st.get("waiting") or 0
            kv += (st.get("kv_bytes") or {}).get("device") or 0
            host += (st.get("kv_bytes") or {}).get("host") or 0
            blocks = st.get("kv_blocks") or {}
            referenced += blocks.get("pinned") or 0
            retained += blocks.get("retained") or 0
            evictable += blocks.get("cached") or 0
        while self._latencies and self._latencies[0][0] < now - self.latency_window_s:
            self._latencies.popleft()
        lat = sorted(x for _, x in self._latencies)
        nan = float("nan")
        row = {"time": now, "live_sessions": max(state.sessions_seen - completed, 0),
               "completions_per_s": nan, "tokens_per_s": nan, "hit_rate": nan,
               "latency_p50_s": percentile(lat, 50) if lat else nan,
               "latency_p95_s": percentile(lat, 95) if lat else nan,
               "latency_p99_s": percentile(lat, 99) if lat else nan,
               "engine_running": running, "engine_waiting": waiting, "kv_device_bytes": kv,
               "kv_referenced_blocks": referenced, "kv_retained_blocks": retained, "kv_evictable_blocks": evictable,
               "kv_host_bytes": host,
               "admission_waiting": len(getattr(getattr(plugin, "admission", None), "held", ()) or ())}
        if self._last is not None:
            t0, c0, p0, k0, o0 = self._last
            dt = now - t0
            if dt > 0:
                row["completions_per_s"] = (completed - c0) / dt
                row["tokens_per_s"] = (prompt - p0 + output - o0) / dt
            if prompt > p0:
                row["hit_rate"] = (cached - k0) / (prompt - p0)
        self._last = (now, completed, prompt, cached, output)
        control = getattr(plugin, "control", None)
        row["control_pass_p50_ms"] = row["control_pass_max_ms"] = nan
        if control is not None:
            window = control.tick_seconds
            new = min(control.ticks - self._passes, len(window))
            self._passes = control.ticks
            if new > 0:
                passes = [1000 * dt for dt in list(window)[-new:]]
                row["control_pass_p50_ms"], row["control_pass_max_ms"] = percentile(passes, 50), max(passes)
        self.samples.append(row)
        self.taken += 1
        return row

    def since(self, taken: int) -> tuple[int, list[dict]]:
        """Samples taken after the first ``taken`` (all kept ones for a new page), and the new count."""
        new = min(self.taken - taken, len(self.samples))
        return self.taken, (list(self.samples)[-new:] if new > 0 else [])
