"""Faults under load: concurrent Open-SWE-shaped sessions while a worker is killed, another is
retired and the driver's connection drops; every answer is checked.

What runs
---------
A ``LocalCluster`` of ``--workers`` worker PROCESSES (nannies: a SIGKILLed worker is restarted
under a new address), ``da.install``-ed, each hosting an EMULATED LLM engine ``emu``
(``worker_plugin/emulated.py``: a cost model, nothing is computed; ``--no-llm`` replaces the
LLM calls by emulated think times). ``--sessions`` requests start over ``--spread`` seconds,
each in its own ``da.session`` (the workflow is in ``tests/fault_components.py``, importable by
the workers)::

    SWEPlanner.plan -> SWEDeveloper.implement x 2-4 (parallel; doc-search tool, LLM, code-exec
    tool) -> SWETester.test (LLM, code-exec) -> on a failing test the failing subtask is
    re-implemented with feedback and tested again (up to 2 retries, seeded)

Every agent records its step in the session's stateful ``Trajectory`` (one instance per
session, on one worker); the request's answer is the trajectory's digest plus the final patch
set's digest (a plain ``client.submit`` inside the session). The same answer is computed
locally, without Dask (``swe_expected``): a call silently run on a fresh instance, a lost step,
a step recorded twice with another value or a stale patch all show as a wrong answer.

Faults (times from the first session's start; each waits for the previous one):

1. ``--kill-at``: the worker holding the most session instances is SIGKILLed (its nanny starts
   a new one);
2. ``--retire-at``: the worker (of those left) holding the most instances is retired
   (``client.retire_workers``; not replaced: the run ends on one worker fewer);
3. ``--disconnect-at``: the driver's connection to the scheduler drops for ``--drop`` seconds
   (the client's scheduler comm is closed and its reconnection held off that long; the
   scheduler sees ``remove_client``, then ``add_client`` when it comes back: within
   ``agents.scheduler.session-grace`` the sessions are kept, but Dask's client cancels its
   in-flight futures on reconnect, "Client lost the connection").

How each request is classified
------------------------------
The driver of each request checks its answer against the expected one. An attempt ends

- ``correct``: the answer is the expected one;
- ``wrong``: an answer came back and it is not the expected one (must never happen);
- ``clear_error``: a ``da.*`` error (``InstanceLostError``, ``SessionClosedError``,
  ``CallFailedError`` and its ``CallLostError``, ``EngineStoppedError``) or Dask's ``FutureCancelledError`` naming the
  cause "Client lost the connection", and the message names the session or the call;
- ``unclear_error``: any other exception (reported with its message);
- ``hung``: no answer within ``--timeout`` seconds (every wait has that deadline).

A request whose first attempt failed with a clear error is retried once in a NEW session (what
a user would do); the class of its last attempt decides the request's: ``completed_correct``
(first attempt or retry correct), ``failed_with_clear_error``, ``failed_unclear``,
``wrong_results``, ``hung``. ``wrong_results`` and ``hung`` must be 0 (the exit status is 1
otherwise).

Scenarios (``--scenarios retire,blip,...`` or ``all``): each fault alone, on a fresh cluster:
``retire`` (a graceful ``retire_workers`` of the busiest worker), ``blip`` (the driver's
connection down 1 s; the driver does what the README says: asks its agent futures again, re-submits
plain Dask work), ``graph-fault`` / ``transition-fault`` (the scheduler plugin's ``update_graph``
/ ``transition`` hook raises for 1 s), ``lifetime`` (workers with ``--lifetime 7s
--lifetime-stagger 3s --lifetime-restart``), ``adapt`` (``cluster.adapt(minimum=1, maximum=3)``;
6 sessions whose drivers pause 1 s between steps, so workers idle while their sessions live),
``restart`` (``dask scheduler`` and ``dask worker`` processes with the preload; at 6 s the
scheduler is SIGKILLed and started again on its port; the driver's client reconnects, Dask's
workers close with their scheduler and are started again, as a deployment would: in-flight
calls fail with ``da.CallLostError``, sessions started before fail their stateful calls with
``da.InstanceLostError`` and are retried in new sessions),
``none`` (no fault: the reference for the plugin faults) and ``mixed`` (the schedule above). The JSON's ``summary`` then has, per scenario, ``sessions``,
``completed_correct``, ``failed_with_clear_error``, ``wrong_results``, ``hung``, ``failed``
(requests with any attempt not correct; must be 0 for retire, lifetime, adapt and blip) and, after
a plugin fault, ``latency_before_s`` / ``latency_after_s`` and, paired with the no-fault run
``none`` (same requests), the median ratio of the later sessions' latencies
``latency_after_vs_none`` (with its range); ``workers_added`` / ``workers_removed`` during the run.

Reproduce::

    .venv/bin/python benchmarks/faults.py --json benchmarks/results/faults.json   # ~35 s on 2 cores
    .venv/bin/python benchmarks/faults.py --scenarios all --json benchmarks/results/faults-scenarios.json
    .venv/bin/python benchmarks/faults.py --quick                                  # 12 shorter sessions, faults at 2/5/8 s

JSON: ``{"config", "events", "requests", "plugin", "summary"}``; ``summary`` holds the counts
above, ``retries`` (requests retried in a new session) and ``retries_correct``, the events'
times and what each caused (``first_failures_by_event``), the trajectory repeats (steps a
re-run stateless agent recorded again: Dask re-runs calls lost with a worker) and the config.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script; the worker processes inherit sys.path
    sys.path.insert(0, _ROOT)

import dask  # noqa: E402
import distributed  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402
from distributed.client import FutureCancelledError  # noqa: E402

import dask_agents as da  # noqa: E402
from dask_agents.client_api import hosted_models  # noqa: E402
from tests import fault_components as fc  # noqa: E402

EMU = {"emu": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
               "emulation": {"max_batch": 64, "decode-s-per-step": 0.01, "prefill-s-per-token": 2e-6}}}
LOST_CONNECTION = "Client lost the connection"
CLEAR_ERRORS = (da.InstanceLostError, da.SessionClosedError, da.CallFailedError, da.EngineStoppedError)


@dataclass
class Config:
    """One run. Times are seconds from the first session's start; None skips the fault."""

    sessions: int = 30
    workers: int = 3
    threads: int = 8
    spread: float = 12.0  # sessions start evenly over this many seconds
    time_scale: float = 5.0  # tools' and think times' wall factor (EMULATED latencies x this)
    llm: bool = True  # EMULATED engine calls (else emulated think times)
    kill_at: float | None = 4.0
    retire_at: float | None = 10.0
    disconnect_at: float | None = 16.0
    drop: float = 1.0  # how long the driver stays disconnected
    timeout: float = 60.0  # per attempt: no answer by then is "hung"
    retry: bool = True  # a clear failure is retried once in a new session
    seed: int = 0
    plugin_fault: str | None = None  # "update_graph" or "transition": that hook of the plugin raises ...
    plugin_fault_at: float = 6.0  # ... from then ...
    plugin_fault_for: float = 1.0  # ... for this long
    lifetime: float | None = None  # workers' --lifetime (s), restarted by their nannies, with ...
    lifetime_stagger: float = 3.0  # ... this --lifetime-stagger
    adapt: bool = False  # cluster.adapt(minimum=1, maximum=workers) instead of a fixed size
    restart_at: float | None = None  # the scheduler process SIGKILLed then and started again (same port)
    pause: float = 0.0  # the driver's pause (s) between its steps (a user reading, a slow client)
    scenario: str = "mixed"


