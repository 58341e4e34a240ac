"""The read-only view policies decide from, built once per control tick.

Everything is a frozen dataclass or a tuple/mapping the policy must not mutate; policies are
small pure functions of a view, so they test without a cluster (build a view by hand).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, Mapping

import immutables


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker: capacity, load, and the calls waiting in its ready queue (not started)."""

    address: str
    nthreads: int
    processing: int  # assigned and not finished (queued on the worker + running)
    running: int  # executing or seceded (long-running)
    queued: tuple[str, ...]  # keys of agents calls waiting on this worker, best priority first
    models: tuple[str, ...] = ()
    idle_since: float | None = None  # when it last became idle (no processing), None if busy
    agents_ready: bool = True  # its worker plugin announced itself (safe to message)

    @property
    def queue_length(self) -> int:
        """Tasks waiting beyond what its threads run at once."""
        return max(self.processing - self.nthreads, 0)


@dataclass(frozen=True, slots=True)
class CallView:
    """One waiting call."""

    key: str
    component: str
    kind: str
    session: str | None
    tenant: str | None
    worker: str | None  # assigned worker (None: held on the scheduler)
    priority: tuple
    created: float
    ready: float | None
    stateful: bool = False
    model: str | None = None
    restricted: bool = False  # has worker/resource restrictions set by someone else
    input_bytes: int = 0  # bytes of its dependencies' results (what a migration moves)
    batch_max: int | None = None  # batching hint: calls of its component coalesce up to this


@dataclass(frozen=True, slots=True)
class SessionView:
    """One live session."""

    id: str
    tenant: str | None
    created: float
    progress: int  # completed calls
    open_calls: int
    state: str
    workflow: str | None = None  # its root component (the workflow it runs)


@dataclass(frozen=True, slots=True)
class ComponentView:
    """Per-component statistics (flattened workflow graph). Counters are cumulative.

    A component whose hints bound its replicas (``max_replicas``) has the workers the control
    plane routed it to as ``replicas`` (empty: not routed yet, it runs anywhere) and its
    ``model=`` hint as ``model``."""

    name: str
    mean_duration: float | None
    calls: int  # created so far
    visits_per_session: float
    open: int = 0  # created and not finished
    completed: int = 0  # finished successfully so far
    replicas: tuple[str, ...] = ()
    min_replicas: int = 1
    max_replicas: int | None = None  # None: unbounded (every worker is its replica)
    model: str | None = None  # its ``model=`` hint (a bounded component's, else not recorded)


@dataclass(frozen=True, slots=True)
class ModelView:
    """An LLM model and the engine workers serving it (draining workers excluded)."""

    name: str
    component: str  # its calls' component name (llm.<model>)
    replicas: tuple[str, ...]
    min_replicas: int = 1
    max_replicas: int | None = None


@dataclass(frozen=True)
class ClusterView:
    """Everything a policy sees at one tick."""

    now: float
    workers: Mapping[str, WorkerView]
    calls: Mapping[str, CallView]  # waiting calls only
    sessions: Mapping[str, SessionView]
    components: Mapping[str, ComponentView]
    kv_affinity: Mapping[tuple[str, str], str] = field(default_factory=dict)  # (session, model) -> worker
    truncated: bool = False  # the call set was cut to the per-tick bound
    models: Mapping[str, ModelView] = field(default_factory=dict)
    draining: frozenset = frozenset()  # workers being moved between models
    # (session, model) -> context tokens of the session's KV on its kv_affinity worker: what a
    # move to another engine recomputes
    kv_tokens: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # workflow (root component) -> the median time its completed sessions took (those with
    # enough history): a session's own fair completion time
    expected_times: Mapping[str, float] = field(default_factory=dict)

    @staticmethod
    def freeze(now: float, workers: dict, calls: dict, sessions: dict, components: dict,
               kv_affinity: dict | None = None, truncated: bool = False, models: dict | None = None,
               draining: set | frozenset = frozenset(), kv_tokens: dict | None = None,
               expected_times: dict | None = None) -> "ClusterView":
        """Wrap plain dicts read-only; immutable maps (``immutables.Map``) are taken as they are
        (no copy: nothing can change them)."""
        return ClusterView(
            now=now, workers=MappingProxyType(workers), calls=MappingProxyType(calls),
            sessions=_read_only(sessions), components=MappingProxyType(components),
            kv_affinity=_read_only(kv_affinity or {}, copy=True), truncated=truncated,
            models=MappingProxyType(dict(models or {})), draining=frozenset(draining),
            kv_tokens=_read_only(kv_tokens or {}, copy=True),
            expected_times=MappingProxyType(dict(expected_times or {})),
        )

    def duration(self, component: str, default: float = 0.5) -> float:
        """Mean duration of a component's calls (``default`` before any was measured)."""
        c = self.components.get(component)
        return c.mean_duration if c is not None and c.mean_duration is not None else default


def _read_only(mapping: Mapping, copy: bool = False) -> Mapping:
    """``mapping`` as the view keeps it: an immutable map as it is, a dict behind a read-only
    proxy (a copy first with ``copy``: the caller keeps mutating it)."""
    if isinstance(mapping, immutables.Map):
        return mapping
    return MappingProxyType(dict(mapping) if copy else mapping)


def fast_constructor(cls: type) -> Callable[..., Any]:
    """A constructor for the frozen, slotted dataclass ``cls`` taking every field's value,
    positionally in field order (no defaults, no keywords), and giving an object equal to
    ``cls(...)`` of the same values.

    The dataclass' own ``__init__`` sets each field through ``object.__setattr__`` (to get
    past ``frozen``): 1.5-2.2 us for six fields, and the view index builds one per touched
    session and per changed call every pass (thousands at 2^18 live futures). This one sets
    the slots through their descriptors (about 1 us)."""
    if "__slots__" not in vars(cls) or any(f.default_factory is not MISSING for f in fields(cls)):
        raise TypeError(f"fast_constructor needs a slotted dataclass without default_factory fields, "
                        f"got {cls.__name__}")
    setters = tuple(getattr(cls, f.name).__set__ for f in fields(cls))
    n = len(setters)
    new = object.__new__

    def make(*values: Any) -> Any:
        if len(values) != n:
            raise TypeError(f"{cls.__name__} needs its {n} fields in order, got {len(values)} values")
        o = new(cls)
        for setter, value in zip(setters, values):
            setter(o, value)
        return o

    make.__doc__ = f"Build a {cls.__name__} from its fields' values in order (see :func:`fast_constructor`)."
    return make


make_worker_view = fast_constructor(WorkerView)
make_call_view = fast_constructor(CallView)
make_session_view = fast_constructor(SessionView)
