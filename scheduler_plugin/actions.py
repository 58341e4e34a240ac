"""What policies may suggest (Nalar's primitives). Policies only return these; the
enforcement layer (``enforce.py``) validates each one and applies it through Dask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True, slots=True)
class SetPriority:
    """Give a waiting call a new priority (smaller runs first; compared as Dask tuples)."""

    key: str
    priority: tuple
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move a queued (not yet started) call from ``source`` to ``target``."""

    key: str
    source: str
    target: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Route:
    """Send new calls of ``component`` only to ``workers`` (empty: anywhere)."""

    component: str
    workers: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Reassign:
    """Move one engine worker from serving ``source`` to serving ``target`` (drain, then swap)."""

    worker: str
    source: str
    target: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Provision:
    """Ask the cluster manager for ``n`` more workers (for ``component``: a model name for engine
    workers, which then load that model)."""

    n: int = 1
    component: str | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Kill:
    """Retire ``worker`` (its queued work is rescheduled by Dask)."""

    worker: str
    reason: str = ""


Action = Union[SetPriority, Migrate, Route, Reassign, Provision, Kill]
"""Any action a policy may return."""


def kind(action: Action) -> str:
    """The action's kind as used in telemetry and event topics (``migrate``, ``set_priority``...)."""
    return {SetPriority: "set_priority", Migrate: "migrate", Route: "route", Reassign: "reassign",
            Provision: "provision", Kill: "kill"}[type(action)]
