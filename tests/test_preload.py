"""``--preload dask_agents.preload`` on real ``dask scheduler`` / ``dask worker`` processes,
and the same preloads through dask-jobqueue's SLURMCluster (job script run locally).

Everything listens on and talks to 127.0.0.1 only. Subprocesses run in their own process
group and are killed (the whole group) in ``finally``.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, Callable

import pytest
from distributed import Client

import dask_agents as da

pytestmark = pytest.mark.timeout(120)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import preload_components  # noqa: E402  (importable by the worker subprocesses too)

DASK = os.path.join(os.path.dirname(sys.executable), "dask")
PRELOAD = "dask_agents.preload"


# -- helpers -------------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    """The subprocess environment: the components module and the repo importable."""
    env = dict(os.environ)
    path = [TESTS_DIR, REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["DASK_AGENTS__WORKER__MODELS"] = "[]"  # no LLM engine: these tests need none
    env.update(extra)
    return env


class Proc:
    """A subprocess in its own process group, output to a log file."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str]):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
            start_new_session=True,
        )

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-6000:]

    def check_alive(self) -> None:
        rc = self.popen.poll()
        if rc is not None:
            pytest.fail(f"{shlex.join(self.args)} exited with {rc}:\n{self.log()}")

    def kill(self) -> None:
        try:
            if self.popen.poll() is None:
                for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                    try:
                        os.killpg(self.popen.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        self.popen.wait(wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            # the nanny's worker process shares the group: make sure nothing is left
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        finally:
            self._log.close()


def wait_for(pred: Callable[[], Any], what: str, timeout: float = 30, procs: tuple[Proc, ...] = ()) -> Any:
    """Poll ``pred`` until it returns something truthy (deadline ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    last_exc: BaseException | None = None
    while True:
        for p in procs:
            p.check_alive()
        try:
            value = pred()
            if value:
                return value
        except Exception as e:  # not ready yet
            last_exc = e
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {shlex.join(p.args)}\n{p.log()}" for p in procs)
            pytest.fail(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})\n{logs}")
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def agents_ping(client: Client) -> dict:
    """The scheduler plugin's ``agents_ping`` handler (workers that said hello)."""

    async def go() -> dict:
        return await client.scheduler.agents_ping()

    return client.sync(go)


def check_preloaded_worker(client: Client, procs: tuple[Proc, ...]) -> str:
    """Wait for one worker with the dask-agents plugin; run stub calls on it; check telemetry."""
    assert da.installed(client) is True
    workers = wait_for(lambda: list(client.scheduler_info()["workers"]), "a worker", procs=procs)
    assert len(workers) == 1, workers
    addr = workers[0]
    wait_for(lambda: addr in agents_ping(client)["workers"], f"agents_ping to list {addr}", procs=procs)

    # the plugin came from the preload (nothing was registered through the client)
    names = client.run(lambda dask_worker: sorted(dask_worker.plugins))
    assert "dask-agents" in names[addr], names

    greeter = da.stub(preload_components.Greeter)
    add = da.stub(preload_components.add)
    with da.session(client, name="preload") as s:
        hello = greeter.greet("world")
        pid = greeter.where()
        total = add(2, 3)
        assert hello.result(timeout=30) == "hello world"
        assert total.result(timeout=30) == 5
        assert pid.result(timeout=30) != os.getpid()  # ran in the worker subprocess

    def finished_rows():
        df = da.telemetry(client, s)
        # "finished" comes from the scheduler's transitions; the exact start/finish from
        # the worker plugin's batched reports (a little later)
        done = df[(df["state"] == "finished") & (df["worker"] == addr) & df["started"].notna()]
        return done.to_dict("records") if len(done) == 3 else None

    done = wait_for(finished_rows, "telemetry rows finished on the worker", procs=procs)
    assert sorted(r["component"] for r in done) == ["Greeter", "Greeter", "add"]
    assert {r["method"] for r in done if r["component"] == "Greeter"} == {"greet", "where"}
    assert all(r["started"] <= r["finished"] for r in done)
    return addr


# -- (a) dask scheduler / dask worker CLI ------------------------------------------------------
def test_cli_preload(tmp_path):
    sched_file = str(tmp_path / "scheduler.json")
    env = _env()
    procs: list[Proc] = []
    try:
        sched = Proc(
            [DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
             "--scheduler-file", sched_file, "--preload", PRELOAD],
            str(tmp_path / "scheduler.log"), env,
        )
        procs.append(sched)
        wait_for(lambda: os.path.exists(sched_file) and os.path.getsize(sched_file) > 0,
                 "the scheduler file", procs=(sched,))
        worker = Proc(
            [DASK, "worker", "--scheduler-file", sched_file, "--host", "127.0.0.1",
             "--nthreads", "4", "--nworkers", "1", "--no-dashboard", "--preload", PRELOAD],
            str(tmp_path / "worker.log"), env,
        )
        procs.append(worker)
        with Client(scheduler_file=sched_file, timeout="20s") as client:
            addr = check_preloaded_worker(client, tuple(procs))
            assert addr.startswith("tcp://127.0.0.1:")
    finally:
        for p in reversed(procs):
            p.kill()


# -- (b) dask-jobqueue SLURMCluster ------------------------------------------------------------
PROLOGUE = "export DASK_AGENTS__WORKER__MODELS='[]'"


def _worker_script(job_script: str) -> tuple[list[str], str]:
    """The prologue lines and the worker command line of a jobqueue job script."""
    prologue, command = [], None
    for line in job_script.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if "distributed.cli.dask_worker" in s or s.split()[:2][-1:] == ["worker"]:
            command = s
        elif command is None:
            prologue.append(s)
    assert command is not None, job_script
    return prologue, command


def test_slurmcluster_preload(tmp_path):
    dask_jobqueue = pytest.importorskip("dask_jobqueue")
    procs: list[Proc] = []
    cluster = dask_jobqueue.SLURMCluster(
        cores=2, memory="4GB", processes=1,
        scheduler_options={"preload": [PRELOAD], "host": "127.0.0.1", "dashboard_address": ":0"},
        worker_extra_args=["--preload", PRELOAD],
        job_script_prologue=[PROLOGUE],
        log_directory=str(tmp_path / "logs"),
    )
    try:
        script = cluster.job_script()
        assert f"--preload {PRELOAD}" in script
        assert PROLOGUE in script
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        assert cluster.scheduler_address in script

        prologue, command = _worker_script(script)
        assert PROLOGUE in prologue
        argv = shlex.split(command)
        if not (os.path.isfile(argv[0]) and os.access(argv[0], os.X_OK)):
            argv[0] = sys.executable  # the job's python is not on this machine
        # a unique name instead of jobqueue's placeholder
        if "--name" in argv:
            argv[argv.index("--name") + 1] = "slurm-job-local"
        job = "\n".join(prologue + ["exec " + shlex.join(argv)])

        with Client(cluster, timeout="20s") as client:
            assert da.installed(client) is True
            assert list(agents_ping(client)["workers"]) == []  # no job submitted yet
            worker = Proc(["bash", "-c", job], str(tmp_path / "job.log"), _env(DASK_AGENTS__WORKER__MODELS="bogus"))
            procs.append(worker)
            addr = check_preloaded_worker(client, (worker,))
            # the job script's prologue ran before the worker (it overrode the env)
            env = client.run(lambda: os.environ.get("DASK_AGENTS__WORKER__MODELS"))
            assert env == {addr: "[]"}
            assert client.scheduler_info()["workers"][addr]["name"] == "slurm-job-local"
    finally:
        for p in reversed(procs):
            p.kill()
        cluster.close(timeout=20)
