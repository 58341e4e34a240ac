"""Per-call overhead of dask-agents, measured side by side with plain Dask in one run.

What is measured
----------------
*Sequential* calls of a no-op: each call waits for its result before the next one is made,
so the numbers are per-call latency and per-call CPU cost, not throughput under concurrency.
Eleven variants on three in-process clusters of the same shape
(``LocalCluster(n_workers=1, threads_per_worker=4, processes=False)``):

``native``
    Calling the no-op Python function directly (the floor).
``plain_dask``
    ``client.submit(noop, i, pure=False).result()`` on a cluster *without* dask-agents, at
    Dask's default batching windows (client -> scheduler 10 ms, scheduler -> worker 5 ms,
    worker -> scheduler 2 ms).
``plain_dask_tuned``
    The same on a second cluster without dask-agents but with the batching windows that
    ``da.install`` sets (``agents.client.batched-send-interval`` 2 ms,
    ``agents.scheduler.batched-send-interval`` 2 ms, ``agents.worker.batched-send-interval``
    1 ms), set through the same helpers the plugins use
    (``dask_agents.scheduler_plugin.dask_compat.set_client_stream_interval`` /
    ``set_worker_stream_interval``, ``dask_agents.worker_plugin.dask_compat.set_batched_send_interval``).
    **The headline ratios are against this variant**: it differs from the installed cluster
    only by the plugins, so the ratios measure the plugins, not the batching windows.
``plain_submit``
    The same ``client.submit(...).result()`` on a third cluster where ``da.install(client)``
    registered the scheduler/worker plugins (and lowered the windows), made inside
    ``with da.session(client):``. Plain Dask work inside a session is not a call: it carries
    no annotation and the scheduler plugin records nothing for it, so this measures an
    untouched plain task on an installed cluster (the plugins' cost to plain Dask work: the
    hooks' early returns, the control loop and reports in the background).
``stub_tool``
    ``da.stub(noop_tool)(i).result()`` on the installed cluster, in a session, where
    ``noop_tool`` is a ``@da.tool`` function (a recorded call).
``stub_class``
    ``da.stub(NoopAgent).run(i).result()`` on the installed cluster, in a session, where
    ``NoopAgent`` is an ``@da.agent`` class (one shared instance hosted by the worker).

``direct_class``
    ``da.stub(DirectNoop).run(i).result()`` on the installed cluster, in a session, where
    ``DirectNoop`` is an ``@da.agent(model=...)`` class whose model's only engine is on the
    worker: a driver's **direct call** (``dask_agents/direct.py``), one RPC straight to the
    worker instead of the scheduler path (the variant fails if a timed call took the
    scheduler path).

``nested_plain_dask``
    Nested calls as an agent makes them, from *inside* a task: a plain Dask task on the second
    cluster (dask-agents' windows, no plugins; the task's client gets the window ``da.install``
    gives workers' clients) runs ``with worker_client() as c:`` and ``calls`` sequential
    ``c.submit(noop, i, pure=False).result()``, each timed there.
``nested_stub_tool``
    The same inside a dask-agents component on the installed cluster:
    ``da.stub(noop_tool)(i).value()``, which takes the worker-local fast path
    (``worker_plugin/local.py``: the tool runs in the caller's thread, recorded through the
    worker's reports, its value published to the scheduler after the caller has it).
``nested_stub_tool_scheduler``
    The same with the worker's fast path switched off between blocks: every nested call goes
    through the scheduler (update-graph, compute-task, task-finished, key-in-memory).

``nested_llm``
    LLM calls made inside a component, ``da.llm(m).generate(prompt, max_tokens=1).value()``,
    on the EMULATED engine the installed cluster's worker hosts, once the session's first call
    admitted it there: under the admission lease they go straight to the engine in the
    caller's thread. Latency here is the call's overhead, created -> received by the engine
    (the engine's ``arrival_time``), not the generation.
``nested_llm_scheduler``
    The same with the worker's fast path switched off: every call goes through the scheduler
    (admission binds it to the engine).

A Ray actor call (``ray.get(actor.run.remote(i))``, ``reference.ray_actor``) is timed after
the Dask clusters are closed, for reference (latency only: the actor's own process is not on
this process's CPU clock); ``--no-ray`` skips it.

For each variant the benchmark reports the median over rounds of calls per second and of CPU
seconds per call, and the p50/p95 latency of single calls (pooled over all rounds).

How CPU is counted
------------------
All clusters use ``processes=False``: client, scheduler and worker are threads of this one
process, so ``time.process_time()`` (CPU of all threads of the process, user + system)
captures the CPU cost of a call on all three sides at once. All clusters are alive during
the whole measurement, so each variant's CPU also includes the idle background of the
*other* clusters (heartbeats, periodic callbacks). That background is measured once
(``idle_cpu_s_per_s`` in the configuration); ``cpu_s_per_call_idle_adjusted`` subtracts it
over each block's wall time, which matters for slow variants such as ``plain_dask`` (10 ms
client batching window), whose longer wall time per call is otherwise charged more of it.
The summary ratios use the unadjusted CPU.

Noise control
-------------
The clusters are created up front. After warm-up calls of every variant, the benchmark runs
``rounds`` rounds; each round runs ``calls`` sequential calls of every variant, in an order
rotated from round to round, so machine noise (other processes, frequency scaling) hits all
variants alike. Medians over rounds are reported, with the spread of the per-round values
(min-max) and per-round *paired* CPU ratios (same round, less sensitive to slow drifts in
machine load): ``results.<variant>.cpu_ratio_vs_<base>_paired_median`` (and ``_min``/``_max``).

Reproduce
---------
::

    .venv/bin/python benchmarks/overhead.py --quick --json benchmarks/results/overhead.json
    .venv/bin/python benchmarks/overhead.py --json benchmarks/results/overhead-full.json

(``make bench`` runs the quick form.) ``--quick`` takes about a minute on a 2-core machine;
the full run takes a few minutes.

JSON output
-----------
``{"config": {...}, "results": {variant: {...}}, "summary": {...}}``. ``config`` records the
batching windows each cluster actually ran with (``batched_send_intervals_s``, read back from
the streams). ``summary`` holds the calls/s of every variant, the headline ratios against
``plain_dask_tuned`` (``stub_cpu_ratio_vs_plain_dask_tuned``, ``stub_class_cpu_ratio_vs_plain_dask_tuned``,
``plain_submit_cpu_ratio_vs_plain_dask_tuned``, the p50 latency ratios
``*_latency_p50_ratio_vs_plain_dask_tuned``, and the paired medians ``*_paired``),
``stub_cpu_ratio_vs_submit`` (stub-tool CPU per call / plain-submit CPU per call, both with
dask-agents installed) and, labeled, the ratios against plain Dask at its default windows
(``*_vs_plain_dask_default_intervals``; ``stub_cpu_ratio_vs_plain_dask`` is the same figure
under its former name).
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
from dask_agents.stats import percentile  # noqa: E402


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


@da.agent
class NestedBench:
    """Nested calls as an agent makes them: ``n`` sequential tool calls from inside a component."""

    def run(self, start: int, n: int) -> dict:
        tool = da.stub(noop_tool)
        return timed_calls(lambda i: tool(i).value(), n, start)


BENCH_MODEL = "overhead-emu"
"""The EMULATED engine the installed cluster hosts for the LLM variants (one-token answers)."""
BENCH_ENGINE = {"engine": "emulated", "model": "emulated", "tokenizer": "byte",
                "emulation": {"time_scale": 0.001, "kv_blocks": 4096, "block_size": 16, "max_batch": 8}}


@da.agent
class LLMBench:
    """Nested LLM calls as an agent makes them: the session's first call admits it to the
    engine on this worker; the ``n`` timed calls follow (under the admission lease when the
    fast path is on). Each call's latency here is its overhead: created -> received by the
    engine (the engine's ``arrival_time``, same process clock)."""

    def run(self, start: int, n: int) -> dict:
        from distributed import get_worker

        llm = da.llm(BENCH_MODEL)
        local = get_worker().plugins["dask-agents"].local
        llm.generate([3, 4, 5], max_tokens=1).value()
        deadline = time.time() + 10
        while local is not None and not local.leased(BENCH_MODEL, da.current_session()) and time.time() < deadline:
            time.sleep(0.001)
        lat = [0.0] * n
        c0, w0 = time.process_time(), time.perf_counter()
        for k in range(n):
            t = time.time()
            r = llm.generate([3, 4, 5, 6 + (start + k) % 200], max_tokens=1).value()
            lat[k] = r.arrival_time - t
        return {"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0, "lat": lat,
                "leased": local is not None and local.leased(BENCH_MODEL, da.current_session())}


@da.agent(model=BENCH_MODEL)
class DirectNoop:
    """The no-op agent beside the engine of the model it calls: the driver's calls of it go
    straight to that worker (direct calls)."""

    def run(self, i: int) -> int:
        return i


def nested_plain(start: int, n: int) -> dict:
    """The same from inside a plain Dask task, as a careful Dask user writes it."""
    from distributed import worker_client

    import dask_agents.config as agents_config
    from dask_agents.scheduler_plugin import dask_compat

    with worker_client() as c:
        # the window da.install gives workers' clients (Dask builds them with 10 ms), through the
        # plugin's own helper: the same windows on both sides
        dask_compat.set_client_stream_interval(c, agents_config.seconds("client.batched-send-interval"))
        return timed_calls(lambda i: c.submit(noop, i, pure=False).result(), n, start)


def _fast_path(dask_worker: Any = None, on: bool = True) -> bool:
    """Switch the worker's fast path (``worker_plugin/local.py``) on or off between blocks."""
    plugin = dask_worker.plugins["dask-agents"]
    if not on and plugin.local is not None:
        plugin._bench_local, plugin.local = plugin.local, None
    elif on and plugin.local is None:
        plugin.local = getattr(plugin, "_bench_local", None)
    return plugin.local is not None


VARIANTS = ("native", "plain_dask", "plain_dask_tuned", "plain_submit", "stub_tool", "stub_class", "direct_class",
            "nested_plain_dask", "nested_stub_tool", "nested_stub_tool_scheduler", "nested_llm",
            "nested_llm_scheduler")
NESTED = ("nested_plain_dask", "nested_stub_tool", "nested_stub_tool_scheduler")
DESCRIPTIONS = {
    "native": "noop(i) called directly in Python",
    "plain_dask": "client.submit(noop, i, pure=False).result(), cluster WITHOUT dask-agents, Dask's default "
                  "batching windows",
    "plain_dask_tuned": "client.submit(noop, i, pure=False).result(), cluster WITHOUT dask-agents, batching "
                        "windows as da.install sets them",
    "plain_submit": "client.submit(noop, i, pure=False).result(), dask-agents installed, in da.session "
                    "(plain Dask work: not a recorded call)",
    "stub_tool": "da.stub(noop_tool)(i).result(), dask-agents installed, in da.session",
    "stub_class": "da.stub(NoopAgent).run(i).result(), dask-agents installed, in da.session",
    "direct_class": "da.stub(DirectNoop).run(i).result(), dask-agents installed, in da.session: an agent with "
                    "model= whose engine is on the worker, so a direct call (one RPC, no scheduler)",
    "nested_plain_dask": "inside a plain Dask task: `with worker_client() as c: c.submit(noop, i, pure=False)"
                         ".result()`, cluster WITHOUT dask-agents, batching windows as da.install sets them "
                         "(the task's client too)",
    "nested_stub_tool": "inside a dask-agents component: da.stub(noop_tool)(i).value() (the worker-local fast "
                        "path: runs in the caller's thread)",
    "nested_stub_tool_scheduler": "the same with the worker's fast path switched off (the scheduler path)",
    "nested_llm": "inside a dask-agents component: da.llm(m).generate(prompt, max_tokens=1).value() on the "
                  "EMULATED engine of that worker, under the admission lease (the fast path); latency: created "
                  "-> received by the engine",
    "nested_llm_scheduler": "the same with the worker's fast path switched off (the scheduler path: "
                            "admission binds it)",
}

QUICK = {"calls": 200, "rounds": 7, "warmup": 60, "native_calls": 50_000}
FULL = {"calls": 500, "rounds": 21, "warmup": 200, "native_calls": 200_000}


def new_cluster() -> tuple[LocalCluster, Client]:
    """A fresh in-process cluster of the benchmark's shape and a client on it."""
    cluster = LocalCluster(
        n_workers=1, threads_per_worker=4, processes=False, dashboard_address=":0",
    )
    return cluster, Client(cluster)


def tune_like_install(client: Client) -> dict:
    """Give a cluster without dask-agents the batching windows ``da.install`` sets, through the
    plugins' own helpers (client -> scheduler, scheduler -> each worker, each worker -> scheduler).
    Returns the windows read back (:func:`batched_send_intervals`)."""
    import dask_agents.config as agents_config
    from dask_agents.scheduler_plugin import dask_compat as sched_compat

    client_s = agents_config.seconds("client.batched-send-interval")
    sched_s = agents_config.seconds("scheduler.batched-send-interval")
    worker_s = agents_config.seconds("worker.batched-send-interval")
    sched_compat.set_client_stream_interval(client, client_s)

    def on_scheduler(dask_scheduler=None, seconds=sched_s):
        from dask_agents.scheduler_plugin import dask_compat

        dask_compat.set_worker_stream_interval(dask_scheduler, dask_compat.worker_addresses(dask_scheduler), seconds)

    def on_worker(dask_worker=None, seconds=worker_s):
        from dask_agents.worker_plugin import dask_compat

        dask_compat.set_batched_send_interval(dask_worker, seconds)

    client.run_on_scheduler(on_scheduler)
    client.run(on_worker)
    return batched_send_intervals(client)


def _seconds(interval: Any) -> float | None:
    from dask.utils import parse_timedelta

    return None if interval is None else float(parse_timedelta(interval, default="s"))


def batched_send_intervals(client: Client) -> dict:
    """The batching windows a cluster runs with, read back from its streams (seconds)."""
    def on_scheduler(dask_scheduler=None):
        return sorted({getattr(bs, "interval", None) for bs in dask_scheduler.stream_comms.values()}, key=str)

    def on_worker(dask_worker=None):
        return getattr(getattr(dask_worker, "batched_stream", None), "interval", None)

    return {
        "client_to_scheduler": _seconds(getattr(getattr(client, "scheduler_comm", None), "interval", None)),
        "scheduler_to_worker": [_seconds(x) for x in client.run_on_scheduler(on_scheduler)],
        "worker_to_scheduler": sorted({_seconds(x) for x in client.run(on_worker).values()}, key=str),
    }


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
    """The three clusters, the calls of every variant, and the per-round measurements."""

    def __init__(self, plain: Client, tuned: Client, agents: Client, calls: int, native_calls: int):
        self.plain = plain
        self.tuned = tuned
        self.agents = agents
        self.calls = calls
        self.native_calls = native_calls
        self.counter = 0
        self.tool = da.stub(noop_tool)
        self.agent = da.stub(NoopAgent)
        self.rounds: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        self.direct_required = False  # after the warm-up: the client holds its token by then

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
        if variant in ("plain_dask", "plain_dask_tuned"):
            c = self.plain if variant == "plain_dask" else self.tuned
            return timed_calls(lambda i: c.submit(noop, i, pure=False).result(), n, start)
        if variant == "nested_plain_dask":
            return self.tuned.submit(nested_plain, start, n, pure=False).result()
        if variant in ("nested_stub_tool", "nested_stub_tool_scheduler", "nested_llm", "nested_llm_scheduler"):
            on = variant in ("nested_stub_tool", "nested_llm")
            if self.agents.run(_fast_path, on=on) != {w: on for w in self.agents.scheduler_info()["workers"]}:
                raise RuntimeError(f"could not switch the fast path {'on' if on else 'off'}")
            with da.session(self.agents, name="bench"):
                if variant.startswith("nested_llm"):
                    out = da.stub(LLMBench).run(start, n).value()
                    if out.pop("leased") != on:
                        raise RuntimeError(f"{variant}: the admission lease was {'not ' if on else ''}held")
                    return out
                return da.stub(NestedBench).run(start, n).value()
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
            elif variant == "direct_class":
                # the worker runs direct calls on its fast path: on, whatever the block before left
                if self.agents.run(_fast_path, on=True) != {w: True for w in self.agents.scheduler_info()["workers"]}:
                    raise RuntimeError("could not switch the fast path on")
                run = da.stub(DirectNoop).run
                sent = []

                def direct_call(i: int) -> int:
                    fut = run(i)
                    out = fut.result()
                    call = fut.__dict__.get("_agents_direct")
                    sent.append(call is not None and call.state == "finished")  # not refused, not rerouted
                    return out

                out = timed_calls(direct_call, n, start)
                if not all(sent) and self.direct_required:
                    raise RuntimeError(f"direct_class: {sent.count(False)} of {n} calls took the scheduler path")
            else:
                raise ValueError(variant)
        return out

    def warmup(self, n: int) -> None:
        for v in VARIANTS:
            self.block(v, n if v != "native" else 1000)
        self.direct_required = True

    def run_round(self, r: int) -> None:
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            n = self.native_calls if v == "native" else self.calls
            m = self.block(v, n)
            m["n"] = n
            self.rounds[v].append(m)


# -- statistics ------------------------------------------------------------------------------


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
            "calls_per_s_min": min(rate) if rate else float("nan"),
            "calls_per_s_max": max(rate) if rate else float("nan"),
            "cpu_s_per_call_min": min(cpu) if cpu else float("nan"),
            "cpu_s_per_call_max": max(cpu) if cpu else float("nan"),
            "latency_p50_s_by_round": [percentile(m["lat"], 50) for m in ms],
            "calls_per_s_by_round": rate,
            "cpu_s_per_call_by_round": cpu,
        }
    # Paired (same-round) CPU ratios: less sensitive to slow drifts in machine load.
    pairs = [(base, v) for base in ("plain_submit", "plain_dask", "plain_dask_tuned")
             for v in ("plain_dask_tuned", "plain_submit", "stub_tool", "stub_class", "direct_class")]
    pairs += [("nested_plain_dask", v) for v in ("nested_stub_tool", "nested_stub_tool_scheduler")]
    pairs += [("nested_llm_scheduler", "nested_llm")]
    for base, v in pairs:
        if v == base:
            continue
        b = results[base]["cpu_s_per_call_by_round"]
        x = results[v]["cpu_s_per_call_by_round"]
        ratios = [xi / bi for xi, bi in zip(x, b)]
        results[v][f"cpu_ratio_vs_{base}_paired_median"] = statistics.median(ratios)
        results[v][f"cpu_ratio_vs_{base}_paired_min"] = min(ratios)
        results[v][f"cpu_ratio_vs_{base}_paired_max"] = max(ratios)
    return results


