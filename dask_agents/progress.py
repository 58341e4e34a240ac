"""``da.progress``: progress bars for sessions and calls, in the style of ``distributed.progress``.

    with da.session(client) as s:
        ...
    da.progress(s)                      # terminal: blocks, redrawing, until the session completes
    da.progress([s1, s2, fut1, fut2])   # sessions and futures (AgentFutures or plain) together

A session's bar is its finished calls over the calls a session makes, as the completed
sessions of the cluster did (their mean), or the calls known so far when more (a live graph
grows: measured against what is known alone, the bar would move back); it is complete when the
session is (the driver left and every call ended). Futures are grouped by component (key prefix), one bar per group. In a notebook
(``notebook=None`` detects a kernel) it returns an ipywidgets display that updates in the
background; with an asynchronous client, ``await da.progress(...)``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable, TextIO

from dask.utils import format_time, key_split, parse_timedelta
from distributed import Client, Future

from dask_agents.errors import NotInstalledError

_DONE = frozenset({"finished", "error", "cancelled", "lost"})


@dataclass
class Row:
    """One bar: a session or a group of futures."""

    label: str
    done: int
    total: int
    status: str  # sessions: active/closing/completed/unknown; futures: pending/finished/error
    complete: bool
    detail: str = ""

    @property
    def fraction(self) -> float:
        """Done over total (1.0 when complete)."""
        if self.complete:
            return 1.0
        return self.done / self.total if self.total else 0.0


class Tracker:
    """What to watch: session ids and futures of one client; ``poll`` returns the rows."""

    # A session's end reaches the scheduler by RPC, its calls by the client's batched stream:
    # the end can arrive first, and the session looks completed with no calls until they land.
    # An empty completed session counts as complete only after this long.
    EMPTY_GRACE = 1.0

    def __init__(self, client: Client, sessions: list[str], futures: list[Future]):
        self.client = client
        self.sessions = sessions
        self.futures = futures
        self._seen: set[str] = set()
        self._empty_since: dict[str, float] = {}

    async def poll(self) -> list[Row]:
        """The current rows (one RPC for all sessions; futures are read locally)."""
        rows: list[Row] = []
        if self.sessions:
            got = await self.client.scheduler.agents_progress(sessions=self.sessions)
            for sid in self.sessions:
                d = got.get(sid)
                if d is None:
                    # never seen (no call yet) or expired after completing (then it is done)
                    done = sid in self._seen
                    rows.append(Row(sid, 0, 0, "completed" if done else "unknown", done))
                    continue
                self._seen.add(sid)
                complete = d["state"] == "completed"
                expected = d.get("expected")
                total = d["calls"] if complete or not expected else max(d["calls"], expected)
                detail = f"{d['progress']}/{d['calls']} calls"
                if total > d["calls"]:
                    detail += f" (~{total} expected)"
                if d["open"]:
                    detail += f", {d['open']} open"
                if d["current"]:
                    detail += f", in {d['current']}"
                if d["retries"]:
                    detail += f", {_plural(d['retries'], 'retry', 'retries')}"
                if d["failed"]:
                    detail += f", {d['failed']} failed"
                if complete and d["calls"] == 0:
                    first = self._empty_since.setdefault(sid, time.monotonic())
                    complete = time.monotonic() - first >= self.EMPTY_GRACE
                rows.append(Row(sid, d["progress"], total, d["state"] if complete or d["calls"] else "active",
                                complete, detail))
        groups: dict[str, list[Future]] = {}
        for f in self.futures:
            groups.setdefault(key_split(f.key), []).append(f)
        for name, fs in groups.items():
            statuses = [f.status for f in fs]
            done = sum(1 for st in statuses if st in _DONE)
            errors = sum(1 for st in statuses if st == "error")
            status = "error" if errors else ("finished" if done == len(fs) else "pending")
            detail = f"{done}/{len(fs)} calls" + (f", {errors} failed" if errors else "")
            rows.append(Row(name, done, len(fs), status, done == len(fs), detail))
        return rows

    @staticmethod
    def finished(rows: list[Row]) -> bool:
        """True when every row is complete."""
        return all(r.complete for r in rows)


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _flatten(items: Iterable[Any], out: list) -> list:
    for x in items:
        if isinstance(x, (list, tuple, set, frozenset)):
            _flatten(x, out)
        elif isinstance(x, dict):
            _flatten(x.values(), out)
        else:
            out.append(x)
    return out


def tracker(items: Iterable[Any], client: Client | None = None) -> Tracker:
    """A :class:`Tracker` for sessions (``da.Session`` or id strings) and futures."""
    from dask_agents.session import Session

    sessions: list[str] = []
    futures: list[Future] = []
    for x in _flatten(items, []):
        if isinstance(x, Session):
            sessions.append(x.id)
            client = client or x.client
        elif isinstance(x, str):
            sessions.append(x)
        elif isinstance(x, Future):
            futures.append(x)
            client = client or x.client
        else:
            raise TypeError(f"da.progress() takes sessions (da.Session or id), futures or lists of them, "
                            f"not {type(x).__name__}")
    if client is None:
        from distributed import get_client

        client = get_client()
    return Tracker(client, list(dict.fromkeys(sessions)), futures)


def _bar(fraction: float, width: int) -> str:
    return "#" * int(width * min(max(fraction, 0.0), 1.0))


class TextProgress:
    """Bars on a terminal: redrawn in place on a TTY, printed once at the end otherwise."""

    def __init__(self, tracker: Tracker, interval: float = 0.2, width: int = 40, max_rows: int = 10,
                 file: TextIO | None = None, timeout: float | None = None):
        self.tracker = tracker
        self.interval = interval
        self.width = width
        self.max_rows = max_rows
        self.file = file or sys.stdout
        self.timeout = timeout
        self.start = time.monotonic()
        self._lines = 0
        self.rows: list[Row] = []

    def format(self, rows: list[Row]) -> list[str]:
        """The lines of one frame: an overall bar when there are several rows, then each row."""
        elapsed = format_time(time.monotonic() - self.start)
        lines = []
        if len(rows) > 1:
            done = sum(1 for r in rows if r.complete)
            frac = sum(r.fraction for r in rows) / len(rows)
            lines.append(f"[{_bar(frac, self.width):<{self.width}}] | {int(100 * frac):3d}% | "
                         f"{done}/{len(rows)} complete | {elapsed}")
        shown = sorted(rows, key=lambda r: r.complete)[: self.max_rows] if len(rows) > self.max_rows else rows
        for r in shown:
            state = "Completed" if r.complete else r.status
            lines.append(f"[{_bar(r.fraction, self.width):<{self.width}}] | {int(100 * r.fraction):3d}% {state} | "
                         f"{r.label} | {r.detail}" + ("" if len(rows) > 1 else f" | {elapsed}"))
        if len(rows) > len(shown):
            lines.append(f"... and {len(rows) - len(shown)} more")
        return lines

    def draw(self, rows: list[Row], final: bool = False) -> None:
        """Show one frame (in place on a TTY)."""
        self.rows = rows
        tty = getattr(self.file, "isatty", lambda: False)()
        if not tty and not final:
            return
        lines = self.format(rows)
        out = []
        if tty and self._lines:
            out.append(f"\x1b[{self._lines}F")
        out.extend(f"\x1b[2K{line}\n" if tty else f"{line}\n" for line in lines)
        self._lines = len(lines)
        try:
            self.file.write("".join(out))
            self.file.flush()
        except ValueError:  # closed stream
            pass

    def _expired(self) -> bool:
        return self.timeout is not None and time.monotonic() - self.start > self.timeout

    def run(self) -> list[Row]:
        """Poll and draw until everything completes (or ``timeout``); returns the last rows."""
        client = self.tracker.client
        while True:
            rows = client.sync(self.tracker.poll)
            if Tracker.finished(rows) or self._expired():
                self.draw(rows, final=True)
                return rows
            self.draw(rows)
            time.sleep(self.interval)

    async def run_async(self) -> list[Row]:
        """:meth:`run` for asynchronous clients."""
        while True:
            rows = await self.tracker.poll()
            if Tracker.finished(rows) or self._expired():
                self.draw(rows, final=True)
                return rows
            self.draw(rows)
            await asyncio.sleep(self.interval)


class WidgetProgress:
    """Bars as ipywidgets in a notebook, updated from the client's event loop until complete."""

    def __init__(self, tracker: Tracker, interval: float = 0.2, timeout: float | None = None):
        from ipywidgets import HTML, VBox

        self.tracker = tracker
        self.interval = interval
        self.timeout = timeout
        self.start = time.monotonic()
        self.elapsed = HTML("")
        self.rows_box = VBox([])
        self.widget = VBox([self.elapsed, self.rows_box])
        self._bars: dict[str, tuple[Any, Any, Any]] = {}
        self.rows: list[Row] = []
        self.done = False

    def _ipython_display_(self, **kwargs: Any) -> None:
        from IPython.display import display

        display(self.widget, **kwargs)

    def draw(self, rows: list[Row]) -> None:
        """Update the widgets to ``rows`` (new rows get new bars)."""
        from ipywidgets import HTML, FloatProgress, HBox, Layout

        self.rows = rows
        if [r.label for r in rows] != list(self._bars):
            bars = {}
            for r in rows:
                old = self._bars.get(r.label)
                bars[r.label] = old or (HTML(f"<code>{r.label}</code>", layout=Layout(width="260px")),
                                        FloatProgress(min=0.0, max=1.0), HTML(""))
            self._bars = bars
            self.rows_box.children = [HBox(list(b)) for b in bars.values()]
        for r in rows:
            _label, bar, text = self._bars[r.label]
            bar.value = r.fraction
            bar.bar_style = "danger" if r.status in ("error", "erred") or "failed" in r.detail else (
                "success" if r.complete else "")
            text.value = f"&nbsp;{'Completed' if r.complete else r.status} | {r.detail}"
        word = "Finished" if self.done else "Running"
        self.elapsed.value = (f'<div style="padding: 0px 10px 5px 10px"><b>{word}:</b> '
                              f"{format_time(time.monotonic() - self.start)}</div>")

    async def loop(self) -> None:
        """Poll and redraw until complete (runs on the client's event loop)."""
        while True:
            try:
                rows = await self.tracker.poll()
            except Exception as e:  # the scheduler went away: show it and stop
                self.elapsed.value = f"<b>Stopped:</b> {type(e).__name__}: {e}"
                return
            finished = Tracker.finished(rows)
            expired = self.timeout is not None and time.monotonic() - self.start > self.timeout
            self.done = finished
            self.draw(rows)
            if finished or expired:
                return
            await asyncio.sleep(self.interval)


