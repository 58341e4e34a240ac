"""Routes for drivers' direct calls (the scheduler's half of ``dask_agents/direct.py``).

The global controller still decides where a session's calls belong (admission binds it to an
engine, placement learns which model each component calls); a driver that takes routes is told
so on its own stream (``agents-direct``), and its calls go there straight, in one RPC. It is
told, whenever it opens a session: its token (a keyed hash of its id under the scheduler's
secret: the workers run direct calls only with it), where each model's engines are and which
model each component calls; and, whenever the session's engine binding changes,
the new one (None when it is gone). Binding stays the scheduler's: a session whose first call
of a model has no route (several engines of it, no binding yet) asks for one (``agents-route``,
on the client's stream after the session's open), and the scheduler binds the session then, as
that call's arrival on the scheduler path would, and answers where (``routed``), or None: the
scheduler path.
"""

from __future__ import annotations

from typing import Any, Callable

from dask_agents.direct import DIRECT_OP
from dask_agents.scheduler_plugin import dask_compat
from dask_agents.tokens import direct_token

MAX_SESSIONS = 1_000_000
"""Sessions whose owners take routes that one scheduler remembers (each entry ~150 bytes);
past it the oldest are forgotten (their calls then take the scheduler path)."""


MAX_CLIENTS = 10_000
"""Clients whose last routes the scheduler remembers (past it the oldest are told all again)."""


class DirectRoutes:
    """Tells drivers that take routes where their sessions' calls belong."""

    def __init__(self, scheduler: Callable[[], Any], secret: Callable[[], str], models: Callable[[], dict],
                 components: Callable[[], dict]):
        self._scheduler, self._secret, self._models, self._components = scheduler, secret, models, components
        self.owners: dict[str, str] = {}  # session -> its owner, which takes routes
        # client -> what it was last told (token, engines, components): a session's open, once
        # per request on the scheduler's loop, sends only what changed since
        self._told: dict[str, tuple[str, dict, dict]] = {}
        self.sent = 0

    def opened(self, sid: str, client: str) -> None:
        """``client`` opened ``sid`` and takes routes: its token, the engines, the components."""
        self.owners[sid] = client
        while len(self.owners) > MAX_SESSIONS:
            self.owners.pop(next(iter(self.owners)))
        models = {m: sorted(ws) for m, ws in self._models().items() if ws}
        components = self._components()
        told = self._told.get(client)
        msg: dict = {"session": sid}
        if told is None:
            msg["token"] = direct_token(self._secret(), client)
        if told is None or told[1] != models:
            msg["models"] = models
        if told is None or told[2] != components:
            msg["components"] = components
        self._told[client] = (msg.get("token") or (told[0] if told else ""), models, components)
        while len(self._told) > MAX_CLIENTS:
            self._told.pop(next(iter(self._told)))
        self._send(client, msg)

    def bound(self, sid: str, what: str, worker: str | None) -> None:
        """``sid``'s binding ``what`` (``llm:<model>``) is now ``worker`` (None: none)."""
        client = self.owners.get(sid)
        if client is not None and what.startswith("llm:"):
            self._send(client, {"bound": [[sid, what[4:], worker]]})

    def routed(self, client: str, sid: Any, model: Any, worker: str | None) -> None:
        """The answer to ``client``'s route request for ``sid``'s calls of ``model``: the
        engine's worker they go to, or None (the scheduler path)."""
        if isinstance(sid, str) and isinstance(model, str):
            self._send(client, {"routed": [sid, model, worker]})

    def ended(self, sid: str) -> None:
        self.owners.pop(sid, None)

    def _send(self, client: str, msg: dict) -> None:
        s = self._scheduler()
        if s is None:
            return
        try:
            dask_compat.send_to_client(s, client, {"op": DIRECT_OP, **msg})
            self.sent += 1
        except Exception:  # the client went away: its sessions' calls take the scheduler path
            self.owners = {k: c for k, c in self.owners.items() if c != client}
            self._told.pop(client, None)
