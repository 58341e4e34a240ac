"""More of the Dask internals dask-agents fences in scheduler_plugin/ and worker_plugin/ dask_compat.

The companion of tests/test_dask_compat.py: one test per compat function (or a few closely
related ones) that tests/test_dask_compat.py does not call. Each asserts what the project relies
on, read back from Dask's own state, so that a distributed upgrade that changes the internal
fails here rather than as a symptom elsewhere.
"""

from __future__ import annotations

import threading

import pytest
from dask_agents.scheduler_plugin import dask_compat as sc
from dask_agents.worker_plugin import dask_compat as wc
from distributed import Client, Scheduler, SchedulerPlugin, Worker
from distributed.core import Status
from distributed.utils_test import gen_cluster

from tests.conftest import async_wait_for

GATE = threading.Event()  # in-process workers: tasks see this module's globals; tests open it
ORDER: list = []  # what ran, in the order it ran (one thread per worker: one at a time)


def inc(x: int) -> int:
    return x + 1


def hold(i: int = 0) -> int:
    GATE.wait(30)
    return i


def hold_and_record(i: int) -> int:
    ORDER.append(i)
    GATE.wait(30)
    return i


def hold_seceded() -> bool:
    wc.secede_if_in_task()
    return GATE.wait(30)


def record() -> None:
    from distributed.worker import thread_state

    ORDER.append(thread_state.key)


SEEN: dict = {}


def priority_spy() -> int:
    from distributed import get_worker
    from distributed.worker import thread_state

    SEEN[thread_state.key] = wc.task_priority(get_worker(), thread_state.key)  # what the worker was given
    return 1


def payload(n: int) -> bytes:
    return b"x" * n


def _keys(tasks: list) -> list:
    return [sc.task_key(ts) for ts in tasks]


# -- priorities ---------------------------------------------------------------------------------

@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_priority_reads_and_set_priority_is_what_dask_sends(c: Client, s: Scheduler, a: Worker):
    new = (-3, 1, 99)

    class SetPriority(SchedulerPlugin):  # where the project calls it: after Dask's _set_priorities
        def update_graph(self, scheduler, *, keys, **kw):
            for k in keys:
                if k == "prio-set":
                    sc.set_priority(sc.task(scheduler, k), new)

    s.add_plugin(SetPriority(), name="set-priority")
    seen = SEEN
    seen.clear()
    default = c.submit(priority_spy, key="prio-default", priority=7)
    changed = c.submit(priority_spy, key="prio-set", priority=7)
    await c.gather([default, changed])
    # Dask stores the user's priority negated first (smaller runs first): the project reads [0]
    assert sc.priority(sc.task(s, "prio-default"))[0] == -7
    assert sc.priority(sc.task(s, "prio-set")) == new == s.tasks["prio-set"].priority
    # the compute-task message carried the value set in update_graph, not Dask's own
    assert seen["prio-set"] == new and seen["prio-default"] == tuple(s.tasks["prio-default"].priority)


# one thread, saturation 1.0: the scheduler sends one root-ish task and holds the rest back
QUEUEING = {"distributed.scheduler.worker-saturation": 1.0}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=QUEUEING)
async def test_queued_on_scheduler_is_best_priority_first(c: Client, s: Scheduler, a: Worker):
    GATE.clear()
    futs = c.map(hold, range(8), pure=False)  # root-ish (8 > 2 x 1 thread): queued on the scheduler
    await async_wait_for(lambda: len(s.queued) == 7)
    three = sc.queued_on_scheduler(s, 3)
    everything = sc.queued_on_scheduler(s, 100)
    assert len(three) == 3 and len(everything) == 7
    assert all(sc.state(ts) == "queued" for ts in everything) and set(everything) == set(s.queued)
    prios = [sc.priority(ts) for ts in everything]
    assert prios == sorted(set(prios))  # best (smallest) first, no ties to hide a wrong order
    assert three == everything[:3] and everything[0] is s.queued.peek()  # what the scheduler sends next
    assert sc.queued_on_scheduler(s, 0) == [] and sc.queued_on_scheduler(s, -1) == []
    GATE.set()
    assert sorted(await c.gather(futs)) == list(range(8))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=QUEUEING)
