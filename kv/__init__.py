"""Engine-agnostic KV state: sizing now; residency, policies and the simulator build on it."""

from kv.sizing import KVGeometry

__all__ = ["KVGeometry"]