SCENARIOS: dict[str, dict] = {
    # the original schedule: a worker SIGKILLed, another retired, the driver disconnected
    "mixed": {},
    # no fault: the reference the plugin faults' later sessions are compared with (same requests)
    "none": {"kill_at": None, "retire_at": None, "disconnect_at": None},
    "retire": {"kill_at": None, "retire_at": 6.0, "disconnect_at": None},
    "blip": {"kill_at": None, "retire_at": None, "disconnect_at": 6.0, "drop": 1.0},
    "graph-fault": {"kill_at": None, "retire_at": None, "disconnect_at": None, "plugin_fault": "update_graph"},
    "transition-fault": {"kill_at": None, "retire_at": None, "disconnect_at": None, "plugin_fault": "transition"},
    # dask-jobqueue's --lifetime with a stagger and restart, as docs/production.md recommends
    "lifetime": {"kill_at": None, "retire_at": None, "disconnect_at": None, "lifetime": 7.0},
    # `dask scheduler` / `dask worker` processes; the scheduler SIGKILLed and restarted with its
    # preload on the same port; Dask's workers close with it and are started again (the deployment)
    "restart": {"kill_at": None, "retire_at": None, "disconnect_at": None, "restart_at": 6.0},
    # few sessions whose drivers pause 1 s between steps: workers go idle while their sessions live
    "adapt": {"kill_at": None, "retire_at": None, "disconnect_at": None, "adapt": True, "sessions": 6,
              "spread": 3.0, "pause": 1.0},
}
"""Each fault alone (``--scenarios``), plus the original mixed schedule. Scale-down scenarios
(retire, lifetime, adapt) and the blip must fail no session; no scenario may give a wrong answer
or hang."""
NO_FAILURES = ("retire", "lifetime", "adapt", "blip")


@dataclass
class Attempt:
    session: str
    outcome: str = "pending"  # correct, wrong, clear_error, unclear_error, hung
    started: float = 0.0
    ended: float | None = None
    error_type: str | None = None
    error: str | None = None
    cause: str | None = None  # kill, retire, disconnect, other (clear errors)
    answer: dict | None = None
    repeats: int = 0


@dataclass
class Request:
    id: str
    seed: int
    expected: dict
    start_at: float
    attempts: list[Attempt] = field(default_factory=list)
    result: str = "pending"  # completed_correct, failed_with_clear_error, failed_unclear, wrong_results, hung


