"""Injected faults (issue 7): workers killed mid-workflow, a failing or hanging control loop,
a scheduler restarted with its preload.

Each test asserts: every request completes or fails with a clear error; no future hangs (all
waits have timeouts); no call runs twice where that would be visible (marker files per start);
state is reclaimed (bindings to a dead worker dropped).
"""

from __future__ import annotations

import glob
import os
import signal
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from tests import fault_components as fc
from dask_agents.client_api import hosted_models
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(180)


# -- helpers ---------------------------------------------------------------------------------
def _plugin_view(dask_scheduler=None) -> dict:
    p = dask_scheduler.plugins["dask-agents"]
    return {
        "bindings": {f"{s}|{w}": addr for (s, w), addr in p.bindings.items()},
        "placed": {str(k): v[0] for k, v in p.placed.items()},
        "recovery": p.recovery.stats(),
        "workers": sorted(dask_scheduler.workers),
    }


def plugin_view(client: Client) -> dict:
    return client.run_on_scheduler(_plugin_view)


def markers(d, what: str) -> dict[str, list[int]]:
    """call key -> pids it started in."""
    out: dict[str, list[int]] = {}
    for path in glob.glob(os.path.join(str(d), f"{what}-*")):
        name = os.path.basename(path)[len(what) + 1:]
        key, pid = name.rsplit("-", 1)
        out.setdefault(key, []).append(int(pid))
    return out


def pids(client: Client) -> dict[int, str]:
    return {pid: addr for addr, pid in client.run(os.getpid).items()}


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def process_cluster():
    """Two worker processes under nannies (a killed one is restarted under a new address)."""
    clusters = []

    def make(**config):
        with dask.config.set({"distributed.scheduler.allowed-failures": 3, **config}):
            cluster = LocalCluster(n_workers=2, threads_per_worker=4, processes=True, dashboard_address=":0",
                                   worker_dashboard_address=":0")
        clusters.append(cluster)
        return cluster

    yield make
    for c in clusters:
        c.close(timeout=30)


def test_a_workers_own_client_batches_with_the_window_da_install_set():
    """Nested calls go through the worker's own client, which Dask builds with its 10 ms window:
    the window the driver's da.install read applies there too (issue 26: it did not)."""
    cluster = LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0",
                           worker_dashboard_address=":0")
    try:
        with Client(cluster) as client:
            with dask.config.set({"agents.client.batched-send-interval": "3ms"}):  # the driver's, not the worker's
                da.install(client)
            with da.session(client):
                assert da.stub(fc.nested_window)().value(timeout=60) == (7, 0.003)
    finally:
        cluster.close(timeout=30)


def _count_gathers(dask_scheduler: Any) -> None:
    """Count the scheduler's ``who_has`` and ``gather`` requests (how a client finds results)."""
    dask_scheduler.agents_test_gathers = 0
    for name in ("who_has", "gather"):
        handler = dask_scheduler.handlers[name]

        def counted(*args: Any, _h: Any = handler, **kwargs: Any) -> Any:
            dask_scheduler.agents_test_gathers += 1
            return _h(*args, **kwargs)

        dask_scheduler.handlers[name] = counted


def test_a_result_produced_on_the_callers_worker_is_read_there():
    """A nested call that ran on the caller's own worker is read from that worker's memory: no
    ``who_has``/``gather`` through the scheduler (issue 26: 86-92% of LLM calls paid it)."""
    cluster = LocalCluster(n_workers=1, threads_per_worker=4, processes=True, dashboard_address=":0",
                           worker_dashboard_address=":0")
    try:
        with Client(cluster) as client:
            da.install(client)
            client.run_on_scheduler(_count_gathers)
            with da.session(client):
                got = da.stub(fc.nested_results)(5).value(timeout=60)
            assert got == [(i, True) for i in range(5)]
            # the driver's own read of the outer result is the only request (the scheduler's gather)
            assert client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.agents_test_gathers) <= 1
    finally:
        cluster.close(timeout=30)


