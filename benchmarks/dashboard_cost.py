"""What the Agents dashboard page costs the scheduler, at 1,000 live sessions, side by side.

What is measured
----------------
A scheduler process (``dask scheduler --preload dask_agents.preload``, dashboard on) and two
worker processes (``dask worker --nworkers 2``, enough threads that no call queues) run
``--sessions`` (1,000) sessions that stay live for the whole run: each session is an
asyncio task of this process that makes one tool call after another (each sleeps
uniformly in ``--step`` seconds on a worker) inside ``async with da.session(...)``. While
they run, the benchmark alternates phases *without* and *with* the page open:

``off``
    no browser on the Agents page (the page does nothing then: it only computes for open
    pages);
``on``
    one viewer has ``/agents`` open and receives its updates (``--viewer chromium``: headless
    Debian Chromium, a real browser; ``bokeh``: a ``bokeh.client`` session, the same
    server-side work without rendering). The viewer runs at the lowest CPU priority
    (``nice 19``): on a small machine it shares the scheduler's cores, while what is measured
    is the scheduler's side. Measurement starts once the page has loaded and
    sent its first update (the one-time page load is reported apart).

For each phase: the scheduler process's CPU seconds (user + system, every thread, from
``psutil``) per wall second and per completed call, the calls completed, the live sessions,
and, from the page's own accounting (``Dashboard.stats()``), the event-loop seconds its
refreshes took. Phases alternate so machine noise hits both alike.

Summary: ``page_cpu_share`` = (scheduler CPU/s with the page - without) / scheduler CPU/s
without, from the phase means; ``page_cpu_share_per_call`` the same per completed call (the
call rate moves a little between phases, so this is the fairer side-by-side ratio);
``page_update_cpu_share`` = CPU seconds the page's refreshes used on the scheduler's
event-loop thread (``thread_time``, from the page's own accounting) / the scheduler
process's CPU seconds, in the phases with the page open: a direct and much less noisy
measure of the same cost. ``page_update_wall_s_per_s`` is how long the refreshes held the
event loop per second (wall time: it includes waiting for a CPU on a busy machine).
``under_5_percent``: both the direct share and the per-call side-by-side ratio are < 5%.

Reproduce::

    .venv/bin/python benchmarks/dashboard_cost.py --quick --json benchmarks/results/dashboard-cost-quick.json
    .venv/bin/python benchmarks/dashboard_cost.py --json benchmarks/results/dashboard-cost.json

Phases run in the order off, on, on, off (then on, off, off, on, ...): the scheduler's own cost
drifts up as the live sessions' graphs grow, and this order cancels a linear drift.
``--quick``: 1,000 sessions, 2 + 2 phases of 15 s (about 2 minutes in all); the full run has
4 + 4 phases of 25 s (about 5 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.processes import start_scheduler, stop_processes  # noqa: E402

import psutil  # noqa: E402
from distributed import Client  # noqa: E402

import dask_agents as da  # noqa: E402

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@da.tool
def wait_tool(seconds: float) -> float:
    """A tool call that takes ``seconds`` (sleeps on the worker)."""
    time.sleep(seconds)
    return seconds


# -- processes -----------------------------------------------------------------------------------

def start_cluster(tmp: str, nthreads: int, log: Any) -> tuple[subprocess.Popen, subprocess.Popen, str, int]:
    """A scheduler and two worker processes with the dask-agents preload; (procs, address, port)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]),
           "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    sched, info = start_scheduler(tmp, env, log, dashboard=True)
    address, port = info["address"], info["services"]["dashboard"]
    workers = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", "2", "--nthreads", str(nthreads),
         "--preload", "dask_agents.preload", "--no-dashboard", "--memory-limit", "0"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    return sched, workers, address, port


