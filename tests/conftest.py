"""Shared fixtures. Tests use small clusters and poll for state (no fixed sleeps)."""

from __future__ import annotations

import os
import time
from typing import Callable

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402

import dask_agents  # noqa: E402,F401  (registers agents.* defaults before Dask's test utils copy the config)

try:  # its jobqueue.* defaults too: gen_cluster's config reset restores the copy taken at import
    import dask_jobqueue  # noqa: E402,F401
except ImportError:  # pragma: no cover - in the test extra
    pass


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.02) -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s: {predicate}")
        time.sleep(interval)


async def async_wait_for(predicate, timeout: float = 30.0, interval: float = 0.02):
    """Async :func:`wait_for`; ``predicate`` may be a coroutine function."""
    import asyncio
    import inspect

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s: {predicate}")
        await asyncio.sleep(interval)
