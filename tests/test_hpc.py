"""The SLURM deployment of ``examples/hpc/slurm.py``, run for real without SLURM.

Jobs run through a ``SLURMJob`` subclass whose ``submit_command``/``cancel_command`` are a
local ``sbatch``/``scancel`` (bash runs the generated job script in its own process group;
cancel kills the group), so dask-jobqueue's own submission, job-id parsing and cancellation
paths run unchanged; the scheduler (in this process) loads the preload as in production.

- the job scripts: preload, ``--gres``, resources, threads, non-daemonic engine workers;
- TLS: the scheduler on ``tls://`` with the plugin, a job joining with the certificates
  jobqueue wrote for it, an LLM call over TLS;
- end to end: an engine job (emulated ``chat`` and ``coder`` engines) and an agent job join
  with the worker plugin ready, the engine worker process can start a child process, the
  example workflow runs with agent calls on the agent worker and LLM calls on the engine
  worker; under load the ``reallocate`` policy's ``Provision`` submits an engine job through
  ``da.attach_cluster``, and a ``Kill`` of its worker cancels that job;
- ``main()`` of the example as a user runs it; the example's GPU config is valid.

Everything listens on 127.0.0.1 (Linux: job liveness is read from /proc). Every job's process
group is killed when a test ends, whatever happened.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import dask
import pytest
import yaml
from distributed import Client

import dask_agents as da
from dask_agents.client_api import hosted_models
from dask_agents.scheduler_plugin.plugin import NAME as SCHEDULER_PLUGIN

dask_jobqueue = pytest.importorskip("dask_jobqueue")
from dask_jobqueue.slurm import SLURMJob  # noqa: E402

from examples.hpc import slurm as hpc  # noqa: E402

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL = ["--host", "127.0.0.1", "--dashboard-address", ":0"]  # the jobs' workers listen on 127.0.0.1 only

# -- a local sbatch / scancel --------------------------------------------------------------
FAKE_SLURM = r'''
"""A local stand-in for sbatch/scancel: `fake_slurm.py sbatch SCRIPT`, `fake_slurm.py scancel ID`."""
import os, shutil, signal, subprocess, sys, time

JOBS = {jobs!r}
REPO = {repo!r}


def group_alive(pgid):
    """Whether a process of group ``pgid`` is still running (zombies do not count)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{{d}}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