# -- one request --------------------------------------------------------------------------------
def drive(client: Client, req: Request, cfg: Config, t0: float) -> Attempt:
    """One attempt at ``req`` in a new session: the Open-SWE driver, its answer checked."""
    planner, dev, tester = da.stub(fc.SWEPlanner), da.stub(fc.SWEDeveloper), da.stub(fc.SWETester)
    traj = da.stub(fc.Trajectory)
    model = "emu" if cfg.llm else None
    ts = cfg.time_scale
    deadline = time.time() + cfg.timeout
    left = lambda: max(0.01, deadline - time.time())  # noqa: E731
    name = f"{req.id}-a{len(req.attempts)}"
    att = Attempt(session="?", started=time.time() - t0)
    try:
        with da.session(client, name=name) as s:
            att.session = s.id
            subtasks = planner.plan(req.id, req.seed, model, ts)
            n = len(subtasks.value(timeout=left()))
            time.sleep(cfg.pause)
            patches = [dev.implement(subtasks, k, 0, None, model, ts) for k in range(n)]
            rnd = 0
            while True:
                passed, failing = tester.test(req.seed, patches, rnd, model, ts).value(timeout=left())
                time.sleep(cfg.pause)
                if passed:
                    break
                rnd += 1
                patches[failing] = dev.implement(subtasks, failing, rnd, fc.swe_feedback(failing, rnd - 1), model, ts)
            combined = client.submit(fc.swe_combine, patches, pure=False)  # plain Dask work in the session
            summary = traj.summary().value(timeout=left())
            try:
                patch_digest = combined.result(timeout=left())
            except FutureCancelledError as e:  # the README: Dask cancels plain futures on a lost
                if LOST_CONNECTION not in str(e):  # connection; plain work is re-submitted (agent
                    raise  # calls are not: their futures get their results after the reconnect)
                patch_digest = client.submit(fc.swe_combine, patches, pure=False).result(timeout=left())
        att.answer = {"trajectory": summary["digest"], "steps": summary["steps"], "patches": patch_digest,
                      "retries": rnd}
        att.repeats = summary["repeats"]
        att.outcome = "correct" if att.answer == req.expected else "wrong"
    except (da.CallTimeoutError, TimeoutError) as e:  # noqa: B014 (CallTimeoutError is one, named for clarity)
        att.outcome, att.error_type, att.error = "hung", type(e).__name__, str(e)[:400]
    except Exception as e:  # noqa: BLE001 (every failure is classified)
        att.error_type, att.error = type(e).__name__, str(e)[:600]
        att.outcome = "clear_error" if is_clear(e, att.session) else "unclear_error"
    att.ended = time.time() - t0
    return att


_CALL_KEY = re.compile(r"[A-Za-z_][\w.:]*-[0-9a-f]{32}")


def is_clear(e: BaseException, session: str) -> bool:
    """A da.* error, or Dask's cancellation after a lost connection, naming the session or a call."""
    text = str(e)
    names_it = session in text or _CALL_KEY.search(text) is not None
    if isinstance(e, CLEAR_ERRORS):
        return names_it
    if isinstance(e, FutureCancelledError):
        return LOST_CONNECTION in text and names_it
    return False


def run_request(client: Client, req: Request, cfg: Config, t0: float) -> Request:
    time.sleep(max(0.0, t0 + req.start_at - time.time()))
    att = drive(client, req, cfg, t0)
    req.attempts.append(att)
    if att.outcome == "clear_error" and cfg.retry:
        req.attempts.append(drive(client, req, cfg, t0))
    last = req.attempts[-1]
    req.result = {"correct": "completed_correct", "wrong": "wrong_results", "clear_error": "failed_with_clear_error",
                  "unclear_error": "failed_unclear", "hung": "hung"}[last.outcome]
    return req


# -- the cluster's view --------------------------------------------------------------------------
def _plugin_view(dask_scheduler: Any = None) -> dict:
    p = dask_scheduler.plugins["dask-agents"]
    per_worker: dict[str, int] = {}
    for (_s, what), addr in list(p.bindings.items()):
        if not what.startswith("llm:"):
            per_worker[addr] = per_worker.get(addr, 0) + 1
    return {"instances_per_worker": per_worker, "workers": sorted(dask_scheduler.workers),
            "orphans": len(p.orphans), "recovery": {k: v for k, v in p.recovery.stats().items() if k != "incidents"},
            "open_sessions": sum(1 for s in p.state.sessions.values() if s.state != "completed")}


def plugin_view(client: Client) -> dict:
    return client.run_on_scheduler(_plugin_view)


