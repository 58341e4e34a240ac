"""A new user's fan-out workflow on dask-agents against plain Dask calling the same engines inline.

    .venv/bin/python benchmarks/fanout.py --json benchmarks/results/fanout.json [--rounds 3] [--requests 12]

The workflow (``benchmarks/fanout_app.py``): a researcher plans, runs 3 searches (3 ms tool),
9 readers call the LLM (~300-token prompts, 16 output tokens), a writer drafts and a stateful
critic sends the draft back 0-3 times; ``--requests`` requests at once on 2 worker processes
(``--threads`` threads each), each worker hosting the shipped tiny model on a REAL vLLM CPU
engine. Each round starts a fresh cluster per variant (variants in alternating order), warms it
with 2 requests, then times one batch of ``--requests`` concurrent requests (the same questions
for both variants of a round): each request's latency (submitted -> its result at the driver)
and the CPU seconds the worker processes burned during the batch (psutil, all their threads:
engines, agents, Dask). Reported: per round the ratio dask-agents / plain Dask of mean latency
and of worker CPU, and their median over rounds with the [min, max] spread; for dask-agents,
how many calls of each kind took the worker-local fast path.

The machine's cores are shared by the driver (with the scheduler: a LocalCluster's scheduler
runs in the driver's process), the workers and their engines: the ratios say how the two drive
the same engines on the same cores, not how fast a GPU is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dask  # noqa: E402
from distributed import Client, LocalCluster, as_completed  # noqa: E402

import dask_agents as da  # noqa: E402
from benchmarks import fanout_app as app  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # (the workers inherit it) engine logs off the run's output
VARIANTS = ("dask", "dask-agents")
WARMUP = 2


def _cpu_seconds() -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return t.user + t.system


def _engine_counters(dask_worker: Any) -> dict:
    """This worker's engine counters (steps, tokens), whichever variant hosts it."""
    plugin = dask_worker.plugins.get(app.PLUGIN)
    host = getattr(plugin, "host", None)
    if host is None:
        engines = getattr(dask_worker.plugins.get("dask-agents"), "engines", None)
        host = engines.start(app.MODEL) if engines is not None and app.MODEL in engines.hosted else None
    return {} if host is None else {k: v for k, v in host.stats().items() if isinstance(v, (int, float))}


def questions(round_: int, n: int, tag: str) -> list[str]:
    """The questions of one batch: the same for both variants of a round."""
    return [f"{tag} r{round_} q{i}: " + app.text(f"{tag}/{round_}/{i}", 200) for i in range(n)]


@contextlib.contextmanager
def cluster(variant: str, threads: int) -> Iterator[Client]:
    """Two worker processes with an engine each, for ``variant``."""
    stack = contextlib.ExitStack()
    with stack:
        if variant == "dask-agents":
            stack.enter_context(dask.config.set({"agents.llm.models": {app.MODEL: dict(app.ENTRY)}}))
        lc = stack.enter_context(LocalCluster(n_workers=2, threads_per_worker=threads, processes=True,
                                              dashboard_address=None))
        client = stack.enter_context(Client(lc))
        if variant == "dask-agents":
            da.install(client, models=[app.MODEL])  # returns once the engines have loaded
        else:
            client.register_plugin(app.EngineHostPlugin())  # each worker loads its engine in setup
        yield client


def submit(variant: str, client: Client, qs: list[str]) -> dict:
    """Submit one request per question at once; futures -> (question, submitted time)."""
    out: dict = {}
    for q in qs:
        t = time.perf_counter()
        if variant == "dask-agents":
            with da.session(client, name=q.split(":")[0].replace(" ", "-")):
                f = da.stub(app.Researcher).answer(q)
        else:
            f = client.submit(app.research_task, q, pure=False)
        out[f] = (q, t)
    return out


