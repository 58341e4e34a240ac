"""dask-agents on a SLURM cluster through dask-jobqueue 0.9.0.

One Dask cluster, two kinds of SLURM jobs:

* the **scheduler** runs here (the login node, inside ``SLURMCluster``) with
  ``preload: dask_agents.preload``: the global controller (scheduler plugin) is there
  from the start, with no ``da.install(client)`` call;
* **engine jobs** (``--gres=gpu:1``): one ``dask worker --preload dask_agents.preload
  --resources GPU=1`` per job hosting the models in ``agents.worker.models`` (vLLM on the
  job's GPU), under a Nanny whose worker process is *not daemonic*
  (``DASK_DISTRIBUTED__WORKER__DAEMON=False``) so vLLM may start processes of its own;
  these are the jobs the control plane adds and removes (``Provision``, which the
  ``reallocate`` policy asks for, and ``Kill``) once ``da.attach_cluster(client, cluster)``
  links the cluster to it;
* **agent jobs** (CPU only): many threads (agents mostly wait on LLMs and tools) and an
  ``agent`` resource that keeps agent code off the GPU nodes.

Everything else comes from Dask config: ``--config DIR`` names a Dask config directory on
the shared file system (for example with ``examples/hpc/agents.yaml`` in it) that is
loaded here and exported as ``DASK_CONFIG`` in every job, so the scheduler, the client and
all workers see the same ``agents.*`` settings (models, policies).

    python examples/hpc/slurm.py --print-script              # both job scripts; no SLURM needed
    python examples/hpc/slurm.py --queue gpu --cpu-queue cpu --config /shared/dask-agents \\
        --engine-jobs 2 --agent-jobs 1 --provision 4        # submit, run a tiny workflow

Needs ``pip install dask-agents[hpc]`` (dask-jobqueue) here and ``dask-agents[gpu]`` (CUDA
vLLM) in the environment the jobs run (by default the same ``python`` as here: a shared
file system). ``tests/test_hpc.py`` runs these job scripts for real on one machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections.abc import Sequence
from typing import Any

import dask
from distributed import Client

import dask_agents as da
from dask_agents.client_api import hosted_models

PRELOAD = "dask_agents.preload"
AGENT_RESOURCE = "agent"  # agent jobs advertise it; agent components ask for one unit per call
ENGINE_JOB_NAME = "dask-agents-engine"
AGENT_JOB_NAME = "dask-agents-agent"
AGENT_WORKER_PREFIX = "agents"  # worker names of agent jobs: agents-0, agents-1, ...


# -- job definitions ---------------------------------------------------------------------------
def _prologue(env: dict[str, str], config: str | None, extra: Sequence[str]) -> list[str]:
    lines = [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]
    if config:
        # the same agents.* settings as the scheduler and the client
        lines.append(f"export DASK_CONFIG={shlex.quote(config)}")
    return lines + list(extra)


def engine_job_options(*, models: Sequence[str] = ("coder",), gpus: int = 1, cores: int = 8,
                       memory: str = "64GB", nanny: bool = True, queue: str | None = None,
                       account: str | None = None, walltime: str = "01:00:00", config: str | None = None,
                       python: str | None = None, extra_prologue: Sequence[str] = (),
                       worker_extra_args: Sequence[str] = (), log_directory: str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``SLURMJob`` for one GPU engine worker (one worker process per job).

    ``models``: names under ``agents.llm.models`` the worker loads at start (its GPU hosts
    them). ``nanny=True`` keeps a Nanny (it restarts a worker process that dies, e.g. on a
    CUDA fault) and makes the worker process non-daemonic; ``nanny=False`` runs the worker in
    the job's main process (``--no-nanny``: non-daemonic too, but nothing restarts it).
    ``extra_prologue``: more job script lines (``module load cuda``, ``export HF_HUB_OFFLINE=1``);
    ``worker_extra_args``: more ``dask worker`` options (``--lifetime 55m --lifetime-stagger 4m``
    to retire workers before the walltime kills them, ``--local-directory $TMPDIR``).
    """
    env = {
        # the models this worker hosts, loaded when the worker starts
        "DASK_AGENTS__WORKER__MODELS": json.dumps(list(models)),
        # a Nanny's worker process is daemonic by default, and a daemonic process cannot
        # have children: vLLM's engine-core process, tensor-parallel workers, compile pools
        "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
    }
    return dict(
        queue=queue, account=account, walltime=walltime, cores=cores, memory=memory,
        processes=1,  # one worker per job: it owns the job's GPU(s) and engine(s)
        nanny=nanny, python=python, job_name=ENGINE_JOB_NAME, log_directory=log_directory,
        worker_extra_args=["--preload", PRELOAD, "--resources", f"GPU={gpus}", *worker_extra_args],
        job_extra_directives=[f"--gres=gpu:{gpus}"],
        job_script_prologue=_prologue(env, config, extra_prologue),
    )