if sys.argv[1] == "sbatch":
    n = 0
    while True:  # reserve a name atomically: jobs are submitted concurrently (and bash reads its
        script = os.path.join(JOBS, f"job-{{n}}.sh")  # script as it runs: an overwrite would mix two)
        try:
            os.close(os.open(script, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            n += 1
    shutil.copy(sys.argv[-1], script)  # sbatch keeps its own copy; jobqueue deletes the file
    env = dict(os.environ)  # SLURM's default --export=ALL ...
    env["PYTHONPATH"] = os.pathsep.join([REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    log = open(script[:-3] + ".log", "wb")
    p = subprocess.Popen(["bash", script], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)  # ... from the submission dir
    with open(os.path.join(JOBS, "pids"), "a") as f:
        f.write(f"{{p.pid}}\n")
    print(f"Submitted batch job {{p.pid}}")
elif sys.argv[1] == "scancel":
    pgid = int(sys.argv[-1])
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not group_alive(pgid):
            break
    with open(os.path.join(JOBS, "cancelled"), "a") as f:
        f.write(f"{{pgid}}\n")
'''


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies do not count)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return [line.strip() for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _logs(jobs: str) -> str:
    out = []
    for name in sorted(os.listdir(jobs)):
        if name.endswith(".log"):
            with open(os.path.join(jobs, name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-4000:]}")
    return "\n".join(out)


def wait_for(pred: Callable[[], Any], what: str, jobs: str, timeout: float = 60.0) -> Any:
    """Poll ``pred`` until truthy; on timeout fail with the jobs' logs."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = pred()
            if value:
                return value
            last = value
        except Exception as e:  # not ready yet
            last = e
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})\n{_logs(jobs)}")
        time.sleep(0.1)


# -- (a) job scripts -------------------------------------------------------------------------
def _command(script: str) -> list[str]:
    """The worker command line of a job script."""
    lines = [s for s in script.splitlines() if "distributed.cli.dask_worker" in s]
    assert len(lines) == 1, script
    return shlex.split(lines[0])


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_job_scripts():
    scripts = hpc.job_scripts(hpc.engine_job_options(models=["coder", "chat"], gpus=2, cores=8),
                              hpc.agent_job_options(threads=64, cpus=4, agent_slots=512),
                              scheduler="tcp://10.0.0.1:8786")
    engine, agent = scripts["engine"], scripts["agent"]
    assert "#SBATCH --gres=gpu:2" in engine and "--gres" not in agent
    assert "#SBATCH --cpus-per-task=8" in engine and "#SBATCH --cpus-per-task=4" in agent
    assert "export DASK_DISTRIBUTED__WORKER__DAEMON=False" in engine
    assert "export DASK_AGENTS__WORKER__MODELS='[\"coder\", \"chat\"]'" in engine
    assert "export DASK_AGENTS__WORKER__MODELS='[]'" in agent
    e, a = _command(engine), _command(agent)
    assert e[1:3] == ["-m", "distributed.cli.dask_worker"] and e[3] == "tcp://10.0.0.1:8786"
    assert _opt(e, "--preload") == _opt(a, "--preload") == "dask_agents.preload"
    assert _opt(e, "--resources") == "GPU=2" and _opt(a, "--resources") == "agent=512"
    assert _opt(e, "--nthreads") == "8" and _opt(a, "--nthreads") == "64"
    assert "--nanny" in e and "--nanny" in a
    # the prologue runs before the worker starts
    assert engine.index("DASK_DISTRIBUTED__WORKER__DAEMON") < engine.index("distributed.cli.dask_worker")

    no_nanny = hpc.job_scripts(hpc.engine_job_options(nanny=False, config="/shared/dask-agents"))["engine"]
    assert "--no-nanny" in _command(no_nanny)
    assert "export DASK_CONFIG=/shared/dask-agents" in no_nanny


def test_tls_cluster(local_slurm, tmp_path):
    """With a Security object the scheduler listens on tls:// with the plugin; the job's worker
    command line carries the certificates jobqueue wrote for it; the job joins over TLS with
    the worker plugin, and an LLM call (emulated engine) and its telemetry go through."""
    from distributed.security import Security

    job_cls, jobs, config_dir = local_slurm
    engine = hpc.engine_job_options(models=["coder"], cores=2, memory="2GB", config=config_dir, worker_extra_args=LOCAL)
    with dask.config.set({"agents.llm.models": MODELS}):
        cluster = hpc.make_cluster(engine=engine, host="127.0.0.1", dashboard_address=":0", job_cls=job_cls,
                                   security=Security.temporary(), shared_temp_directory=str(tmp_path))
        try:
            assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
            assert SCHEDULER_PLUGIN in cluster.scheduler.plugins
            argv = _command(cluster.job_script())
            assert argv[3] == cluster.scheduler_address
            for opt in ("--tls-ca-file", "--tls-cert", "--tls-key"):
                assert os.path.isfile(_opt(argv, opt)), opt
            assert _opt(argv, "--preload") == "dask_agents.preload"

            cluster.scale(1)
            with Client(cluster, timeout="30s") as client:  # the cluster's Security
                (addr,) = wait_for(lambda: list(_agents_ping(client)["workers"]), "the job's hello over TLS", jobs,
                                   timeout=90)
                assert addr.startswith("tls://127.0.0.1:")
                with da.session(client, name="tls") as s:
                    r = da.llm("coder").generate("hello over TLS", max_tokens=4).value(timeout=60)
                assert r.output_tokens == 4 and r.worker == addr and r.emulated
                wait_for(lambda: da.telemetry(client, s)["started"].notna().all(), "the call's telemetry", jobs)
        finally:
            cluster.close(timeout=30)
    pids = [int(p) for p in _lines(os.path.join(jobs, "pids"))]
    assert len(pids) == 1
    wait_for(lambda: not any(_group_alive(p) for p in pids), "the job to end", jobs, timeout=30)


# -- (b) end to end with a local sbatch -------------------------------------------------------
EMU = {"engine": "emulated", "tokenizer": "byte",
       # ~0.2 s per 10-token call, 2 at a time: 10 calls/s per replica
       "emulation": {"max_batch": 2, "decode_s_per_step": 0.02, "prefill_s_per_token": 0.0, "time_scale": 1.0}}
MODELS = {"chat": {"model": "emulated-chat", **EMU}, "coder": {"model": "emulated-coder", **EMU}}
CONFIG = {
    "agents.llm.models": MODELS,
    "agents.control.interval": "50ms",
    "agents.control.policies.reallocate.options.persistence": 4,
    "agents.control.policies.reallocate.options.provision": True,
    "agents.control.policies.reallocate.options.provision-cooldown": "120s",
}


def _worker_state(dask_worker: Any) -> dict:
    """What the deployment promises on each worker (run there by ``client.run``)."""
    import multiprocessing

    plugin = dask_worker.plugins.get("dask-agents")
    out = {"plugin_ready": bool(plugin is not None and plugin.ready.is_set()),
           "daemon": multiprocessing.current_process().daemon,
           "models_env": os.environ.get("DASK_AGENTS__WORKER__MODELS"),
           "child_exitcode": None}
    if not out["daemon"]:  # what vLLM needs: a child process of the worker process
        import time as _time

        p = multiprocessing.get_context("spawn").Process(target=_time.sleep, args=(0,))
        p.start()
        p.join(60)
        out["child_exitcode"] = p.exitcode
    return out


def _kill(address: str, dask_scheduler: Any = None) -> int:
    from dask_agents.scheduler_plugin.actions import Kill

    return dask_scheduler.plugins[SCHEDULER_PLUGIN].control.enforcer.apply([Kill(address, reason="test")], "test")


def _provisions(dask_scheduler: Any = None) -> int:
    return dask_scheduler.plugins[SCHEDULER_PLUGIN].control.enforcer.stats()["applied"].get("provision", 0)


@pytest.fixture
def local_slurm(tmp_path):
    """(SLURMJob subclass running jobs here, jobs directory, Dask config directory)."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    fake = tmp_path / "fake_slurm.py"
    fake.write_text(FAKE_SLURM.format(jobs=str(jobs), repo=REPO))
    # the job's Dask config (what a real deployment keeps on the shared file system)
    config_dir = tmp_path / "dask-config"
    config_dir.mkdir()
    (config_dir / "agents.yaml").write_text(yaml.safe_dump({"agents": {"llm": {"models": MODELS}}}))
    job_cls = type("LocalSLURMJob", (SLURMJob,), {
        "submit_command": f"{shlex.quote(sys.executable)} {shlex.quote(str(fake))} sbatch",
        "cancel_command": f"{shlex.quote(sys.executable)} {shlex.quote(str(fake))} scancel",
    })
    try:
        yield job_cls, str(jobs), str(config_dir)
    finally:  # whatever happened: no job outlives the test
        for pid in _lines(str(jobs / "pids")):
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_slurm_deployment_end_to_end(local_slurm, tmp_path):
    job_cls, jobs, config_dir = local_slurm
    engine = hpc.engine_job_options(models=["chat", "coder"], cores=2, memory="2GB", config=config_dir,
                                    worker_extra_args=LOCAL, log_directory=str(tmp_path / "logs"))
    agent = hpc.agent_job_options(threads=8, cpus=1, memory="2GB", agent_slots=64, config=config_dir,
                                  worker_extra_args=LOCAL)
    with dask.config.set(CONFIG):
        cluster = hpc.make_cluster(engine=engine, host="127.0.0.1", dashboard_address=":0", job_cls=job_cls)
        try:
            script = cluster.job_script()
            assert cluster.scheduler_address in script and "--preload dask_agents.preload" in script
            cluster.scale(1)  # one engine job
            assert hpc.add_agent_workers(cluster, 1, agent) == ["agents-0"]
            with Client(cluster, timeout="30s") as client:
                _check_deployment(client, cluster, jobs)
                _check_provision_and_kill(client, cluster, jobs)
        finally:
            cluster.close(timeout=30)
    # cluster.close() cancelled the remaining jobs through scancel
    pids = [int(p) for p in _lines(os.path.join(jobs, "pids"))]
    assert len(pids) == 3
    wait_for(lambda: not any(_group_alive(p) for p in pids), "every job to end", jobs, timeout=30)
    assert sorted(int(p) for p in _lines(os.path.join(jobs, "cancelled"))) == sorted(pids)


def _hosted(client: Client) -> dict[str, list[str]]:
    """Model -> sorted addresses of the workers hosting it."""
    return {m: sorted(ws) for m, ws in hosted_models(client).items()}


def _agents_ping(client: Client) -> dict:
    """The scheduler plugin's ``agents_ping`` handler (workers that said hello)."""

    async def go() -> dict:
        return await client.scheduler.agents_ping()

    return client.sync(go)


def _check_deployment(client: Client, cluster: Any, jobs: str) -> None:
    """Both jobs join with the worker plugin ready, as their job scripts say; the workflow runs."""
    assert da.installed(client) is True  # from the scheduler's preload: nothing was registered

    def ready() -> dict | None:
        info = client.scheduler_info()["workers"]
        said_hello = _agents_ping(client)["workers"]
        if len(info) == 2 and all(a in said_hello for a in info):
            return {v["name"]: a for a, v in info.items()}
        return None

    by_name = wait_for(ready, "the engine and agent jobs to join", jobs, timeout=90)
    engine_name = f"{cluster._name}-0"
    assert set(by_name) == {engine_name, "agents-0"}, by_name
    gpu, cpu = by_name[engine_name], by_name["agents-0"]
    resources = {a: v["resources"] for a, v in client.scheduler_info()["workers"].items()}
    assert resources == {gpu: {"GPU": 1}, cpu: {"agent": 64}}
    nthreads = client.nthreads()
    assert nthreads == {gpu: 2, cpu: 8}

    state = client.run(_worker_state)
    assert state[gpu] == {"plugin_ready": True, "daemon": False, "models_env": '["chat", "coder"]',
                          "child_exitcode": 0}, state
    assert state[cpu]["plugin_ready"] and state[cpu]["models_env"] == "[]"
    names = client.run(lambda dask_worker: "dask-agents" in dask_worker.plugins)
    assert names == {gpu: True, cpu: True}
    wait_for(lambda: _hosted(client) == {"chat": [gpu], "coder": [gpu]}, "the engine's models", jobs)

    # the example's workflow: agents on the agent worker, LLM calls on the engine worker
    summary, sid = hpc.run_workflow(client, [f"fix bug #{i}" for i in range(4)], model="coder")
    assert summary.startswith("4 reviews, ")

    def finished() -> Any:
        df = da.telemetry(client, sid)
        done = len(df) == 9 and (df["state"] == "finished").all() and df["started"].notna().all()
        return (df,) if done else None

    (df,) = wait_for(finished, "the workflow's telemetry", jobs)
    where = df.groupby("component")["worker"].agg(lambda w: sorted(set(w))).to_dict()
    assert where == {"Reviewer": [cpu], "summarize": [cpu], "llm.coder": [gpu]}, where
    assert df[df["component"] == "llm.coder"]["emulated"].eq(True).all()


def _check_provision_and_kill(client: Client, cluster: Any, jobs: str) -> None:
    """Under load on ``coder`` with no donor, ``reallocate`` provisions an engine job through
    the cluster manager; a ``Kill`` of that worker cancels its job."""
    link = da.attach_cluster(client, cluster, interval="100ms", max_workers=3)
    try:
        before = set(cluster.worker_spec)
        futs: list = []
        t0, i = time.monotonic(), 0
        while not client.run_on_scheduler(_provisions) and time.monotonic() - t0 < 60:
            with da.session(client, name=f"load{i}"):
                futs.append(da.llm("coder").generate(f"request {i}", max_tokens=10))
            i += 1
            time.sleep(0.05)  # inter-arrival time of the workload (20 calls/s against ~10/s)
        assert client.run_on_scheduler(_provisions) == 1, _logs(jobs)
        wait_for(lambda: link.added == 1, "the link to scale the cluster", jobs, timeout=30)
        (new_name,) = set(cluster.worker_spec) - before
        assert new_name == f"{cluster._name}-1"

        def new_worker() -> str | None:
            for addr, v in client.scheduler_info()["workers"].items():
                if v["name"] == new_name and addr in _hosted(client).get("coder", []):
                    return addr
            return None

        new = wait_for(new_worker, "the provisioned engine job to serve coder", jobs, timeout=90)
        results = client.gather(futs)  # nothing lost while the cluster grew
        assert len(results) == len(futs) and all(r.output_tokens == 10 for r in results)

        job_id = int(cluster.workers[new_name].job_id)
        assert _group_alive(job_id)
        assert client.run_on_scheduler(_kill, new) == 1
        wait_for(lambda: link.removed == [new_name] and new_name not in cluster.worker_spec
                 and new not in client.scheduler_info()["workers"], "the kill to go through the cluster", jobs)
        wait_for(lambda: str(job_id) in _lines(os.path.join(jobs, "cancelled")), "scancel of the job", jobs)
        wait_for(lambda: not _group_alive(job_id), "the killed job's processes to end", jobs, timeout=30)
        left = sorted(v["name"] for v in client.scheduler_info()["workers"].values())
        assert left == sorted([f"{cluster._name}-0", "agents-0"]) and new not in _hosted(client)["coder"]
        # the cluster keeps serving on what is left
        r = da.llm("coder").generate("after the kill", max_tokens=4)
        assert r.value(timeout=60).output_tokens == 4
    finally:
        link.stop()


def test_example_main(local_slurm, monkeypatch, capsys):
    """``python examples/hpc/slurm.py ...`` as a user runs it, with the local sbatch."""
    import copy

    job_cls, jobs, config_dir = local_slurm
    monkeypatch.setattr(dask_jobqueue.SLURMCluster, "job_cls", job_cls)
    saved = copy.deepcopy(dask.config.config)  # main() loads --config into this process's config
    try:
        hpc.main(["--engine-jobs", "1", "--agent-jobs", "1", "--config", config_dir, "--host", "127.0.0.1",
                  "--dashboard-address", ":0", "--timeout", "90"])
    except Exception as e:  # say why a job did not come up: its own log
        pytest.fail(f"{type(e).__name__}: {e}\n{_logs(jobs)}")
    finally:
        dask.config.config.clear()
        dask.config.config.update(saved)
    out = capsys.readouterr().out
    assert "2 workers up" in out and "8 reviews, " in out, out
    assert "llm.coder" in out and "Reviewer" in out
    pids = [int(p) for p in _lines(os.path.join(jobs, "pids"))]
    assert len(pids) == 2
    wait_for(lambda: not any(_group_alive(p) for p in pids), "every job to end", jobs, timeout=30)


def test_example_config_is_valid():
    """``examples/hpc/agents.yaml`` passes the config schema and, merged over the shipped
    defaults (as Dask merges it), gives valid model settings; its GPU engines need the
    non-daemonic workers the engine jobs provide."""
    from dask_agents.config import DEFAULTS, validate
    from dask_agents.model_settings import ModelSettings

    with open(os.path.join(REPO, "examples", "hpc", "agents.yaml")) as f:
        cfg = yaml.safe_load(f)
    validate(cfg["agents"])
    merged = dask.config.merge(DEFAULTS, cfg)
    models = {name: ModelSettings(**entry) for name, entry in merged["agents"]["llm"]["models"].items()}
    assert set(models) == {"coder", "chat"}
    assert {m.engine for m in models.values()} == {"vllm-async"}
    assert all(m.load_format == "auto" and m.tokenizer == "auto" for m in models.values())
    assert "export DASK_DISTRIBUTED__WORKER__DAEMON=False" in hpc.job_scripts()["engine"]