def ray_actor_latency(calls: int, rounds: int) -> dict:
    """For reference: a Ray actor call (``ray.get(actor.run.remote(i))``) on this machine, timed
    the same way, after the Dask clusters are closed (Ray's processes would load them). Only
    latency: the actor runs in a process of its own, so this process's CPU clock misses it."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             logging_level="ERROR", configure_logging=True)
    try:
        actor = ray.remote(num_cpus=0)(_RayNoop).remote()
        call = lambda i: ray.get(actor.run.remote(i))  # noqa: E731
        timed_calls(call, max(calls // 2, 20), 0)  # warm-up
        lat = [x for r in range(rounds) for x in timed_calls(call, calls, r * calls)["lat"]]
        return {"description": "ray.get(actor.run.remote(i)) on a Ray actor (ray.init(num_cpus=2)), after the "
                               "Dask clusters closed; latency only", "ray": ray.__version__,
                "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
                "latency_samples": len(lat)}
    finally:
        ray.shutdown()


class _RayNoop:
    def run(self, i: int) -> int:
        return i


def measure_idle_cpu(seconds: float = 2.0) -> float:
    """CPU seconds per second this process burns with all clusters up and no calls."""
    c0, w0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.perf_counter() - w0)


def print_table(config: dict, results: dict, summary: dict) -> None:
    print()
    print("dask-agents per-call overhead (sequential no-op calls)")
    print("-" * 72)
    for k in ("mode", "python", "dask", "distributed", "dask_agents", "platform", "cpu_count",
              "calls_per_round", "native_calls_per_round", "rounds", "warmup_calls",
              "cluster", "idle_cpu_s_per_s", "wall_s"):
        print(f"  {k:32s} {config.get(k)}")
    for name, iv in config["batched_send_intervals_s"].items():
        print(f"  {'batching windows ' + name:32s} {iv}")
    print()
    hdr = (f"  {'variant':27s} {'calls/s':>8s} {'CPU us/call':>12s} {'(idle-adj)':>11s} {'p50 ms':>8s} "
           f"{'p95 ms':>8s} {'CPU/tuned':>10s} {'CPU/dask':>9s} {'CPU/submit':>11s}")
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    sub = results["plain_submit"]["cpu_s_per_call"]
    base = results["plain_dask"]["cpu_s_per_call"]
    tuned = results["plain_dask_tuned"]["cpu_s_per_call"]
    for v in VARIANTS:
        r = results[v]
        cpu = r["cpu_s_per_call"]
        rt, rb, rs = ((f"{cpu / x:{w}.3f}" if v != "native" else f"{'-':>{w}s}") for x, w in
                      ((tuned, 10), (base, 9), (sub, 11)))
        print(
            f"  {v:27s} {r['calls_per_s']:8.1f} {cpu * 1e6:12.2f} "
            f"{r['cpu_s_per_call_idle_adjusted'] * 1e6:11.2f} "
            f"{r['latency_p50_s'] * 1e3:8.3f} {r['latency_p95_s'] * 1e3:8.3f} {rt} {rb} {rs}"
        )
    print()
    print("  summary:")
    for k, val in summary.items():
        print(f"    {k:58s} {val:.4g}")
    print()


def make_summary(results: dict) -> dict:
    """Headline ratios against plain Dask at dask-agents' batching windows; the ones against
    plain Dask at its default windows are kept, labeled."""
    r = results
    cpu = {v: r[v]["cpu_s_per_call"] for v in VARIANTS}
    p50 = {v: r[v]["latency_p50_s"] for v in VARIANTS}
    out = {("stub" if v == "stub_tool" else v) + "_calls_per_s": r[v]["calls_per_s"] for v in
           ("stub_tool", "stub_class", "plain_submit", "plain_dask_tuned", "plain_dask", "native")}
    for v, name in (("stub_tool", "stub"), ("stub_class", "stub_class"), ("plain_submit", "plain_submit")):
        out[f"{name}_cpu_ratio_vs_plain_dask_tuned"] = cpu[v] / cpu["plain_dask_tuned"]
        out[f"{name}_cpu_ratio_vs_plain_dask_tuned_paired"] = r[v]["cpu_ratio_vs_plain_dask_tuned_paired_median"]
        out[f"{name}_latency_p50_ratio_vs_plain_dask_tuned"] = p50[v] / p50["plain_dask_tuned"]
    out["stub_cpu_ratio_vs_submit"] = cpu["stub_tool"] / cpu["plain_submit"]
    # a driver's direct call (issue 26): one RPC to the worker, against the scheduler path
    out["direct_latency_p50_s"] = p50["direct_class"]
    out["direct_cpu_ratio_vs_plain_dask_tuned"] = cpu["direct_class"] / cpu["plain_dask_tuned"]
    out["direct_cpu_ratio_vs_plain_dask_tuned_paired"] = r["direct_class"]["cpu_ratio_vs_plain_dask_tuned_paired_median"]
    out["direct_latency_p50_ratio_vs_stub_class"] = p50["direct_class"] / p50["stub_class"]
    # against plain Dask at Dask's default windows (10 ms client window): mostly the windows
    for v, name in (("stub_tool", "stub"), ("stub_class", "stub_class"), ("plain_submit", "plain_submit"),
                    ("plain_dask_tuned", "plain_dask_tuned")):
        out[f"{name}_cpu_ratio_vs_plain_dask_default_intervals"] = cpu[v] / cpu["plain_dask"]
    out["stub_latency_p50_ratio_vs_plain_dask_default_intervals"] = p50["stub_tool"] / p50["plain_dask"]
    out["stub_cpu_ratio_vs_plain_dask"] = out["stub_cpu_ratio_vs_plain_dask_default_intervals"]  # the former name
    # nested calls (issue 26): the fast path and the scheduler path against a plain Dask task
    # made the same way, inside a task, at the same windows
    for v, name in (("nested_stub_tool", "nested_fast_path"), ("nested_stub_tool_scheduler", "nested_scheduler_path")):
        out[f"{name}_latency_p50_s"] = p50[v]
        out[f"{name}_cpu_ratio_vs_nested_plain_dask"] = cpu[v] / cpu["nested_plain_dask"]
        out[f"{name}_cpu_ratio_vs_nested_plain_dask_paired"] = r[v]["cpu_ratio_vs_nested_plain_dask_paired_median"]
    out["nested_plain_dask_latency_p50_s"] = p50["nested_plain_dask"]
    # LLM calls (issue 26): created -> received by the engine, under the lease and through the scheduler
    out["nested_llm_fast_path_overhead_p50_s"] = p50["nested_llm"]
    out["nested_llm_scheduler_path_overhead_p50_s"] = p50["nested_llm_scheduler"]
    out["nested_llm_fast_path_cpu_ratio_vs_scheduler_path_paired"] = (
        r["nested_llm"]["cpu_ratio_vs_nested_llm_scheduler_paired_median"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="fewer calls and rounds (about a minute)")
    p.add_argument("--calls", type=int, help="calls per variant per round (overrides the preset)")
    p.add_argument("--rounds", type=int, help="number of rounds (overrides the preset)")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray actor reference")
    args = p.parse_args(argv)

    preset = dict(QUICK if args.quick else FULL)
    if args.calls:
        preset["calls"] = args.calls
    if args.rounds:
        preset["rounds"] = args.rounds

    dask.config.set({"agents.llm.models": {BENCH_MODEL: BENCH_ENGINE}})  # in-process clusters read it
    t_start = time.perf_counter()
    clusters: list[LocalCluster] = []
    clients: list[Client] = []
    try:
        # All three clusters up front; dask-agents only on the third one.
        for _ in range(3):
            cluster, client = new_cluster()
            clusters.append(cluster)
            clients.append(client)
        plain, tuned, agents = clients
        da.install(agents, models=[BENCH_MODEL])  # (its entry: set at the top of main)
        tune_like_install(tuned)
        if da.installed(plain) or da.installed(tuned):
            raise RuntimeError("a baseline cluster unexpectedly has the dask-agents plugin")

        bench = Bench(plain, tuned, agents, preset["calls"], preset["native_calls"])
        bench.warmup(preset["warmup"])
        idle = measure_idle_cpu()
        for r in range(preset["rounds"]):
            bench.run_round(r)
            print(f"  round {r + 1}/{preset['rounds']} done", file=sys.stderr, flush=True)
        results = summarize(bench.rounds, idle)
        intervals = {name: batched_send_intervals(c) for name, c in
                     (("plain_dask", plain), ("plain_dask_tuned", tuned), ("dask_agents", agents))}
    finally:
        for c in reversed(clients):
            c.close()
        for c in reversed(clusters):
            c.close()
    reference = {}
    if not args.no_ray:
        reference["ray_actor"] = ray_actor_latency(preset["calls"], min(preset["rounds"], 5))

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
        "cluster": "LocalCluster(n_workers=1, threads_per_worker=4, processes=False), one per side "
                   "(plain Dask, plain Dask at dask-agents' windows, dask-agents installed)",
        "batched_send_intervals_s": intervals,
        "client_batched_send_interval_s": {k: v["client_to_scheduler"] for k, v in intervals.items()},
        "cpu_clock": "time.process_time() of the whole process (client+scheduler+worker threads)",
        "idle_cpu_s_per_s": round(idle, 5),
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    summary = make_summary(results)
    if "ray_actor" in reference:
        summary["ray_actor_latency_p50_s"] = reference["ray_actor"]["latency_p50_s"]
        summary["nested_fast_path_latency_p50_ratio_vs_ray_actor"] = (
            summary["nested_fast_path_latency_p50_s"] / reference["ray_actor"]["latency_p50_s"])
    print_table(config, results, summary)
    if args.json:
        path = os.path.abspath(args.json)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"config": config, "results": results, "reference": reference, "summary": summary}, f,
                      indent=2)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
