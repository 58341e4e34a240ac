"""What policies may suggest (Nalar's primitives). Policies only return these; the
enforcement layer (``enforce.py``) validates each one and applies it through Dask.

Each action checks its own fields when it is built: a malformed one (a priority that is not a
tuple of finite numbers, an empty worker address, ``n < 1``...) raises :class:`ActionError`
naming the action and the field, inside the policy that built it, so it never reaches the
scheduler's queues."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Union

from dask_agents.errors import short_repr


class ActionError(ValueError):
    """A control action with a malformed field; the message names the action and the field."""


def _fail(action: Any, field: str, what: str, value: Any) -> ActionError:
    """An :class:`ActionError` naming the action's class, the field and the (shortened) value."""
    return ActionError(f"{type(action).__name__}.{field}: {what}, got {short_repr(value)}")


def _text(action: Any, field: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        raise _fail(action, field, "must be a non-empty string", value)


def _key(action: Any, value: Any) -> None:
    # Dask keys are strings or tuples (our calls' keys are strings)
    if not ((isinstance(value, str) and value) or (isinstance(value, tuple) and value)):
        raise _fail(action, "key", "must be a Dask key (a non-empty string or tuple)", value)


def _reason(action: Any, value: Any) -> None:
    if not isinstance(value, str):
        raise _fail(action, "reason", "must be a string", value)


def _as_tuple(action: Any, field: str, value: Any) -> tuple:
    if isinstance(value, list):
        value = tuple(value)
        object.__setattr__(action, field, value)  # frozen: normalise once, at construction
    if not isinstance(value, tuple):
        raise _fail(action, field, "must be a tuple", value)
    return value


def _finite_number(p: Any) -> bool:
    """A finite real number, not a bool (plain ints and floats checked first: a policy
    suggests thousands of priorities per pass, and ``isinstance(p, Real)`` is an ABC check)."""
    t = type(p)
    if t is float:
        return math.isfinite(p)
    if t is int:
        return True
    return isinstance(p, Real) and not isinstance(p, bool) and math.isfinite(p)


@dataclass(frozen=True, slots=True)
class SetPriority:
    """Give a waiting call a new priority (smaller runs first; compared as Dask tuples)."""

    key: str
    priority: tuple
    reason: str = ""

    def __post_init__(self) -> None:
        _key(self, self.key)
        prio = _as_tuple(self, "priority", self.priority)
        # Dask heaps compare priorities with every other task's: only finite numbers keep them ordered
        if not prio or not all(_finite_number(p) for p in prio):
            raise _fail(self, "priority", "must be a non-empty tuple of finite numbers", self.priority)
        _reason(self, self.reason)


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move a queued (not yet started) call from ``source`` to ``target``."""

    key: str
    source: str
    target: str
    reason: str = ""

    def __post_init__(self) -> None:
        _key(self, self.key)
        _text(self, "source", self.source)
        _text(self, "target", self.target)
        _reason(self, self.reason)


@dataclass(frozen=True, slots=True)
class Route:
    """Send new calls of ``component`` only to ``workers`` (empty: anywhere)."""

    component: str
    workers: tuple[str, ...]
    reason: str = ""

    def __post_init__(self) -> None:
        _text(self, "component", self.component)
        workers = _as_tuple(self, "workers", self.workers)
        if not all(isinstance(w, str) and w for w in workers):
            raise _fail(self, "workers", "must be worker addresses (non-empty strings)", self.workers)
        _reason(self, self.reason)


@dataclass(frozen=True, slots=True)
class Reassign:
    """Move one engine worker from serving ``source`` to serving ``target`` (drain, then swap)."""

    worker: str
    source: str
    target: str
    reason: str = ""

    def __post_init__(self) -> None:
        _text(self, "worker", self.worker)
        _text(self, "source", self.source)
        _text(self, "target", self.target)
        _reason(self, self.reason)


@dataclass(frozen=True, slots=True)
class Provision:
    """Ask the cluster manager for ``n`` more workers (for ``component``: a model name for engine
    workers, which then load that model)."""

    n: int = 1
    component: str | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, Integral) or self.n < 1:
            raise _fail(self, "n", "must be an int >= 1", self.n)
        _text(self, "component", self.component, optional=True)
        _reason(self, self.reason)


@dataclass(frozen=True, slots=True)
class Kill:
    """Retire ``worker`` (its queued work is rescheduled by Dask)."""

    worker: str
    reason: str = ""

    def __post_init__(self) -> None:
        _text(self, "worker", self.worker)
        _reason(self, self.reason)


Action = Union[SetPriority, Migrate, Route, Reassign, Provision, Kill]
"""Any action a policy may return."""

KINDS: dict[type, str] = {SetPriority: "set_priority", Migrate: "migrate", Route: "route", Reassign: "reassign",
                          Provision: "provision", Kill: "kill"}


def kind(action: Action) -> str:
    """The action's kind as used in telemetry and event topics (``migrate``, ``set_priority``...).

    Raises :class:`ActionError` for anything that is not an action."""
    try:
        return KINDS[type(action)]
    except (KeyError, TypeError):
        raise ActionError(
            f"not a control action: {type(action).__name__} (policies return {', '.join(t.__name__ for t in KINDS)})"
        ) from None