def batch(variant: str, client: Client, qs: list[str]) -> dict:
    """Run one batch to its end: latencies and what each request returned."""
    subs = submit(variant, client, qs)
    lat, answers = [], []
    for f in as_completed(list(subs)):
        v = f.result()
        q, t = subs[f]
        lat.append(time.perf_counter() - t)
        if v["notes"] != app.SEARCHES * app.DOCS_PER_SEARCH or v["send_backs"] != app.send_backs(q):
            raise RuntimeError(f"{variant}: wrong answer for {q[:20]!r}: {v}")
        answers.append(v)
    return {"latencies_s": lat, "send_backs": sum(a["send_backs"] for a in answers)}


def fast_path_shares(client: Client) -> dict:
    """dask-agents: per component, its calls in the run (warm-up included) and how many took the
    worker-local fast path."""
    df = da.telemetry(client)
    if df is None or len(df) == 0 or "fast_path" not in df:
        return {}
    g = df.groupby("component")["fast_path"].agg(["count", "sum"])
    return {str(k): {"calls": int(r["count"]), "fast_path": int(r["sum"])} for k, r in g.iterrows()}


def run_variant(variant: str, round_: int, requests: int, threads: int) -> dict:
    t0 = time.perf_counter()
    with cluster(variant, threads) as client:
        started = time.perf_counter() - t0
        batch(variant, client, questions(round_, WARMUP, "warm"))
        cpu0 = client.run(_cpu_seconds)
        eng0 = client.run(_engine_counters)
        w0 = time.perf_counter()
        out = batch(variant, client, questions(round_, requests, "req"))
        wall = time.perf_counter() - w0
        cpu1 = client.run(_cpu_seconds)
        eng1 = client.run(_engine_counters)
        shares = fast_path_shares(client) if variant == "dask-agents" else None
    lat = out["latencies_s"]
    return {"variant": variant, "round": round_, "startup_s": round(started, 1), "wall_s": wall,
            "mean_s": statistics.fmean(lat), "p90_s": sorted(lat)[int(0.9 * (len(lat) - 1))],
            "latencies_s": lat, "send_backs": out["send_backs"],
            "worker_cpu_s": sum(cpu1[a] - cpu0[a] for a in cpu1),
            "engines": {a: {k: eng1[a].get(k, 0) - eng0.get(a, {}).get(k, 0) for k in eng1[a]} for a in eng1},
            "fast_path": shares}


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": xs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--threads", type=int, default=16, help="threads per worker (both variants)")
    a = ap.parse_args(argv)
    runs: list[dict] = []
    for r in range(a.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            res = run_variant(v, r, a.requests, a.threads)
            runs.append(res)
            print(f"round {r} {v:12s} mean {res['mean_s']:.2f} s  p90 {res['p90_s']:.2f} s  "
                  f"worker CPU {res['worker_cpu_s']:.1f} s  (start {res['startup_s']} s)", flush=True)
    by = {(x["variant"], x["round"]): x for x in runs}
    lat = [by["dask-agents", r]["mean_s"] / by["dask", r]["mean_s"] for r in range(a.rounds)]
    cpu = [by["dask-agents", r]["worker_cpu_s"] / by["dask", r]["worker_cpu_s"] for r in range(a.rounds)]
    result = {"benchmark": "fanout", "command": " ".join(["benchmarks/fanout.py", *(argv or sys.argv[1:])]),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "config": {"rounds": a.rounds, "requests": a.requests, "threads": a.threads, "warmup": WARMUP,
                         "engine": app.ENTRY, "workflow": {"searches": app.SEARCHES, "docs": app.DOCS_PER_SEARCH,
                                                           "prompt_tokens": app.PROMPT_TOKENS,
                                                           "out_tokens": app.OUT_TOKENS, "tool_s": app.TOOL_S}},
              "ratios": {"mean_latency": spread(lat), "worker_cpu": spread(cpu)}, "runs": runs}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"dask-agents / plain Dask, median [min, max] of {a.rounds} paired rounds: mean latency "
          f"{statistics.median(lat):.2f}x [{min(lat):.2f}, {max(lat):.2f}], worker CPU "
          f"{statistics.median(cpu):.2f}x [{min(cpu):.2f}, {max(cpu):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
