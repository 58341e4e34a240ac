"""Client-side queries of the scheduler plugin: session graphs, telemetry, models."""

from __future__ import annotations

from typing import Any, Callable

from distributed import Client

from dask_agents.errors import NotInstalledError
from dask_agents.models import SessionGraph, WorkflowGraph


def _not_installed(e: Exception) -> bool:
    return "agents_" in str(e) or "unknown operation" in str(e).lower()


_NOT_INSTALLED = (
    "the scheduler has no dask-agents plugin: call da.install(client), "
    "or start the scheduler with --preload dask_agents.preload"
)


def _call(client: Client, op: str, then: Callable[[Any], Any] = lambda x: x, **kwargs: Any) -> Any:
    """Call scheduler handler ``op``; returns ``then(reply)``, or a coroutine for async clients."""

    async def go() -> Any:
        try:
            return then(await getattr(client.scheduler, op)(**kwargs))
        except Exception as e:
            if _not_installed(e):
                raise NotInstalledError(_NOT_INSTALLED) from None
            raise

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
]


def telemetry(client: Client, session: Any = None):
    """One row per call (pandas DataFrame): timestamps are POSIX seconds, tokens for LLM calls."""
    import pandas as pd

    sid = getattr(session, "id", session)
    return _call(client, "agents_telemetry", lambda rows: pd.DataFrame(rows, columns=COLUMNS), session=sid)


def hosted_models(client: Client) -> dict[str, list[str]]:
    """Model name -> workers hosting it."""
    return _call(client, "agents_models")