class Viewer:
    """A browser (or bokeh.client session) with the Agents page open."""

    def __init__(self, kind: str, url: str, log: Any):
        self.kind = kind
        self.tmp = tempfile.mkdtemp(prefix="agents-viewer-")
        if kind == "chromium":
            cmd = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={self.tmp}", "--window-size=1600,1400", url]
        else:
            # bokeh.client has no public "keep reading" call any more; the private one is it
            cmd = [sys.executable, "-c", "import sys\nfrom bokeh.client import pull_session\n"
                   "s = pull_session(url=sys.argv[1])\n"
                   "(getattr(s, 'loop_until_closed', None) or s._loop_until_closed)()", url]
        # lowest CPU priority: the browser shares this machine's cores with the scheduler (in
        # practice it runs on someone's laptop); what we measure is the scheduler's side
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=lambda: os.nice(19))

    def close(self) -> None:
        """Stop the viewer (its process group: Chromium starts helpers)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        shutil.rmtree(self.tmp, ignore_errors=True)


def chromium() -> str | None:
    """Path of Debian's chromium, if installed."""
    return shutil.which("chromium") or (os.path.exists("/usr/bin/chromium") and "/usr/bin/chromium") or None


def _scheduler_view(dask_scheduler: Any = None) -> dict:
    p = dask_scheduler.plugins["dask-agents"]
    live = sum(1 for s in p.state.sessions.values() if s.state != "completed")
    dash = p.dashboard.stats() if p.dashboard is not None else None
    ctl = p.control.stats() if p.control is not None else {}
    return {"live_sessions": live, "dashboard": dash, "control_ticks": ctl.get("ticks"),
            "control_tick_p50_s": ctl.get("tick_seconds_p50")}


# -- the workload ---------------------------------------------------------------------------------

class Workload:
    """``n`` live sessions making sequential tool calls until stopped."""

    def __init__(self, client: Client, n: int, step: tuple[float, float], seed: int = 0):
        self.client = client
        self.n = n
        self.step = step
        self.rng = random.Random(seed)
        self.completed = 0
        self.errors = 0
        self.stop = False
        self.tasks: list[asyncio.Task] = []

    async def session(self, i: int) -> None:
        rng = random.Random(f"{i}")
        tool = da.stub(wait_tool)
        async with da.session(self.client, name=f"s{i:04d}"):
            await asyncio.sleep(rng.uniform(0, self.step[1]))  # spread the starts
            while not self.stop:
                try:
                    await tool(round(rng.uniform(*self.step), 3))
                    self.completed += 1
                except Exception:
                    self.errors += 1

    def start(self) -> None:
        """Start every session."""
        self.tasks = [asyncio.ensure_future(self.session(i)) for i in range(self.n)]

    async def finish(self, timeout: float) -> None:
        """Let the sessions end after their current call."""
        self.stop = True
        await asyncio.wait(self.tasks, timeout=timeout)


# -- phases ------------------------------------------------------------------------------------------

async def measure(client: Client, sched: psutil.Process, work: Workload, seconds: float) -> dict:
    """Scheduler CPU, completed calls and page refresh time over ``seconds``."""
    before = await client.run_on_scheduler(_scheduler_view)
    t0, c0, n0 = time.monotonic(), sched.cpu_times(), work.completed
    await asyncio.sleep(seconds)
    t1, c1, n1 = time.monotonic(), sched.cpu_times(), work.completed
    after = await client.run_on_scheduler(_scheduler_view)
    wall = t1 - t0
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    calls = n1 - n0
    d0, d1 = before["dashboard"] or {}, after["dashboard"] or {}
    upd = d1.get("update_seconds", 0.0) - d0.get("update_seconds", 0.0)
    upd_cpu = d1.get("update_cpu_seconds", 0.0) - d0.get("update_cpu_seconds", 0.0)
    return {
        "wall_s": wall, "scheduler_cpu_s": cpu, "scheduler_cpu_per_s": cpu / wall, "calls": calls,
        "calls_per_s": calls / wall, "scheduler_cpu_per_call_ms": 1000 * cpu / calls if calls else None,
        "live_sessions": [before["live_sessions"], after["live_sessions"]],
        "page_updates": d1.get("updates", 0) - d0.get("updates", 0), "page_update_s": upd,
        "page_update_s_per_s": upd / wall, "page_update_cpu_s": upd_cpu,
        "page_update_cpu_share": upd_cpu / cpu if cpu else None, "page_documents": d1.get("documents", 0),
        "page_max_update_s": d1.get("max_update_seconds"),
        "control_tick_p50_s": after["control_tick_p50_s"],
    }


