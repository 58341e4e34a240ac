"""Offline KV tools, never imported by a worker: traces (generated, telemetry, Mooncake), the
trace simulator, the offline optimum and its bound, and ``dask-agents replay``. They build on
:mod:`dask_agents.kv.runtime` (its policies and cost model) and nothing there builds on them."""