# -- (0) a worker that only made nested calls into a session is killed --------------------------
def test_killing_a_worker_never_closes_other_workers_sessions(tmp_path):
    """Workers' own clients never own a session: before, the nested call's client going away
    with its worker closed the session and reset its instance on a surviving worker."""
    d = str(tmp_path)
    with dask.config.set({"distributed.scheduler.allowed-failures": 3}):
        cluster = LocalCluster(n_workers=3, threads_per_worker=4, processes=True, dashboard_address=":0",
                               worker_dashboard_address=":0")
    try:
        with Client(cluster) as client:
            da.install(client)
            counter, relay = da.stub(fc.Counter), da.stub(fc.relay_bump)
            sessions = [da.session(client) for _ in range(6)]
            for sess in sessions:  # drivers inside their blocks throughout (entered, not left)
                sess.__enter__()
                assert counter.bump(d).value(timeout=60)[0] == 1
                sess._leave()
            homes = {sess.id: plugin_view(client)["bindings"][f"{sess.id}|Counter"] for sess in sessions}
            workers = sorted(client.scheduler_info()["workers"])
            # the victim: a worker holding no instance if there is one, else the one holding fewest
            victim = min(workers, key=lambda w: list(homes.values()).count(w))
            for sess in sessions:  # a nested call from the victim's own client into each session
                sess.__enter__()
                with dask.annotate(workers=[victim]):
                    assert relay(d).value(timeout=60)[0] == 2
                sess._leave()
            kill(next(pid for pid, addr in pids(client).items() if addr == victim))
            wait_for(lambda: victim not in plugin_view(client)["workers"], timeout=30)
            for sess in sessions:
                with sess:
                    if homes[sess.id] == victim:  # its instance died with the worker: a clear error
                        with pytest.raises(da.InstanceLostError):
                            counter.bump(d).value(timeout=60)
                    else:  # the instance on a surviving worker kept its state
                        assert counter.bump(d).value(timeout=60)[0] == 3
    finally:
        cluster.close(timeout=30)


# -- (1) an agent worker killed mid-workflow ---------------------------------------------------
def test_agent_worker_killed_mid_workflow(process_cluster, tmp_path):
    cluster = process_cluster()
    d = str(tmp_path)
    with Client(cluster) as client:
        da.install(client)
        counter, slow = da.stub(fc.Counter), da.stub(fc.slow_double)
        with da.session(client, name="doomed") as s:
            first = counter.bump(d, hold=True)  # running on the instance's worker when it dies
            queued = [counter.bump(d) for _ in range(2)]  # waiting behind it on the same instance
            wait_for(lambda: markers(d, "bump"), timeout=60)
            (bump_pid,) = next(iter(markers(d, "bump").values()))
            victim = pids(client)[bump_pid]
            tools = [slow(i, d, hold=True) for i in range(12)]  # stateless, on both workers
            wait_for(lambda: any(bump_pid in p for p in markers(d, "slow").values()), timeout=60)
            kill(bump_pid)
            wait_for(lambda: victim not in plugin_view(client)["workers"], timeout=30)
            open(os.path.join(d, "release"), "w").close()

            # stateless calls queued or running on the dead worker were rerouted and complete
            assert [t.value(timeout=60)[0] for t in tools] == [2 * i for i in range(12)]
            assert all(pid != bump_pid for _, pid in (t.value(timeout=1) for t in tools))
            # calls of the lost stateful instance fail with a clear error, never hang
            for f in [first, *queued]:
                with pytest.raises(da.InstanceLostError) as ei:
                    f.value(timeout=30)
                msg = str(ei.value)
                assert s.id in msg and "Counter.bump" in msg and victim in msg and "lost" in msg
                assert ei.value.session == s.id and ei.value.component == "Counter" and ei.value.worker == victim
            # a later call of the session fails the same way: it never runs on a fresh instance
            with pytest.raises(da.InstanceLostError, match="start a new session"):
                counter.bump(d).value(timeout=30)

        # nothing ran twice where it would show: each stateful call started at most once, and
        # the ones that failed never started again on another worker
        starts = markers(d, "bump")
        assert all(len(p) == 1 for p in starts.values()), starts
        assert first.key in starts and all(q.key not in starts for q in queued)
        view = plugin_view(client)
        assert victim not in view["bindings"].values() and victim not in view["placed"].values()
        rec = view["recovery"]
        assert rec["workers_lost"] >= 1 and rec["failed"] == 4  # the 3 stranded calls and the later one
        assert any(i.get("worker") == victim for i in rec["incidents"])
        events = [e for _, e in client.get_events("agents-faults")]
        assert any(e.get("worker") == victim and e.get("failed") == 3 for e in events)
        # the session completed (its failed calls are terminal) and the telemetry says so
        rows = da.telemetry(client, s)
        assert set(rows[rows["key"].isin([f.key for f in queued])]["state"]) == {"erred"}


