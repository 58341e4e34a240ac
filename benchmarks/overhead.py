"""Per-call overhead of dask-agents, measured side by side with plain Dask in one run.

What is measured
----------------
*Sequential* calls of a no-op: each call waits for its result before the next one is made,
so the numbers are per-call latency and per-call CPU cost, not throughput under concurrency.
Five variants:

``native``
    Calling the no-op Python function directly (the floor).
``plain_dask``
    ``client.submit(noop, i, pure=False).result()`` on a fresh in-process
    ``LocalCluster(n_workers=1, threads_per_worker=4, processes=False)`` *without*
    dask-agents installed (Dask's default batching windows, no plugins).
``plain_submit``
    The same ``client.submit(...).result()`` on a second cluster of the same shape where
    ``da.install(client)`` registered the scheduler/worker plugins and lowered the batching
    windows, made inside ``with da.session(client):`` (so each task carries the session
    annotation and is recorded by the scheduler plugin).
``stub_tool``
    ``da.stub(noop_tool)(i).result()`` on that installed cluster, in a session, where
    ``noop_tool`` is a ``@da.tool`` function.
``stub_class``
    ``da.stub(NoopAgent).run(i).result()`` on the installed cluster, in a session, where
    ``NoopAgent`` is an ``@da.agent`` class (one shared instance hosted by the worker).

For each variant the benchmark reports the median over rounds of calls per second and of CPU
seconds per call, and the p50/p95 latency of single calls (pooled over all rounds).

How CPU is counted
------------------
Both clusters use ``processes=False``: client, scheduler and worker are threads of this one
process, so ``time.process_time()`` (CPU of all threads of the process, user + system)
captures the CPU cost of a call on all three sides at once. Both clusters are alive during
the whole measurement, so each variant's CPU also includes the idle background of the
*other* cluster (heartbeats, periodic callbacks). That background is measured once
(``idle_cpu_s_per_s`` in the configuration); ``cpu_s_per_call_idle_adjusted`` subtracts it
over each block's wall time, which matters for slow variants such as ``plain_dask`` (10 ms
client batching window), whose longer wall time per call is otherwise charged more of it.
The summary ratios use the unadjusted CPU.

Noise control
-------------
Both clusters are created up front. After warm-up calls of every variant, the benchmark runs
``rounds`` rounds; each round runs ``calls`` sequential calls of every variant, in an order
rotated from round to round, so machine noise (other processes, frequency scaling) hits all
variants alike. Medians over rounds are reported; per-round paired CPU ratios are also in
the JSON (``results.<variant>.cpu_ratio_vs_plain_submit_paired_median``).

Reproduce
---------
::

    .venv/bin/python benchmarks/overhead.py --quick --json benchmarks/results/overhead.json
    .venv/bin/python benchmarks/overhead.py --json benchmarks/results/overhead-full.json

(``make bench`` runs the quick form.) ``--quick`` takes well under a minute on a 2-core
machine; the full run takes a few minutes.

JSON output
-----------
``{"config": {...}, "results": {variant: {...}}, "summary": {...}}`` where ``summary`` holds
``stub_calls_per_s``, ``stub_class_calls_per_s``, ``plain_submit_calls_per_s``,
``plain_dask_calls_per_s``, ``native_calls_per_s``, ``stub_cpu_ratio_vs_submit`` (stub-tool
CPU per call / plain-submit CPU per call, both with dask-agents installed) and
``stub_cpu_ratio_vs_plain_dask`` (stub-tool CPU per call / plain-Dask CPU per call).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

# Run as a script (`python benchmarks/overhead.py`): make the repository importable.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import dask  # noqa: E402
import distributed  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

import dask_agents as da  # noqa: E402


# -- the no-op work ---------------------------------------------------------------------------
def noop(i: int) -> int:
    """The no-op: returns its argument."""
    return i


@da.tool
def noop_tool(i: int) -> int:
    """The same no-op declared as a dask-agents tool."""
    return i


@da.agent
class NoopAgent:
    """A class agent whose method is the no-op."""

    def run(self, i: int) -> int:
        return i


VARIANTS = ("native", "plain_dask", "plain_submit", "stub_tool", "stub_class")
DESCRIPTIONS = {
    "native": "noop(i) called directly in Python",
    "plain_dask": "client.submit(noop, i, pure=False).result(), cluster WITHOUT dask-agents",
    "plain_submit": "client.submit(noop, i, pure=False).result(), dask-agents installed, in da.session",
    "stub_tool": "da.stub(noop_tool)(i).result(), dask-agents installed, in da.session",
    "stub_class": "da.stub(NoopAgent).run(i).result(), dask-agents installed, in da.session",
}

QUICK = {"calls": 200, "rounds": 7, "warmup": 60, "native_calls": 50_000}
FULL = {"calls": 500, "rounds": 21, "warmup": 200, "native_calls": 200_000}


def new_cluster() -> tuple[LocalCluster, Client]:
    """A fresh in-process cluster of the benchmark's shape and a client on it."""
    cluster = LocalCluster(
        n_workers=1, threads_per_worker=4, processes=False, dashboard_address=":0",
    )
    return cluster, Client(cluster)


