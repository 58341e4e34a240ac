"""Components for tests/test_preload.py.

They live in an importable module (not in the test module) so that worker *subprocesses*
can unpickle them by reference: the tests put this directory on the workers' PYTHONPATH.
"""

from __future__ import annotations

import os

import dask_agents as da


@da.agent
class Greeter:
    """A stateless agent: one shared instance per worker."""

    def greet(self, name: str) -> str:
        return f"hello {name}"

    def where(self) -> int:
        """The pid of the worker process that ran the call."""
        return os.getpid()


@da.tool
def add(a: int, b: int) -> int:
    return a + b
