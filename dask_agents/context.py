"""Per-thread / per-task context: the current session and the call that is running.

On the driver, :func:`dask_agents.session` sets the session. Inside a running component the
runtime sets both, so calls made there inherit the session and record their creator.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Client

from dask_agents.models import DRIVER


@dataclass
class SessionContext:
    """The active session: its id, tenant and (on the driver) the client it is bound to."""

    id: str
    tenant: str | None = None
    client: "Client | None" = None
    # the id of the scheduler the session's first call here went to (None before it): its
    # calls carry it, so that a restarted scheduler knows the session's instances are gone
    opened_on: str | None = None


current_session: ContextVar[SessionContext | None] = ContextVar("dask_agents_session", default=None)
current_call: ContextVar[str | None] = ContextVar("dask_agents_call", default=None)
current_depth: ContextVar[int] = ContextVar("dask_agents_depth", default=0)  # calls nested here (0: driver)


def session_id() -> str | None:
    """The id of the session in effect here, or None."""
    s = current_session.get()
    return s.id if s is not None else None


def creator() -> str:
    """The key of the running call, or ``"driver"`` outside any component."""
    return current_call.get() or DRIVER


def call_id() -> str | None:
    """The key of the call running here (inside a component), or None on the driver."""
    return current_call.get()