def _wait(pred, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False


def _busiest(view: dict, exclude: set[str] = frozenset()) -> str | None:
    cands = [(n, w) for w, n in view["instances_per_worker"].items() if w in view["workers"] and w not in exclude]
    return max(cands)[1] if cands else None


def kill_busiest(client: Client, t0: float, at: float) -> dict:
    """SIGKILL the worker process holding the most session instances (waits for one to hold any)."""
    time.sleep(max(0.0, t0 + at - time.time()))
    _wait(lambda: plugin_view(client)["instances_per_worker"], 30)
    view = plugin_view(client)
    victim = _busiest(view) or view["workers"][0]
    pid = client.run(os.getpid, workers=[victim])[victim]
    ev = {"event": "kill", "t": time.time() - t0, "worker": victim, "pid": pid,
          "instances_on_worker": view["instances_per_worker"].get(victim, 0), "open_sessions": view["open_sessions"]}
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: victim not in plugin_view(client)["workers"], 60)
    ev["removed_t"] = time.time() - t0
    return ev


def retire_busiest(client: Client, t0: float, at: float, exclude: set[str]) -> dict:
    time.sleep(max(0.0, t0 + at - time.time()))
    view = plugin_view(client)
    victim = _busiest(view, exclude) or next(w for w in view["workers"] if w not in exclude)
    ev = {"event": "retire", "t": time.time() - t0, "worker": victim,
          "instances_on_worker": view["instances_per_worker"].get(victim, 0), "open_sessions": view["open_sessions"]}
    client.retire_workers(workers=[victim])
    _wait(lambda: victim not in plugin_view(client)["workers"], 60)
    ev["removed_t"] = time.time() - t0
    return ev


def drop_connection(client: Client, t0: float, at: float, drop: float) -> dict:
    """Close the client's scheduler comm and hold its reconnection off for ``drop`` seconds."""
    import distributed.client as dc

    time.sleep(max(0.0, t0 + at - time.time()))
    view = plugin_view(client)
    real_connect = dc.connect
    until = time.time() + drop

    async def refused(*args: Any, **kwargs: Any) -> Any:
        if time.time() < until:
            raise OSError("dask-agents fault benchmark: the driver's network is down")
        return await real_connect(*args, **kwargs)

    ev = {"event": "disconnect", "t": time.time() - t0, "drop_s": drop, "client": client.id,
          "open_sessions": view["open_sessions"],
          "client_batched_send_interval_before_s": getattr(client.scheduler_comm, "interval", None)}
    dc.connect = refused
    try:
        client.sync(client.scheduler_comm.comm.close)
        time.sleep(drop / 2)
        ev["orphaned_sessions_while_down"] = plugin_view(client)["orphans"]  # the RPC pool still works
        _wait(lambda: client.status == "running", drop + 30)
        ev["reconnected_t"] = time.time() - t0
        # Dask's reconnect makes a new client stream at its own 10 ms window (da.install set 2 ms)
        ev["client_batched_send_interval_after_s"] = getattr(client.scheduler_comm, "interval", None)
    finally:
        dc.connect = real_connect
    _wait(lambda: plugin_view(client)["orphans"] == 0, 5)
    ev["orphaned_sessions_after"] = plugin_view(client)["orphans"]
    seen = [(t, e.get("action")) for t, e in client.get_events(client.id) if isinstance(e, dict)
            and e.get("action") in ("remove-client", "add-client") and t >= t0 + ev["t"] - 1]
    ev["scheduler_saw"] = [{"action": a, "t": t - t0} for t, a in seen]
    return ev


def _break_hook(hook: str, dask_scheduler: Any = None) -> None:
    plugin = dask_scheduler.plugins["dask-agents"]

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"dask-agents fault benchmark: injected {hook} fault")

    setattr(plugin, hook, broken)


def _mend_hook(hook: str, dask_scheduler: Any = None) -> None:
    plugin = dask_scheduler.plugins["dask-agents"]
    if hook in plugin.__dict__:
        delattr(plugin, hook)


def plugin_fault(client: Client, t0: float, at: float, hook: str, duration: float) -> dict:
    """The scheduler plugin's ``hook`` (``update_graph`` or ``transition``) raises for
    ``duration`` seconds (Dask logs it and goes on without the plugin's part)."""
    time.sleep(max(0.0, t0 + at - time.time()))
    ev = {"event": f"{hook}-fault", "t": time.time() - t0, "duration_s": duration}
    client.run_on_scheduler(_break_hook, hook)
    try:
        time.sleep(duration)
    finally:
        client.run_on_scheduler(_mend_hook, hook)
    ev["removed_t"] = time.time() - t0
    return ev


