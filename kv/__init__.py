"""KV state for agent sessions: :mod:`kv.runtime` (what an engine worker runs) and
:mod:`kv.offline` (traces, simulator, optimum, replay; never imported by a worker)."""

from kv.runtime.sizing import KVGeometry

__all__ = ["KVGeometry"]