def agent_job_options(*, threads: int = 64, cpus: int = 4, memory: str = "16GB", agent_slots: int = 1024,
                      nanny: bool = True, queue: str | None = None, account: str | None = None,
                      walltime: str = "01:00:00", config: str | None = None, python: str | None = None,
                      extra_prologue: Sequence[str] = (), worker_extra_args: Sequence[str] = (),
                      log_directory: str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``SLURMJob`` for one CPU agent worker.

    Agents spend most of their time waiting on LLM and tool calls (and secede from the
    thread pool while they wait), so the worker runs ``threads`` threads on ``cpus`` booked
    CPUs (``job_cpu``), and hosts no model. ``agent_slots`` units of the ``agent`` resource
    bound how many agent calls it runs at once. ``extra_prologue``, ``worker_extra_args``: as
    in :func:`engine_job_options`.
    """
    env = {"DASK_AGENTS__WORKER__MODELS": "[]"}  # no engine here: LLM calls go to engine workers
    return dict(
        queue=queue, account=account, walltime=walltime,
        cores=threads, job_cpu=cpus,  # --nthreads threads, --cpus-per-task cpus
        memory=memory, processes=1, nanny=nanny, python=python, job_name=AGENT_JOB_NAME,
        log_directory=log_directory,
        worker_extra_args=["--preload", PRELOAD, "--resources", f"{AGENT_RESOURCE}={agent_slots}",
                           *worker_extra_args],
        job_script_prologue=_prologue(env, config, extra_prologue),
    )


def make_cluster(*, engine: dict[str, Any] | None = None, host: str | None = None,
                 dashboard_address: str = ":8787", security: Any = None, job_cls: type | None = None,
                 scheduler_options: dict[str, Any] | None = None, **cluster_kwargs: Any) -> Any:
    """A ``SLURMCluster`` whose scheduler (here) loads the preload and whose jobs are engine jobs.

    ``engine``: ``engine_job_options(...)`` (default: one GPU, model ``coder``). ``host``: an
    address of this machine the compute nodes can reach. ``security``: a
    ``distributed.security.Security`` (TLS everywhere; jobqueue writes temporary certificates
    to ``shared_temp_directory`` and adds the ``--tls-*`` options to the worker command line).
    ``job_cls``: a ``SLURMJob`` subclass (tests run the jobs locally). Other keywords go to
    ``SLURMCluster`` (``name``, ``shared_temp_directory``, ...).

    ``cluster.scale(n)`` and ``da.attach_cluster`` add and remove *engine* jobs; agent jobs
    are added with :func:`add_agent_workers`.
    """
    from dask_jobqueue import SLURMCluster

    options: dict[str, Any] = {"preload": [PRELOAD], "dashboard_address": dashboard_address,
                               **(scheduler_options or {})}
    if host:
        options["host"] = host
    kwargs = {**(engine if engine is not None else engine_job_options()), **cluster_kwargs}
    if job_cls is not None:
        kwargs["job_cls"] = job_cls
    return SLURMCluster(scheduler_options=options, security=security, **kwargs)


def _shared_job_kwargs(cluster: Any) -> dict:
    """What the cluster decided for all of its jobs (TLS files, interface, protocol), so an
    added job of another kind joins the same way. dask-jobqueue keeps it in the private
    ``JobQueueCluster._job_kwargs`` (0.9.0, pinned in setup.cfg; ``tests/test_hpc.py`` runs a
    TLS deployment through it): if a release renames it, this fails loudly, not silently."""
    import dask_jobqueue

    kwargs = getattr(cluster, "_job_kwargs", None)
    if not isinstance(kwargs, dict):
        raise RuntimeError(f"dask-jobqueue {getattr(dask_jobqueue, '__version__', '?')} has no "
                           "JobQueueCluster._job_kwargs: this example supports dask-jobqueue 0.9")
    return {k: kwargs[k] for k in ("config_name", "interface", "protocol", "security") if k in kwargs}


def add_agent_workers(cluster: Any, n: int, options: dict[str, Any] | None = None) -> list[str]:
    """Add ``n`` agent jobs to ``cluster`` and submit them; returns their worker names.

    A SpecCluster may mix worker kinds: these are entries of ``cluster.worker_spec`` with
    the agent job's options (``agent_job_options``) beside the engine jobs, so
    ``cluster.close()`` cancels them with the rest. The control plane never removes them (it
    kills engine workers by name) and adds engine jobs with ``cluster.scale(len(worker_spec)
    + k)``. Do not shrink the cluster with ``cluster.scale(n)`` yourself: Dask drops the
    newest entries, whatever their kind; use ``cluster.scale_down(names)``.
    """
    shared = _shared_job_kwargs(cluster)
    opts = {**(options if options is not None else agent_job_options()), **shared}
    names: list[str] = []
    i = 0
    while len(names) < n:
        name = f"{AGENT_WORKER_PREFIX}-{i}"
        i += 1
        if name not in cluster.worker_spec:
            cluster.worker_spec[name] = {"cls": cluster.job_cls, "options": dict(opts)}
            names.append(name)
    cluster.scale(len(cluster.worker_spec))  # same size: only submits what is not running yet
    return names


def job_scripts(engine: dict[str, Any] | None = None, agent: dict[str, Any] | None = None,
                scheduler: str = "tcp://<scheduler-address>:8786") -> dict[str, str]:
    """The two job scripts (``engine``, ``agent``) without starting a scheduler."""
    from dask_jobqueue.slurm import SLURMJob

    engine = engine if engine is not None else engine_job_options()
    agent = agent if agent is not None else agent_job_options()
    return {"engine": SLURMJob(scheduler=scheduler, name="SLURMCluster-0", **engine).job_script(),
            "agent": SLURMJob(scheduler=scheduler, name=f"{AGENT_WORKER_PREFIX}-0", **agent).job_script()}


def use_config(path: str | None) -> None:
    """Load the Dask config directory (or file) ``path`` here: the scheduler and the client
    read ``agents.*`` (models, policies) from this process's config."""
    if path:
        dask.config.refresh(paths=[*dask.config.paths, path])


# -- a tiny workflow ---------------------------------------------------------------------------
@da.agent(resources={AGENT_RESOURCE: 1})
class Reviewer:
    """A tiny agent (runs on an agent worker): asks a model about a change, keeps one line."""

    def review(self, change: str, model: str = "coder") -> str:
        answer = da.llm(model).generate(f"Review this change:\n{change}\n", max_tokens=16).value(timeout=300)
        return (answer.text.splitlines() or [""])[0]


@da.tool(kind="custom", resources={AGENT_RESOURCE: 1})
def summarize(reviews: list[str]) -> str:
    """Join the reviews' sizes into one line."""
    return f"{len(reviews)} reviews, {sum(len(r) for r in reviews)} characters"


def run_workflow(client: Client, changes: Sequence[str], model: str = "coder", name: str = "slurm-demo") -> tuple[str, str]:
    """Review ``changes`` in parallel, then summarize; returns (summary, session id)."""
    reviewer = da.stub(Reviewer)
    with da.session(client, name=name) as s:
        reviews = [reviewer.review(c, model) for c in changes]  # AgentFutures, returned at once
        summary = da.stub(summarize)(reviews)  # futures as arguments become dependencies
        out = summary.value(timeout=600)
    return out, s.id


# -- command line ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """Submit engine and agent jobs, link the cluster to the control plane, run the workflow."""
    p = argparse.ArgumentParser(prog="python -m examples.hpc.slurm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print-script", action="store_true", help="print both job scripts and exit")
    p.add_argument("--engine-jobs", type=int, default=1, help="GPU engine jobs at start")
    p.add_argument("--agent-jobs", type=int, default=1, help="CPU agent jobs")
    p.add_argument("--provision", type=int, default=0,
                   help="let the reallocate policy grow engine jobs up to this many (0: never)")
    p.add_argument("--models", default="coder", help="comma-separated models each engine job hosts")
    p.add_argument("--queue", default=None, help="SLURM partition of the engine (GPU) jobs")
    p.add_argument("--cpu-queue", default=None, help="SLURM partition of the agent jobs (default: --queue)")
    p.add_argument("--account", default=None, help="SLURM account")
    p.add_argument("--walltime", default="01:00:00")
    p.add_argument("--config", default=None, help="Dask config directory on the shared file system")
    p.add_argument("--host", default=None, help="scheduler address reachable from the compute nodes")
    p.add_argument("--dashboard-address", default=":8787", help="the scheduler's dashboard (and /agents page)")
    p.add_argument("--no-nanny", action="store_true", help="engine workers without a Nanny")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the jobs to start")
    args = p.parse_args(argv)

    models = [m for m in args.models.split(",") if m]
    common = dict(account=args.account, walltime=args.walltime, config=args.config)
    engine = engine_job_options(models=models, queue=args.queue, nanny=not args.no_nanny, **common)
    agent = agent_job_options(queue=args.cpu_queue or args.queue, **common)
    if args.print_script:
        for kind, script in job_scripts(engine, agent).items():
            print(f"# ---- {kind} job ----\n{script}")
        return

    use_config(args.config)
    if args.provision:
        dask.config.set({"agents.control.policies.reallocate.options.provision": True})
    cluster = make_cluster(engine=engine, host=args.host, dashboard_address=args.dashboard_address)
    try:
        cluster.scale(args.engine_jobs)
        add_agent_workers(cluster, args.agent_jobs, agent)
        with Client(cluster) as client:
            assert da.installed(client), "the scheduler did not load dask_agents.preload"
            link = da.attach_cluster(client, cluster, max_workers=args.agent_jobs + max(args.provision, args.engine_jobs))
            t0 = time.time()
            client.wait_for_workers(args.engine_jobs + args.agent_jobs, timeout=args.timeout)
            print(f"{len(client.scheduler_info()['workers'])} workers up in {time.time() - t0:.0f}s; "
                  f"models: {hosted_models(client)}")
            summary, _ = run_workflow(client, [f"fix bug #{i}" for i in range(8)], model=models[0])
            print(summary)
            print(da.telemetry(client)[["component", "method", "state", "worker"]].to_string(index=False))
            print(f"control plane: added {link.added} engine job(s), removed {link.removed}")
            link.stop()
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