async def wait_documents(client: Client, want: int, timeout: float) -> int:
    """Wait until the page has ``want`` open documents (>= for want > 0); returns the count."""
    deadline = time.monotonic() + timeout
    while True:
        v = await client.run_on_scheduler(_scheduler_view)
        docs = (v["dashboard"] or {}).get("documents", 0)
        if (docs >= want if want else docs == 0) or time.monotonic() > deadline:
            return docs
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace, log_path: str) -> dict:
    tmp = tempfile.mkdtemp(prefix="agents-dashboard-cost-")
    log = open(log_path, "w")
    sched_proc, workers_proc, address, port = start_cluster(tmp, args.nthreads, log)
    viewer_kind = args.viewer
    if viewer_kind == "auto":
        viewer_kind = "chromium" if chromium() else "bokeh"
    url = f"http://127.0.0.1:{port}/agents"
    phases = []
    try:
        async with Client(address, asynchronous=True) as client:
            await client.wait_for_workers(2, timeout=120)
            await da.install(client)
            sched = psutil.Process(sched_proc.pid)
            work = Workload(client, args.sessions, (args.step_min, args.step_max))
            work.start()
            print(f"  warm-up {args.warmup:g}s: starting {args.sessions} sessions", flush=True)
            await asyncio.sleep(args.warmup)
            # ABBA BAAB ...: the scheduler's cost drifts up as the live sessions' graphs grow;
            # this order gives both modes the same mean position, so a linear drift cancels
            order = [m for k in range(args.pairs) for m in (("off", "on") if k % 4 in (0, 3) else ("on", "off"))]
            for k, mode in enumerate(order):
                viewer = None
                load = None
                if mode == "on":
                    viewer = Viewer(viewer_kind, url, log)
                    t0 = time.monotonic()
                    docs = await wait_documents(client, 1, 60)
                    if docs < 1:
                        raise RuntimeError(f"the {viewer_kind} viewer did not open {url}")
                    await asyncio.sleep(args.settle)  # page loaded, first updates sent
                    load = time.monotonic() - t0
                m = await measure(client, sched, work, args.phase)
                m.update(mode=mode, viewer=viewer_kind if mode == "on" else None, page_open_s=load)
                phases.append(m)
                print(f"  phase {k + 1}/{len(order)} {mode:3s}: scheduler CPU {m['scheduler_cpu_per_s']:.3f} s/s, "
                      f"{m['calls_per_s']:.1f} calls/s, {m['scheduler_cpu_per_call_ms'] or 0:.2f} ms CPU/call, "
                      f"live sessions {m['live_sessions'][1]}, page refreshes {m['page_updates']}: "
                      f"{m['page_update_cpu_s'] * 1000 / args.phase:.2f} ms CPU/s, "
                      f"{m['page_update_s_per_s'] * 1000:.2f} ms wall/s", flush=True)
                if viewer is not None:
                    viewer.close()
                    await wait_documents(client, 0, 60)  # Bokeh drops the document ~15 s later
            await work.finish(timeout=args.step_max + 30)
            errors = work.errors
    finally:
        stop_processes([workers_proc, sched_proc], log, tmp)
    return {"phases": phases, "errors": errors, "viewer": viewer_kind}


