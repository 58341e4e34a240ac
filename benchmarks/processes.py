"""Starting and stopping real ``dask scheduler`` (and worker) processes for the benchmarks that measure them (shared)."""

from __future__ import annotations

import json
import os
import shutil
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


def stop_processes(procs: list[subprocess.Popen], log: IO, tmp: str) -> None:
    """Stop a cluster's processes in the order given (workers first: terminate, kill after
    30 s), close its log and remove its scratch directory."""
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)
