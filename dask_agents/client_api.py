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
# Clients whose scheduler was seen with the plugin. Checked once per client and scheduler
# (a restarted one, at the same address, may lack it) because a scheduler without our
# handlers does not answer an unknown RPC at all (it only logs), so calling one blindly would
# hang.
_verified: set[tuple[str, str, str | None]] = set()


def _ident(client: Client) -> tuple[str, str, str | None]:
    from dask_agents.worker_plugin import dask_compat

    return (client.id, str(client.scheduler.address), dask_compat.scheduler_id(client))


async def _has_plugin(client: Client) -> bool:
    """Whether ``client``'s scheduler has the plugin (asked once per client and scheduler)."""
    from dask_agents.install import _has_plugin as check

    if _ident(client) not in _verified:
        if not await client.run_on_scheduler(check):
            return False
        _verified.add(_ident(client))
    return True


def _call(client: Client, op: str, then: Callable[[Any], Any] = lambda x: x, **kwargs: Any) -> Any:
    """Call scheduler handler ``op``; returns ``then(reply)``, or a coroutine for async clients.

    Raises NotInstalledError (instead of hanging) when the scheduler lacks the plugin."""
    async def go() -> Any:
        if not await _has_plugin(client):
            raise NotInstalledError(_NOT_INSTALLED)
        return then(await getattr(client.scheduler, op)(**kwargs))

    if client.asynchronous:
        return go()
    return client.sync(go)


def _stream(client: Client, msg: dict) -> Any:
    """Send ``msg`` on ``client``'s own stream to the scheduler (ordered with its submits) once
    the scheduler is known to have the plugin (an unknown stream op would cost the client its
    connection); a no-op without the plugin. A coroutine with an asynchronous client."""
    def send() -> None:
        if client.status in ("running", "connecting", "newly-created"):
            client._send_to_scheduler(msg)  # noqa: SLF001 (Dask's client stream: ordered with submits)

    if client.status in ("closing", "closed"):  # nobody to tell: the scheduler saw the client go
        return None
    if client.asynchronous:
        async def go() -> None:
            if await _has_plugin(client):
                send()

        return go()
    if _ident(client) in _verified or client.sync(_has_plugin, client):
        send()
    return None


def open_session(client: Client, session: str, tenant: str | None = None) -> Any:
    """Tell the scheduler that ``client`` opened ``session`` (its ``da.session`` block): this
    client owns it, whoever else joins it. A coroutine with an asynchronous client."""
    from dask_agents import direct

    # ``direct``: this client takes routes for its sessions' calls (dask_agents/direct.py)
    routes = direct.routes_of(client)
    wants = routes is not None and not client.asynchronous
    out = _stream(client, {"op": SESSION_OPEN_OP, "session": session, "tenant": tenant, "direct": wants})
    if wants and _ident(client) in _verified:  # sent: its first calls may ask for a route (after it, same stream)
        routes.opened.add(session)
    return out


def end_session(client: Client, session: str, cancel: bool = False, direct: list | None = None) -> Any:
    """Tell the scheduler the driver is done with ``session`` (no-op when not installed).

    ``cancel``: the driver gave up on it (left its block with an exception): the session's
    open calls are failed or cancelled. The message goes on the client's own stream, after
    the calls it submitted before, so the scheduler cannot see the end before them. With an
    asynchronous client this returns a coroutine."""
    msg = {"op": SESSION_END_OP, "session": session, "cancel": bool(cancel)}
    if direct:  # calls it made straight on workers: the session completes after their records
        msg["direct"] = list(direct)
    return _stream(client, msg)


async def reattach(client: Client, keys: list) -> bool:
    """After ``client`` reconnected: ask the scheduler again for calls whose futures Dask
    cancelled when the connection dropped (``dask_agents.scheduler_plugin.sessions``). False
    when the scheduler has no dask-agents plugin (nothing was kept). On the client's loop,
    after the futures were given live states, so that the answers find them."""
    if client.status != "running" or not await _has_plugin(client):
        return False
    client._send_to_scheduler({"op": REATTACH_OP, "keys": list(keys)})  # noqa: SLF001 (its stream)
    return True


SESSION_END_OP = "agents-session-end"
"""The client-stream op of :func:`end_session` (``dask_agents.scheduler_plugin.plugin.SESSION_END_OP``)."""
SESSION_OPEN_OP = "agents-session-open"
"""The client-stream op of :func:`open_session` (``dask_agents.scheduler_plugin.plugin.SESSION_OPEN_OP``)."""
REATTACH_OP = "agents-reattach"
"""The client-stream op of :func:`reattach` (``dask_agents.scheduler_plugin.plugin.REATTACH_OP``)."""


def session_graph(client: Client, session: Any) -> SessionGraph:
    """The live call graph of a session (a Session or its id) as the scheduler rebuilt it. For
    a Session this driver has left, the scheduler first waits (at most 2 s) for the session's
    end and for the records of its calls that went straight to workers, so that a graph read
    right after the block shows what the block did."""
    sid = getattr(session, "id", session)
    settle = getattr(session, "ended", False) is True

    def parse(data: Any) -> SessionGraph:
        if data is None:
            raise KeyError(f"unknown or expired session {sid!r}")
        return SessionGraph.model_validate(data)

    return _call(client, "agents_session_graph", parse, session=sid, settle=settle)