def summarize(phases: list[dict]) -> dict:
    """Phase means and the page's share of the scheduler's CPU."""
    def mean(mode: str, key: str) -> float:
        vals = [p[key] for p in phases if p["mode"] == mode and p[key] is not None]
        return statistics.fmean(vals) if vals else float("nan")

    off, on = mean("off", "scheduler_cpu_per_s"), mean("on", "scheduler_cpu_per_s")
    off_call, on_call = mean("off", "scheduler_cpu_per_call_ms"), mean("on", "scheduler_cpu_per_call_ms")
    def sd(mode: str, key: str) -> float:
        vals = [p[key] for p in phases if p["mode"] == mode and p[key] is not None]
        return statistics.stdev(vals) if len(vals) > 1 else float("nan")

    upd = mean("on", "page_update_s_per_s")
    upd_cpu = mean("on", "page_update_cpu_share")
    return {
        "scheduler_cpu_per_s_off": off, "scheduler_cpu_per_s_on": on,
        "scheduler_cpu_per_call_ms_off": off_call, "scheduler_cpu_per_call_ms_on": on_call,
        # spread between phases of the same mode: the side-by-side ratios cannot resolve less
        "scheduler_cpu_per_call_ms_off_stdev": sd("off", "scheduler_cpu_per_call_ms"),
        "scheduler_cpu_per_call_ms_on_stdev": sd("on", "scheduler_cpu_per_call_ms"),
        "calls_per_s_off": mean("off", "calls_per_s"), "calls_per_s_on": mean("on", "calls_per_s"),
        "page_cpu_share": (on - off) / off, "page_cpu_share_per_call": (on_call - off_call) / off_call,
        "page_update_wall_s_per_s": upd, "page_update_cpu_share": upd_cpu,
        "live_sessions_min": min(min(p["live_sessions"]) for p in phases),
        "page_max_update_s": max((p["page_max_update_s"] or 0) for p in phases),
        "under_5_percent": bool(upd_cpu < 0.05 and (on_call - off_call) / off_call < 0.05),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="one off and one on phase of 20 s")
    p.add_argument("--sessions", type=int, default=1000, help="live sessions (default 1000)")
    p.add_argument("--step-min", type=float, default=4.0, help="shortest tool call, seconds")
    p.add_argument("--step-max", type=float, default=12.0, help="longest tool call, seconds")
    p.add_argument("--nthreads", type=int, default=None, help="threads per worker process (default: no queueing)")
    p.add_argument("--viewer", choices=("auto", "chromium", "bokeh"), default="auto",
                   help="what opens the page: headless Chromium (auto: if installed) or a bokeh.client session")
    p.add_argument("--phase", type=float, help="seconds per phase")
    p.add_argument("--pairs", type=int, help="off/on phase pairs")
    p.add_argument("--warmup", type=float, help="seconds before the first phase")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after the page opens before measuring")
    args = p.parse_args(argv)
    preset = {"phase": 15.0, "pairs": 2, "warmup": 15.0} if args.quick else {"phase": 25.0, "pairs": 4, "warmup": 25.0}
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.nthreads is None:
        args.nthreads = args.sessions // 2 + 16
    config = {k: getattr(args, k) for k in ("sessions", "step_min", "step_max", "nthreads", "viewer", "phase", "pairs",
                                            "warmup", "settle")}
    config.update(machine=platform.machine(), cpus=os.cpu_count(), python=platform.python_version(),
                  workers="2 processes", update_interval="agents.dashboard.update-interval (default 1s)")
    print("dashboard_cost: scheduler CPU with and without the Agents page open")
    for k, v in config.items():
        print(f"  {k}: {v}")
    log_path = os.path.join(tempfile.gettempdir(), "dashboard_cost.log")
    result = asyncio.run(run(args, log_path))
    summary = summarize(result["phases"])
    config["viewer"] = result["viewer"]
    print("summary:")
    for k, v in summary.items():
        print(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
    print(f"  (tool-call errors: {result['errors']}; process log: {log_path})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": config, "phases": result["phases"], "summary": summary}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
