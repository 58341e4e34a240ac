"""The Agents page in Dask's dashboard: data, incremental updates, and the page in a real browser.

The browser test needs Debian's ``chromium`` (``scripts/bootstrap.sh`` installs it when run as
root or with sudo) and the ``playwright`` package (the ``test`` extra; no browser download:
it drives /usr/bin/chromium). It writes ``test-artifacts/dashboard-agents.png``.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import dask
import pytest
from distributed import Client, LocalCluster, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.client_api import posix_seconds
from dask_agents.scheduler_plugin.dashboard import PAGE, SessionsSync
from dask_agents.scheduler_plugin.dashboard_data import SESSION_COLUMNS, DashboardModel, SessionsView, fmt_bytes, short
from dask_agents.scheduler_plugin.plugin import NAME
from dask_agents.scheduler_plugin.state import WorkflowState
from tests.conftest import async_wait_for, wait_for
from dask_agents.worker_plugin.plugin import NAME as WORKER_PLUGIN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "test-artifacts")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EMU = {"emu": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
               "emulation": {"time_scale": 0.001}}}
CONFIG = {"agents.llm.models": EMU, "agents.dashboard.update-interval": "200ms",
          "agents.dashboard.engine-stats-interval": "200ms"}
DASHBOARD = {"dashboard": True, "dashboard_address": "127.0.0.1:0"}
GATE = threading.Event()


@da.tool
def lookup(topic: str) -> str:
    return f"notes on {topic}"


@da.tool
def review(topic: str) -> str:
    GATE.wait(60)
    return f"reviewed {topic}"


@da.tool
def check(patch: str) -> bool:
    return False  # the tests fail: the developer is asked again (a retry)


@da.tool
def broken(what: str) -> str:
    raise ValueError(f"broken build: {what}")


@da.agent
class Planner:
    def plan(self, issue: str) -> list[str]:
        return [f"{issue}: part {i}" for i in range(2)]


@da.agent
class Developer:
    def implement(self, task: str) -> str:
        notes = da.stub(lookup)(task).value(30)
        return da.llm("emu").generate(f"Implement {task} using {notes}", max_tokens=4).value(30).text


def solve(client: Client, issue: str, gated: bool = False) -> tuple[da.Session, list]:
    """Plan, implement in parallel; a gated session also waits on a review that blocks."""
    with da.session(client, name=issue) as s:
        plan = da.stub(Planner).plan(issue)
        patches = [da.stub(Developer).implement(t) for t in plan]  # len() materializes the plan
        held = [da.stub(review)(issue)] if gated else []
        for p in patches:
            p.value(60)
    return s, held


def retry_once(client: Client, issue: str) -> da.Session:
    """Implement, test (it fails), implement again: the second Developer call is a retry."""
    with da.session(client, name=issue) as s:
        first = da.stub(Developer).implement(issue)
        assert da.stub(check)(first).value(60) is False
        da.stub(Developer).implement(issue + " again").value(60)
    return s


def fail_once(client: Client, issue: str) -> tuple[da.Session, str]:
    """A session whose tool call fails (the session goes on and completes)."""
    with da.session(client, name=issue) as s:
        bad = da.stub(broken)(issue)
        with pytest.raises(da.CallFailedError, match="broken build"):
            bad.value(60)
    return s, bad.key


# -- data and incremental updates (no browser) ------------------------------------------------------

def test_retries_count_re_visits_after_a_consumer_finished():
    st = WorkflowState()
    ann = lambda comp: {"session": "s", "component": comp, "kind": "agent"}  # noqa: E731
    st.add_call("dev-1", ann("dev"), [], 1.0)
    st.add_call("dev-2", ann("dev"), [], 1.0)  # parallel developers: not retries
    st.on_transition("dev-1", "memory", 2.0)
    st.on_transition("dev-2", "memory", 2.0)
    st.add_call("test-1", ann("tester"), ["dev-1", "dev-2"], 2.0)
    st.add_call("llm-1", ann("llm.coder"), [], 2.0)
    st.on_transition("llm-1", "memory", 2.5)
    st.add_call("llm-2", ann("llm.coder"), [], 2.6)  # sequential LLM calls: not retries either
    st.on_transition("test-1", "erred", 3.0)
    st.add_call("dev-3", ann("dev"), [], 3.0)  # the tester did not finish: nothing consumed yet
    st.on_transition("dev-3", "memory", 3.5)
    st.add_call("test-2", ann("tester"), ["dev-3"], 3.5)
    st.on_transition("test-2", "memory", 4.0)  # the tester consumed dev's result
    st.add_call("dev-4", ann("dev"), [], 4.0)  # a developer again: a retry
    summary = st.session_summary("s", 5.0)
    assert summary["retries"] == 1 and st.calls["dev-4"].retry and not st.calls["dev-3"].retry
    assert summary["failed"] == 1 and summary["open"] == 2 and summary["progress"] == 5


def test_session_summary_reports_current_components():
    st = WorkflowState()
    for i, comp in enumerate(["a", "b", "c"]):
        st.add_call(f"{comp}-1", {"session": "s", "component": comp}, [], 1.0 + i)
    st.on_transition("a-1", "memory", 2.0)
    st.on_transition("b-1", "processing", 2.0, worker="w1")
    v = st.sessions["s"].version
    assert st.session_summary("s", 3.0)["current"] == "b"
    st.on_transition("c-1", "processing", 3.0, worker="w2")
    assert st.sessions["s"].version > v
    assert st.session_summary("s", 3.0)["current"] == "b, c"
    assert st.open_by_state[("c", "processing")] == 1 and st.open_by_state[("a", "pending")] == 0


def test_the_page_follows_the_live_session_running_longest():
    """The newest session has always just started (two nodes): the page's default graph is the
    oldest live one; with none live, the newest."""
    from types import SimpleNamespace

    st = WorkflowState()
    for i, sid in enumerate(["done", "old", "new"]):
        st.add_call(f"a-{sid}", {"session": sid, "component": "a"}, [], 1.0 + i)
    model = DashboardModel(SimpleNamespace(state=st))
    st.sessions["done"].state = "completed"
    assert model.pick_session() == "old"
    st.sessions["old"].state = st.sessions["new"].state = "completed"
    assert model.pick_session() == "new"


def test_a_graph_lays_out_calls_whose_records_came_before_their_creators():
    """A driver's direct call is recorded by its worker, and its nested calls' records often
    come first: the layout's depths must not depend on the records' order (it raised KeyError,
    and the page's graph stopped updating)."""
    from types import SimpleNamespace

    st = WorkflowState()
    st.add_call("llm-1", {"session": "s", "component": "llm.emu", "creator": "Dev-1"}, [], 2.0)
    st.add_call("tool-1", {"session": "s", "component": "lookup", "creator": "Dev-1"}, [], 2.0)
    st.add_call("Dev-1", {"session": "s", "component": "Dev", "creator": "Plan-1"}, ["Plan-1"], 1.5)
    st.add_call("Plan-1", {"session": "s", "component": "Plan"}, [], 1.0)
    _, layout = DashboardModel(SimpleNamespace(state=st)).graph("s")
    x = dict(zip(layout["nodes"]["key"], layout["nodes"]["x"]))
    assert x == {"Plan-1": 0.0, "Dev-1": 1.0, "llm-1": 2.0, "tool-1": 2.0}


def test_busy_time_counts_each_call_within_the_window_exactly():
    """Utilization comes from the workers' exact start/finish times: a call is split across
    the buckets it spans; the window's oldest bucket counts in proportion to its overlap."""
    from dask_agents.scheduler_plugin.dashboard_data import BusyTime

    busy = BusyTime(seconds=10.0, width=1.0)
    busy.add("dev", 100.2, 100.3)  # a short call, never seen by a page-refresh sample
    busy.add("dev", 101.5, 104.0)
    busy.add("dev", 95.0, 99.5)  # mostly before the window [100, 110) at t=110
    busy.add("dev", 5.0, 4.0)  # nonsense (finished before started): nothing
    assert busy.total("dev", 105.0) == pytest.approx(0.1 + 2.5 + 4.5)  # window [95, 105]: all of them
    # window [99.75, 109.75]: bucket 99 (0.5 s busy) overlaps it by a quarter: at most one
    # bucket's worth off at the window's edge
    assert busy.total("dev", 109.75) == pytest.approx(0.1 + 2.5 + 0.5 * 0.25)
    assert busy.total("dev", 110.0) == pytest.approx(0.1 + 2.5)  # window [100, 110]: the old one is out
    assert busy.total("tester", 110.0) == 0.0
    assert busy.total("dev", 500.0) == 0.0
    assert not busy.partial["dev"] and not busy.cover["dev"]  # old buckets are dropped


def test_busy_time_equals_splitting_each_call_across_its_buckets():
    """The O(1) add (partial end buckets, whole buckets as +1/-1 coverage changes) sums to what
    splitting every call across every bucket it spans gives, as the window moves on, for calls
    of any length, reported late or out of order."""
    import random

    from dask_agents.scheduler_plugin.dashboard_data import BusyTime

    rng = random.Random(7)
    seconds, width = 30.0, 1.0
    busy = BusyTime(seconds=seconds, width=width)
    buckets: dict[int, float] = {}  # the reference: every bucket of every call

    def split(started: float, finished: float) -> None:
        b1 = int(finished // width)
        for b in range(max(int(started // width), b1 - busy.keep), b1 + 1):
            part = min(finished, (b + 1) * width) - max(started, b * width)
            if part > 0:
                buckets[b] = buckets.get(b, 0.0) + part

    now = 1000.0
    for _ in range(400):
        now += rng.uniform(0.0, 0.7)
        for _ in range(rng.randrange(4)):
            length = rng.choice([rng.uniform(0, 0.3), rng.uniform(0, 5), rng.uniform(0, 80)])
            finished = now - rng.uniform(0, 3)  # reported up to 3 s late
            busy.add("dev", finished - length, finished)
            split(finished - length, finished)
        horizon = now - seconds
        first = int(horizon // width)
        want = sum(x * ((b + 1) * width - horizon) / width if b == first else x
                   for b, x in buckets.items() if b >= first)
        assert busy.total("dev", now) == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_the_bottleneck_label_does_not_flip_between_near_equal_components():
    from dask_agents.scheduler_plugin.dashboard_data import pick_bottleneck

    rows = {"dev": {"capacity_x": 1.00}, "tester": {"capacity_x": 0.97}}
    assert pick_bottleneck(rows, None) == "tester"  # the lowest
    assert pick_bottleneck(rows, "dev") == "dev"  # within 10% of the current one: it stays
    rows["tester"]["capacity_x"] = 0.85
    assert pick_bottleneck(rows, "dev") == "tester"  # clearly lower: it moves
    assert pick_bottleneck({"tester": rows["tester"]}, "dev") == "tester"  # dev has no waiting work
    assert pick_bottleneck({}, "dev") is None


def test_failed_calls_keep_their_error_and_fail_their_session():
    st = WorkflowState()
    st.add_call("t-1", {"session": "s", "component": "tests", "kind": "tool"}, [], 1.0)
    st.add_call("t-2", {"session": "s", "component": "tests", "kind": "tool"}, [], 1.0)
    st.on_transition("t-1", "erred", 2.0, worker="tcp://w1", error="ValueError('broken build')")
    st.on_transition("t-2", "erred", 2.0, worker="tcp://w1")  # no text from Dask: still listed
    assert [r.key for r in st.errors] == ["t-1", "t-2"] and st.calls_erred == 2
    assert st.calls["t-1"].error == "ValueError('broken build')" and st.calls["t-2"].error == "unknown error"
    assert st.calls["t-1"].row()["error"] == "ValueError('broken build')"
    assert st.sessions_failed == 0
    st.close_session("s", 3.0)
    assert st.sessions["s"].state == "completed" and st.sessions_failed == 1


class RecordingSource:
    """A ColumnDataSource that records what a page would send."""

    def __init__(self):
        from bokeh.models import ColumnDataSource

        self.cds = ColumnDataSource({c: [] for c in SESSION_COLUMNS})
        self.ops: list[str] = []

    def __getattr__(self, name):
        return getattr(self.cds, name)

    @property
    def data(self):
        return self.cds.data

    @data.setter
    def data(self, value):
        self.ops.append("reload")
        self.cds.data = value

    def patch(self, patches):
        self.ops.append("patch:" + ",".join(sorted(patches)))
        self.cds.patch(patches)

    def stream(self, data, rollover=None):
        self.ops.append(f"stream:{len(data['session'])}:{rollover}")
        self.cds.stream(data, rollover=rollover)


def view(sessions: dict[str, int], now: float = 100.0) -> SessionsView:
    rows = {sid: (v, {**{c: (sid if c == "session" else v if c == "progress" else 0) for c in SESSION_COLUMNS},
                      "created": 90.0, "completed": None})
            for sid, v in sessions.items()}
    return SessionsView(list(sessions), dict(sessions), rows)


def test_sessions_table_streams_patches_and_rolls_over():
    src = RecordingSource()
    sync = SessionsSync(src, slack=2)
    sync.sync(view({"a": 1, "b": 1}), 100.0)
    assert src.ops == ["stream:2:2", "patch:age_s"] and src.data["session"] == ["a", "b"]
    src.ops.clear()
    sync.sync(view({"a": 1, "b": 2}), 101.0)  # b changed: only its changed cell is sent
    assert src.ops == ["patch:age_s,progress"]  # one message: the changed cell and the ages
    assert src.data["progress"] == [1, 2] and src.data["age_s"] == [11.0, 11.0]
    src.ops.clear()
    sync.sync(view({"b": 2, "c": 1}), 102.0)  # a left from the front, c arrived: one stream
    assert src.ops == ["stream:1:2", "patch:age_s"] and src.data["session"] == ["b", "c"]
    src.ops.clear()
    sync.sync(view({"b": 2, "c": 1}), 103.0)  # nothing changed: only the ages move
    assert src.ops == ["patch:age_s"]
    src.ops.clear()
    sync.sync(view({"b": 2, "d": 1, "e": 1, "f": 1}), 104.0)  # c left from the middle: kept for now
    assert src.data["session"] == ["b", "c", "d", "e", "f"] and "reload" not in src.ops
    sync.sync(view({"b": 2, "f": 1}), 105.0)  # three stale rows in the middle > slack: reload once
    assert src.ops[-2:] == ["reload", "patch:age_s"] or src.ops[-1] == "reload"
    assert src.data["session"] == ["b", "f"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 2)], timeout=90, config=CONFIG,
             scheduler_kwargs=DASHBOARD)
async def test_page_is_served_and_model_shows_the_workflow(c: Client, s: Scheduler, a: Worker, b: Worker):
    from tornado.httpclient import AsyncHTTPClient

    await da.install(c, models=["emu"])
    plugin = s.plugins[NAME]
    dash = plugin.dashboard
    assert dash is not None and dash.path == f"/{PAGE}"
    GATE.clear()
    async with da.session(c, name="live") as live:
        futs = [da.stub(review)("x"), da.stub(review)("y")]
        llm = da.llm("emu").generate("hello there, engine", max_tokens=2)
        await llm
    await async_wait_for(lambda: plugin.state.open_per_component["review"] == 2)
    await async_wait_for(lambda: len(plugin.aggregates.engines) == 2, timeout=10)
    page = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/{PAGE}")
    assert page.code == 200 and b"bokeh" in page.body and b"docs_json" in page.body
    status = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/status")
    assert b'href="agents"' in status.body  # linked from Dask's navigation bar

    model = DashboardModel(plugin)
    sv = model.sessions()
    assert sv.order == [live.id] and sv.row(live.id)["state"] == "closing"
    assert sv.row(live.id)["open"] == 2 and sv.row(live.id)["calls"] == 3 and sv.row(live.id)["progress"] == 1
    comps = {r["component"]: r for r in model.components()}
    assert comps["review"]["queued"] + comps["review"]["running"] == 2
    assert comps["llm.emu"]["kind"] == "llm (emu)" and comps["llm.emu"]["replicas"] == 2
    engines = model.engines()
    assert {r["model"] for r in engines} == {"emu"} and len(engines) == 2
    assert all(r["engine"] == "emulated (EMULATED)" and r["kv_host"] == "—" for r in engines)
    assert sum(r["cached_tokens"] + r["recomputed_tokens"] for r in engines) == (await llm).prompt_tokens
    version, layout = model.graph(live.id)
    assert sorted(layout["nodes"]["key"]) == sorted([f.key for f in futs] + [llm.key])
    assert layout["counts"].get("finished") == 1
    GATE.set()
    await c.gather(futs)
    await async_wait_for(lambda: plugin.state.sessions[live.id].state == "completed")
    assert model.graph(live.id)[0] != version  # the session moved: the graph is redone
    df = await da.telemetry(c, live)
    assert str(df["created"].dtype) == "datetime64[ns, UTC]" and str(df["finished"].dtype) == "datetime64[ns, UTC]"
    assert (df["finished"] >= df["created"]).all()
    assert df["emulated"].dtype == bool  # True where an emulated engine served the call, else False
    assert df.loc[df["kind"] == "llm", "emulated"].all() and not df.loc[df["kind"] != "llm", "emulated"].any()

    # utilization: the call-seconds the workers timed, over the threads of the workers that ran
    # the component times the window (not "a call was running at the last refresh")
    await async_wait_for(lambda: all(plugin.state.calls[f.key].started is not None for f in futs))
    df = await da.telemetry(c, live)
    now = time.time() + 1.0  # (past the model's cache of the last refresh)
    win = min(dash.model.window, now - dash.model.since)
    rows = {r["component"]: r for r in dash.model.components(now)}
    reviews = posix_seconds(df[df["component"] == "review"])
    hosts = set(reviews["worker"])
    busy = (reviews["finished"] - reviews["started"].clip(lower=now - dash.model.window)).sum()
    assert rows["review"]["slots"] == 2 * len(hosts) and rows["review"]["replicas"] == len(hosts)
    assert rows["review"]["busy"] == pytest.approx(min(busy / (2 * len(hosts) * win), 1.0), abs=2e-3)
    assert 0 < rows["review"]["busy"] < 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=CONFIG)
async def test_no_page_without_the_dask_dashboard(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    assert s.plugins[NAME].dashboard is None  # the plugin still runs
    async with da.session(c):
        assert await da.stub(lookup)("x") == "notes on x"


# -- the page in a browser ----------------------------------------------------------------------------

def _playwright():
    if not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (scripts/bootstrap.sh installs Debian's chromium as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    return sync_playwright


def _graph_data(page) -> dict:
    return page.evaluate("""() => {
        const doc = Bokeh.documents[0];
        const src = doc.get_model_by_name("agents-graph-nodes");
        return {key: Array.from(src.get_column("key")), state: Array.from(src.get_column("state"))};
    }""")


def _columns(page, name: str, columns: tuple[str, ...]) -> dict[str, list]:
    """Columns of the page's ColumnDataSource ``name``, as the browser holds them."""
    return page.evaluate(f"""() => {{
        const src = Bokeh.documents[0].get_model_by_name({name!r});
        const out = {{}};
        for (const c of {list(columns)!r}) out[c] = Array.from(src.get_column(c));
        return out;
    }}""")


def _worker_name(cluster, address: str):
    return next((name for name, w in cluster.workers.items() if w.address == address), None)


def test_agents_page_in_chromium():
    sync_playwright = _playwright()
    os.makedirs(ARTIFACTS, exist_ok=True)
    shot = os.path.join(ARTIFACTS, "dashboard-agents.png")
    GATE.clear()
    with dask.config.set(CONFIG), \
            LocalCluster(n_workers=2, threads_per_worker=8, processes=False, dashboard_address="127.0.0.1:0") \
            as cluster, Client(cluster) as client:
        da.install(client, models=["emu"])
        done = [solve(client, f"issue{i}")[0] for i in range(2)]
        retried = retry_once(client, "issue-retry")
        failed, bad_key = fail_once(client, "issue-broken")
        live, held = solve(client, "issue-live", gated=True)
        plugin = cluster.scheduler.plugins[NAME]
        wait_for(lambda: plugin.state.sessions[live.id].open_calls == 1)
        wait_for(lambda: all(plugin.state.sessions[s.id].state == "completed" for s in [*done, retried, failed]))
        wait_for(lambda: plugin.state.sessions[retried.id].retries == 1)
        hosts = {w.address: w.plugins[WORKER_PLUGIN] for w in cluster.workers.values()}
        url = f"http://127.0.0.1:{cluster.scheduler.http_server.port}/{PAGE}"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1400})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(url)
                # the sessions table: one row per session, with state and progress
                for s in [*done, live]:
                    page.locator(".slick-row", has_text=s.id).first.wait_for(timeout=20_000)
                # live sessions first: the live table comes before the completed one
                assert live.id in page.locator(".slick-row").first.inner_text()
                assert page.locator(".slick-row", has_text=live.id).count() == 1
                live_row = page.locator(".slick-row", has_text=live.id).first
                live_summary = plugin.state.session_summary(live.id, time.time())
                assert "closing" in live_row.inner_text()
                assert f"{live_summary['progress']}/{live_summary['calls']}" in live_row.inner_text()
                for s in done:
                    assert "completed" in page.locator(".slick-row", has_text=s.id).first.inner_text()
                # the graph follows the newest live session, nodes coloured by state
                title = page.locator("text=session " + live.id).first
                title.wait_for(timeout=10_000)
                graph = da.session_graph(client, live)
                data = _graph_data(page)
                assert sorted(data["key"]) == sorted(n.call_id for n in graph.nodes)
                want = {n.call_id: n.state for n in graph.nodes}
                assert {k: st for k, st in zip(data["key"], data["state"])} == want
                assert "processing" in data["state"] and "finished" in data["state"]
                # the other sections
                for text in ("Planner", "Developer", "llm.emu", "emulated (EMULATED)", "prefix hit rate",
                             "pass last", "set_priority"):
                    page.get_by_text(text).first.wait_for(timeout=10_000)
                # time series: sampled in the scheduler each second, kept from the start, so the page
                # opened late has the past ones; it grows in real time (poll for 3 more)
                ts_len = """() => Bokeh.documents[0].get_model_by_name("agents-timeseries").get_length()"""
                n0 = page.evaluate(ts_len)
                assert n0 >= 1
                page.wait_for_function(f"() => ({ts_len})() >= {n0 + 3}", timeout=20_000)
                live_ts = page.evaluate("""() => Array.from(
                    Bokeh.documents[0].get_model_by_name("agents-timeseries").get_column("live_sessions"))""")
                kept = [r["live_sessions"] for r in plugin.timeseries.samples]
                assert live_ts[-3:] == kept[len(live_ts) - 3:len(live_ts)] and live_ts[-1] == 1
                times = page.evaluate("""() => Array.from(
                    Bokeh.documents[0].get_model_by_name("agents-decisions").get_column("time"))""")
                assert times and times == sorted(times, reverse=True)  # newest decision on top
                # the timeline follows the live session too: its running review is a bar that grows
                tl = _columns(page, "agents-timeline", ("key", "lane", "mark", "state", "end_ms"))
                review_key = held[0].key
                assert set(tl["key"]) <= set(plugin.state.sessions[live.id].calls) and review_key in tl["key"]
                end0 = tl["end_ms"][tl["key"].index(review_key)]
                page.wait_for_function(f"""() => {{
                    const src = Bokeh.documents[0].get_model_by_name("agents-timeline");
                    const i = Array.from(src.get_column("key")).indexOf({review_key!r});
                    return i >= 0 && src.get_column("end_ms")[i] > {end0};
                }}""", timeout=10_000)
                # the errors panel: the failed call, its error and a link to Dask's page for the task
                page.locator(".slick-row", has_text="broken build").first.wait_for(timeout=10_000)
                errs = _columns(page, "agents-errors", ("call", "session", "error", "link"))
                i = errs["call"].index(bad_key)
                assert errs["session"][i] == failed.id and "broken build: issue-broken" in errs["error"][i]
                assert errs["link"][i].endswith(".html") and "/info/task/" in errs["link"][i]
                link = page.locator(".slick-row", has_text="broken build").first.locator("a")
                assert link.get_attribute("href") == errs["link"][i]
                page.get_by_text("calls failed: 1").first.wait_for(timeout=10_000)
                # the KV panel shows what each engine reports: blocks referenced, retained,
                # evictable, the device's blocks and bytes (polled: reports arrive every 200 ms)
                def kv_matches() -> bool:
                    shown = _columns(page, "agents-engines", ("worker", "kv_referenced", "kv_retained",
                                                              "kv_evictable", "kv_blocks", "kv_device"))
                    want = {}
                    for addr, wp in hosts.items():
                        rep = wp.engine_stats()["emu"]
                        b = rep["kv_blocks"]
                        want[addr.split("://")[-1]] = (b["pinned"], b["retained"], b["cached"], b["capacity"],
                                                       fmt_bytes(rep["kv_bytes"]["device"]))
                    got = {w: tuple(v) for w, *v in zip(*shown.values())}
                    return got == want and any(v[2] > 0 for v in want.values())
                wait_for(kv_matches, timeout=20)
                addr = next(iter(hosts))
                row_text = page.locator(".slick-row", has_text="emulated (EMULATED)").filter(
                    has_text=addr.split("://")[-1]).first.inner_text()
                assert fmt_bytes(hosts[addr].engine_stats()["emu"]["kv_bytes"]["device"]) in row_text
                page.wait_for_timeout(500)
                page.screenshot(path=shot, full_page=True)
                # live updates: release the review, the row turns completed without a reload
                GATE.set()
                client.gather(held)
                page.locator(".slick-row", has_text=live.id).filter(has_text="completed").first.wait_for(
                    timeout=20_000)
                assert page.locator(".slick-row", has_text=live.id).count() == 1  # moved to the completed table
                assert page.get_by_text("Completed sessions").count() == 1
                # clicking a row shows that session's graph
                # (the tables redraw their rows every refresh: a click can land on a row being
                # replaced, so it is repeated until the page shows the choice)
                title = page.locator("text=session " + done[0].id).first
                for attempt in range(5):
                    page.locator(".slick-row", has_text=done[0].id).first.click()
                    try:
                        title.wait_for(timeout=6_000)
                        break
                    except Exception:
                        assert attempt < 4, "the page never showed the clicked session's graph"
                assert sorted(_graph_data(page)["key"]) == sorted(
                    n.call_id for n in da.session_graph(client, done[0]).nodes)
                # a session with a retry, opened directly: its timeline marks the re-visit
                page.goto(f"{url}?session={retried.id}")
                page.wait_for_function("""() => {
                    const plot = Bokeh.documents.length && Bokeh.documents[0].get_model_by_name("agents-timeline-plot");
                    return plot && plot.title.text.includes("1 retry (hatched /)");
                }""", timeout=20_000)
                tl = _columns(page, "agents-timeline", ("key", "lane", "component", "mark", "start_ms", "end_ms"))
                recs = plugin.state.sessions[retried.id].calls
                assert sorted(tl["key"]) == sorted(recs)  # every call ran on a worker
                assert [k for k, m in zip(tl["key"], tl["mark"]) if m == "retry"] == [
                    k for k, r in recs.items() if r.retry]
                retry_key = next(k for k, r in recs.items() if r.retry)
                assert recs[retry_key].component == "Developer"
                for k, lane, start, end in zip(tl["key"], tl["lane"], tl["start_ms"], tl["end_ms"]):
                    r = recs[k]
                    assert lane.split(" ")[0] in (short(r.worker), str(_worker_name(cluster, r.worker)))
                    assert start == pytest.approx(r.started * 1000) and end == pytest.approx(r.finished * 1000)
                page.wait_for_timeout(500)
                page.screenshot(path=os.path.join(ARTIFACTS, "dashboard-agents-retry.png"), full_page=True)
                assert not errors, errors
            finally:
                browser.close()
        stats = plugin.dashboard.stats()
    assert stats["updates"] > 0 and stats["documents"] >= 0
    assert os.path.getsize(shot) > 20_000


def test_page_with_the_preload_and_gone_after_close():
    import asyncio

    from tornado.httpclient import AsyncHTTPClient

    async def main() -> tuple[int, int, bool]:
        async with Scheduler(dashboard=True, dashboard_address="127.0.0.1:0", preload=["dask_agents.preload"]) as s:
            url = f"http://127.0.0.1:{s.http_server.port}/{PAGE}"
            page = await AsyncHTTPClient().fetch(url, raise_error=False)
            plugin = s.plugins[NAME]
            app = plugin.dashboard.app
            assert app in s.http_application.applications
            await plugin.close()  # what the scheduler does on close: the page goes with the plugin
            gone = await AsyncHTTPClient().fetch(url, raise_error=False)
            return page.code, gone.code, app not in s.http_application.applications

    with dask.config.set(CONFIG):
        code, after, removed = asyncio.run(main())
    assert code == 200 and after == 404 and removed
