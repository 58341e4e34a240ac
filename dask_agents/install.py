"""Putting dask-agents on a cluster: ``install(client)`` or ``--preload dask_agents.preload``."""

from __future__ import annotations

import inspect
from typing import Any

from distributed import Client

import dask_agents.config as agents_config
from dask_agents.scheduler_plugin import dask_compat as sched_compat


def install(client: Client, *, models: list[str] | dict[str, list[str]] | None = None, wait: bool = True,
            timeout: float | str | None = None) -> Any:
    """Register the scheduler plugin and the worker plugin on ``client``'s cluster.

    ``models``: models every worker hosts (loaded at start; default ``agents.worker.models``;
    models not hosted anywhere still load lazily on the first worker a call lands on).
    ``wait`` (default): return once every worker's engines for those models have loaded, or
    raise :class:`~dask_agents.errors.EngineLoadError` naming the worker, the model and the
    cause; ``timeout`` bounds that wait (default ``agents.llm.load-timeout``). Returns
    ``{worker address: {model: load seconds}}`` (empty with ``wait=False``: the engines load in
    the background and the first calls wait for them; that wait is never counted as a call's
    service time, see ``engine_load_s`` in :func:`~dask_agents.telemetry`).
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
    _check_settings(_model_names(models))
    interval = agents_config.seconds("client.batched-send-interval")
    limit = agents_config.seconds("llm.load-timeout") if timeout is None else _timeout(timeout)
    names = _model_names(models)
    if client.asynchronous:
        async def go() -> dict:
            unknown = _unknown(names)
            if unknown:  # not in the driver's registry: perhaps in the workers' own configuration
                _refuse(unknown, names, await client.run(_registry_names))
            if not await client.run_on_scheduler(_has_plugin):
                await client.register_plugin(AgentsSchedulerPlugin())
            await client.register_plugin(AgentsWorkerPlugin(models=models, client_interval=interval))
            sched_compat.set_client_stream_interval(client, interval)
            if not wait:
                return {}
            results = await client.run(_wait_engines, limit)
            info = client.scheduler_info()  # (a cached identity, or a coroutine in other releases)
            return _loaded(results, await info if inspect.isawaitable(info) else info)

        return go()
    unknown = _unknown(names)
    if unknown:  # not in the driver's registry: perhaps in the workers' own configuration
        _refuse(unknown, names, client.run(_registry_names))
    if not client.run_on_scheduler(_has_plugin):
        client.register_plugin(AgentsSchedulerPlugin())
    client.register_plugin(AgentsWorkerPlugin(models=models, client_interval=interval))
    sched_compat.set_client_stream_interval(client, interval)
    from dask_agents import direct

    direct.install_routes(client)  # its sessions' calls may go straight to their workers
    if not wait:
        return {}
    return _loaded(client.run(_wait_engines, limit), client.scheduler_info())


def _model_names(models: Any) -> set[str]:
    """Every model name in ``models`` (a list, or a mapping of worker names to lists)."""
    if models is None:
        return set()
    if isinstance(models, dict):
        return {m for names in models.values() for m in names}
    return set(models)


def _unknown(names: set[str]) -> set[str]:
    """Of ``names``, those the driver's ``agents.llm.models`` does not have."""
    return names - set(agents_config.get("llm.models") or {})


def _registry_names(dask_worker: Any = None) -> list[str]:
    """The model names of a worker's own ``agents.llm.models``."""
    return sorted(agents_config.get("llm.models") or {})


def _refuse(unknown: set[str], names: set[str], per_worker: dict) -> None:
    """UnknownModelError for the names neither the driver's nor any worker's registry has, before
    anything is installed (a typo must not leave the cluster with a plugin that cannot start)."""
    from dask_agents.errors import UnknownModelError

    known = set(agents_config.get("llm.models") or {}) | {m for names_ in per_worker.values() for m in names_}
    missing = sorted(unknown - known)
    if missing:
        raise UnknownModelError(
            f"da.install: unknown model(s) {', '.join(map(repr, missing))}: not in agents.llm.models "
            f"({', '.join(sorted(known)) or 'none'}); nothing was installed")


def _timeout(value: float | str) -> float:
    from dask.utils import parse_timedelta

    try:
        t = parse_timedelta(value)
    except Exception:
        t = None
    if not isinstance(t, (int, float)) or not t > 0 or t != t or t == float("inf"):
        raise ValueError(f"da.install(timeout=...) takes a positive duration, got {value!r}")
    return float(t)


async def _wait_engines(timeout: float, dask_worker: Any = None) -> dict:
    """On each worker: wait for its start-up engines (off its event loop); model -> outcome."""
    import asyncio

    plugin = dask_worker.plugins.get("dask-agents")
    engines = getattr(plugin, "engines", None)
    if engines is None:
        return {}
    return await asyncio.to_thread(engines.wait_hosted, timeout)


def _loaded(results: dict, info: dict) -> dict:
    """``{worker: {model: load seconds}}``, or EngineLoadError naming each engine that did not load."""
    from dask_agents.errors import EngineLoadError

    workers = info.get("workers", {})
    failed = [f"worker {workers.get(addr, {}).get('name', addr)!r} ({addr}): {r['error']}"
              for addr, per in sorted(results.items()) for r in per.values() if r.get("error")]
    if failed:
        raise EngineLoadError("da.install: " + "; ".join(failed))
    return {addr: {m: r["load_s"] for m, r in per.items()} for addr, per in results.items()}


def _names(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(m, str) and m for m in value)


def _check_settings(names: set[str]) -> None:
    """ConfigError for a model to install whose entry in the driver's ``agents.llm.models`` the
    engines would refuse (a context longer than the model's, say), before anything is installed."""
    from pydantic import ValidationError

    from dask_agents.errors import ConfigError
    from dask_agents.model_settings import ModelSettings

    entries = agents_config.get("llm.models") or {}
    for name in sorted(names & set(entries)):
        try:
            settings = ModelSettings(**entries[name])
        except ValidationError as e:
            why = "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
            raise ConfigError(f"agents.llm.models.{name}: {why}") from None
        why = settings.context_error()
        if why is not None:
            raise ConfigError(f"agents.llm.models.{name}: {why}")


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
