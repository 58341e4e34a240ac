"""Putting dask-agents on a cluster: ``install(client)`` or ``--preload dask_agents.preload``."""

from __future__ import annotations

from typing import Any

from distributed import Client

import dask_agents.config as agents_config
from dask_agents.scheduler_plugin import dask_compat as sched_compat


def install(client: Client, *, models: list[str] | dict[str, list[str]] | None = None) -> Any:
    """Register the scheduler plugin and the worker plugin on ``client``'s cluster.

    ``models``: models every worker hosts (loaded at start; default ``agents.worker.models``;
    models not hosted anywhere still load lazily on the first worker a call lands on).
    Idempotent: installing twice keeps one plugin of each kind. With an asynchronous client
    it returns a coroutine (``await da.install(client)``). An invalid ``agents.*`` setting
    raises :class:`~dask_agents.errors.ConfigError` naming the key before anything is installed.
    """
    from dask_agents.scheduler_plugin.plugin import AgentsSchedulerPlugin
    from dask_agents.worker_plugin.plugin import AgentsWorkerPlugin

    if not isinstance(client, Client):
        raise TypeError(f"da.install() needs a distributed.Client, got {type(client).__name__}")
    _check_models(models)
    agents_config.validate()  # a bad agents.* value fails here, naming its key
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


def _names(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(m, str) and m for m in value)


def _check_models(models: Any) -> None:
    """``models``: None, a list of model names, or ``{worker name (str or int) or "*": [model names]}``."""
    ok = models is None or _names(models) or (
        isinstance(models, dict)
        and all(isinstance(k, (str, int)) and not isinstance(k, bool) and _names(v) for k, v in models.items()))
    if not ok:
        raise TypeError("da.install(models=...) takes a list of model names or a mapping "
                        f"{{worker name or '*': [model names]}}, got {models!r}")


def _has_plugin(dask_scheduler: Any) -> bool:
    from dask_agents.scheduler_plugin.plugin import NAME

    return NAME in dask_scheduler.plugins


def installed(client: Client) -> Any:
    """True if the scheduler has the dask-agents plugin (a coroutine for async clients)."""
    return client.run_on_scheduler(_has_plugin)
