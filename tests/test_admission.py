"""Admission and late binding of LLM calls (issue 14): the scheduler holds a session's LLM calls
until an engine has room, so policies order and move them before any engine admits them, and a
new session is admitted only while the KV working sets of the live sessions fit.

Engines here are EMULATED (64 KV blocks of 16 tokens; ``kv-target`` 0.9 lets 57 blocks be
claimed): a session with a 400-token prompt and a 100-token budget claims 32 blocks, so one
such session fits an engine and two do not. An engine's batch slot is taken in some tests by a
``blocker`` entry in the scheduler's count of calls in flight there: the engine is busy as far
as the control plane knows, with no timing involved.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Iterator

import dask
import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.actions import Migrate, SetPriority
from dask_agents.scheduler_plugin.admission import HELD
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for

EMU = {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
       "emulation": {"time_scale": 0.001, "kv_blocks": 64, "block_size": 16, "max_batch": 1}}
# slot-factor 1: an engine's one batch slot is all it gets (no call queued in the engine)
CONFIG = {"agents.llm.models": {"emu": EMU}, "agents.control.enabled": False,
          "agents.control.client-actions": True,  # the tests run passes by hand
          "agents.scheduler.admission.slot-factor": 1}
LONG = list(range(3, 403))  # 400 prompt tokens: with max_tokens=100, a 32-block working set


async def _engines(c: Client, s: Scheduler, n: int):
    """Install, and wait until every engine reported its KV capacity to the admission."""
    await da.install(c, models=["emu"])
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: len(plugin.model_workers.get("emu", ())) == n)
    await async_wait_for(lambda: len(plugin.admission.engines) == n
                         and all(r.capacity == 64 for r in plugin.admission.engines.values()))
    return plugin


def _ended(plugin, sid: str) -> bool:
    st = plugin.state.sessions.get(sid)
    return st is not None and st.state == "completed"


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60, config=CONFIG)
async def test_a_new_session_waits_while_its_working_set_does_not_fit(c: Client, s: Scheduler, a: Worker) -> None:
    plugin = await _engines(c, s, 1)
    adm = plugin.admission
    a_in, release_a, b_key = asyncio.Event(), asyncio.Event(), []

    async def first() -> str:
        async with da.session(c) as sa:
            await da.llm("emu").generate(LONG, max_tokens=100)
            a_in.set()
            await release_a.wait()
            return sa.id

    async def second() -> tuple[str, object]:
        async with da.session(c) as sb:
            fut = da.llm("emu").generate(LONG, max_tokens=100)
            b_key.append(fut.key)
            return sb.id, await fut

    ta = asyncio.ensure_future(first())
    await a_in.wait()
    tb = asyncio.ensure_future(second())
    await async_wait_for(lambda: b_key and adm.is_held(b_key[0])
                         and s.tasks[b_key[0]].state == "no-worker")
    assert s.tasks[b_key[0]].worker_restrictions == {HELD}
    assert adm.snapshot()["held"] == 1 and not tb.done()
    # the control loop's view shows it waiting, with no worker: policies can act on it
    view = plugin.view_index.build(0.0, 100)
    assert view.calls[b_key[0]].worker is None and view.calls[b_key[0]].model == "emu"
    # and operators see it on the Agents page: one call held, A's 32-block working set admitted
    from dask_agents.scheduler_plugin.dashboard_data import DashboardModel

    (row,) = DashboardModel(plugin).engines()
    assert row["held"] == 1 and row["bound"] == 0 and row["working_set"] == "32 / 64 blocks (1 sessions)"

    release_a.set()  # session A ends: its working set leaves the engine, B fits
    sid_a = await ta
    sid_b, out = await tb
    assert out.output_tokens == 100 and out.worker == a.address
    assert _ended(plugin, sid_a)
    admitted = [x for x in adm.recent if x.session == sid_b]
    assert admitted and admitted[0].note == ""  # admitted for room, not for waiting out the bound
    assert admitted[0].time >= plugin.state.sessions[sid_a].completed_at
    assert adm.counts["waited_out"] == 0 and not adm.held


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60,
             config={**CONFIG, "agents.scheduler.admission.max-wait": "300ms"})
async def test_no_session_waits_past_the_bound(c: Client, s: Scheduler, a: Worker) -> None:
    plugin = await _engines(c, s, 1)
    adm = plugin.admission
    async with da.session(c) as sa:
        await da.llm("emu").generate(LONG, max_tokens=100)
        async with da.session(c) as sb:  # A is still live: B does not fit, and is admitted anyway
            out = await da.llm("emu").generate(LONG, max_tokens=100)
        assert not _ended(plugin, sa.id)
    assert out.output_tokens == 100
    assert adm.counts["waited_out"] == 1
    note = [x for x in adm.recent if x.session == sb.id][0]
    assert note.waited_s >= 0.3 and "max-wait" in note.note
    events = [e for _t, e in s.get_events("agents-admission")]
    assert events and events[-1]["session"] == sb.id
    # visible where operators look: /metrics and agents-control
    from dask_agents.scheduler_plugin import metrics

    fams = {f.name: f for f in metrics.families(plugin)}
    decided = {smp.labels["kind"]: smp.value for smp in fams["dask_agents_admission_decisions"].samples
               if smp.name.endswith("_total")}
    assert decided["waited_out"] == 1 and decided["admitted"] == 2
    control = await plugin._control("stats")
    assert control["admission"]["counts"]["waited_out"] == 1
    assert control["admission"]["recent"][-1]["note"] == note.note


@pytest.mark.parametrize("step_aside", [True, False])
def test_admission_steps_aside_while_nothing_is_short(step_aside: bool) -> None:
    """A new session whose predicted peak (the typical one learned from ended sessions) does not
    fit next to a live session, but whose pending call does: while nothing is short it is
    admitted at once, never held; with ``step-aside`` off it waits (here until ``max-wait``)."""
    cfg = {**CONFIG, "agents.scheduler.admission.max-wait": "300ms",
           "agents.scheduler.admission.step-aside": step_aside}

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60, config=cfg)
    async def run(c: Client, s: Scheduler, a: Worker) -> None:
        plugin = await _engines(c, s, 1)
        adm = plugin.admission
        async with da.session(c) as sa:
            await da.llm("emu").generate([3] * 100, max_tokens=28)  # holds 8 blocks, stays live
            adm.typical["emu"] = 50 * 16.0  # sessions of this model grew to 50 blocks: 8 + 50 > 57
            async with da.session(c) as sb:
                out = await da.llm("emu").generate([4] * 100, max_tokens=28)  # needs 8 blocks now
            assert not _ended(plugin, sa.id)
        assert out.output_tokens == 28
        admitted = [x for x in adm.recent if x.session == sb.id]
        if step_aside:
            assert adm.counts["held"] == 0 and adm.counts["bound_loose"] == 2
            assert admitted[0].note == "" and adm.counts["waited_out"] == 0
        else:
            assert adm.counts["held"] == 1 and adm.counts["waited_out"] == 1
            assert "max-wait" in admitted[0].note

    run()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60, config=CONFIG)
async def test_a_short_engine_ends_stepping_aside(c: Client, s: Scheduler, a: Worker) -> None:
    """Stepping aside never outlives the room it relies on: an engine at its slots, or a call
    of the model held, and the next call waits."""
    plugin = await _engines(c, s, 1)
    adm = plugin.admission
    r = adm.room(a.address, "emu")
    assert not adm.short("emu", {})
    r.inflight.add("blocker")  # the engine's one slot is taken
    assert adm.short("emu", {})
    async with da.session(c):
        fut = da.llm("emu").generate([5] * 20, max_tokens=4)
        await async_wait_for(lambda: adm.is_held(fut.key) and s.tasks[fut.key].state == "no-worker")
        assert adm.short("emu", {})  # held: short even with the slot free again
        r.inflight.discard("blocker")
        assert adm.short("emu", {})
        adm.pump()
        assert (await fut).output_tokens == 4
    assert not adm.short("emu", {}) and adm.counts["held"] == 1


class PreferNewest:
    """A test policy: the newest held call of model ``emu`` goes first, to engine ``TARGET``."""

    TARGET: str | None = None

    def __call__(self, view) -> Iterator:
        held = sorted((cv for cv in view.calls.values() if cv.worker is None and cv.model == "emu"),
                      key=lambda cv: cv.created)
        if held:
            yield SetPriority(held[-1].key, (-100,), reason="test: newest first")
            yield Migrate(held[-1].key, "scheduler", self.TARGET, reason="test: to the target engine")


POLICY = {"agents.control.policies": {"newest": {"enabled": True, "class": "tests.test_admission.PreferNewest",
                                                  "options": {}}}}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=60, config={**CONFIG, **POLICY})
async def test_policies_reorder_and_rebind_waiting_calls_before_any_engine_admits_them(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    plugin = await _engines(c, s, 2)
    adm = plugin.admission
    for w in (a, b):  # both engines busy: every call waits in the scheduler
        adm.room(w.address, "emu").inflight.add("blocker")
    futs: list = []

    async def one(i: int):
        async with da.session(c):
            fut = da.llm("emu").generate([3 + i] * 20, max_tokens=4)
            futs.append(fut)
            return await fut

    tasks = []
    for i in range(3):  # one after the other: arrival order is 0, 1, 2
        tasks.append(asyncio.ensure_future(one(i)))
        await async_wait_for(lambda: len(futs) == i + 1 and adm.is_held(futs[i].key))
    await async_wait_for(lambda: all(s.tasks[f.key].state == "no-worker" for f in futs))
    PreferNewest.TARGET = b.address
    await plugin._control("run_once")  # the policy sees the held calls and acts on the newest
    newest = futs[-1]
    assert adm.held[newest.key].target == b.address
    assert s.tasks[newest.key].priority == (-100,)
    assert all(s.tasks[f.key].state == "no-worker" for f in futs)  # nothing bound yet: no room

    adm.room(b.address, "emu").inflight.discard("blocker")  # engine b has a slot now
    adm.pump()
    outs = [await t for t in tasks]  # b serves them one at a time (one slot), newest first
    assert {o.worker for o in outs} == {b.address}
    await async_wait_for(lambda: all(plugin.state.calls[f.key].started for f in futs))  # reports trail results
    started = {f.key: plugin.state.calls[f.key].started for f in futs}
    assert started[newest.key] < started[futs[0].key] < started[futs[1].key]
    assert adm.counts["policy_targets"] == 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=60, config=CONFIG)
async def test_a_call_waiting_on_its_busy_engine_is_rebound_once_and_runs_once(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    plugin = await _engines(c, s, 2)
    adm = plugin.admission
    async with da.session(c) as sess:
        first = await da.llm("emu").generate([5] * 40, max_tokens=4)
        home = first.worker
        other = b.address if home == a.address else a.address
        adm.room(home, "emu").inflight.add("blocker")  # its engine is busy
        second = await da.llm("emu").generate([5] * 40 + list(first.token_ids) + [6] * 8, max_tokens=4)
        assert second.worker == other  # waited longer than recomputing 44 tokens: moved
        assert plugin.bindings[(sess.id, "llm:emu")] == other  # the session follows it
        third = await da.llm("emu").generate([7] * 8, max_tokens=4)
        assert third.worker == other
    assert adm.counts["rebound"] == 1
    # each call ran exactly once: the engines saw three requests' prompt tokens, no more
    served = 0
    for w in (a, b):
        host = w.plugins["dask-agents"].engines._hosts["emu"]
        served += host.stats()["queries"]
    assert served == 40 + 52 + 8
    # nothing left behind
    assert not adm.held and all(not r.inflight - {"blocker"} for r in adm.engines.values())


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=60, config=CONFIG)
async def test_a_lazily_loaded_model_gets_engines_where_sessions_arrive(c: Client, s: Scheduler, a: Worker,
                                                                        b: Worker) -> None:
    """``da.install(client)`` without ``models=``: the first call starts the engine where it lands;
    before, every later session went to that engine for good while the other worker idled."""
    await da.install(c)
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: len(plugin.ready_workers) == 2)
    done = asyncio.Event()
    served: list[str] = []

    async def one(i: int) -> None:
        async with da.session(c):
            served.append((await da.llm("emu").generate([3 + i] * 20, max_tokens=4)).worker)
            await done.wait()  # stay live: the next session is new demand, not a replacement

    tasks = []
    for i in range(2):
        tasks.append(asyncio.ensure_future(one(i)))
        await async_wait_for(lambda: len(served) == i + 1)
    done.set()
    await asyncio.gather(*tasks)
    assert sorted(served) == sorted([a.address, b.address])  # one engine per worker, none idle
    await async_wait_for(lambda: plugin.model_workers.get("emu") == {a.address, b.address})
    assert plugin.admission.counts["engines_started"] == 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=60,
             config={**CONFIG, "agents.llm.models": {"emu": {**EMU, "max-replicas": 1}}})
async def test_lazy_engines_stop_at_max_replicas(c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await da.install(c)
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: len(plugin.ready_workers) == 2)
    async with da.session(c):
        first = await da.llm("emu").generate([3] * 20, max_tokens=4)
        async with da.session(c):
            second = await da.llm("emu").generate([4] * 20, max_tokens=4)
    assert first.worker == second.worker
    assert plugin.admission.counts["engines_started"] == 0


def test_an_engine_that_reports_after_its_models_lease_went_out_gets_the_lease() -> None:
    """The lease is pushed when a model's lease opens or closes; an engine of the model that
    reports later (a second worker slower to start) must get it too, not wait for a change
    that may never come (seen: a two-worker cluster whose second worker never held it)."""
    from dask_agents.scheduler_plugin.admission import LEASE_OP, Admission
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.recovery import Recovery
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState

    sent: list = []
    soon: list = []

    class Scheduler:  # what push_leases uses of Dask's scheduler
        workers = {"a": "ws-a", "b": "ws-b"}
        running = {"ws-a", "ws-b"}

        class loop:
            add_callback = staticmethod(lambda fn, *args: soon.append((fn, args)))

        def worker_send(self, address: str, msg: dict) -> None:
            sent.append((address, msg))

    roster, state = Roster(), WorkflowState()
    roster.scheduler = Scheduler()
    adm = Admission(roster, state, Placement(roster, state, Recovery(roster, state), lambda component: None))
    assert adm.leasing
    roster.hosts["m"] = {"a"}
    adm.room("a", "m")
    adm.tick()  # nothing short: the lease goes out to the one engine
    for fn, args in soon:
        fn(*args)
    soon.clear()
    assert sent == [("a", {"op": LEASE_OP, "leases": {"m": []}})]
    sent.clear()
    roster.hosts["m"].add("b")
    adm.room("b", "m")  # the second engine reports: nothing opened or closed
    for fn, args in soon:
        fn(*args)
    assert sent == [("b", {"op": LEASE_OP, "leases": {"m": []}})]


def test_the_working_set_limit_follows_what_the_engine_shows():
    """AIMD on an engine's limit: up while new sessions wait and returning calls find their
    prefixes, down at once when they find them evicted; never faster than once a second."""
    from dask_agents.scheduler_plugin.admission import Admission
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.recovery import Recovery
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState

    roster, state = Roster(), WorkflowState()
    adm = Admission(roster, state, Placement(roster, state, Recovery(roster, state), lambda component: None))
    r = adm.room("w", "m")
    r.capacity, r.block_size = 100, 16

    class Rec:
        model, session, worker = "m", "s", "w"

    state.session("s", None, 0.0)
    adm.admitted_on[("s", "m")] = "w"

    def returning(prompt: int, cached: int, held_before: int) -> None:
        """A returning call of a thread (of a session) that held ``held_before`` tokens found ``cached``."""
        adm.threads.setdefault(("s", "m"), {})[None] = held_before
        Rec.metrics = {"prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": 0}
        adm.on_llm_report(Rec)

    for _ in range(10):  # returning calls found 900 of the 900 tokens their session held
        returning(prompt=1000, cached=900, held_before=900)
    adm.adapt(10.0)
    assert r.factor == 1.0  # nothing waits: no reason to admit more
    adm._blocked = {"m"}
    adm.adapt(10.0)
    assert r.factor == pytest.approx(1.1) and r.kv_limit(0.9) == pytest.approx(0.9 * 1.1 * 100)
    adm.adapt(10.5)
    assert r.factor == pytest.approx(1.1)  # at most once per second
    adm.adapt(11.1)
    assert r.factor == pytest.approx(1.2)
    for _ in range(10):  # now the engine evicts: returning calls find only the system prompt
        returning(prompt=1000, cached=100, held_before=900)
    adm.adapt(12.2)
    assert r.factor == pytest.approx(1.2 * 0.7) and adm.counts["limit_changes"] == 3
    returning(prompt=1000, cached=0, held_before=20)  # too short to judge: ignored
    assert r.samples == 20


def test_another_agents_first_call_is_not_taken_for_an_eviction() -> None:
    """A session of several agents: each agent's LLM calls extend that agent's own context. A
    call is judged against the context its own thread (its caller's calls) had, so another
    agent's first call (sharing only the system prompt) is no miss, and the limit holds; an
    agent whose own context was evicted is one."""
    from dask_agents.scheduler_plugin.admission import Admission
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.recovery import Recovery
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState

    roster, state = Roster(), WorkflowState()
    adm = Admission(roster, state, Placement(roster, state, Recovery(roster, state), lambda component: None))
    r = adm.room("w", "m")
    r.capacity, r.block_size = 1000, 16
    state.session("s", None, 0.0)
    adm.admitted_on[("s", "m")] = "w"

    def call(creator: str, prompt: int, cached: int, output: int = 200) -> None:
        rec = type("Rec", (), {"model": "m", "session": "s", "worker": "w", "creator": creator,
                               "metrics": {"prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output}})
        adm.on_llm_report(rec)

    for i in range(12):  # analyst i: its first call shares the 512-token system prompt only, then extends its own
        call(f"analyst-{i}", prompt=3000, cached=512)
        call(f"analyst-{i}", prompt=3400, cached=3200)
    assert r.samples == 12 and r.misses == 0.0
    adm.adapt(10.0)
    assert r.factor == 1.0  # (per session, every analyst's first call read as a miss: the factor fell)
    for i in range(12):
        call(f"analyst-{i}", prompt=3800, cached=512)  # now their own contexts are gone
    adm.adapt(11.5)
    assert r.factor == pytest.approx(0.7)
    adm.on_session_ended("s")
    assert ("s", "m") not in adm.threads


@pytest.mark.parametrize("slack, near_ok", [(1, [True, True, False]), (0, [True, False, False])])
def test_a_new_session_goes_beside_its_caller_only_within_the_near_slack(slack: int, near_ok: list) -> None:
    """Locality (the engine beside the calling component, where its LLM calls then run leased)
    is worth at most ``near-slack`` live sessions more than the least loaded engine
    (``balance-by: sessions``; calls: the next test)."""
    from dask_agents.scheduler_plugin.admission import Admission, HeldCall
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.recovery import Recovery
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState

    with dask.config.set({"agents.scheduler.admission.near-slack": slack,
                          "agents.scheduler.admission.balance-by": "sessions"}):
        roster, state = Roster(), WorkflowState()
        adm = Admission(roster, state, Placement(roster, state, Recovery(roster, state), lambda component: None))
    assert adm.near_slack == slack
    for w in ("near", "far"):
        r = adm.room(w, "m")
        r.capacity, r.block_size, r.slots = 10_000, 16, 8
    adm.room("far", "m").sessions.add("other")
    seen = []
    for extra in range(3):  # the near engine holds 0, 1, then 2 sessions more than the other
        adm.room("near", "m").sessions.clear()
        adm.room("near", "m").sessions.update(f"s{i}" for i in range(1 + extra))
        h = HeldCall("k", "new", "m", "llm.m", 0.0, 100, near="near")
        seen.append(adm._near_ok(h, ["near", "far"], {}))
    assert seen == near_ok


def test_balance_by_calls_counts_calls_in_flight_not_sessions() -> None:
    """``balance-by: calls`` (the default; what Ray's and LangGraph's routers in the yardstick count): the
    engine beside the caller is near enough while its calls in flight, not its live sessions,
    are within the slack; the roomiest engine, while nothing is short, is the one with the
    fewest calls in flight."""
    from dask_agents.scheduler_plugin.admission import Admission, HeldCall
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.recovery import Recovery
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState

    with dask.config.set({"agents.scheduler.admission.balance-by": "calls"}):
        roster, state = Roster(), WorkflowState()
        adm = Admission(roster, state, Placement(roster, state, Recovery(roster, state), lambda component: None))
    for w in ("near", "far"):
        r = adm.room(w, "m")
        r.capacity, r.block_size, r.slots = 10_000, 16, 8
    adm.room("near", "m").sessions.update(f"s{i}" for i in range(5))  # many sessions, paused on tools
    adm.room("far", "m").inflight.update({"c1", "c2"})  # one session, two calls running
    adm.room("far", "m").sessions.add("busy")
    h = HeldCall("k", "new", "m", "llm.m", 0.0, 100, near="near")
    assert adm._near_ok(h, ["near", "far"], {})  # 0 calls in flight here against 2 there
    assert adm._roomiest(h, ["near", "far"], {}, loose=True) == "near"
    adm.room("near", "m").inflight.update({"a", "b", "c", "d"})
    assert not adm._near_ok(h, ["near", "far"], {})  # 4 against 2: past the slack of 1
    assert adm._roomiest(h, ["near", "far"], {}, loose=True) == "far"
    # a session bound by its first agent call (nothing short) goes where a first LLM call would:
    # the engine with fewer calls in flight, though the other has more KV room (the finance
    # workflow's paused sessions hold KV and no compute: ranked by KV, new sessions piled onto
    # the busier engine)
    for w in ("near", "far"):
        roster.hosts["m"].add(w)
    adm.placement.candidates = lambda model, component: ["near", "far"]
    adm._spare = lambda model, candidates: []
    for sid in ("s0", "s1", "s2", "s3", "s4", "busy", "early"):
        state.session(sid, None, 0.0)
    adm.tokens[("busy", "m")] = 3000  # far's one session holds more KV than near's five
    assert adm._roomiest(h, ["near", "far"], {}) == "near"  # by KV room alone
    assert adm.bind_early("early", "m") == "far"  # 2 calls in flight there against 4
    # a session bound early counts as a call on its way until its first LLM call: the next new
    # session does not pile onto the same engine before that call shows
    state.session("early2", None, 0.0)
    adm.room("far", "m").inflight.add("c3")  # 3 in flight + 1 on its way there, 4 here: a tie, then KV room
    assert adm.bind_early("early2", "m") == "near"


def test_sessions_bound_by_their_first_agent_call_count_the_typical_peak() -> None:
    """Placement from the start must not get around admission: a burst of sessions opened by
    agent calls (``bind_early``, before any LLM call says what a session needs) binds only
    while each fits at the model's typical peak, and counts that peak until its first LLM call;
    the rest are left to their first LLM call, which admission holds until there is room. An
    engine that may still start elsewhere (``_spare``) leaves the choice to that call too."""
    from dask_agents.scheduler_plugin.admission import Admission
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.recovery import Recovery
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState

    roster, state = Roster(), WorkflowState()
    adm = Admission(roster, state, Placement(roster, state, Recovery(roster, state), lambda component: None))
    for w in ("w1", "w2"):
        r = adm.room(w, "m")
        r.capacity, r.block_size, r.slots = 100, 16, 64  # a KV limit of 0.9 x 100 = 90 blocks each
        roster.hosts["m"].add(w)
    adm.placement.candidates = lambda model, component: ["w1", "w2"]
    adm._spare = lambda model, candidates: []
    adm.typical["m"] = 30 * 16  # the model's sessions grow to 30 blocks
    for i in range(10):
        state.session(f"s{i}", None, 0.0)
    bound = [adm.bind_early(f"s{i}", "m") for i in range(10)]
    # 30 blocks each: three fit an engine (90), and the model is short once one engine is past 0.9 x 90
    assert bound == ["w1", "w2", "w1", "w2", "w1"] + [None] * 5, bound
    assert adm.working_set("s0", "m") == 30 and adm.counts["bound_early"] == 5
    adm.early.discard(("s0", "m"))  # (what its first LLM call does): it counts what it needs
    assert adm.working_set("s0", "m") == 1
    # one served under its worker's lease (no update_graph: on_call never runs): its first call
    # is in flight at once (load), and from its report on it counts what it holds, not the
    # typical peak for the rest of its life
    assert "s1" in adm.room("w2", "m").early and adm.working_set("s1", "m") == 30
    state.add_call("llm-s1", {"session": "s1", "component": "llm.m", "kind": "llm"}, (), 0.0)
    adm.on_local_llm("llm-s1", "w2", "m")
    assert "s1" not in adm.room("w2", "m").early and "llm-s1" in adm.room("w2", "m").inflight

    class Report:
        model, session, worker, metrics = "m", "s1", "w2", {"prompt_tokens": 150, "cached_tokens": 0,
                                                            "output_tokens": 10}

    adm.on_llm_report(Report)
    assert adm.working_set("s1", "m") == 10  # 160 tokens
    adm._spare = lambda model, candidates: ["w3"]  # a third engine may start: not bound here
    state.session("s10", None, 0.0)
    adm.room("w1", "m").sessions.clear()
    assert adm.bind_early("s10", "m") is None


def test_sessions_paused_on_long_tools_are_parked_while_the_host_tier_holds_them() -> None:
    """Pause and resume at tool boundaries: an admitted session whose tool is expected to run
    longer than ``park-margin`` x moving its KV to the host tier and back leaves its engine's
    resident working sets while the host tier has room for it (longest pauses first), so a
    waiting session fits in its place; short pauses, sessions not paused on a tool, a full
    host tier or ``park: false`` park nothing."""
    from dask_agents.scheduler_plugin.admission import Admission
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.recovery import Recovery
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState

    class Pauses:
        rest: dict[str, float] = {}

        def remaining(self, sid: str, now: float) -> float | None:
            return self.rest.get(sid)

        def resume_within(self, sid: str, now: float, horizon: float) -> float | None:
            rest = self.rest.get(sid)
            return None if rest is None else float(rest <= horizon)

    def make(**config: object) -> Admission:
        with dask.config.set({f"agents.scheduler.admission.{k}": v for k, v in config.items()}):
            roster, state = Roster(), WorkflowState()
            adm = Admission(roster, state, Placement(roster, state, Recovery(roster, state), lambda c: None),
                            pauses=Pauses())
        for i in range(4):
            state.session(f"s{i}", None, 0.0)
        # 100 blocks of 2 MiB on the device (a KV limit of 90), 40 free in the host tier
        adm.on_engine_stats("w", {"m": {"block_size": 16, "kv_blocks": {"capacity": 100},
                                        "kv_capacity_bytes": {"device": 100 * 2**21, "host": 50 * 2**21},
                                        "kv_bytes": {"device": 0, "host": 10 * 2**21}}})
        r = adm.room("w", "m")
        for sid, tokens in (("s0", 30 * 16), ("s1", 30 * 16), ("s2", 20 * 16)):
            r.sessions.add(sid)
            adm.admitted_on[(sid, "m")] = "w"
            adm.peak[(sid, "m")] = tokens
        return adm

    adm = make()
    r = adm.room("w", "m")
    assert r.host_free == 40 and r.block_bytes == 2**21
    adm.typical["m"] = 30 * 16
    assert adm.resident(r) == 80 and not adm._fits(r, "s3", {})  # s3 (30 blocks at its peak) waits
    # s0 waits on a 40 s test run, s2 on a 20 s one, s1 on a 50 ms file read: moving 30 blocks
    # (60 MiB) out and back takes 5 ms at 25 GB/s, but the pump must see the room first
    adm.pauses.rest = {"s0": 40.0, "s1": 0.05, "s2": 20.0}
    assert adm.parked(r, 0.0) == {"s0": 30}  # the host tier's 40 blocks hold s0, not s0 and s2
    assert adm.resident(r) == 50 and adm.resident(r, parked=False) == 80 and adm._fits(r, "s3", {})
    r.host_free = 25
    assert adm.parked(r, 0.0) == {"s2": 20}  # only the smaller one fits the host tier now
    r.host_free = 60
    assert adm.parked(r, 0.0) == {"s0": 30, "s2": 20}
    adm.park_margin = 1e6  # a margin past what a 40 s pause covers: nothing is worth moving
    assert adm.parked(r, 0.0) == {}
    adm.pauses.rest = {}  # nobody waits on a tool
    assert adm.parked(make().room("w", "m"), 0.0) == {}
    off = make(park=False)
    off.pauses.rest = {"s0": 40.0}
    assert off.parked(off.room("w", "m"), 0.0) == {} and off.resident(off.room("w", "m")) == 80
    no_host = make()
    no_host.pauses.rest = {"s0": 40.0}
    no_host.room("w", "m").host_free = None
    assert no_host.parked(no_host.room("w", "m"), 0.0) == {}


_TOOL_GO = threading.Event()


@da.tool(kind="code_exec")
def _test_run_held() -> str:
    """A test run that lasts until the test lets it end."""
    _TOOL_GO.wait(60)
    return "passed"


# the engine of CONFIG with a host tier of 64 blocks; a waiting new session is admitted after
# 20 s at most (the test would see ``waited_out``, not ``admitted_parked``)
PARK = {**CONFIG, "agents.scheduler.admission.max-wait": "20s",
        "agents.llm.models": {"emu": {**EMU, "emulation": {**EMU["emulation"], "host_kv_blocks": 64}}}}
LONG_B = [(7 * i) % 251 + 3 for i in range(600)]  # 600 tokens (with 100 output: 44 blocks), not LONG's prefix


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60, config=PARK)
async def test_a_session_paused_on_a_long_tool_makes_room_for_a_waiting_one(c: Client, s: Scheduler,
                                                                          a: Worker) -> None:
    """Pause and resume (issue 28): session A (32 blocks) waits on a test run; session B (44
    blocks) does not fit beside it under the engine's limit (57 of 64 blocks) and would wait
    (max-wait); A is parked instead, B admitted and served, A's KV moved to the host tier for
    B's prefill, and A's next call, after its tool, finds its whole prompt cached (restored from
    the host: host hits, nothing recomputed)."""
    import time

    plugin = await _engines(c, s, 1)
    adm = plugin.admission
    await async_wait_for(lambda: adm.room(a.address, "emu").host_free == 64)
    engine = a.plugins["dask-agents"].engines.start("emu")
    _TOOL_GO.clear()
    try:
        async with da.session(c) as sa:
            first = await da.llm("emu").generate(LONG, max_tokens=100)
            assert first.cached_tokens == 0
            run = da.stub(_test_run_held)()
            await async_wait_for(lambda: plugin.kv_hints.remaining(sa.id, time.time()) is not None)
            assert adm.parked(adm.room(a.address, "emu"), time.time()) == {sa.id: 32}
            async with da.session(c) as sb:
                out_b = await da.llm("emu").generate(LONG_B, max_tokens=100)
            assert out_b.output_tokens == 100 and out_b.worker == a.address
            assert adm.counts["admitted_parked"] == 1 and adm.counts["waited_out"] == 0
            assert [x.note for x in adm.recent if x.session == sb.id] == ["into the room of sessions parked on tools"]
            assert engine.stats()["offloaded_blocks"] > 0  # A's blocks made room for B's
            _TOOL_GO.set()
            assert await run == "passed"
            again = await da.llm("emu").generate(LONG + [5] * 40, max_tokens=10)
        assert again.cached_tokens == 400  # A's 25 full prompt blocks: kept or restored, none recomputed
        assert engine.stats()["host_hits"] > 0
    finally:
        _TOOL_GO.set()


def test_parking_pauses_on_an_engine_whose_parked_sessions_come_back_to_a_recompute() -> None:
    """A parked session whose room was lent and whose return finds its prefix gone cost a
    recompute (the host tier could not keep it, or the tool ended before the restore): two in
    a row pause parking on that engine for ``max-wait``; a return that finds its prefix resets
    the count."""
    import time

    from dask_agents.scheduler_plugin.admission import Admission
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.recovery import Recovery
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState

    class Pauses:
        def remaining(self, sid: str, now: float) -> float | None:
            return 40.0 if sid.startswith("p") else None

        def resume_within(self, sid: str, now: float, horizon: float) -> float | None:
            return 0.0 if sid.startswith("p") else None

    roster, state = Roster(), WorkflowState()
    adm = Admission(roster, state, Placement(roster, state, Recovery(roster, state), lambda c: None), pauses=Pauses())
    adm.on_engine_stats("w", {"m": {"block_size": 16, "kv_blocks": {"capacity": 100},
                                    "kv_capacity_bytes": {"device": 100 * 2**21, "host": 100 * 2**21}}})
    r = adm.room("w", "m")
    adm.typical["m"] = 40 * 16
    for sid in ("p1", "p2", "p3", "n1", "n2", "n3"):
        state.session(sid, None, 0.0)

    def returns(sid: str, cached: int) -> None:
        rec = type("Rec", (), {"model": "m", "session": sid, "worker": "w",
                               "metrics": {"prompt_tokens": 800, "cached_tokens": cached, "output_tokens": 10}})()
        adm.on_llm_report(rec)

    def park_and_lend(parked: str, newcomer: str) -> None:
        r.sessions.clear()
        r.sessions.add(parked)
        adm.admitted_on[(parked, "m")] = "w"
        adm.peak[(parked, "m")] = 60 * 16  # 60 blocks: a 40-block newcomer fits (limit 90) only in its room
        adm.threads[(parked, "m")] = {None: 60 * 16}  # (what its returning call's own thread held)
        assert adm.parked(r, time.time()) == {parked: 60}
        r.sessions.add(newcomer)
        assert adm._into_parked(r, newcomer, {}) and parked in r.lent
        r.sessions.discard(newcomer)

    park_and_lend("p1", "n1")
    returns("p1", cached=800)  # kept or restored: a hit
    assert r.park_misses == 0 and not r.lent
    park_and_lend("p2", "n2")
    returns("p2", cached=0)  # recomputed
    assert r.park_misses == 1 and adm.parked(r, time.time()) == {"p2": 60}  # one miss: parking goes on
    park_and_lend("p3", "n3")
    before = time.time()
    returns("p3", cached=16)  # recomputed again: two in a row
    assert adm.counts["park_misses"] == 2 and adm.counts["park_paused"] == 1
    assert r.park_off_until >= before + adm.max_wait and adm.parked(r, before) == {}
    assert adm.parked(r, r.park_off_until + 1) == {"p3": 60}  # after max-wait it parks again


def test_admission_without_a_cap_holds_what_a_tuned_cap_would_and_follows_a_doubled_context() -> None:
    """No cap is configured: the number of live sessions an engine admits comes from the
    working sets it learns (ended sessions' peak contexts, live sessions' own). On a hand-made
    trace of sessions that grow to 100 blocks on an engine whose limit is 900 blocks, it settles
    at 9 live sessions, the cap a user would tune; when contexts double to 200 blocks, it
    settles at 4 once the typical peak has followed, with no knob touched."""
    from collections import deque

    from dask_agents.scheduler_plugin.admission import Admission
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.recovery import Recovery
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState

    roster, state = Roster(), WorkflowState()
    adm = Admission(roster, state, Placement(roster, state, Recovery(roster, state), lambda c: None))
    adm.on_engine_stats("w", {"m": {"block_size": 16, "kv_blocks": {"capacity": 1000}}})
    r = adm.room("w", "m")
    live: deque[str] = deque()
    n = 0

    def run(blocks: int, sessions: int) -> list[int]:
        """Sessions arrive whenever one may be admitted and each grows to ``blocks``; the oldest
        ends before the next arrival: the live count at each admission."""
        nonlocal n
        seen = []
        for _ in range(sessions):
            sid = f"s{n}"
            n += 1
            state.session(sid, None, 0.0)
            while not adm._fits(r, sid, {}):  # it waits until enough sessions ended
                old = live.popleft()
                state.sessions[old].state = "completed"
                adm.on_session_ended(old)
            r.sessions.add(sid)
            adm.admitted_on[(sid, "m")] = "w"
            adm.models_of[sid].add("m")
            adm.peak[(sid, "m")] = blocks * 16  # it grows to its peak
            live.append(sid)
            seen.append(len(live))
        return seen

    first = run(100, 60)
    assert first[-20:] == [9] * 20 and adm.typical["m"] == pytest.approx(1600)
    second = run(200, 60)
    assert second[-20:] == [4] * 20 and adm.typical["m"] == pytest.approx(3200, rel=0.01)


@da.tool(kind="code_exec")
def _test_run(seconds: float) -> str:
    """A test run of known length (the workload's tool latency, what the KV manager learns)."""
    import time

    time.sleep(seconds)
    return "passed"


@da.tool(kind="code_exec")
def _test_run_until_restored(session: str) -> bool:
    """A test run that ends once ``session``'s KV, after leaving the engine's device for the host
    tier, is all back on the device (at most 60 s): True if it saw both while still running."""
    import time

    from distributed import get_worker

    engine = get_worker().plugins["dask-agents"].engines.start("emu")
    deadline = time.monotonic() + 60
    offloaded = False
    while time.monotonic() < deadline:
        r = engine.kv_directive("inspect", session)["residency"]
        offloaded = offloaded or r["device_blocks"] < r["blocks"]
        if offloaded and r["device_blocks"] == r["blocks"]:  # (the host tier may keep its copy)
            return True
        time.sleep(0.01)
    return False


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=90,
             config={**PARK, "agents.kv.min-samples": 3, "agents.kv.prefetch-margin": "500ms", "agents.kv.tick": "20ms"})
async def test_a_parked_session_is_restored_before_its_tool_returns(c: Client, s: Scheduler, a: Worker) -> None:
    """Pause and resume (issue 28), the resume half: session A's test runs take about 3 s (its
    first three teach the scheduler and the engine's KV manager); A is parked during the fourth,
    B takes its room and ends; the KV manager brings A's KV back from the host tier while the
    test still runs, on its learned length: the tool itself sees A's blocks back on the device
    before it returns (it ends only then, so a restore after it could not pass)."""
    import time

    plugin = await _engines(c, s, 1)
    adm = plugin.admission
    await async_wait_for(lambda: adm.room(a.address, "emu").host_free == 64)
    engine = a.plugins["dask-agents"].engines.start("emu")
    llm = da.llm("emu")
    async with da.session(c) as sa:
        await llm.generate(LONG, max_tokens=100)
        for i in range(3):  # what its test runs take, learned on both sides
            assert await da.stub(_test_run)(3.0) == "passed"
            await llm.generate(LONG + [5] * (i + 1), max_tokens=10)
        assert plugin.kv_hints.latency_of("code_exec").empirical
        run = da.stub(_test_run_until_restored)(sa.id)
        await async_wait_for(lambda: sa.id in adm.parked(adm.room(a.address, "emu"), time.time()))
        async with da.session(c):
            await llm.generate(LONG_B, max_tokens=100)
        assert adm.counts["admitted_parked"] == 1 and engine.stats()["offloaded_blocks"] > 0
        assert await run is True  # restored while the tool ran
        again = await llm.generate(LONG + [6] * 40, max_tokens=10)
    assert again.cached_tokens == 400


def test_parking_counts_what_is_back_and_lends_only_what_a_newcomer_needs() -> None:
    """Parking's accounting, adversarially: a session with an LLM call held or bound is back
    whatever its tools say (never parked, so a pump cannot admit a second newcomer into its
    room); a newcomer borrows the room of as few parked sessions as cover it (longest pauses
    first), which stay parked until they are back; an engine whose every session is parked is
    not empty: a newcomer must still fit its limit."""
    import time

    from dask_agents.scheduler_plugin.admission import Admission, HeldCall
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.recovery import Recovery
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState

    class Pauses:
        rest = {"p1": 40.0, "p2": 30.0}

        def remaining(self, sid: str, now: float) -> float | None:
            return self.rest.get(sid)

        def resume_within(self, sid: str, now: float, horizon: float) -> float | None:
            return 0.0 if sid in self.rest else None

    roster, state = Roster(), WorkflowState()
    adm = Admission(roster, state, Placement(roster, state, Recovery(roster, state), lambda c: None), pauses=Pauses())
    adm.on_engine_stats("w", {"m": {"block_size": 16, "kv_blocks": {"capacity": 100},
                                    "kv_capacity_bytes": {"device": 100 * 2**21, "host": 100 * 2**21}}})
    r = adm.room("w", "m")
    for sid in ("p1", "p2", "n1", "n2", "big"):
        state.session(sid, None, 0.0)
    for sid in ("p1", "p2"):
        r.sessions.add(sid)
        adm.admitted_on[(sid, "m")] = "w"
        adm.peak[(sid, "m")] = 40 * 16
    now = time.time()
    assert adm.parked(r, now) == {"p1": 40, "p2": 40} and adm.resident(r) == 0
    adm.tokens[("big", "m")] = 95 * 16  # past the limit (90) alone
    assert not adm._fits(r, "big", {})  # every session parked: the engine is not empty
    # a newcomer of 20 blocks needs 80 + 20 - 90 = 10 blocks of room: p1's (the longest pause) covers it
    adm.tokens[("n1", "m")] = 20 * 16
    r.sessions.add("n1")
    assert adm._into_parked(r, "n1", {}) and r.lent == {"p1"}
    # p2's LLM call is held (its tool returned): it is back, not parked, whatever its tools say
    adm._hold(HeldCall("llm-p2", "p2", "m", "llm.m", now, 100))
    assert adm.parked(r, now) == {"p1": 40}
    adm._unhold("llm-p2")
    assert "p2" in adm.parked(r, now)
    # p1 stays parked while its room is lent, however unlikely its prediction says it is to stay away
    adm.pauses.resume_within = lambda sid, now, horizon: 1.0 if sid in adm.pauses.rest else None
    assert adm.parked(r, now) == {"p1": 40}
    adm.pauses.rest = {"p2": 30.0}  # p1's tool returned: it is back
    assert adm.parked(r, now) == {}