# -- (2) an emulated-engine worker killed mid-generation ---------------------------------------
EMU = {"emu": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
               "emulation": {"time_scale": 1.0, "decode_s_per_step": 0.02, "max_batch": 64}}}


def _engine_running(dask_worker: Any) -> int:
    """Requests the worker's emulated engine is running now."""
    engines = dask_worker.plugins["dask-agents"].engines
    return sum(h.stats().get("running") or 0 for h in list(engines._hosts.values()) if hasattr(h, "stats"))


def test_engine_worker_killed_mid_generation(process_cluster):
    cluster = process_cluster(**{"agents.llm.models": EMU})
    with Client(cluster) as client:
        da.install(client, models=["emu"])
        wait_for(lambda: len(hosted_models(client).get("emu", [])) == 2, timeout=60)
        sessions, futs = [], []
        for i in range(6):
            with da.session(client, name=f"chat{i}") as s:
                sessions.append(s)
                # 100 decode steps x 20 ms: about 2 s each, long enough to be killed mid-way
                futs.append(da.llm("emu").generate(f"session {i}: tell a long story", max_tokens=100))
        wait_for(lambda: len(plugin_view(client)["placed"]) == 6, timeout=30)
        view = plugin_view(client)
        victim = sorted(view["placed"].values())[0]
        # killed while its engine is generating (not before the requests reach it)
        wait_for(lambda: (client.run(_engine_running, workers=[victim]).get(victim) or 0) > 0, timeout=30)
        pid = {a: p for p, a in pids(client).items()}[victim]
        kill(pid)
        results = [f.value(timeout=60) for f in futs]  # every generation completes, none hangs
        assert all(r.output_tokens == 100 for r in results)
        assert all(r.worker != victim for r in results)
        view = plugin_view(client)
        assert victim not in view["bindings"].values()
        assert view["recovery"]["rerouted"] >= 1 and view["recovery"]["failed"] == 0
        # later calls of those sessions go to a live engine (their new binding)
        with sessions[0]:  # a late call reopens the session
            r = da.llm("emu").generate("after the crash", max_tokens=4).value(timeout=30)
        assert r.worker != victim
        assert victim not in hosted_models(client).get("emu", [])


# -- (3) the control loop: a policy raising, a policy hanging, the loop dying or stalling ------
import asyncio  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402

from distributed import Scheduler, Worker  # noqa: E402
from distributed.utils_test import gen_cluster  # noqa: E402

from dask_agents.scheduler_plugin.actions import Route  # noqa: E402
from dask_agents.scheduler_plugin.plugin import NAME  # noqa: E402
from tests.conftest import async_wait_for  # noqa: E402

SLEEPING = threading.Event()  # set while the hanging policy sleeps
WAKE = threading.Event()


class Raises:
    """A policy with a bug."""

    def __call__(self, view):
        raise RuntimeError("policy bug")


class Hangs:
    """A policy that blocks (``time.sleep``-like) until WAKE is set: it must not block the
    scheduler's event loop."""

    calls = 0

    def __call__(self, view):
        Hangs.calls += 1
        SLEEPING.set()
        WAKE.wait(20)
        SLEEPING.clear()
        return []


@da.tool
def echo(x):
    return x, threading.current_thread().name


def _incidents(stats: dict, kind: str) -> list[dict]:
    return [i for i in stats["incidents"] if i["action"] == kind]


FAULTY = {"agents.control.policies.raises": {"class": "tests.test_faults.Raises"},
          "agents.control.policies.hangs": {"class": "tests.test_faults.Hangs"},
          "agents.control.interval": "50ms"}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=FAULTY)