class ProcessCluster:
    """``dask scheduler`` and ``dask worker`` processes with ``--preload dask_agents.preload``
    on loopback (the ``restart`` scenario: a LocalCluster's scheduler cannot be restarted on
    its port). A supervisor thread plays the deployment (SLURM's requeue, a Kubernetes
    restart): a worker process that exits is started again."""

    def __init__(self, cfg: Config, log_dir: str):
        import socket
        import subprocess

        self._subprocess = subprocess
        with socket.socket() as sock:  # a port the restarted scheduler takes again
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        dask_bin = os.path.join(os.path.dirname(sys.executable), "dask")
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                        DASK_AGENTS__LLM__MODELS=json.dumps(EMU),
                        DASK_AGENTS__WORKER__MODELS=json.dumps(["emu"] if cfg.llm else []),
                        DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES="5")
        self.scheduler_args = [dask_bin, "scheduler", "--host", "127.0.0.1", "--port", str(self.port),
                               "--no-dashboard", "--preload", "dask_agents.preload"]
        self.worker_args = [dask_bin, "worker", self.address, "--host", "127.0.0.1", "--nthreads", str(cfg.threads),
                            "--no-dashboard", "--preload", "dask_agents.preload", "--death-timeout", "60"]
        self.n = 0
        self._logs: list[Any] = []
        self.scheduler = self._start(self.scheduler_args, "scheduler")
        self.workers = [self._start(self.worker_args, "worker") for _ in range(cfg.workers)]
        self.restarted_workers = 0
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)
        self._supervisor.start()

    def _start(self, args: list[str], name: str) -> Any:
        self.n += 1
        log = open(os.path.join(self.log_dir, f"{name}-{self.n}.log"), "wb")
        self._logs.append(log)
        return self._subprocess.Popen(args, stdout=log, stderr=self._subprocess.STDOUT, env=self.env, cwd=_ROOT,
                                      start_new_session=True)

    def _supervise(self) -> None:
        while not self._stop.wait(0.2):
            for i, w in enumerate(self.workers):
                if w.poll() is not None and not self._stop.is_set():
                    self.workers[i] = self._start(self.worker_args, "worker")
                    self.restarted_workers += 1

    def restart_scheduler(self) -> None:
        """SIGKILL the scheduler's process group, start it again on the same port."""
        _killpg(self.scheduler, signal.SIGKILL)
        self.scheduler.wait(10)
        self.scheduler = self._start(self.scheduler_args, "scheduler")

    def close(self) -> None:
        self._stop.set()
        self._supervisor.join(5)
        for p in [*self.workers, self.scheduler]:
            _killpg(p, signal.SIGTERM)
        for p in [*self.workers, self.scheduler]:
            try:
                p.wait(15)
            except self._subprocess.TimeoutExpired:
                _killpg(p, signal.SIGKILL)
        for log in self._logs:
            log.close()
        import shutil

        shutil.rmtree(self.log_dir, ignore_errors=True)  # (the processes' logs: kept only while it runs)


