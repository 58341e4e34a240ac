"""Engines a worker gave up on, as the scheduler sees them: placement avoids them until they are back.

A worker whose engine for a model was given up (it crashed again after ``RESTARTS_MAX``
restarts, ``dask_agents.worker_plugin.engines.Engines``) says hello again without that model, and again with
it once the engine is back (restarted or reloaded). ``set_worker_models`` then drops the worker
from the model's hosts: while another worker hosts the model, sessions bound to the dead engine
move there at their next call (``Placement.bound_ok`` fails) and new sessions go there.

Two things it does not do, which these functions add (placement and the plugin call them; both O(what the
worker stopped announcing), nothing per call unless no worker hosts the model):

- when no worker hosts the model any more, ``Placement.candidates`` falls back to every ready worker, the
  one whose engine gave up included (its calls fail there at once): :func:`exclude_dropped`
  keeps such workers out of that fallback while any other worker can take the call (and start
  the engine there);
- a session bound to that worker would keep the binding in that fallback case (``bound_ok``
  accepts any ready worker): :func:`note_models` drops the sessions' bindings for a model the
  worker stopped announcing (their KV died with the engine), so their next call is placed anew.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable
from weakref import WeakKeyDictionary

if TYPE_CHECKING:
    from dask_agents.scheduler_plugin.placement import Placement

# placement -> worker -> models it announced once and stopped announcing (kept per placement
# object, not on it: this module owns it)
_dropped: "WeakKeyDictionary[Placement, dict[str, set[str]]]" = WeakKeyDictionary()


def note_models(placement: "Placement", worker: str, models: Iterable[str]) -> None:
    """``worker`` is about to be registered as hosting ``models`` (a hello, a swap): remember
    the models it stopped announcing (and forget those it announces again), and drop the
    session bindings to it for the models it stopped announcing. Call it before
    ``set_worker_models`` applies ``models``."""
    models = set(models)
    info = placement.roster.ready.get(worker) or {}
    before = set(info.get("models") or ())
    per_worker = _dropped.setdefault(placement, {})
    for w in [w for w in per_worker if w not in placement.roster.ready and w != worker]:
        del per_worker[w]  # workers that left: nothing to avoid any more
    mine = per_worker.setdefault(worker, set())
    mine -= models
    gone = before - models
    mine |= gone
    if not mine:
        del per_worker[worker]
    if gone:
        _unbind(placement, worker, gone)


def _unbind(placement: "Placement", worker: str, models: set[str]) -> None:
    whats = {f"llm:{m}" for m in models}
    for key in [k for k in placement.bindings.keys_on(worker) if k[1] in whats]:
        sid, what = key
        del placement.bindings[key]
        placement.told(sid, what, None)
        keys = placement.session_bindings.get(sid)
        if keys is not None and key in keys:
            keys.remove(key)
        if placement.bound.get(worker, 0) > 0:
            placement.bound[worker] -= 1
        placement.state.forget_kv(sid, what[4:])  # its KV died with the engine


def exclude_dropped(placement: "Placement", model: str | None, pool: Iterable[str]) -> list[str]:
    """``pool``, the candidate workers for a call of ``model``, without the workers that stopped
    announcing ``model`` (their engine for it gave up), unless that leaves none. Only the
    fallback needs it: when some worker hosts ``model``, the pool is its hosts already."""
    pool = list(pool)
    if model is None or placement.roster.hosts.get(model):
        return pool
    per_worker = _dropped.get(placement)
    if not per_worker:
        return pool
    keep = [w for w in pool if model not in per_worker.get(w, ())]
    return keep or pool
