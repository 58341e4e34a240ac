"""Putting dask-agents on a cluster: ``install(client)`` or ``--preload dask_agents.preload``."""

from __future__ import annotations

from typing import Any

from distributed import Client

import dask_agents.config as agents_config
from scheduler_plugin import dask_compat as sched_compat


def install(client: Client, *, models: list[str] | None = None, workers_models: dict[str, list[str]] | None = None) -> None:
    """Register the scheduler plugin and the worker plugin on ``client``'s cluster.

    ``models``: models every worker hosts (loaded at start; default ``agents.worker.models``;
    models not hosted anywhere still load lazily on the first worker a call lands on).
    Idempotent: installing twice keeps one plugin of each kind.
    """
    from scheduler_plugin.plugin import AgentsSchedulerPlugin
    from worker_plugin.plugin import AgentsWorkerPlugin

    if not isinstance(client, Client):
        raise TypeError(f"da.install() needs a distributed.Client, got {type(client).__name__}")
    if not _scheduler_has_plugin(client):
        client.register_plugin(AgentsSchedulerPlugin())
    client.register_plugin(AgentsWorkerPlugin(models=models))
    sched_compat.set_client_stream_interval(client, agents_config.seconds("client.batched-send-interval"))


def _scheduler_has_plugin(client: Client) -> bool:
    from scheduler_plugin.plugin import NAME

    def check(dask_scheduler: Any) -> bool:
        return NAME in dask_scheduler.plugins

    return bool(client.run_on_scheduler(check))


def installed(client: Client) -> bool:
    """True if the scheduler has the dask-agents plugin."""
    return _scheduler_has_plugin(client)
