"""Client-side queries of the scheduler plugin: session graphs, telemetry, models."""

from __future__ import annotations

from typing import Any, Callable

from distributed import Client

from dask_agents.errors import NotInstalledError
from dask_agents.models import SessionGraph, WorkflowGraph


_NOT_INSTALLED = (
    "the scheduler has no dask-agents plugin: call da.install(client), "
    "or start the scheduler with --preload dask_agents.preload"
)
# Clients whose scheduler was seen with the plugin. Checked once per client because a
# scheduler without our handlers does not answer an unknown RPC at all (it only logs), so
# calling one blindly would hang.
_verified: set[tuple[str, str]] = set()


def _ident(client: Client) -> tuple[str, str]:
    return (client.id, str(client.scheduler.address))


def _call(client: Client, op: str, then: Callable[[Any], Any] = lambda x: x, **kwargs: Any) -> Any:
    """Call scheduler handler ``op``; returns ``then(reply)``, or a coroutine for async clients.

    Raises NotInstalledError (instead of hanging) when the scheduler lacks the plugin."""
    from dask_agents.install import _has_plugin

    async def go() -> Any:
        if _ident(client) not in _verified:
            if not await client.run_on_scheduler(_has_plugin):
                raise NotInstalledError(_NOT_INSTALLED)
            _verified.add(_ident(client))
        return then(await getattr(client.scheduler, op)(**kwargs))

    if client.asynchronous:
        return go()
    return client.sync(go)


def end_session(client: Client, session: str) -> Any:
    """Tell the scheduler the driver is done with ``session`` (no-op when not installed).

    With an asynchronous client this returns a coroutine."""
    if client.asynchronous:
        async def go() -> None:
            try:
                await _call(client, "agents_session_end", session=session)
            except NotInstalledError:
                pass

        return go()
    try:
        _call(client, "agents_session_end", session=session)
    except NotInstalledError:
        pass


def session_graph(client: Client, session: Any) -> SessionGraph:
    """The live call graph of a session (a Session or its id) as the scheduler rebuilt it."""
    sid = getattr(session, "id", session)

    def parse(data: Any) -> SessionGraph:
        if data is None:
            raise KeyError(f"unknown or expired session {sid!r}")
        return SessionGraph.model_validate(data)

    return _call(client, "agents_session_graph", parse, session=sid)


def workflow_graph(client: Client) -> WorkflowGraph:
    """The flattened workflow graph (visits per session per component, edges, durations)."""
    return _call(client, "agents_workflow_graph", WorkflowGraph.model_validate)


COLUMNS = [
    "key", "session", "component", "method", "kind", "creator", "state", "worker", "created",
    "ready", "started", "finished", "n_dependencies", "prompt_tokens", "cached_tokens", "output_tokens", "kv_bytes",
    "emulated", "migrations", "priority_changes",
]


def telemetry(client: Client, session: Any = None):
    """One row per call (pandas DataFrame): timestamps are POSIX seconds, tokens for LLM calls."""
    import pandas as pd

    sid = getattr(session, "id", session)
    return _call(client, "agents_telemetry", lambda rows: pd.DataFrame(rows, columns=COLUMNS), session=sid)


def hosted_models(client: Client) -> dict[str, list[str]]:
    """Model name -> workers hosting it."""
    return _call(client, "agents_models")