async def test_requeue_with_priority_promotes_in_the_scheduler_queue(c: Client, s: Scheduler, a: Worker):
    GATE.clear()
    ORDER.clear()
    futs = c.map(hold_and_record, range(8), pure=False)
    await async_wait_for(lambda: len(s.queued) == 7 and len(ORDER) == 1)
    last = sc.queued_on_scheduler(s, 100)[-1]
    best = sc.priority(s.queued.peek())
    sc.requeue_with_priority(s, last, (best[0] - 1,) + tuple(best[1:]))
    assert sc.priority(last) < best and sc.is_queued_on_scheduler(s, last) and len(s.queued) == 7
    assert s.queued.peek() is last and sc.queued_on_scheduler(s, 1) == [last]
    GATE.set()  # the running task ends: the scheduler sends the promoted one into the freed slot
    results = await c.gather(futs)
    assert sorted(results) == list(range(8))
    assert ORDER[1] == next(i for i, f in enumerate(futs) if f.key == sc.task_key(last))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=QUEUEING)
async def test_requeue_with_priority_demotes_in_the_scheduler_queue(c: Client, s: Scheduler, a: Worker):
    """(Could not: HeapSet.discard leaves the old heap entry, found first at the old priority.)"""
    GATE.clear()
    futs = c.map(hold, range(8), pure=False)
    try:
        await async_wait_for(lambda: len(s.queued) == 7)
        first = s.queued.peek()
        worst = sc.priority(sc.queued_on_scheduler(s, 100)[-1])
        sc.requeue_with_priority(s, first, (worst[0] + 1,) + tuple(worst[1:]))
        assert sc.priority(first) > worst and len(s.queued) == 7
        # the enforcement layer demotes a call: the scheduler must send another one first
        assert s.queued.peek() is not first
        assert sc.queued_on_scheduler(s, 100)[-1] is first
    finally:
        GATE.set()
        await c.gather(futs)


# -- reading load ---------------------------------------------------------------------------------

@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_workers_lists_running_workers_only(c: Client, s: Scheduler, a: Worker, b: Worker):
    assert sorted(ws.address for ws in sc.workers(s)) == sorted([a.address, b.address])
    assert all(ws is s.workers[ws.address] for ws in sc.workers(s))  # Dask's WorkerState objects
    a.status = Status.paused  # the worker tells the scheduler: it takes no new tasks
    try:
        await async_wait_for(lambda: [ws.address for ws in sc.workers(s)] == [b.address])
        assert a.address in s.workers  # still connected, just not running
    finally:
        a.status = Status.running
    await async_wait_for(lambda: len(sc.workers(s)) == 2)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_worker_summary_counts_assigned_and_running(c: Client, s: Scheduler, a: Worker):
    GATE.clear()
    ws = s.workers[a.address]
    assert sc.worker_summary(ws) == (a.address, 1, 0, 0)
    running = c.submit(hold, 1, pure=False)
    waiting = c.submit(hold, 2, pure=False)  # behind it: the one thread is taken

    async def summary_after_heartbeat():
        await a.heartbeat()  # the scheduler learns what executes from heartbeats
        return sc.worker_summary(ws) == (a.address, 1, 2, 1)

    await async_wait_for(summary_after_heartbeat, 20)
    GATE.set()
    await c.gather([running, waiting])
    assert sc.worker_summary(ws)[2] == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_worker_summary_counts_a_seceded_task_once(c: Client, s: Scheduler, a: Worker):
    """(Was counted twice, and free_threads said -1: a heartbeat reports seceded tasks as executing.)"""
    GATE.clear()
    ws = s.workers[a.address]
    seceded = c.submit(hold_seceded, pure=False)
    # the worker reports a secede at once: wait for it before the freed slot's tasks arrive
    await async_wait_for(lambda: sc.task(s, seceded.key) is not None and sc.task(s, seceded.key) in ws.long_running)
    running = c.submit(hold, 1, pure=False)
    waiting = c.submit(hold, 2, pure=False)
    try:
        async def executing_reported():
            await a.heartbeat()  # the scheduler learns what executes from heartbeats
            return sc.task(s, running.key) in ws.executing

        await async_wait_for(executing_reported, 20)
        # three assigned; two running (one executing, one seceded); one waiting
        assert sc.worker_summary(ws) == (a.address, 1, 3, 2)
        # the heartbeat lists the seceded task in ``executing`` too: it holds no thread
        assert [sc.task_key(t) for t, _ in sc.executing(ws)] == [running.key]
        assert sc.free_threads(s, a.address) == 0
    finally:
        GATE.set()
        await c.gather([seceded, running, waiting])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_input_bytes_counts_dependencies_in_memory(c: Client, s: Scheduler, a: Worker):
    GATE.clear()
    x = c.submit(payload, 10_000, key="x-bytes")
    y = c.submit(payload, 20_000, key="y-bytes")
    z = c.submit(lambda p, q, r: len(p) + len(q), x, y, c.submit(hold, key="gated-bytes"), key="z-bytes")
    await c.gather([x, y])
    nx, ny = s.tasks["x-bytes"].nbytes, s.tasks["y-bytes"].nbytes
    assert nx >= 10_000 and ny >= 20_000
    # the gated input has no result yet (Dask's nbytes is -1 then): it is not counted
    assert sc.input_bytes(sc.task(s, "z-bytes")) == nx + ny
    assert sc.input_bytes(sc.task(s, "x-bytes")) == 0  # no dependencies
    GATE.set()
    await z
    assert sc.input_bytes(sc.task(s, "z-bytes")) == nx + ny + s.tasks["gated-bytes"].nbytes


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"R": 1}})] * 2)
async def test_restriction_kinds(c: Client, s: Scheduler, a: Worker, b: Worker):
    futs = {
        "plain": c.submit(inc, 1, key="plain-r"),
        "resource": c.submit(inc, 2, key="resource-r", resources={"R": 1}),
        "host": c.submit(inc, 3, key="host-r", workers=["127.0.0.1"]),
        "strict": c.submit(inc, 4, key="strict-r", workers=[a.address]),
        "loose": c.submit(inc, 5, key="loose-r", workers=[a.address], allow_other_workers=True),
    }
    await c.gather(list(futs.values()))
    ts = {name: sc.task(s, f.key) for name, f in futs.items()}
    assert s.tasks["host-r"].host_restrictions == {"127.0.0.1"}  # a host, not a worker address
    foreign = {name for name, t in ts.items() if sc.has_foreign_restrictions(t)}
    strict = {name for name, t in ts.items() if sc.has_strict_worker_restriction(t)}
    assert foreign == {"resource", "host"}
    assert strict == {"strict"}  # allow_other_workers makes it loose


