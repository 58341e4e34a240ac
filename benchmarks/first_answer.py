"""First use, timed: how long a new user waits for the first answer of the built-in model.

Each round is a fresh ``python`` process running what the README's Quickstart runs (a
``LocalCluster`` of 2 worker processes, ``da.install(client, models=["coder"])``, one
``generate``), timed in phases from that process's own clock: ``cluster_s`` (the cluster up),
``install_s`` (the plugins installed and every engine loaded: vLLM imported in the engine's
process, the dummy weights made, the KV cache allocated), ``first_answer_s`` (the first LLM
call, from submit to its result) and ``to_answer_s`` = install + first answer (the wait after
the cluster is up: issue 30's "first answer <= 10 s"). It also counts the lines the run printed
to stderr at the default log level (library noise). Rounds are sequential and fresh; medians
and [min, max] are reported. REAL engines (vLLM CPU build, the tiny dummy-weight model).

    .venv/bin/python benchmarks/first_answer.py --rounds 3 --json benchmarks/results/first-answer.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROUND = r'''
import json, sys, time
t0 = time.time()
from distributed import Client, LocalCluster
import dask_agents as da
if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=4, dashboard_address=":0") as cluster, Client(cluster) as client:
        t1 = time.time()
        da.install(client, models=["coder"])
        t2 = time.time()
        with da.session(client):
            r = da.llm("coder").generate("def parse(text):", max_tokens=16).value()
        t3 = time.time()
        print("ROUND " + json.dumps({"cluster_s": t1 - t0, "install_s": t2 - t1, "first_answer_s": t3 - t2,
                                     "to_answer_s": t3 - t1, "tokens": r.output_tokens}))
'''


def one_round(tmp: str) -> dict:
    """One fresh process; its phases and its stderr line count."""
    path = os.path.join(tmp, "first_answer_round.py")
    with open(path, "w") as f:
        f.write(ROUND)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    t = time.time()
    run = subprocess.run([sys.executable, path], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    line = next(x for x in run.stdout.splitlines() if x.startswith("ROUND "))
    out = json.loads(line[len("ROUND "):])
    out["process_s"] = time.time() - t
    out["stderr_lines"] = len([x for x in run.stderr.splitlines() if x.strip()])
    out["stderr"] = run.stderr.splitlines()[:40]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the rounds and medians here")
    a = p.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rounds = [one_round(tmp) for _ in range(a.rounds)]
    keys = ("cluster_s", "install_s", "first_answer_s", "to_answer_s", "stderr_lines")
    summary = {k: {"median": statistics.median(r[k] for r in rounds), "min": min(r[k] for r in rounds),
                   "max": max(r[k] for r in rounds)} for k in keys}
    for k in keys:
        s = summary[k]
        print(f"{k:16s} median {s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]")
    out = {"config": {"rounds": a.rounds, "cpus": os.cpu_count(), "python": sys.version.split()[0],
                      "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "engine": "REAL vLLM CPU, builtin:tiny-llama"},
           "rounds": rounds, "summary": summary}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