async def test_policy_raising_or_hanging_never_blocks_serving(c: Client, s: Scheduler, a: Worker, caplog):
    WAKE.clear()
    Hangs.calls = 0
    await da.install(c)
    ctl = s.plugins[NAME].control
    await async_wait_for(lambda: SLEEPING.is_set(), timeout=10)  # the loop runs by itself
    # while the policy sleeps, the event loop is free: calls complete with the policy still inside
    # (on the event loop it would hold everything until WAKE, which only this test sets)
    for i in range(10):
        async with da.session(c):
            assert (await da.stub(echo)(i))[0] == i
        assert SLEEPING.is_set() and not WAKE.is_set()
    await async_wait_for(lambda: "hangs" in ctl.watchdog.hung, timeout=5)
    ticks = ctl.ticks
    await async_wait_for(lambda: ctl.ticks >= ticks + 5, timeout=5)  # the other policies keep going
    assert Hangs.calls == 1  # quarantined: not called again while its thread is stuck
    stats = await da.control(c).stats()
    assert stats["running"] and stats["loop_alive"] and list(stats["hung_policies"]) == ["hangs"]
    assert _incidents(stats, "policy-timeout")[0]["policy"] == "hangs"
    assert "raises" in stats["errors"] and "policy bug" in stats["errors"]["raises"]
    assert _incidents(stats, "policy-error") and stats["policy_errors"] >= 3
    assert stats["restarts"] == 0  # a bad policy does not take the loop down
    WAKE.set()  # its thread returns: the policy is called again
    await async_wait_for(lambda: Hangs.calls >= 2, timeout=5)
    stats = await da.control(c).stats()
    assert not stats["hung_policies"] and _incidents(stats, "policy-recovered")
    events = [e for _, e in await c.get_events("agents-control")]
    kinds = {e.get("action") for e in events}
    assert {"policy-error", "policy-timeout", "policy-recovered"} <= kinds
    assert "policy bug" in caplog.text and "policy-timeout" in caplog.text


LOOP = {"agents.control.interval": "50ms"}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=LOOP)
async def test_control_loop_dies_or_stalls_and_restarts_within_a_second(c: Client, s: Scheduler, a: Worker,
                                                                        b: Worker, caplog):
    await da.install(c)
    plugin = s.plugins[NAME]
    ctl = plugin.control
    await async_wait_for(lambda: ctl.ticks >= 2)
    # a decision the loop made: calls of `echo` go to worker b only
    assert ctl.enforcer.apply([Route("echo", (b.address,))], "test") == 1

    # (a) a pass raises: the loop task dies
    real_build = ctl.build_view
    died = {"n": 0}

    def broken_build():
        died["n"] += 1
        raise RuntimeError("view bug")

    ctl.build_view = broken_build
    await async_wait_for(lambda: died["n"] >= 1, timeout=5)
    ctl.build_view = real_build  # the restarted loop builds a fresh view
    # serving goes on meanwhile, on the last decisions (the route stands)
    async with da.session(c):
        out = [await da.stub(echo)(i) for i in range(5)]
    assert [o[0] for o in out] == list(range(5))
    await async_wait_for(lambda: ctl.watchdog.restarts >= 1, timeout=5)
    ticks = ctl.ticks
    await async_wait_for(lambda: ctl.ticks > ticks, timeout=5)
    stats = await da.control(c).stats()
    died_inc = _incidents(stats, "loop-died")[0]
    restarted = _incidents(stats, "loop-restarted")[0]
    # restarted with a fresh view (how fast: watchdog-interval + stall-timeout, tests/test_watchdog.py)
    assert "view bug" in died_inc["error"] and restarted["time"] >= died_inc["time"]
    assert stats["loop_alive"] and stats["running"]
    df = await da.telemetry(c)
    assert set(df[df["component"] == "echo"]["worker"]) == {b.address}

    # (b) a pass hangs on an await: the watchdog sees no progress and restarts it
    never = asyncio.Event()
    real_pass = ctl.run_pass

    async def stuck_pass():
        ctl.run_pass = real_pass
        await never.wait()

    ctl.run_pass = stuck_pass
    await async_wait_for(lambda: ctl.watchdog.restarts >= 2, timeout=5)
    stats = await da.control(c).stats()
    stalled = _incidents(stats, "loop-stalled")[0]
    restarted = _incidents(stats, "loop-restarted")[-1]
    # a stall, not a death: the stuck pass was detected past its deadline and the loop restarted
    # (the deadline arithmetic is tested without a cluster in tests/test_watchdog.py)
    assert restarted["time"] >= stalled["time"]
    ticks = ctl.ticks
    await async_wait_for(lambda: ctl.ticks > ticks, timeout=5)
    assert stats["restarts"] == 2
    kinds = [e.get("action") for _, e in await c.get_events("agents-control")]
    assert kinds.count("loop-restarted") == 2 and "loop-died" in kinds and "loop-stalled" in kinds
    assert "control loop died" in caplog.text and "view bug" in caplog.text
    # the route decided before the failures still stands
    async with da.session(c):
        assert (await da.stub(echo)("late"))[0] == "late"
    df = await da.telemetry(c)
    assert set(df[df["component"] == "echo"]["worker"]) == {b.address}