def workflow_graph(client: Client) -> WorkflowGraph:
    """The flattened workflow graph (visits per session per component, edges, durations)."""
    return _call(client, "agents_workflow_graph", WorkflowGraph.model_validate)


COLUMNS = [
    "key", "session", "component", "method", "kind", "creator", "state", "worker", "created",
    "ready", "started", "finished", "n_dependencies", "prompt_tokens", "cached_tokens", "output_tokens", "kv_bytes",
    "emulated", "migrations", "priority_changes", "tenant", "model", "retry", "queue_s", "service_s",
    "ttft_s", "tpot_s", "engine_load_s", "error", "fast_path",
]
SESSION_COLUMNS = [
    "session", "tenant", "state", "created", "completed", "age_s", "calls", "progress", "open", "failed",
    "retries", "current",
]
KV_COLUMNS = ["time", "worker", "model", "tier", "bytes", "capacity_bytes"]
TABLES = {"calls": COLUMNS, "sessions": SESSION_COLUMNS, "kv": KV_COLUMNS}
TIME_COLUMNS = ("created", "ready", "started", "finished", "completed", "time")
"""Timestamp columns of the telemetry tables: ``datetime64[ns, UTC]`` in ``da.telemetry``'s
frames (NaT when unknown); :func:`posix_seconds` turns them back into POSIX seconds."""


def posix_seconds(df: Any) -> Any:
    """``df`` with its timestamp columns (:data:`TIME_COLUMNS`) as POSIX seconds (floats, NaN
    when unknown), whether they hold datetimes (``da.telemetry``), ISO strings (its CSV files)
    or seconds already (older files): what arithmetic on times (``report``, ``whatif``) reads."""
    import pandas as pd

    out = df.copy()
    for c in TIME_COLUMNS:
        if c not in out.columns:
            continue
        col = out[c]
        if pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col):
            out[c] = col.astype(float)
            continue
        if not pd.api.types.is_datetime64_any_dtype(col):
            col = pd.to_datetime(col, utc=True, format="ISO8601")
        elif col.dt.tz is None:
            col = col.dt.tz_localize("UTC")
        # (whatever the unit a file kept: ns from pandas, us from parquet)
        out[c] = (col.dt.tz_convert("UTC") - pd.Timestamp(0, tz="UTC")).dt.total_seconds()
    return out


def telemetry(client: Client, session: Any = None, table: str = "calls"):
    """Telemetry as a pandas DataFrame. Timestamps (``created``, ``ready``, ``started``,
    ``finished``, ``completed``, ``time``) are ``datetime64[ns, UTC]`` (NaT when unknown; durations
    are the ``*_s`` columns, in seconds; :func:`posix_seconds` gives POSIX seconds back);
    ``emulated`` is a bool: whether an emulated engine or tool served the call, so its times are
    EMULATED.

    ``table="calls"`` (default): one row per call; ``queue_s`` is runnable -> started,
    ``service_s`` started -> finished (the workers' exact times), ``retry`` marks a re-visit
    (see the dashboard's retries), tokens for LLM calls and, as their worker measured them,
    ``ttft_s`` (time to first token, from the engine's receipt of the request) and ``tpot_s``
    (time per output token after the first); ``error`` the text of a failed call's exception.
    ``table="sessions"``: one row per retained session (state, age or latency, calls,
    progress, open, failed, retries, current components).
    ``table="kv"``: the engines' KV residency samples (time, worker, model, tier, bytes,
    capacity), one per engine and tier about every ``agents.dashboard.engine-stats-interval``;
    only engines that report KV bytes appear (those with per-session KV control: vLLM's and
    the emulated one)."""
    import pandas as pd

    if table not in TABLES:
        raise ValueError(f"unknown telemetry table {table!r} (one of {', '.join(TABLES)})")
    sid = getattr(session, "id", session)
    columns = TABLES[table]

    def frame(rows: list) -> Any:
        df = pd.DataFrame(rows, columns=columns)
        if "emulated" in df.columns:  # True for calls an emulated engine or tool served, else False
            df["emulated"] = df["emulated"].astype("boolean").fillna(False).astype(bool)
        for c in TIME_COLUMNS:
            if c in df.columns:
                df[c] = pd.to_datetime(pd.to_numeric(df[c], errors="coerce"), unit="s", utc=True)
        return df

    return _call(client, "agents_telemetry", frame, session=sid, table=table)


def session_progress(client: Client, sessions: list[str]) -> dict[str, dict | None]:
    """Session id -> its summary (state, calls, progress, open, failed, retries, current), or
    None for unknown/expired ones. A coroutine with an asynchronous client."""
    return _call(client, "agents_progress", sessions=list(sessions))


def hosted_models(client: Client) -> dict[str, list[str]]:
    """Model name -> workers hosting it."""
    return _call(client, "agents_models")
