"""Putting dask-agents on a cluster: ``install(client)`` or ``--preload dask_agents.preload``."""

from __future__ import annotations

from typing import Any

from distributed import Client

import dask_agents.config as agents_config
from scheduler_plugin import dask_compat as sched_compat


def install(client: Client, *, models: list[str] | None = None) -> Any:
    """Register the scheduler plugin and the worker plugin on ``client``'s cluster.

    ``models``: models every worker hosts (loaded at start; default ``agents.worker.models``;
    models not hosted anywhere still load lazily on the first worker a call lands on).
    Idempotent: installing twice keeps one plugin of each kind. With an asynchronous client
    it returns a coroutine (``await da.install(client)``).
    """
    from scheduler_plugin.plugin import AgentsSchedulerPlugin
    from worker_plugin.plugin import AgentsWorkerPlugin

    if not isinstance(client, Client):
        raise TypeError(f"da.install() needs a distributed.Client, got {type(client).__name__}")
    interval = agents_config.seconds("client.batched-send-interval")
    if client.asynchronous:
        async def go() -> None:
            if not await client.run_on_scheduler(_has_plugin):
                await client.register_plugin(AgentsSchedulerPlugin())
            await client.register_plugin(AgentsWorkerPlugin(models=models))
            sched_compat.set_client_stream_interval(client, interval)

        return go()
    if not client.run_on_scheduler(_has_plugin):
        client.register_plugin(AgentsSchedulerPlugin())
    client.register_plugin(AgentsWorkerPlugin(models=models))
    sched_compat.set_client_stream_interval(client, interval)
    return None


def _has_plugin(dask_scheduler: Any) -> bool:
    from scheduler_plugin.plugin import NAME

    return NAME in dask_scheduler.plugins


def installed(client: Client) -> Any:
    """True if the scheduler has the dask-agents plugin (a coroutine for async clients)."""
    return client.run_on_scheduler(_has_plugin)