# -- (4) a scheduler restarted with its preload keeps its configuration -----------------------
def _scheduler_config(dask_scheduler=None) -> dict:
    import dask as _dask

    p = dask_scheduler.plugins.get("dask-agents")
    return {
        "installed": p is not None,
        "interval": p.control.interval if p else None,
        "policies": sorted(p.control.policies) if p else None,
        "retention": _dask.config.get("agents.scheduler.session-retention"),
        "models": sorted(_dask.config.get("agents.llm.models")),
        "running": p.control.running if p else None,
    }


def test_scheduler_restart_with_preload_keeps_configuration(tmp_path):
    from tests.test_preload import DASK, PRELOAD, Proc, _env, agents_ping
    from tests.test_preload import wait_for as pwait

    import socket

    with socket.socket() as sock:  # a free port the restarted scheduler can take again
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    emu = '{"emu": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte", "emulation": {"time_scale": 0.001}}}'
    env = _env(DASK_AGENTS__CONTROL__INTERVAL="70ms", DASK_AGENTS__SCHEDULER__SESSION_RETENTION="3 minutes",
               DASK_AGENTS__CONTROL__POLICIES__BATCHING__ENABLED="False", DASK_AGENTS__LLM__MODELS=emu,
               DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING="False")
    wenv = dict(env, DASK_AGENTS__WORKER__MODELS='["emu"]')
    sched_args = [DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard", "--preload", PRELOAD]
    worker_args = [DASK, "worker", address, "--host", "127.0.0.1", "--nthreads", "4", "--no-dashboard",
                   "--preload", PRELOAD, "--death-timeout", "60"]
    procs: list[Proc] = []
    expected = {"installed": True, "interval": 0.07, "policies": ["balance", "prioritize", "reallocate"],
                "retention": "3 minutes", "models": ["coder", "emu"], "running": True}

    def one_run(client: Client, procs: tuple) -> None:
        pwait(lambda: client.scheduler_info()["workers"], "a worker", procs=procs)
        pwait(lambda: agents_ping(client)["workers"], "the worker's hello", procs=procs)
        pwait(lambda: hosted_models(client).get("emu"), "the worker's models", procs=procs)
        assert client.run_on_scheduler(_scheduler_config) == expected
        with da.session(client) as s:
            r = da.llm("emu").generate("hello after a restart", max_tokens=4).value(timeout=60)
        assert r.output_tokens == 4 and r.emulated
        pwait(lambda: len(da.telemetry(client, s)) == 1, "telemetry of the session", procs=procs)

    try:
        sched = Proc(sched_args, str(tmp_path / "scheduler1.log"), env)
        procs.append(sched)
        worker = Proc(worker_args, str(tmp_path / "worker1.log"), wenv)
        procs.append(worker)
        with Client(address, timeout="10s") as client:  # also how long it tries to reconnect
            one_run(client, (sched,))
            with da.session(client):
                pending = da.stub(fc.slow_double)(1, str(tmp_path), hold=True)  # in flight at the crash
            pwait(lambda: markers(tmp_path, "slow"), "the held call to start", procs=(sched,))
            os.killpg(sched.popen.pid, signal.SIGKILL)  # the scheduler crashes
            sched.popen.wait(10)
            # the request fails with an error on its future naming the call, it does not hang
            # (the client gave up reconnecting: the scheduler stays down past its timeout)
            with pytest.raises(da.CallLostError) as ei:
                pending.value(timeout=60)
            assert pending.key in str(ei.value) and "did not reconnect" in str(ei.value), ei.value
        sched.kill()
        procs.remove(sched)
        sched = Proc(sched_args, str(tmp_path / "scheduler2.log"), env)
        procs.append(sched)
        with Client(address, timeout="30s") as client:
            # Dask workers do not outlive their scheduler's state: replace the old one with a
            # fresh one, as a cluster manager would (no waiting to see whether it comes back)
            worker.kill()
            worker = Proc(worker_args, str(tmp_path / "worker2.log"), wenv)
            procs.append(worker)
            one_run(client, (sched,))
    finally:
        for p in reversed(procs):
            p.kill()


# -- (5) a stateful call still waiting on its inputs when its instance's worker leaves ---------
GATE = threading.Event()


@da.agent(stateful=True)
class Notebook:
    """Session state: the lines written so far."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, line: str, after=None) -> int:
        self.lines.append(line)
        return len(self.lines)


@da.tool
def gated(x):
    GATE.wait(30)
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 2)], timeout=60,
             config={"agents.control.enabled": False})
async def test_waiting_stateful_call_fails_at_once_when_its_instance_is_lost(c: Client, s: Scheduler,
                                                                              a: Worker, b: Worker):
    GATE.clear()
    await da.install(c)
    nb = da.stub(Notebook)
    async with da.session(c, name="notes") as sess:
        assert await nb.add("first") == 1
        home = s.plugins[NAME].bindings[(sess.id, "Notebook")]
        other = b if home == a.address else a
        gate = da.stub(gated)("input")
        waiting = nb.add("second", after=gate)  # pinned to the instance's worker, inputs not ready
        await async_wait_for(lambda: waiting.key in s.plugins[NAME].placed)
        await (a if home == a.address else b).close()
        with pytest.raises(da.InstanceLostError, match=f"Notebook.add \\(session {sess.id}\\)"):
            await waiting  # at once: not after its input arrives, not as a re-run on an empty instance
        assert not GATE.is_set()  # failed before its input could arrive
        GATE.set()
        assert await gate == "input"  # the stateless input was rerouted if it ran there
        with pytest.raises(da.InstanceLostError):  # later calls too: never a fresh, empty instance
            await nb.add("third")
        assert other.plugins[NAME].instances.stateful_count() == 0
    assert home not in s.plugins[NAME].bindings.values()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 2)], timeout=60,
             config={"agents.control.enabled": False})
async def test_routed_call_pinned_to_a_lost_worker_runs_elsewhere(c: Client, s: Scheduler, a: Worker, b: Worker):
    GATE.clear()
    await da.install(c)
    plugin = s.plugins[NAME]
    assert plugin.control.enforcer.apply([Route("echo", (b.address,))], "test") == 1  # the control plane's decision
    async with da.session(c):
        gate = c.submit(gated, "in", workers=[a.address], pure=False)  # runs on a, held
        routed = da.stub(echo)(gate)  # pinned to b by the route, waiting for its input
        await async_wait_for(lambda: plugin.placed.get(routed.key, (None,))[0] == b.address)
        await b.close()
        await async_wait_for(lambda: plugin.recovery.counts["rerouted"] >= 1)
        GATE.set()
        value, _ = await asyncio.wait_for(routed, 30)  # placed again on a live worker: it completes
    assert value == "in"
    df = await da.telemetry(c)
    assert set(df[df["key"] == routed.key]["worker"]) == {a.address}
    assert set(df[df["key"] == routed.key]["state"]) == {"finished"}


# -- recovery never strands a call (emulated scheduler: benchmarks/control_scale.py) -----------
from benchmarks import control_scale as cs  # noqa: E402
from dask_agents.calls import ANNOTATION  # noqa: E402
from dask_agents.scheduler_plugin import dask_compat  # noqa: E402


def _submit(em: cs.Emulation, key: str, ann: dict) -> cs.ETask:
    """One call through the plugin's ``update_graph``, then ``waiting`` (its inputs not ready)."""
    ts = cs.ETask(key, set(), em.order)
    em.order += 1
    em.s.tasks[key] = ts
    em.plugin.update_graph(em.s, client="c", keys={key}, tasks=[key], annotations={ANNOTATION: {key: ann}},
                           priority={}, stimulus_id="test")
    em.transition(ts, "waiting")
    return ts


def _lose(em: cs.Emulation, gone: str) -> None:
    """``gone`` leaves as Dask handles it: its tasks are released to run again, then the hook."""
    ws = em.s.workers.pop(gone)
    em.s.running.discard(ws)
    for ts in list(ws.processing):
        em.transition(ts, "waiting")
    em.plugin.remove_worker(em.s, gone, stimulus_id="test-lost")


def test_recovery_goes_on_past_a_call_whose_recovery_raises(monkeypatch, caplog):
    em = cs.Emulation(4, seed=5, nthreads=2)
    em.fill(400)
    p, gone = em.plugin, "tcp://w0:1"  # the engine worker
    stateful = []
    for i in range(2):  # stateful calls whose instance lives on the lost worker
        ts = _submit(em, f"Notebook-{i}", {"call": f"Notebook-{i}", "component": "Notebook", "method": "add",
                                            "kind": "agent", "session": "s0", "stateful": True})
        p.placement.unplace(ts.key)
        dask_compat.restrict_to_worker(ts, gone)
        p.placed[ts.key] = (gone, "Notebook")
        stateful.append(ts.key)
    llm = sorted(k for k, (w, what) in p.placed.items() if w == gone and what.startswith("llm:")
                 and em.s.tasks[k].state in ("waiting", "processing"))
    assert len(llm) >= 3
    bad_llm, bad_stateful = llm[0], stateful[0]
    place = p.placement.place

    def flaky_place(ts, *args, **kwargs):
        if ts.key == bad_llm:
            raise RuntimeError("boom in place")
        return place(ts, *args, **kwargs)

    lost_error = p.recovery._lost_error

    def flaky_lost_error(key, *args):
        if key == bad_stateful:
            raise ValueError("boom in _lost_error")
        return lost_error(key, *args)

    failed: dict = {}

    def fail_task(scheduler, key, exc, stimulus_id):  # the emulated scheduler has no transition engine
        failed[key] = exc
        scheduler.tasks[key].state = "erred"
        return True

    monkeypatch.setattr(p.placement, "place", flaky_place)
    monkeypatch.setattr(p.recovery, "_lost_error", flaky_lost_error)
    monkeypatch.setattr(dask_compat, "fail_task", fail_task)
    with caplog.at_level(logging.ERROR, logger="dask_agents.scheduler_plugin.recovery"):
        _lose(em, gone)
    assert "boom in place" in caplog.text and "boom in _lost_error" in caplog.text
    # the call whose re-placement raised is unpinned (Dask places it); the others re-placed
    assert not em.s.tasks[bad_llm].worker_restrictions and bad_llm not in p.placed
    for k in llm[1:]:
        pins = em.s.tasks[k].worker_restrictions
        assert pins and gone not in pins and dask_compat.has_worker(em.s, next(iter(pins))), k
    # both stateful calls fail with an error naming their session; never left pinned
    assert set(failed) == set(stateful)
    assert all(isinstance(e, da.InstanceLostError) and e.session == "s0" for e in failed.values())
    assert "boom in _lost_error" in str(failed[bad_stateful]) and "Notebook.add (session s0)" in str(failed[bad_stateful])
    assert "stateful instance was lost" in str(failed[stateful[1]])
    c = p.recovery.counts
    assert c["failed"] == 2 and c["rerouted"] >= len(llm) and not p.recovery.stranded


def test_recovery_reads_annotations_through_the_sanitizer():
    em = cs.Emulation(2, seed=1, nthreads=1)
    p, gone = em.plugin, "tcp://w0:1"  # the only host of the model
    # a recorded LLM call whose raw annotation was overwritten with garbage: the record decides
    llm = _submit(em, "llm.coder-z", {"call": "llm.coder-z", "component": "llm.coder", "kind": "llm",
                                      "llm_model": "coder"})
    assert llm.worker_restrictions == {gone}
    llm.annotations = {ANNOTATION: "garbage"}
    # unrecorded tasks pinned by a user, annotated by any client (dask.annotate(agents=...))
    user = []
    for key, raw in (("x-1", "x"), ("y-1", {"stateful": "yes", "kind": 7}), ("w-1", ["a"])):
        ts = cs.ETask(key, set(), 0)
        ts.annotations = {ANNOTATION: raw}
        ts.worker_restrictions = {gone}
        ts.state = "no-worker"
        em.s.tasks[key] = ts
        p.recovery.stranded.add(key)
        user.append(ts)
    _lose(em, gone)
    assert llm.worker_restrictions == {"tcp://w1:1"}  # re-placed on the live worker
    assert all(ts.worker_restrictions == {gone} for ts in user)  # the user's pins: Dask's behaviour
    assert p.recovery.counts["rerouted"] == 1 and p.recovery.counts["failed"] == 0