# -- one block of calls ----------------------------------------------------------------------
def timed_calls(call: Callable[[int], Any], n: int, start: int) -> dict:
    """Run ``n`` sequential calls; wall, CPU and per-call latencies."""
    lat = [0.0] * n
    pc = time.perf_counter
    c0 = time.process_time()
    w0 = pc()
    for k in range(n):
        i = start + k
        t = pc()
        r = call(i)
        lat[k] = pc() - t
        if r != i:
            raise AssertionError(f"wrong result {r!r} for {i!r}")
    wall = pc() - w0
    cpu = time.process_time() - c0
    return {"wall": wall, "cpu": cpu, "lat": lat}


def timed_native(n: int, start: int) -> dict:
    """Native calls: a tight loop for rate/CPU, plus a sample of individually timed calls.

    Individually timed native calls are dominated by the timer's own cost, so the rate and
    CPU come from the untimed loop and the latency sample is only indicative.
    """
    f = noop
    c0 = time.process_time()
    w0 = time.perf_counter()
    for i in range(start, start + n):
        f(i)
    wall = time.perf_counter() - w0
    cpu = time.process_time() - c0
    sample = timed_calls(f, min(n, 2000), start)
    return {"wall": wall, "cpu": cpu, "lat": sample["lat"]}


class Bench:
    """Both clusters, the calls of every variant, and the per-round measurements."""

    def __init__(self, plain: Client, agents: Client, calls: int, native_calls: int):
        self.plain = plain
        self.agents = agents
        self.calls = calls
        self.native_calls = native_calls
        self.counter = 0
        self.tool = da.stub(noop_tool)
        self.agent = da.stub(NoopAgent)
        self.rounds: dict[str, list[dict]] = {v: [] for v in VARIANTS}

    def _start(self, n: int) -> int:
        s = self.counter
        self.counter += n
        return s

    def block(self, variant: str, n: int) -> dict:
        """``n`` sequential calls of ``variant`` (sessions are opened/closed outside the timing)."""
        gc.collect()
        start = self._start(n)
        if variant == "native":
            return timed_native(n, start)
        if variant == "plain_dask":
            c = self.plain
            return timed_calls(lambda i: c.submit(noop, i, pure=False).result(), n, start)
        with da.session(self.agents, name="bench"):
            if variant == "plain_submit":
                c = self.agents
                out = timed_calls(lambda i: c.submit(noop, i, pure=False).result(), n, start)
            elif variant == "stub_tool":
                tool = self.tool
                out = timed_calls(lambda i: tool(i).result(), n, start)
            elif variant == "stub_class":
                run = self.agent.run
                out = timed_calls(lambda i: run(i).result(), n, start)
            else:
                raise ValueError(variant)
        return out

    def warmup(self, n: int) -> None:
        for v in VARIANTS:
            self.block(v, n if v != "native" else 1000)

    def run_round(self, r: int) -> None:
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            n = self.native_calls if v == "native" else self.calls
            m = self.block(v, n)
            m["n"] = n
            self.rounds[v].append(m)


# -- statistics ------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation."""
    import numpy as np

    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(rounds: dict[str, list[dict]], idle: float) -> dict[str, dict]:
    """Per-variant medians; ``idle`` (CPU s/s with no calls) gives the idle-adjusted CPU."""
    results: dict[str, dict] = {}
    for v, ms in rounds.items():
        rate = [m["n"] / m["wall"] for m in ms]
        cpu = [m["cpu"] / m["n"] for m in ms]
        cpu_adj = [(m["cpu"] - idle * m["wall"]) / m["n"] for m in ms]
        lat = [x for m in ms for x in m["lat"]]
        results[v] = {
            "description": DESCRIPTIONS[v],
            "calls_per_round": ms[0]["n"] if ms else 0,
            "rounds": len(ms),
            "calls_per_s": statistics.median(rate),
            "cpu_s_per_call": statistics.median(cpu),
            # minus the clusters' idle background over the block's wall time: slower variants
            # (longer wall per call) are otherwise charged more of that background.
            "cpu_s_per_call_idle_adjusted": statistics.median(cpu_adj),
            "latency_p50_s": percentile(lat, 50),
            "latency_p95_s": percentile(lat, 95),
            "latency_samples": len(lat),
            "calls_per_s_by_round": rate,
            "cpu_s_per_call_by_round": cpu,
        }
    # Paired (same-round) CPU ratios: less sensitive to slow drifts in machine load.
    for base in ("plain_submit", "plain_dask"):
        b = results[base]["cpu_s_per_call_by_round"]
        for v in ("plain_submit", "stub_tool", "stub_class"):
            x = results[v]["cpu_s_per_call_by_round"]
            results[v][f"cpu_ratio_vs_{base}_paired_median"] = statistics.median(
                xi / bi for xi, bi in zip(x, b)
            )
    return results