def progress(*items: Any, notebook: bool | None = None, interval: str | float = "200ms",
             timeout: float | None = None, file: TextIO | None = None, max_rows: int = 10) -> Any:
    """Show progress bars for sessions (``da.Session`` or session ids) and futures.

    Terminal: blocks until every session completed and every future is done (or ``timeout``
    seconds passed) and returns the last rows. Notebook: returns a widget that updates in the
    background. Asynchronous client: returns a coroutine to await (terminal form)."""
    from dask_agents.install import installed

    t = tracker(items)
    client = t.client
    seconds = float(parse_timedelta(interval, default="s"))
    if notebook is None:
        from distributed.utils import is_kernel

        notebook = is_kernel()
    if client.asynchronous:
        async def go() -> Any:
            if t.sessions and not await installed(client):
                raise NotInstalledError("da.progress on sessions needs the dask-agents scheduler plugin: "
                                        "call da.install(client)")
            if notebook:
                w = WidgetProgress(t, seconds, timeout)
                client.loop.add_callback(w.loop)
                return w
            return await TextProgress(t, seconds, file=file, timeout=timeout, max_rows=max_rows).run_async()

        return go()
    if t.sessions and not installed(client):
        raise NotInstalledError("da.progress on sessions needs the dask-agents scheduler plugin: "
                                "call da.install(client)")
    if notebook:
        w = WidgetProgress(t, seconds, timeout)
        client.loop.add_callback(w.loop)
        return w
    return TextProgress(t, seconds, file=file, timeout=timeout, max_rows=max_rows).run()