# -- control plane --------------------------------------------------------------------------------

@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_send_to_worker_reaches_a_worker_stream_handler(c: Client, s: Scheduler, a: Worker):
    got: list = []
    wc.add_stream_handler(a, "compat-to-worker", lambda **kw: got.append(kw))
    sc.send_to_worker(s, a.address, {"op": "compat-to-worker", "value": 3})
    sc.send_to_worker(s, a.address, {"op": "compat-to-worker", "value": 4})
    await async_wait_for(lambda: len(got) == 2)
    assert [m["value"] for m in got] == [3, 4]  # in order, on the scheduler's stream
    assert a.address in s.workers and a.status == Status.running  # the stream stays open


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_stealing_is_dask_s_extension(c: Client, s: Scheduler, a: Worker):
    from distributed.stealing import WorkStealing

    ext = s.extensions["stealing"]  # work stealing is on by default
    assert sc.stealing(s) is ext and isinstance(ext, WorkStealing)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config={"distributed.scheduler.work-stealing": False})
async def test_stealing_is_created_but_not_started_when_off(c: Client, s: Scheduler, a: Worker):
    from distributed.stealing import WorkStealing

    assert "stealing" not in s.extensions
    ext = sc.stealing(s)
    assert isinstance(ext, WorkStealing) and s.extensions["stealing"] is ext and sc.stealing(s) is ext
    assert a.address in ext.stealable  # it knows the workers that were there already
    # what move_task relies on: Dask routes the victims' answers to it
    assert s.stream_handlers["steal-response"] == ext.move_task_confirm
    assert "stealing" not in s.periodic_callbacks  # never balances on its own
    assert await c.submit(inc, 1) == 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_add_event_is_seen_by_clients(c: Client, s: Scheduler, a: Worker):
    sc.add_event(s, "compat-topic", {"action": "one", "n": 1})
    sc.add_event(s, "compat-topic", {"action": "two", "n": 2})
    events = await c.get_events("compat-topic")
    assert [msg for _, msg in events] == [{"action": "one", "n": 1}, {"action": "two", "n": 2}]
    assert all(isinstance(t, float) for t, _ in events)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_assigned_to_worker_splits_not_started_and_started(c: Client, s: Scheduler, a: Worker):
    GATE.clear()
    seceded = c.submit(hold_seceded, pure=False)
    ws = s.workers[a.address]
    await async_wait_for(lambda: sc.task(s, seceded.key) is not None and sc.task(s, seceded.key) in ws.long_running)
    running = c.submit(hold, 1, pure=False)
    waiting = c.submit(hold, 2, pure=False)
    await async_wait_for(lambda: a.state.tasks.get(running.key) is not None
                         and a.state.tasks[running.key].state == "executing")

    async def split_after_heartbeat():
        await a.heartbeat()  # the scheduler learns what executes from heartbeats
        not_started, started = sc.assigned_to_worker(s, a.address)
        return _keys(not_started) == [waiting.key] and sorted(_keys(started)) == sorted([seceded.key, running.key])

    await async_wait_for(split_after_heartbeat, 20)  # a seceded task counts as started
    assert sc.assigned_to_worker(s, "tcp://127.0.0.1:1") == ([], [])
    GATE.set()
    await c.gather([seceded, running, waiting])
    assert sc.assigned_to_worker(s, a.address) == ([], [])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_cancel_tasks_cancels_dependents_and_counts(c: Client, s: Scheduler, a: Worker):
    from distributed.utils import CancelledError  # what a cancelled future raises

    GATE.clear()
    x = c.submit(hold, 1, key="x-cancel")
    y = c.submit(inc, x, key="y-cancel")
    await async_wait_for(lambda: sc.task_state_on(s, "x-cancel") == "processing")
    assert sc.cancel_tasks(s, ["x-cancel", "no-such-key"], "compat: cancelled on purpose") == 1
    for f in (x, y):  # the dependent goes with it, with the reason
        with pytest.raises(CancelledError, match="compat: cancelled on purpose"):
            await f
    await async_wait_for(lambda: sc.task(s, "x-cancel") is None and sc.task(s, "y-cancel") is None)
    assert sc.cancel_tasks(s, ["x-cancel"], "again") == 0  # nothing left to cancel
    GATE.set()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_cancel_tasks_for_one_client_leaves_others(c: Client, s: Scheduler, a: Worker):
    from distributed.utils import CancelledError

    GATE.clear()
    async with Client(s.address, asynchronous=True) as c2:
        mine = c.submit(hold, 1, key="mine-cancel")
        theirs = c2.submit(hold, 2, key="theirs-cancel")
        await async_wait_for(lambda: sc.task(s, "mine-cancel") is not None and sc.task(s, "theirs-cancel") is not None)
        assert sc.cancel_tasks(s, ["mine-cancel"], "not theirs", client=c2.id) == 0  # c2 does not want it
        assert sc.cancel_tasks(s, ["mine-cancel", "theirs-cancel"], "only c's", client=c.id) == 1
        with pytest.raises(CancelledError, match="only c's"):
            await mine
        GATE.set()
        assert await theirs == 2  # the other client's key goes on and delivers


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_cancel_tasks_for_one_client_releases_a_shared_key_for_it(c: Client, s: Scheduler, a: Worker):
    """(Did nothing: Dask's unforced cancel skips a key another client wants.)"""
    GATE.clear()
    async with Client(s.address, asynchronous=True) as c2:
        mine = c.submit(hold, 1, key="shared-cancel")
        theirs = c2.submit(hold, 1, key="shared-cancel")
        try:
            await async_wait_for(lambda: sc.task(s, "shared-cancel") is not None
                                 and len(s.tasks["shared-cancel"].who_wants) == 2)
            assert sc.cancel_tasks(s, ["shared-cancel"], "only c's", client=c.id) == 1
            # the docstring: "a key another client also wants is only released by this one (it goes on)"
            assert {cs.client_key for cs in s.tasks["shared-cancel"].who_wants} == {c2.id}
        finally:
            GATE.set()
            assert await theirs == 1
            del mine


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_dependent_keys(c: Client, s: Scheduler, a: Worker):
    x = c.submit(inc, 1, key="x-dep")
    y = c.submit(inc, x, key="y-dep")
    z = c.submit(inc, x, key="z-dep")
    await c.gather([y, z])
    assert sorted(sc.dependent_keys(sc.task(s, "x-dep"))) == ["y-dep", "z-dep"]
    assert sc.dependent_keys(sc.task(s, "y-dep")) == []


