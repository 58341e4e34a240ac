"""dask-agents on a SLURM cluster through dask-jobqueue.

The scheduler runs here (the login node) with ``--preload dask_agents.preload``; every
SLURM job runs one ``dask worker --preload dask_agents.preload`` on a GPU node that hosts
the ``coder`` model (``agents.worker.models``, set in the job script's prologue). Nothing
else is needed: no ``da.install(client)`` call, and workers that join later (``scale``,
``adapt``, restarted jobs) get the worker plugin from their own preload.

    python examples/hpc/slurm.py --print-script            # show the job script (no SLURM needed)
    python examples/hpc/slurm.py --jobs 2 --queue gpu      # submit 2 jobs, run a tiny workflow

Needs ``pip install dask-agents[hpc]`` (dask-jobqueue) and the ``gpu`` extra on the nodes.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from distributed import Client

import dask_agents as da
from dask_agents.client_api import hosted_models

PRELOAD = "dask_agents.preload"


def job_options(*, queue: str | None = None, account: str | None = None, walltime: str = "01:00:00",
                cores: int = 8, memory: str = "64GB") -> dict:
    """The SLURM job (= one GPU worker) that dask-jobqueue submits per ``scale`` step."""
    return dict(
        queue=queue,
        account=account,
        walltime=walltime,
        cores=cores,
        memory=memory,
        processes=1,  # one worker process per job: it owns the job's GPU and the model engine
        worker_extra_args=["--preload", PRELOAD, "--resources", "GPU=1"],
        job_extra_directives=["--gres=gpu:1"],
        job_script_prologue=[
            # vLLM starts processes of its own: a daemonic Dask worker process cannot
            "export DASK_DISTRIBUTED__WORKER__DAEMON=False",
            # the models this worker hosts (names under agents.llm.models), loaded at start
            "export DASK_AGENTS__WORKER__MODELS='[\"coder\"]'",
        ],
    )


def make_cluster(host: str | None = None, **job: Any):
    """A SLURMCluster whose scheduler (here) and workers (in the jobs) load the preload."""
    from dask_jobqueue import SLURMCluster

    scheduler_options = {"preload": [PRELOAD], "dashboard_address": ":8787"}
    if host:
        scheduler_options["host"] = host  # an address the compute nodes can reach
    return SLURMCluster(scheduler_options=scheduler_options, **job_options(**job))


def job_script(**job: Any) -> str:
    """The job script ``make_cluster`` would submit, without starting a scheduler."""
    from dask_jobqueue import SLURMCluster

    return SLURMCluster.job_cls(scheduler="tcp://<scheduler-address>:8786", name="dask-worker",
                                **job_options(**job)).job_script()


@da.agent(model="coder")
class Reviewer:
    """A tiny agent: asks the model about a change and keeps the first line of the answer."""

    def review(self, change: str) -> str:
        answer = da.llm("coder").generate(f"Review this change:\n{change}\n", max_tokens=32).result()
        return (answer.text.splitlines() or [""])[0]


@da.tool(kind="custom")
def summarize(reviews: list[str]) -> str:
    return f"{len(reviews)} reviews, {sum(len(r) for r in reviews)} characters"


def run_workflow(client: Client, changes: list[str]) -> str:
    reviewer = da.stub(Reviewer)
    with da.session(client, name="slurm-demo") as s:
        reviews = [reviewer.review(c) for c in changes]  # AgentFutures, returned at once
        summary = da.stub(summarize)(reviews)  # futures as arguments become dependencies
        out = summary.result()
    print(da.telemetry(client, s)[["component", "method", "state", "worker"]].to_string(index=False))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print-script", action="store_true", help="print the SLURM job script and exit")
    p.add_argument("--jobs", type=int, default=1, help="SLURM jobs (one GPU worker each)")
    p.add_argument("--queue", default=None, help="SLURM partition")
    p.add_argument("--account", default=None, help="SLURM account")
    p.add_argument("--walltime", default="01:00:00")
    p.add_argument("--host", default=None, help="scheduler address reachable from the compute nodes")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the workers")
    args = p.parse_args(argv)

    job = dict(queue=args.queue, account=args.account, walltime=args.walltime)
    if args.print_script:
        print(job_script(**job))
        return
    cluster = make_cluster(host=args.host, **job)
    try:
        cluster.scale(jobs=args.jobs)
        with Client(cluster) as client:
            assert da.installed(client), "the scheduler did not load dask_agents.preload"
            t0 = time.time()
            client.wait_for_workers(args.jobs, timeout=args.timeout)
            print(f"{args.jobs} worker(s) up in {time.time() - t0:.0f}s; models: {hosted_models(client)}")
            print(run_workflow(client, [f"fix bug #{i}" for i in range(4)]))
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
