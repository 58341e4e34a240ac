"""Preload module for ``dask scheduler --preload dask_agents.preload`` and
``dask worker --preload dask_agents.preload`` (and dask-jobqueue / LocalCluster preloads).

On a scheduler it adds the global controller; on a worker, the component controller.
Which models a worker hosts comes from ``agents.worker.models`` (for example
``DASK_AGENTS__WORKER__MODELS='["coder"]'``).
"""

from __future__ import annotations

import logging

from distributed import Scheduler, Worker

logger = logging.getLogger(__name__)


async def dask_setup(server: object) -> None:
    """Install the matching dask-agents plugin on the server being started.

    Validates ``agents.*`` first: a bad value raises ConfigError naming its key."""
    import dask_agents.config as agents_config

    if isinstance(server, (Scheduler, Worker)):
        agents_config.validate()
    if isinstance(server, Scheduler):
        from dask_agents.scheduler_plugin.plugin import NAME, AgentsSchedulerPlugin

        if NAME not in server.plugins:
            # Preloads run before the scheduler starts its plugins: start() follows.
            server.add_plugin(AgentsSchedulerPlugin())
        logger.info("dask-agents scheduler plugin installed")
    elif isinstance(server, Worker):
        from dask_agents.worker_plugin.plugin import AgentsWorkerPlugin

        await server.plugin_add(AgentsWorkerPlugin(), name="dask-agents")
        logger.info("dask-agents worker plugin installed")
    else:  # a Nanny: its worker process runs the preload itself
        logger.debug("dask_agents.preload: nothing to do on %s", type(server).__name__)