def measure_idle_cpu(seconds: float = 2.0) -> float:
    """CPU seconds per second this process burns with both clusters up and no calls."""
    c0, w0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.perf_counter() - w0)


def print_table(config: dict, results: dict, summary: dict) -> None:
    print()
    print("dask-agents per-call overhead (sequential no-op calls)")
    print("-" * 72)
    for k in ("mode", "python", "dask", "distributed", "dask_agents", "platform", "cpu_count",
              "calls_per_round", "native_calls_per_round", "rounds", "warmup_calls",
              "cluster", "client_batched_send_interval_s", "idle_cpu_s_per_s", "wall_s"):
        print(f"  {k:32s} {config.get(k)}")
    print()
    hdr = f"  {'variant':14s} {'calls/s':>11s} {'CPU us/call':>12s} {'(idle-adj)':>11s} {'p50 ms':>9s} {'p95 ms':>9s} {'CPU/submit':>11s} {'CPU/dask':>9s}"
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    sub = results["plain_submit"]["cpu_s_per_call"]
    base = results["plain_dask"]["cpu_s_per_call"]
    for v in VARIANTS:
        r = results[v]
        cpu = r["cpu_s_per_call"]
        rs = f"{cpu / sub:11.3f}" if v != "native" else f"{'-':>11s}"
        rb = f"{cpu / base:9.3f}" if v != "native" else f"{'-':>9s}"
        print(
            f"  {v:14s} {r['calls_per_s']:11.1f} {cpu * 1e6:12.2f} "
            f"{r['cpu_s_per_call_idle_adjusted'] * 1e6:11.2f} "
            f"{r['latency_p50_s'] * 1e3:9.3f} {r['latency_p95_s'] * 1e3:9.3f} {rs} {rb}"
        )
    print()
    print("  summary:")
    for k, val in summary.items():
        print(f"    {k:32s} {val:.4g}")
    print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="fewer calls and rounds (well under 2 minutes)")
    p.add_argument("--calls", type=int, help="calls per variant per round (overrides the preset)")
    p.add_argument("--rounds", type=int, help="number of rounds (overrides the preset)")
    args = p.parse_args(argv)

    preset = dict(QUICK if args.quick else FULL)
    if args.calls:
        preset["calls"] = args.calls
    if args.rounds:
        preset["rounds"] = args.rounds

    t_start = time.perf_counter()
    plain_cluster = agents_cluster = plain = agents = None
    try:
        # Both clusters up front; dask-agents only on the second one.
        plain_cluster, plain = new_cluster()
        agents_cluster, agents = new_cluster()
        da.install(agents)
        if da.installed(plain):
            raise RuntimeError("the baseline cluster unexpectedly has the dask-agents plugin")

        bench = Bench(plain, agents, preset["calls"], preset["native_calls"])
        bench.warmup(preset["warmup"])
        idle = measure_idle_cpu()
        for r in range(preset["rounds"]):
            bench.run_round(r)
            print(f"  round {r + 1}/{preset['rounds']} done", file=sys.stderr, flush=True)
        results = summarize(bench.rounds, idle)
        interval = getattr(getattr(agents, "scheduler_comm", None), "interval", None)
        plain_interval = getattr(getattr(plain, "scheduler_comm", None), "interval", None)
    finally:
        for c in (agents, plain):
            if c is not None:
                c.close()
        for c in (agents_cluster, plain_cluster):
            if c is not None:
                c.close()

    config = {
        "mode": "quick" if args.quick else "full",
        "python": sys.version.split()[0],
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "dask_agents": da.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "calls_per_round": preset["calls"],
        "native_calls_per_round": preset["native_calls"],
        "rounds": preset["rounds"],
        "warmup_calls": preset["warmup"],
        "cluster": "LocalCluster(n_workers=1, threads_per_worker=4, processes=False), one per side",
        "client_batched_send_interval_s": {"plain_dask": plain_interval, "dask_agents": interval},
        "cpu_clock": "time.process_time() of the whole process (client+scheduler+worker threads)",
        "idle_cpu_s_per_s": round(idle, 5),
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    summary = {
        "stub_calls_per_s": results["stub_tool"]["calls_per_s"],
        "stub_class_calls_per_s": results["stub_class"]["calls_per_s"],
        "plain_submit_calls_per_s": results["plain_submit"]["calls_per_s"],
        "plain_dask_calls_per_s": results["plain_dask"]["calls_per_s"],
        "native_calls_per_s": results["native"]["calls_per_s"],
        "stub_cpu_ratio_vs_submit": results["stub_tool"]["cpu_s_per_call"] / results["plain_submit"]["cpu_s_per_call"],
        "stub_cpu_ratio_vs_plain_dask": results["stub_tool"]["cpu_s_per_call"] / results["plain_dask"]["cpu_s_per_call"],
    }
    print_table(config, results, summary)
    if args.json:
        path = os.path.abspath(args.json)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"config": config, "results": results, "summary": summary}, f, indent=2)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
