"""Components for tests/test_direct.py (importable by worker processes)."""

from __future__ import annotations

import os
import threading
import time

from distributed import get_worker

import dask_agents as da


@da.agent(model="emu")
class Writer:
    """An agent beside the ``emu`` engine: its LLM call, and where things ran."""

    def write(self, prompt: list) -> dict:
        out = da.llm("emu").generate(prompt, max_tokens=4).value()
        return {"worker": get_worker().address, "llm_worker": out.worker, "output": len(out.token_ids),
                "thread": threading.current_thread().name}

    def fail(self, x: int) -> int:
        raise ValueError(f"bad input {x}")

    def double(self, x: int) -> int:
        return 2 * x

    def logged_wait(self, log: str, release: str) -> str:
        """Appends its call key and worker to ``log``, then waits for ``release`` to exist."""
        from dask_agents import context

        with open(log, "a") as f:
            f.write(f"{context.call_id()} {get_worker().address}\n")
        while not os.path.exists(release):
            time.sleep(0.01)
        return get_worker().address


@da.agent
class Plain:
    """An agent with no model: no route, the scheduler path."""

    def add(self, a: int, b: int) -> int:
        return a + b

    def fail(self, x: int) -> int:
        raise ValueError(f"bad input {x}")
