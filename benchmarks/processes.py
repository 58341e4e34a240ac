"""Starting a real ``dask scheduler`` process for the benchmarks that measure one (shared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import IO, Any


def start_scheduler(tmp: str, env: dict, log: IO[bytes], dashboard: bool) -> tuple[subprocess.Popen, dict]:
    """A ``dask scheduler --preload dask_agents.preload`` on 127.0.0.1 with a random port (and a
    dashboard if asked); returns the process and its scheduler file's contents once written."""
    sched_file = os.path.join(tmp, "scheduler.json")
    web = ["--dashboard-address", "127.0.0.1:0"] if dashboard else ["--no-dashboard"]
    sched = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", *web,
         "--scheduler-file", sched_file, "--preload", "dask_agents.preload"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while not os.path.exists(sched_file) or os.path.getsize(sched_file) == 0:
        if time.time() > deadline or sched.poll() is not None:
            raise RuntimeError("the scheduler did not start (see the log)")
        time.sleep(0.2)
    time.sleep(0.2)  # the file is written in one go, but give the writer a moment to close it
    with open(sched_file) as f:
        info: dict[str, Any] = json.load(f)
    return sched, info
