"""Client-side queries of the scheduler plugin: session graphs, telemetry, models."""

from __future__ import annotations

from typing import Any

from distributed import Client

from dask_agents.errors import NotInstalledError
from dask_agents.models import SessionGraph, WorkflowGraph


def _call(client: Client, op: str, **kwargs: Any) -> Any:
    async def go() -> Any:
        return await getattr(client.scheduler, op)(**kwargs)

    try:
        return client.sync(go)
    except Exception as e:
        if "agents_" in str(e) or "unknown operation" in str(e).lower():
            raise NotInstalledError(
                "the scheduler has no dask-agents plugin: call da.install(client), "
                "or start the scheduler with --preload dask_agents.preload"
            ) from None
        raise


def end_session(client: Client, session: str) -> None:
    """Tell the scheduler the driver is done with ``session`` (best effort when not installed)."""
    try:
        _call(client, "agents_session_end", session=session)
    except NotInstalledError:
        pass


def session_graph(client: Client, session: Any) -> SessionGraph:
    """The live call graph of a session (a Session or its id) as the scheduler rebuilt it."""
    sid = getattr(session, "id", session)
    data = _call(client, "agents_session_graph", session=sid)
    if data is None:
        raise KeyError(f"unknown or expired session {sid!r}")
    return SessionGraph.model_validate(data)


def workflow_graph(client: Client) -> WorkflowGraph:
    """The flattened workflow graph (visits per session per component, edges, durations)."""
    return WorkflowGraph.model_validate(_call(client, "agents_workflow_graph"))


COLUMNS = [
    "key", "session", "component", "method", "kind", "creator", "state", "worker", "created",
    "ready", "started", "finished", "n_dependencies", "prompt_tokens", "cached_tokens", "output_tokens",
]


def telemetry(client: Client, session: Any = None):
    """One row per call (pandas DataFrame): timestamps are POSIX seconds, tokens for LLM calls."""
    import pandas as pd

    sid = getattr(session, "id", session)
    rows = _call(client, "agents_telemetry", session=sid)
    return pd.DataFrame(rows, columns=COLUMNS)


def hosted_models(client: Client) -> dict[str, list[str]]:
    """Model name -> workers hosting it."""
    return _call(client, "agents_models")