def _killpg(p: Any, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def restart_scheduler(client: Client, cluster: ProcessCluster, t0: float, at: float) -> dict:
    """The scheduler process SIGKILLed and started again with its preload on its port; the
    driver's client reconnects (Dask: for its timeout), Dask's workers close and the
    deployment starts new ones."""
    time.sleep(max(0.0, t0 + at - time.time()))
    view = plugin_view(client)
    before = client.scheduler_info()["id"]
    ev = {"event": "restart", "t": time.time() - t0, "open_sessions": view["open_sessions"],
          "instances": sum(view["instances_per_worker"].values()), "scheduler_before": before}
    cluster.restart_scheduler()
    _wait(lambda: client.status == "running" and client.scheduler_info().get("id") != before, 90)
    ev["reconnected_t"] = time.time() - t0
    ev["scheduler_after"] = client.scheduler_info().get("id")
    _wait(lambda: len(client.scheduler_info()["workers"]) == len(cluster.workers), 90)
    ev["removed_t"] = time.time() - t0  # workers back
    return ev


def faults(client: Client, cfg: Config, t0: float, events: list[dict], cluster: Any = None) -> None:
    """The fault schedule, one after another (in its own thread)."""
    gone: set[str] = set()
    try:
        if cfg.restart_at is not None:
            events.append(restart_scheduler(client, cluster, t0, cfg.restart_at))
        if cfg.kill_at is not None:
            ev = kill_busiest(client, t0, cfg.kill_at)
            events.append(ev)
            gone.add(ev["worker"])
        if cfg.retire_at is not None:
            ev = retire_busiest(client, t0, cfg.retire_at, gone)
            events.append(ev)
        if cfg.disconnect_at is not None:
            events.append(drop_connection(client, t0, cfg.disconnect_at, cfg.drop))
        if cfg.plugin_fault is not None:
            events.append(plugin_fault(client, t0, cfg.plugin_fault_at, cfg.plugin_fault, cfg.plugin_fault_for))
    except Exception as e:  # noqa: BLE001 (reported: a fault that could not be injected)
        events.append({"event": "fault-injection-failed", "t": time.time() - t0, "error": f"{type(e).__name__}: {e}"})


def cause_of(att: Attempt, events: list[dict]) -> str | None:
    """Which fault an attempt's failure names (by the worker address or the lost connection)."""
    if att.error is None:
        return None
    if LOST_CONNECTION in att.error:
        return "disconnect"
    for ev in events:
        w = ev.get("worker")
        if w and w in att.error:
            return ev["event"]
    if "closed" in att.error and any(ev["event"] == "disconnect" for ev in events):
        return "disconnect"
    for ev in events:
        if ev["event"] == "restart" and ev.get("scheduler_before") and ev["scheduler_before"] in att.error:
            return "restart"
    return "other"


# -- a run -------------------------------------------------------------------------------------
def make_requests(cfg: Config) -> list[Request]:
    import random

    rng = random.Random(cfg.seed)
    out = []
    for i in range(cfg.sessions):
        rid, seed = f"req{i}", rng.randrange(1 << 30)
        start = cfg.spread * i / max(1, cfg.sessions - 1) if cfg.sessions > 1 else 0.0
        out.append(Request(id=rid, seed=seed, expected=fc.swe_expected(rid, seed), start_at=start))
    return out


def run(cfg: Config, log=print) -> dict:
    """One run of the benchmark; returns the JSON document."""
    t_start = time.time()
    settings = {"distributed.scheduler.allowed-failures": 5, "agents.llm.models": EMU}
    requests = make_requests(cfg)
    events: list[dict] = []
    plugin: dict = {}
    with dask.config.set(settings):
        extra = ({"lifetime": f"{cfg.lifetime}s", "lifetime_stagger": f"{cfg.lifetime_stagger}s",
                  "lifetime_restart": True} if cfg.lifetime is not None else {})
        if cfg.restart_at is not None:
            import tempfile

            cluster: Any = ProcessCluster(cfg, tempfile.mkdtemp(prefix="faults-restart-"))
            client = Client(cluster.address, timeout="90s")  # also how long it tries to reconnect
            _wait(lambda: len(client.scheduler_info()["workers"]) == cfg.workers, 90)
        else:
            cluster = LocalCluster(n_workers=cfg.workers, threads_per_worker=cfg.threads, processes=True,
                                   dashboard_address=":0", worker_dashboard_address=":0", **extra)
            client = Client(cluster)
        try:
            if cfg.restart_at is None:
                da.install(client, models=["emu"] if cfg.llm else [])
            if cfg.llm:
                _wait(lambda: len(hosted_models(client).get("emu", [])) == cfg.workers, 60)
            if cfg.adapt:  # Dask's adaptive scaling decides; it scales down idle workers as sessions end
                cluster.adapt(minimum=1, maximum=cfg.workers, interval="500ms", wait_count=2)
                events.append({"event": "adapt", "t": 0.0, "minimum": 1, "maximum": cfg.workers})
            log(f"faults: cluster up in {time.time() - t_start:.1f}s; {cfg.sessions} sessions over {cfg.spread}s")
            t0 = time.time()
            injector = threading.Thread(target=faults, args=(client, cfg, t0, events, cluster), daemon=True)
            injector.start()
            pool = cf.ThreadPoolExecutor(max_workers=cfg.sessions, thread_name_prefix="request")
            futs = [pool.submit(run_request, client, r, cfg, t0) for r in requests]
            limit = cfg.spread + 2 * cfg.timeout + 60
            cf.wait(futs, timeout=limit)
            for r, f in zip(requests, futs):
                if not f.done():  # stuck outside any timed wait
                    r.result = "hung"
                    r.attempts.append(Attempt(session="?", outcome="hung", error="driver thread did not return"))
                elif f.exception() is not None:
                    r.result = "failed_unclear"
                    r.attempts.append(Attempt(session="?", outcome="unclear_error", error=repr(f.exception())))
            injector.join(timeout=60)
            pool.shutdown(wait=False, cancel_futures=True)
            churn = [(t - t0, e.get("action"), e.get("worker")) for t, e in client.get_events("all")
                     if isinstance(e, dict) and e.get("action") in ("add-worker", "remove-worker") and t >= t0]
            events.append({"event": "workers", "t": 0.0, "added": sum(a == "add-worker" for _, a, _ in churn),
                           "removed": sum(a == "remove-worker" for _, a, _ in churn),
                           "changes": [[round(t, 2), a, w] for t, a, w in churn]})
            try:  # every session ends and its instances go (instance-linger): nothing left behind
                _wait(lambda: not (v := plugin_view(client))["open_sessions"] and not v["instances_per_worker"], 15, 0.2)
                plugin = plugin_view(client)
            except Exception as e:  # noqa: BLE001
                plugin = {"error": repr(e)}
        finally:
            client.close()
            if isinstance(cluster, ProcessCluster):
                events.append({"event": "worker-restarts", "t": 0.0, "added": cluster.restarted_workers})
                cluster.close()
            else:
                cluster.close(timeout=30)
    for r in requests:
        for a in r.attempts:
            a.cause = cause_of(a, events) if a.outcome in ("clear_error", "unclear_error") else None
    doc = {"config": describe(cfg), "events": events, "requests": [asdict(r) for r in requests], "plugin": plugin}
    doc["summary"] = summarize(requests, events, cfg, time.time() - t_start)
    return doc


def describe(cfg: Config) -> dict:
    return {**asdict(cfg), "python": sys.version.split()[0], "dask": dask.__version__,
            "distributed": distributed.__version__, "dask_agents": da.__version__, "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "cluster": (f"dask scheduler + {cfg.workers} dask worker processes (nannies, --nthreads {cfg.threads}), "
                        "--preload dask_agents.preload; exited workers started again" if cfg.restart_at is not None
                        else f"LocalCluster(n_workers={cfg.workers}, threads_per_worker={cfg.threads}, "
                        "processes=True), nannies"),
            "llm": "EMULATED engine 'emu' on every worker" if cfg.llm else "none (emulated think times)",
            "session_grace": dask.config.get("agents.scheduler.session-grace"), "emulated": True}


