"""KV state for agent sessions: :mod:`dask_agents.kv.runtime` (what an engine worker runs) and
:mod:`dask_agents.kv.offline` (traces, simulator, optimum, replay; never imported by a worker)."""

from dask_agents.kv.runtime.sizing import KVGeometry

__all__ = ["KVGeometry"]
