"""Sessions: one user request's calls, grouped.

``with da.session(client) as s:`` makes every stub and LLM call inside the block carry ``s.id``
(a context variable); plain Dask work there (``client.submit``, collections) is left alone.
The session is owned by ``client``: if it disconnects, the session waits
``agents.scheduler.session-grace`` for it to reconnect. Leaving the block tells the scheduler
the driver is done (with an exception: the session's open calls are given up); the session
completes once its last call finishes, and its stateful instances are released
``agents.scheduler.instance-linger`` later.
"""

from __future__ import annotations

import uuid
from contextlib import ExitStack
from typing import Any

from distributed import Client

from dask_agents import context
from dask_agents.annotation import SESSION_LABEL as _LABEL
from dask_agents.errors import short_repr




def _check_label(what: str, value: Any) -> None:
    """Session names and tenants travel to the scheduler, its telemetry and its dashboard:
    short labels of letters, digits and ``_ . : + @ -`` (no spaces, quotes or markup)."""
    if value is None:
        return
    if not isinstance(value, str) or not _LABEL.fullmatch(value):
        raise ValueError(
            f"da.session({what}=...) must be a string of 1-128 letters, digits and _ . : + @ - "
            f"(not starting with a symbol), got {short_repr(value)}"
        )


class Session:
    """A session bound to a client: ``with`` (or ``async with`` for asynchronous clients)."""

    def __init__(self, client: Client | None = None, *, name: str | None = None, tenant: str | None = None):
        if client is None:
            from distributed import get_client

            client = get_client()
        if not isinstance(client, Client):
            raise TypeError(f"da.session() needs a distributed.Client, got {type(client).__name__}")
        _check_label("name", name)
        _check_label("tenant", tenant)
        self.client = client
        self.id = f"{name or 'session'}-{uuid.uuid4().hex[:16]}"
        self.tenant = tenant
        self._stack: ExitStack | None = None
        self._token: Any = None
        self.ended = False  # the driver told the scheduler it made its last call (:meth:`end`)

    def _activate(self) -> None:
        if self._stack is not None:
            raise RuntimeError(f"session {self.id} is already active")
        self._stack = ExitStack()
        # Only stub and LLM calls carry the session (calls.submit_call reads this context):
        # plain Dask work inside the block is not annotated and runs as Dask would run it.
        self._token = context.current_session.set(
            context.SessionContext(self.id, self.tenant, self.client)
        )

    def __enter__(self) -> "Session":
        self._activate()
        opened = self._open()
        if opened is not None:  # asynchronous client used with a plain `with`
            import asyncio

            asyncio.ensure_future(opened)
        return self

    def _open(self) -> Any:
        from dask_agents import client_api

        return client_api.open_session(self.client, self.id, self.tenant)

    def __exit__(self, *exc: Any) -> None:
        self._leave()
        ended = self.end(cancel=exc[0] is not None)
        if ended is not None:  # asynchronous client: do not leave the coroutine unawaited
            import asyncio

            asyncio.ensure_future(ended)

    async def __aenter__(self) -> "Session":
        self._activate()
        opened = self._open()
        if opened is not None:
            await opened
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._leave()
        ended = self.end(cancel=exc[0] is not None)
        if ended is not None:
            await ended

    def _leave(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        context.current_session.reset(self._token)

    def end(self, cancel: bool = False) -> Any:
        """Tell the scheduler that the driver made its last call in this session.

        ``cancel=True`` (what leaving the block with an exception does): the driver gave up on
        the session, so its open calls can no longer matter; the ones not started fail with
        :class:`~dask_agents.errors.SessionClosedError`, the running ones are cancelled.
        Returns a coroutine with an asynchronous client."""
        from dask_agents import client_api, direct

        self.ended = True
        if cancel:  # its calls still running straight on their workers: dropped here too
            direct.cancel_session(self.client, self.id)
        made = direct.session_ended(self.client, self.id)
        return client_api.end_session(self.client, self.id, cancel=cancel, direct=made)

    def graph(self):
        """This session's call graph as the scheduler sees it (:class:`SessionGraph`)."""
        from dask_agents import client_api

        return client_api.session_graph(self.client, self)

    def __repr__(self) -> str:
        return f"<Session {self.id}>"


def session(client: Client | None = None, *, name: str | None = None, tenant: str | None = None) -> Session:
    """Start a session on ``client`` (default: the current client). ``name`` prefixes the id."""
    return Session(client, name=name, tenant=tenant)