# -- the worker side of reprioritizing -----------------------------------------------------------

@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config={"distributed.scheduler.worker-saturation": "inf"})
async def test_worker_reprioritize_changes_the_run_order(c: Client, s: Scheduler, a: Worker):
    GATE.clear()
    ORDER.clear()
    blocker = c.submit(hold, key="blocker-rp")  # holds the one thread: the others wait in ready
    await async_wait_for(lambda: a.state.tasks.get("blocker-rp") is not None
                         and a.state.tasks["blocker-rp"].state == "executing")
    futs = [c.submit(record, key=f"rp-{i}") for i in range(3)]
    await async_wait_for(lambda: all(a.state.tasks.get(f.key) is not None
                                     and a.state.tasks[f.key].state == "ready" for f in futs))
    before = [ts.key for ts in a.state.ready.sorted()]
    old = {k: a.state.tasks[k].priority for k in before}
    wanted = list(reversed(before))  # the first to run is demoted to last: the rebuild must see it
    with pytest.raises(TypeError):  # a malformed priority changes nothing, not even the valid ones
        wc.reprioritize(a, {wanted[0]: (0, 0, 0), wanted[1]: (float("nan"),)})
    assert {k: a.state.tasks[k].priority for k in before} == old
    new = {k: (-10, 0, i) for i, k in enumerate(wanted)}
    assert wc.reprioritize(a, {**new, "not-on-this-worker": (0,)}) == 3
    assert [ts.key for ts in a.state.ready.sorted()] == wanted and a.state.ready.peek().key == wanted[0]
    # the scheduler's priority is replaced; the worker's own arrival suffix is kept
    assert all(a.state.tasks[k].priority == new[k] + (old[k][-1],) for k in wanted)
    GATE.set()
    await c.gather([blocker, *futs])
    assert ORDER == wanted


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"R": 1}})],
             config={"distributed.scheduler.worker-saturation": "inf"})