def summarize(requests: list[Request], events: list[dict], cfg: Config, wall: float) -> dict:
    counts = {k: sum(1 for r in requests if r.result == k)
              for k in ("completed_correct", "failed_with_clear_error", "failed_unclear", "wrong_results", "hung")}
    retried = [r for r in requests if len(r.attempts) > 1]
    first_fail: dict[str, int] = {}
    for r in requests:
        a = r.attempts[0] if r.attempts else None
        if a is not None and a.outcome in ("clear_error", "unclear_error"):
            first_fail[a.cause or "other"] = first_fail.get(a.cause or "other", 0) + 1
    retry_fail: dict[str, int] = {}
    for r in retried:
        a = r.attempts[-1]
        if a.outcome != "correct":
            retry_fail[a.cause or a.outcome] = retry_fail.get(a.cause or a.outcome, 0) + 1
    spans = [(a.started, a.ended) for r in requests for a in r.attempts if a.ended is not None]
    in_flight = lambda t: sum(1 for a, b in spans if a <= t < b)  # noqa: E731
    errors: dict[str, int] = {}
    for r in requests:
        for a in r.attempts:
            if a.error_type:
                errors[a.error_type] = errors.get(a.error_type, 0) + 1
    failed = sum(1 for r in requests if any(a.outcome != "correct" for a in r.attempts))
    latency: dict[str, float | None] = {}
    fault = next((ev for ev in events if ev["event"].endswith("-fault")), None)
    if fault is not None:  # session latency before the fault and after it ended (+ 2 s)
        def mean_of(pred):
            xs = [a.ended - a.started for r in requests for a in r.attempts[:1]
                  if a.ended is not None and a.outcome == "correct" and pred(a)]
            return round(sum(xs) / len(xs), 3) if xs else None

        latency = {"latency_before_s": mean_of(lambda a: a.ended < fault["t"]),
                   "latency_after_s": mean_of(lambda a: a.started > fault["removed_t"] + 2.0)}
    return {
        "scenario": cfg.scenario, "sessions": len(requests), **counts,
        "failed": failed,  # requests with any attempt that did not end correct (retried or not)
        **latency,
        "completed_correct_first_try": sum(1 for r in requests if r.attempts and r.attempts[0].outcome == "correct"),
        "retries": len(retried), "retries_correct": sum(1 for r in retried if r.attempts[-1].outcome == "correct"),
        "attempts": sum(len(r.attempts) for r in requests),
        "first_failures_by_event": first_fail, "retry_failures_by_cause": retry_fail, "errors_by_type": errors,
        "trajectory_repeats": sum(a.repeats for r in requests for a in r.attempts),
        "max_in_flight": max((in_flight(a) for a, _ in spans), default=0),
        "events": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in ev.items()
                    if k in ("event", "t", "removed_t", "reconnected_t", "worker", "instances_on_worker", "added", "removed",
                             "instances", "scheduler_before", "scheduler_after",
                             "open_sessions", "orphaned_sessions_while_down", "orphaned_sessions_after",
                             "scheduler_saw", "client_batched_send_interval_before_s",
                             "client_batched_send_interval_after_s", "error")} | {"in_flight": in_flight(ev["t"])} for ev in events],
        "ok": counts["wrong_results"] == 0 and counts["hung"] == 0 and (cfg.scenario not in NO_FAILURES or failed == 0),
        "wall_s": round(wall, 1),
        "config": {k: getattr(cfg, k) for k in ("sessions", "workers", "threads", "spread", "time_scale", "llm",
                                                 "kill_at", "retire_at", "disconnect_at", "restart_at", "drop", "timeout",
                                                 "plugin_fault", "plugin_fault_at", "plugin_fault_for", "lifetime",
                                                 "lifetime_stagger", "adapt", "pause")},
    }


