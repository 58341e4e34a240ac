"""Engines a worker gave up on, as the scheduler sees them: placement avoids them until they are back.

A worker whose engine for a model was given up (it crashed again after ``RESTARTS_MAX``
restarts, ``dask_agents.worker_plugin.engines.Engines``) says hello again without that model, and again with
it once the engine is back (restarted or reloaded). ``set_worker_models`` then drops the worker
from the model's hosts: while another worker hosts the model, sessions bound to the dead engine
move there at their next call (``_bound_ok`` fails) and new sessions go there.

Two things it does not do, which these functions add (the plugin calls them; both O(what the
worker stopped announcing), nothing per call unless no worker hosts the model):

- when no worker hosts the model any more, ``_candidates`` falls back to every ready worker, the
  one whose engine gave up included (its calls fail there at once): :func:`exclude_dropped`
  keeps such workers out of that fallback while any other worker can take the call (and start
  the engine there);
- a session bound to that worker would keep the binding in that fallback case (``_bound_ok``
  accepts any ready worker): :func:`note_models` drops the sessions' bindings for a model the
  worker stopped announcing (their KV died with the engine), so their next call is placed anew.
"""

from __future__ import annotations

from typing import Any, Iterable
from weakref import WeakKeyDictionary

# plugin -> worker -> models it announced once and stopped announcing (kept per plugin object,
# not on the plugin: this module owns it)
_dropped: "WeakKeyDictionary[Any, dict[str, set[str]]]" = WeakKeyDictionary()


def note_models(plugin: Any, worker: str, models: Iterable[str]) -> None:
    """``worker`` is about to be registered as hosting ``models`` (a hello, a swap): remember
    the models it stopped announcing (and forget those it announces again), and drop the
    session bindings to it for the models it stopped announcing. Call it before
    ``set_worker_models`` applies ``models``."""
    models = set(models)
    info = plugin.ready_workers.get(worker) or {}
    before = set(info.get("models") or ())
    per_worker = _dropped.setdefault(plugin, {})
    for w in [w for w in per_worker if w not in plugin.ready_workers and w != worker]:
        del per_worker[w]  # workers that left: nothing to avoid any more
    mine = per_worker.setdefault(worker, set())
    mine -= models
    gone = before - models
    mine |= gone
    if not mine:
        del per_worker[worker]
    if gone:
        _unbind(plugin, worker, gone)


def _unbind(plugin: Any, worker: str, models: set[str]) -> None:
    whats = {f"llm:{m}" for m in models}
    keys_on = getattr(plugin.bindings, "keys_on", None)  # BindingMap's by-worker index
    on_worker = keys_on(worker) if keys_on is not None else [k for k, w in plugin.bindings.items() if w == worker]
    for key in [k for k in on_worker if k[1] in whats]:
        sid, what = key
        del plugin.bindings[key]
        keys = plugin.session_bindings.get(sid)
        if keys is not None and key in keys:
            keys.remove(key)
        if plugin.bound.get(worker, 0) > 0:
            plugin.bound[worker] -= 1
        plugin.state.forget_kv(sid, what[4:])  # its KV died with the engine


def exclude_dropped(plugin: Any, model: str | None, pool: Iterable[str]) -> list[str]:
    """``pool``, the candidate workers for a call of ``model``, without the workers that stopped
    announcing ``model`` (their engine for it gave up), unless that leaves none. Only the
    fallback needs it: when some worker hosts ``model``, the pool is its hosts already."""
    pool = list(pool)
    if model is None or plugin.model_workers.get(model):
        return pool
    per_worker = _dropped.get(plugin)
    if not per_worker:
        return pool
    keep = [w for w in pool if model not in per_worker.get(w, ())]
    return keep or pool
