"""Components for tests/test_faults.py, importable by worker subprocesses.

Each call leaves a marker file ``<dir>/<what>-<key>-<pid>`` when it starts, so a test can see
where it ran and whether it ran twice; ``hold`` makes a call wait for ``<dir>/release``.
"""

from __future__ import annotations

import os
import time

import dask_agents as da


def _mark(marker_dir: str, what: str) -> None:
    key = da.current_call() or "driver"
    with open(os.path.join(marker_dir, f"{what}-{key}-{os.getpid()}"), "w"):
        pass


def _hold(marker_dir: str, hold: bool, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while hold and not os.path.exists(os.path.join(marker_dir, "release")) and time.monotonic() < deadline:
        time.sleep(0.02)


@da.agent(stateful=True)
class Counter:
    """A stateful agent: its count is the session's state."""

    def __init__(self) -> None:
        self.n = 0

    def bump(self, marker_dir: str, hold: bool = False) -> tuple[int, int]:
        _mark(marker_dir, "bump")
        self.n += 1
        _hold(marker_dir, hold)
        return self.n, os.getpid()


@da.tool(kind="code_exec")
def slow_double(x: int, marker_dir: str, hold: bool = False) -> tuple[int, int]:
    """A stateless tool that can be held mid-run."""
    _mark(marker_dir, "slow")
    _hold(marker_dir, hold)
    return 2 * x, os.getpid()