def print_table(doc: dict) -> None:
    s = doc["summary"]
    print()
    print(f"{s['sessions']} sessions, {s['config']['workers']} worker processes, EMULATED engines/tools; wall {s['wall_s']} s")
    print(f"  {'event':12s} {'t (s)':>7s} {'done (s)':>9s} {'worker / detail':40s} {'in flight':>9s} {'first failures':>14s}")
    for ev in s["events"]:
        done = ev.get("removed_t", ev.get("reconnected_t"))
        detail = ev.get("worker") or ("scheduler saw " + ", ".join(x["action"] for x in ev.get("scheduler_saw", []))
                                      if ev["event"] == "disconnect" else ev.get("error", ""))
        print(f"  {ev['event']:12s} {ev['t']:7.2f} {done if done is not None else float('nan'):9.2f} "
              f"{str(detail)[:40]:40s} {ev.get('in_flight', ''):>9} "
              f"{s['first_failures_by_event'].get(ev['event'], 0):>14}")
    print()
    for k in ("max_in_flight", "completed_correct", "completed_correct_first_try", "retries", "retries_correct",
              "failed_with_clear_error", "failed_unclear", "wrong_results", "hung", "trajectory_repeats"):
        print(f"  {k:30s} {s[k]}")
    print(f"  {'errors_by_type':30s} {s['errors_by_type']}")
    print(f"  {'ok (no wrong, none hung)':30s} {s['ok']}")
    print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="12 shorter sessions over 5 s (time scale 2), faults at 2/5/8 s")
    p.add_argument("--sessions", type=int)
    p.add_argument("--workers", type=int)
    p.add_argument("--threads", type=int)
    p.add_argument("--spread", type=float)
    p.add_argument("--time-scale", type=float)
    p.add_argument("--kill-at", type=float)
    p.add_argument("--retire-at", type=float)
    p.add_argument("--disconnect-at", type=float)
    p.add_argument("--drop", type=float)
    p.add_argument("--timeout", type=float)
    p.add_argument("--no-llm", action="store_true", help="emulated think times instead of EMULATED engine calls")
    p.add_argument("--no-retry", action="store_true", help="do not retry a failed request in a new session")
    p.add_argument("--seed", type=int)
    p.add_argument("--scenarios", help=f"comma-separated, each its own run on a fresh cluster: "
                                       f"{', '.join(SCENARIOS)} (or all); the JSON summary then has one block each")
    args = p.parse_args(argv)
    names = ([n.strip() for n in args.scenarios.split(",")] if args.scenarios else [None])
    if names == ["all"]:
        names = list(SCENARIOS)
    unknown = [n for n in names if n is not None and n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    docs = {}
    for name in names:
        cfg = (Config(sessions=12, spread=5.0, time_scale=2.0, kill_at=2.0, retire_at=5.0, disconnect_at=8.0)
               if args.quick else Config())
        if name is not None:
            for k, v in SCENARIOS[name].items():
                setattr(cfg, k, v)
            cfg.scenario = name
        for k in ("sessions", "workers", "threads", "spread", "time_scale", "kill_at", "retire_at", "disconnect_at",
                  "drop", "timeout", "seed"):
            v = getattr(args, k)
            if v is not None:
                setattr(cfg, k, v)
        cfg.llm = not args.no_llm
        cfg.retry = not args.no_retry
        docs[name or "mixed"] = doc = run(cfg)
        print(f"== scenario {cfg.scenario}")
        print_table(doc)
    if "none" in docs:  # the plugin faults' later sessions against the same requests without a fault
        ref = {r["id"]: r for r in docs["none"]["requests"]}
        for d in docs.values():
            fault = next((ev for ev in d["events"] if ev["event"].endswith("-fault")), None)
            if fault is None:
                continue
            ratios = []
            for r in d["requests"]:
                other = ref.get(r["id"])
                if r["start_at"] <= fault["removed_t"] + 2.0 or other is None or not r["attempts"] or not other["attempts"]:
                    continue
                a, b = r["attempts"][0], other["attempts"][0]
                if a["outcome"] == b["outcome"] == "correct":
                    ratios.append((a["ended"] - a["started"]) / (b["ended"] - b["started"]))
            ratios.sort()
            d["summary"]["latency_after_vs_none"] = (round(ratios[len(ratios) // 2], 3) if ratios else None)
            d["summary"]["latency_after_vs_none_range"] = [round(ratios[0], 3), round(ratios[-1], 3)] if ratios else None
    if args.scenarios:
        out = {"scenarios": docs, "summary": {n: {k: d["summary"][k] for k in (
            "sessions", "completed_correct", "failed_with_clear_error", "wrong_results", "hung", "failed", "ok",
            *(k for k in ("latency_before_s", "latency_after_s", "latency_after_vs_none", "latency_after_vs_none_range")
              if k in d["summary"]))} for n, d in docs.items()}}
        for n, v in out["summary"].items():
            v["workers_added"], v["workers_removed"] = next(
                ((ev["added"], ev["removed"]) for ev in docs[n]["events"] if ev["event"] == "workers"), (None, None))
        out["ok"] = all(v["ok"] for v in out["summary"].values())
    else:
        out = docs["mixed"]
        out["ok"] = out["summary"]["ok"]
    if args.json:
        path = os.path.abspath(args.json)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {path}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
