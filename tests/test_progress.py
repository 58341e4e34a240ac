"""``da.progress``: terminal and notebook progress bars for sessions and futures."""

from __future__ import annotations

import asyncio
import io
import threading

import pytest
from distributed import Client, LocalCluster, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.progress import Row, TextProgress, Tracker, WidgetProgress
from tests.conftest import async_wait_for, wait_for

GATE = threading.Event()


@da.tool
def gated(i: int) -> int:
    GATE.wait(30)
    return i


@da.tool
def quick(i: int) -> int:
    return i


def inc(x: int) -> int:
    return x + 1


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60)
async def test_progress_waits_for_sessions_and_futures(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    GATE.clear()
    async with da.session(c, name="fast") as fast:
        await da.stub(quick)(1)
    slow = da.session(c, name="slow")
    async with slow:
        pending = [da.stub(gated)(i) for i in range(3)]
    plain = [c.submit(inc, i, pure=False) for i in range(2)]
    out = io.StringIO()
    task = asyncio.ensure_future(da.progress([fast, slow], plain, pending, file=out, interval=0.05))
    # everything but the gated calls is done, and those run (held by the gate)
    await async_wait_for(lambda: all(f.done() for f in plain) and len(a.state.executing) == 3)
    assert not task.done()  # the slow session has open calls
    assert out.getvalue() == ""  # not a terminal: only the final frame is printed
    GATE.set()
    rows = await asyncio.wait_for(task, 30)
    by_label = {r.label: r for r in rows}
    assert by_label[fast.id].complete and by_label[fast.id].total == 1
    assert by_label[slow.id].complete and by_label[slow.id].done == 3 and by_label[slow.id].status == "completed"
    assert by_label["inc"].done == by_label["inc"].total == 2  # plain futures, grouped by key prefix
    assert by_label["gated"].total == 3
    text = out.getvalue()
    assert "100% |" in text and f"{slow.id} | 3/3 calls" in text and "4/4 complete" in text


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60)
async def test_a_live_sessions_bar_is_measured_against_what_sessions_make(c: Client, s: Scheduler, a: Worker):
    """The denominator does not race the growing graph: two sessions made 4 calls each, so a
    session with 1 call known so far is at 0 of 4, not 0 of 1 (and never of fewer than known)."""
    await da.install(c)
    for name in ("one", "two"):
        async with da.session(c, name=name):
            await c.gather([da.stub(quick)(i) for i in range(4)])
    GATE.clear()
    async with da.session(c, name="live") as live:
        held = da.stub(gated)(0)
        await async_wait_for(lambda: len(a.state.executing) == 1)
        (row,) = await Tracker(c, [live.id], []).poll()
        assert (row.done, row.total, row.complete) == (0, 4, False)
        assert row.detail.startswith("0/1 calls (~4 expected), 1 open")
        GATE.set()
        await held
        more = [da.stub(quick)(i) for i in range(5)]  # past the expectation: known calls count
        await c.gather(more)
        (row,) = await Tracker(c, [live.id], []).poll()
        assert row.total == 6 and "expected" not in row.detail


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60)
async def test_tty_redraws_in_place_and_reports_failures(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    GATE.clear()
    async with da.session(c, name="redraw") as sess:
        futs = [da.stub(gated)(i) for i in range(2)]
    out = TTY()
    task = asyncio.ensure_future(da.progress(sess, file=out, interval=0.05))
    await async_wait_for(lambda: "\x1b[1F" in out.getvalue(), timeout=10)  # moved up to redraw
    GATE.set()
    rows = await asyncio.wait_for(task, 30)
    await c.gather(futs)
    assert rows[0].complete and "Completed" in out.getvalue().splitlines()[-1]


def test_unknown_inputs_are_rejected():
    with pytest.raises(TypeError, match="sessions .* futures"):
        da.progress(42)


def test_session_details_read_as_english():
    from types import SimpleNamespace

    def summary(retries: int, failed: int) -> dict:
        return {"progress": 3, "calls": 4, "open": 1, "current": "Tester", "retries": retries, "failed": failed,
                "state": "active", "expected": None}

    async def agents_progress(sessions):
        return {"a": summary(1, 0), "b": summary(2, 1)}

    t = Tracker(SimpleNamespace(scheduler=SimpleNamespace(agents_progress=agents_progress)), ["a", "b"], [])
    a, b = asyncio.run(t.poll())
    assert a.detail == "3/4 calls, 1 open, in Tester, 1 retry"
    assert b.detail == "3/4 calls, 1 open, in Tester, 2 retries, 1 failed"


def test_rows_and_text_format():
    p = TextProgress(Tracker(None, [], []), width=10)
    rows = [Row("s-1", 2, 4, "active", False, "2/4 calls"), Row("s-2", 4, 4, "completed", True, "4/4 calls")]
    lines = p.format(rows)
    assert lines[0].startswith("[#######   ]") and "1/2 complete" in lines[0]  # mean of 0.5 and 1.0
    assert lines[1].startswith("[#####     ] |  50% active | s-1")
    assert lines[2].startswith("[##########] | 100% Completed | s-2")
    many = [Row(f"s{i}", 0, 1, "active", False) for i in range(15)]
    assert p.format(many)[-1] == "... and 5 more"


def test_terminal_and_notebook_with_a_sync_client():
    pytest.importorskip("ipywidgets")
    with LocalCluster(n_workers=1, threads_per_worker=4, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        da.install(client)
        with da.session(client, name="sync") as sess:
            f = da.stub(quick)(3)
            f.result(30)
        out = io.StringIO()
        rows = da.progress(sess, file=out)
        assert rows[0].complete and "100% Completed" in out.getvalue()
        GATE.clear()
        with da.session(client, name="nb") as nb:
            futs = [da.stub(gated)(i) for i in range(2)]
        w = da.progress(nb, notebook=True, interval=0.05)
        assert isinstance(w, WidgetProgress)
        wait_for(lambda: w.rows, timeout=10)
        label, bar, text = w._bars[nb.id]
        assert not w.done and bar.value < 1.0
        GATE.set()
        client.gather(futs)
        wait_for(lambda: w.done, timeout=20)
        label, bar, text = w._bars[nb.id]
        assert bar.value == 1.0 and bar.bar_style == "success" and "Completed" in text.value
        assert "Finished" in w.elapsed.value and nb.id in label.value


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_sessions_need_the_plugin(c: Client, s: Scheduler, a: Worker):
    with pytest.raises(da.NotInstalledError):
        await da.progress("session-123")