async def test_worker_reprioritize_reorders_constrained_tasks(c: Client, s: Scheduler, a: Worker):
    GATE.clear()
    ORDER.clear()
    blocker = c.submit(hold, key="blocker-rc", resources={"R": 1})  # holds R: the others wait for it
    await async_wait_for(lambda: a.state.tasks.get("blocker-rc") is not None
                         and a.state.tasks["blocker-rc"].state == "executing")
    futs = [c.submit(record, key=f"rc-{i}", resources={"R": 1}) for i in range(3)]
    await async_wait_for(lambda: all(a.state.tasks.get(f.key) is not None
                                     and a.state.tasks[f.key].state == "constrained" for f in futs))
    before = [ts.key for ts in a.state.constrained.sorted()]
    wanted = list(reversed(before))
    assert wc.reprioritize(a, {k: (-10, 0, i) for i, k in enumerate(wanted)}) == 3
    assert [ts.key for ts in a.state.constrained.sorted()] == wanted
    GATE.set()
    await c.gather([blocker, *futs])
    assert ORDER == wanted


# -- dashboard ------------------------------------------------------------------------------------

@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], scheduler_kwargs={"dashboard": True, "dashboard_address": ":0"})
async def test_dask_bokeh_app_is_dask_s_dashboard(c: Client, s: Scheduler, a: Worker):
    from bokeh.server.tornado import BokehTornado

    app = sc._dask_bokeh_app(s)
    assert isinstance(app, BokehTornado) and app in s.http_application.applications
    assert "/status" in app.app_paths and "/workers" in app.app_paths  # Dask's own pages
    assert sc.dashboard_prefix(s) == app.prefix


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_dask_bokeh_app_is_none_without_dashboard(c: Client, s: Scheduler, a: Worker):
    assert sc._dask_bokeh_app(s) is None


def test_dashboard_theme() -> None:
    from bokeh.themes import Theme
    from jinja2 import Environment

    theme, env = sc.dashboard_theme()
    assert isinstance(theme, Theme) and isinstance(env, Environment)
    html = env.get_template("simple.html").render(pages=["compat-nav"], prefix="")  # what our page uses
    assert "compat-nav" in html  # the navigation bar Dask's pages render


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], scheduler_kwargs={"dashboard": True, "dashboard_address": ":0"})
async def test_start_bokeh_application_serves_a_page(c: Client, s: Scheduler, a: Worker):
    from bokeh.models import Div
    from tornado.httpclient import AsyncHTTPClient

    calls: list = []

    def make_document(scheduler, extra, doc):  # as scheduler_plugin/dashboard.py builds its page
        theme, env = sc.dashboard_theme()
        calls.append((scheduler, extra))
        doc.add_root(Div(text="compat"))
        doc.template = env.get_template("simple.html")
        doc.template_variables.update(extra)
        doc.theme = theme

    sc.add_dashboard_page_link(s, "compat-bokeh")
    app = sc.start_bokeh_application(s, {"/compat-bokeh": make_document}, sc.dashboard_prefix(s))
    try:
        assert app in s.http_application.applications
        url = f"http://127.0.0.1:{s.http_server.port}/compat-bokeh"
        page = await AsyncHTTPClient().fetch(url)
        assert page.code == 200
        # Dask's template (Bokeh's own has no navigation bar), with Dask's links and ours
        assert b'href="status"' in page.body and b'href="compat-bokeh"' in page.body
        [(scheduler, extra)] = calls  # the page load built one document
        assert scheduler is s and "compat-bokeh" in extra["pages"]  # Dask's template variables
    finally:
        sc.remove_http_application(s, app)
        app.stop()
        sc.remove_dashboard_page_link(s, "compat-bokeh")
    assert app not in s.http_application.applications
    gone = await AsyncHTTPClient().fetch(url, raise_error=False)
    assert gone.code == 404
    assert (await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/status")).code == 200


# -- private helpers ------------------------------------------------------------------------------

def _after_dependencies(order: dict, dependencies: dict) -> bool:
    return all(order[d] < order[k] for k, deps in dependencies.items() for d in deps if d in order)


def test_topological_order_places_dependencies_first() -> None:
    import dask.order

    chain = {"dsk": {"A": 1, "B": 1, "C": 1}, "dependencies": {"A": set(), "B": {"A"}, "C": {"B"}}}
    # why it exists: dask.order orders this chain of literals backwards (see dask_compat)
    assert not _after_dependencies(dask.order.order(**chain), chain["dependencies"])
    assert sc._topological_order(**chain) == {"A": 0, "B": 1, "C": 2}
    # a diamond, ties kept in dsk's order, dependencies outside dsk ignored, extra kwargs accepted
    dsk = {"D": 1, "C": 1, "B": 1, "A": 1}
    deps = {"D": {"B", "C"}, "C": {"A"}, "B": {"A", "outside"}, "A": set()}
    order = sc._topological_order(dsk=dsk, dependencies=deps, return_stats=False)
    assert sorted(order) == sorted(dsk) and sorted(order.values()) == [0, 1, 2, 3]
    assert _after_dependencies(order, deps) and order == {"A": 0, "C": 1, "B": 2, "D": 3}
    # a cycle (a retry loop of groups) cannot be placed: the /groups wrapper leaves its closing edge out
    with pytest.raises(ValueError, match="cycle"):
        sc._topological_order(dsk={"A": 1, "B": 1}, dependencies={"A": {"B"}, "B": {"A"}})


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_stream_origin_reads_the_stream_s_identity(c: Client, s: Scheduler, a: Worker):
    code = type(s).handle_stream.__code__
    seen: list = []

    def probe(**msg) -> None:  # called by Dask's handle_stream: two frames up from _stream_origin
        seen.append((msg.get("n"), sc._stream_origin(code)))

    sc.add_stream_handler(s, "compat-origin", probe)
    wc.send_to_scheduler(a, {"op": "compat-origin", "n": 1, "worker": "tcp://forged:1"})
    await async_wait_for(lambda: len(seen) == 1)
    c._send_to_scheduler({"op": "compat-origin", "n": 2})
    await async_wait_for(lambda: len(seen) == 2)
    assert seen[0] == (1, {"worker": a.address})  # the stream's, not the message's claim
    assert seen[1] == (2, {"client": c.id})
    probe(n=3)  # not called by that loop
    assert seen[2] == (3, None)

    def other_code(**msg) -> None:
        seen.append(("other", sc._stream_origin(probe.__code__)))

    sc.add_stream_handler(s, "compat-origin-other", other_code)
    wc.send_to_scheduler(a, {"op": "compat-origin-other"})
    await async_wait_for(lambda: len(seen) == 4)
    assert seen[3] == ("other", None)  # a loop other than the one named is not trusted
