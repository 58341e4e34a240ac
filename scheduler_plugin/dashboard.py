"""The Agents page in Dask's dashboard: ``http://<scheduler>:8787/agents``.

Registered by the scheduler plugin whenever it starts (``da.install(client)`` or
``--preload dask_agents.preload``) on a scheduler whose dashboard is on: a Bokeh application
served from the scheduler's own HTTP server, under Dask's dashboard prefix, with Dask's page
template and a link in Dask's navigation bar. Sections:

- time series (kept in the scheduler, ``timeseries.py``): live sessions, admission, engine
  queues, latency percentiles, throughput, tokens/s, hit rate, KV blocks and bytes;
- sessions: live ones on top, the latest completed below (progress bar, state, age, current
  component, retries, failures); click a row to see its graph;
- a session's live call graph, nodes coloured by state, and its timeline (each call a bar on
  its worker or engine, coloured by component, retries and failures hatched);
- errors: the latest failed calls with their error and a link to Dask's task page;
- components: replicas, capacity, ready queue per replica, utilization (from the workers'
  timings), service/arrival rates, mean queueing and service time, the bottleneck;
- engines and KV: per worker and model, sessions bound, engine queue, KV bytes per tier and
  the device's blocks (referenced, retained, evictable), prefix-cache hit rate, cached and
  recomputed tokens, tier traffic;
- control loop: tick times (plot), counters, recent decisions (newest first).

Cost: one :class:`~dask_agents.scheduler_plugin.dashboard_data.DashboardModel` computes for every open
page at most once per refresh; each page then sends only what changed (ColumnDataSource
``patch``/``stream``; a full reload only when rows must leave from the middle of a table).
Nothing runs while no page is open. :meth:`Dashboard.stats` reports the event-loop time
spent, also exported as ``dask_agents_dashboard_update_seconds_total``.
"""

from __future__ import annotations

import functools
import html
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

from dask_agents.scheduler_plugin import dask_compat, validate
from dask_agents.scheduler_plugin.dashboard_data import (
    COMPONENT_COLUMNS,
    DECISION_COLUMNS,
    ENGINE_COLUMNS,
    ERROR_COLUMNS,
    SESSION_COLUMNS,
    STATE_COLORS,
    TIMELINE_COLUMNS,
    DashboardModel,
)
from dask_agents.scheduler_plugin.state import TERMINAL
from dask_agents.scheduler_plugin.timeseries import COLUMNS as TIMESERIES_COLUMNS

if TYPE_CHECKING:
    from dask_agents.scheduler_plugin.plugin import AgentsSchedulerPlugin

TS_COLUMNS = (*TIMESERIES_COLUMNS, "t_ms")  # t_ms: the sample's time for Bokeh's datetime axis

logger = logging.getLogger(__name__)

PAGE = "agents"
# Texts whose counters move at every refresh are re-sent at most this often (one message each).
TEXT_EVERY_S = 5.0
"""The page's path under Dask's dashboard prefix."""


class Dashboard:
    """The Agents page of one scheduler plugin: its Bokeh application and its cost."""

    def __init__(self, plugin: "AgentsSchedulerPlugin", prefix: str):
        self.plugin = plugin
        self.prefix = prefix
        self.model = DashboardModel(plugin)
        self.app: Any = None
        self.documents = 0
        self.updates = 0
        self.update_seconds = 0.0
        self.update_cpu_seconds = 0.0
        self.last_update_seconds = 0.0
        self.max_update_seconds = 0.0
        self.failed_sections: set[str] = set()  # sections whose refresh failed (logged once each)

    @property
    def path(self) -> str:
        """The page's URL path on the scheduler's HTTP server (``/agents``)."""
        return f"{self.prefix.rstrip('/')}/{PAGE}"

    def stats(self) -> dict:
        """Open pages, refreshes done, the event-loop seconds they took (wall: total, last,
        max) and the CPU seconds of the event-loop thread they used (``update_cpu_seconds``)."""
        return {"path": self.path, "documents": self.documents, "updates": self.updates,
                "update_seconds": self.update_seconds, "update_cpu_seconds": self.update_cpu_seconds,
                "last_update_seconds": self.last_update_seconds, "max_update_seconds": self.max_update_seconds}

    def timed(self, fn: Any) -> None:
        """Run one page refresh and account its time (wall, and CPU of this thread)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            fn()
        finally:
            dt = time.perf_counter() - t0
            self.update_cpu_seconds += time.thread_time() - c0
            self.updates += 1
            self.update_seconds += dt
            self.last_update_seconds = dt
            self.max_update_seconds = max(self.max_update_seconds, dt)

    def uninstall(self) -> None:
        """Stop serving the page (plugin close)."""
        s = self.plugin.scheduler
        if self.app is not None and s is not None:
            dask_compat.remove_http_application(s, self.app)
            dask_compat.remove_dashboard_page_link(s, PAGE)
            try:
                self.app.stop()
            except Exception as e:  # closing anyway
                logger.debug("dask-agents: stopping the dashboard app failed: %s", e)
            self.app = None


def install(plugin: "AgentsSchedulerPlugin") -> Dashboard | None:
    """Serve the Agents page from ``plugin``'s scheduler; None if Dask's dashboard is off.

    Never raises: a dashboard problem must not keep the plugin (and the cluster) from starting."""
    s = plugin.scheduler
    try:
        prefix = dask_compat.dashboard_prefix(s)
        if prefix is None:
            logger.info("dask-agents: the scheduler's dashboard is off; no Agents page")
            return None
        dash = Dashboard(plugin, prefix)
        dash.app = dask_compat.start_bokeh_application(
            s, {f"/{PAGE}": functools.partial(_document, weakref.ref(dash))}, prefix)
        dask_compat.add_dashboard_page_link(s, PAGE)
        logger.info("dask-agents: Agents page at %s", dash.path)
        return dash
    except Exception:
        logger.exception("dask-agents: could not add the Agents page to the dashboard")
        return None


def _wanted_session(args: dict) -> str:
    """The session a page URL asks for (``?session=<id>``; "" for none). A query that is not a
    session id is the browser's mistake: 400, naming what is wrong (never a 500)."""
    from tornado.web import HTTPError

    raw = (args.get("session") or [b""])[0]
    try:
        wanted = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        return validate.session_id(wanted, "session") if wanted else ""
    except (UnicodeDecodeError, ValueError) as e:
        raise HTTPError(400, reason="session is not a session id") from e


def _document(ref: Any, scheduler: Any, extra: dict, doc: Any) -> None:
    """Build one browser session's document (Bokeh calls this per page load)."""
    theme, env = dask_compat.dashboard_theme()
    dash = ref()
    if dash is None:
        return
    args = doc.session_context.request.arguments if doc.session_context and doc.session_context.request else {}
    page = AgentsPage(dash, _wanted_session(args))
    doc.title = "Dask: Agents"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = theme
    page.update()
    pref = weakref.ref(page)

    def tick() -> None:
        p = pref()
        if p is None:
            return
        session = doc.session_context.session if doc.session_context is not None else None
        if session is not None and session.connection_count == 0:
            return  # the browser left (Bokeh keeps the document a while): nobody to update
        p.update()

    doc.add_periodic_callback(tick, int(dash.model.interval * 1000))
    doc._agents_page = page  # keep the page alive as long as its document (ours, on a Bokeh object)
    dash.documents += 1

    def destroyed(ctx: Any) -> None:
        d = ref()
        if d is not None:
            d.documents -= 1

    doc.on_session_destroyed(destroyed)


_BAR = ('<div style="background:#e0e0e0;width:100%;height:14px;margin-top:4px;position:relative">'
        '<div style="background:<%= color %>;width:<%= pct %>%;height:100%"></div>'
        '<span style="position:absolute;left:4px;top:0;font-size:10px;line-height:14px">'
        '<%= progress %>/<%= calls %></span></div>')


def _formatter(cache: dict, kind: Any, fmt: str) -> Any:
    """One formatter per kind and format on a page (``cache``: the page's): every Bokeh model
    of a page adds to the cost of each message to its browser (the serializer indexes them all).
    Models belong to one document, so pages do not share them."""
    key = (kind.__name__, fmt)
    if key not in cache:
        cache[key] = kind(format=fmt, nan_format="—", null_format="—") if fmt else kind()
    return cache[key]


def _table(source: Any, spec: list[tuple[str, str, Any]], height: int, name: str,
           widths: dict[str, int] | None = None, view: Any = None, formatters: dict | None = None) -> Any:
    from bokeh.models import CustomJS, DataTable, NumberFormatter, StringEditor, StringFormatter, TableColumn

    formatters = {} if formatters is None else formatters
    editor = formatters.setdefault("editor", StringEditor())  # (the tables are read-only: one will do)
    cols = []
    for field, title, fmt in spec:
        if fmt is None:
            formatter = _formatter(formatters, StringFormatter, "")
        elif isinstance(fmt, str):
            formatter = _formatter(formatters, NumberFormatter, fmt)
        else:
            formatter = fmt
        cols.append(TableColumn(field=field, title=title, formatter=formatter, editor=editor,
                                width=(widths or {}).get(field, 60)))
    table = DataTable(source=source, columns=cols, height=height, sizing_mode="stretch_width",
                      index_position=None, name=name, reorderable=False, **({"view": view} if view else {}))
    # BokehJS's DataTable redraws when its view's indices change (data replaced, rows streamed),
    # not on a patch of existing rows: poke it so patched cells show.
    source.js_on_change("patching", CustomJS(args={"table": table}, code="table.view.change.emit()"))
    return table


def _no_sync_back(fig: Any) -> None:
    """The browser auto-ranges the plot; it need not tell the server (one message less per
    refresh and plot)."""
    for r in (fig.x_range, fig.y_range):
        r.syncable = False


def _small_sync(source: Any, rows: list[dict], columns: list[str]) -> None:
    """Bring a small table's source to ``rows``: cell patches when the row count is the same."""
    n = len(source.data[columns[0]])
    if n != len(rows):
        source.data = {c: [r[c] for r in rows] for c in columns}
        return
    patches: dict[str, list] = {}
    for c in columns:
        old = source.data[c]
        for i, r in enumerate(rows):
            v = r[c]
            if old[i] != v and not (v != v and old[i] != old[i]):  # NaN == NaN here
                patches.setdefault(c, []).append((i, v))
    if patches:
        source.patch(patches)


_INTS = ("progress", "calls", "open", "retries", "failed")
_FLOATS = ("pct",)
_STRINGS = tuple(c for c in SESSION_COLUMNS if c not in _INTS + _FLOATS + ("age_s",))


class SessionsSync:
    """Keeps one page's sessions table in step with the model, incrementally.

    Rows stay in session-creation order. Each refresh sends, in one patch: the changed text
    cells of the sessions that moved, each numeric column that changed anywhere (as one
    binary array: cheaper to encode than hundreds of cells) and the ages; new sessions are
    streamed at the end, and rows that left from the front are dropped with ``rollover``
    (with steady churn the oldest sessions complete first). Rows that left from the middle
    stay (as they were) until they reach the front or become too many; then the table is
    reloaded once."""

    def __init__(self, source: Any, slack: int = 200):
        import numpy as np

        self.source = source
        self.keys: list[str] = []
        self.versions: list[int] = []
        self.sent: list[dict] = []  # the row each table row shows
        self.slack = slack
        self.reloads = 0
        self.num = {c: np.zeros(0, dtype=np.int64 if c in _INTS else float) for c in _INTS + _FLOATS}
        self.created = np.zeros(0)
        self.ended = np.zeros(0)  # NaN while the session lives

    @staticmethod
    def _arrays(rows: list[dict]) -> tuple[dict, Any, Any]:
        import numpy as np

        num = {c: np.fromiter((r[c] for r in rows), dtype=np.int64 if c in _INTS else float, count=len(rows))
               for c in _INTS + _FLOATS}
        created = np.fromiter((r["created"] for r in rows), dtype=float, count=len(rows))
        ended = np.fromiter((np.nan if r["completed"] is None else r["completed"] for r in rows), dtype=float,
                            count=len(rows))
        return num, created, ended

    def ages(self, now: float) -> Any:
        """Age of every row (to completion for completed sessions)."""
        import numpy as np

        return (np.where(np.isnan(self.ended), now, self.ended) - self.created).round(2)

    def sync(self, view: Any, now: float) -> None:
        """Apply the current :class:`~dask_agents.scheduler_plugin.dashboard_data.SessionsView`."""
        import numpy as np

        wanted = view.versions
        keys = self.keys
        front = 0
        while front < len(keys) and keys[front] not in wanted:
            front += 1
        stale = sum(1 for k in keys[front:] if k not in wanted)
        if stale > self.slack or (front and front == len(keys)):
            self.reload(view, now)
            return
        patches: dict[str, list] = {}
        moved: set[str] = set()
        num = self.num
        for i in range(front, len(keys)):
            k = keys[i]
            v = wanted.get(k)
            if v is not None and v != self.versions[i]:
                row, old = view.row(k), self.sent[i]
                for c in _STRINGS:  # only the cells that changed
                    if row[c] != old[c]:
                        patches.setdefault(c, []).append((i, row[c]))
                for c in num:
                    if row[c] != old[c]:
                        num[c][i] = row[c]
                        moved.add(c)
                if row["completed"] is not None:
                    self.ended[i] = row["completed"]
                self.versions[i] = v
                self.sent[i] = row
        present = set(keys)
        new = [k for k in view.order if k not in present]
        if new or front:
            if not new:  # only rows leaving: a stream needs rows, so reload (rare: no arrivals)
                self.reload(view, now)
                return
            for c in moved:  # indices before the rollover
                patches[c] = [(slice(0, len(keys)), num[c].copy())]
            if patches:
                self.source.patch(patches)
                patches, moved = {}, set()
            rows = [view.row(k) for k in new]
            data = {c: [r[c] for r in rows] for c in SESSION_COLUMNS}
            total = len(keys) + len(new) - front
            self.source.stream(data, rollover=total)
            self.keys = keys[front:] + new
            self.versions = self.versions[front:] + [wanted[k] for k in new]
            self.sent = self.sent[front:] + rows
            add, created, ended = self._arrays(rows)
            self.num = {c: np.concatenate([num[c][front:], add[c]]) for c in num}
            self.created = np.concatenate([self.created[front:], created])
            self.ended = np.concatenate([self.ended[front:], ended])
        n = len(self.keys)
        for c in moved:
            patches[c] = [(slice(0, n), self.num[c].copy())]
        if n:  # the ages move every time; everything goes as one message
            patches["age_s"] = [(slice(0, n), self.ages(now))]
        if patches:
            self.source.patch(patches)

    def reload(self, view: Any, now: float) -> None:
        """Replace the whole table."""
        self.keys = list(view.order)
        self.versions = [view.versions[k] for k in self.keys]
        self.sent = [view.row(k) for k in self.keys]
        self.num, self.created, self.ended = self._arrays(self.sent)
        data = {c: [row[c] for row in self.sent] for c in SESSION_COLUMNS}
        data["age_s"] = list(self.ages(now))
        self.source.data = data
        self.reloads += 1


class AgentsPage:
    """The Bokeh models of one open page and their refresh."""

    def __init__(self, dash: Dashboard, session: str = ""):
        from bokeh.layouts import column, row
        from bokeh.models import (
            CDSView,
            ColumnDataSource,
            DataRange1d,
            DatetimeTicker,
            DatetimeTickFormatter,
            Div,
            FactorRange,
            GroupFilter,
            HoverTool,
            HTMLTemplateFormatter,
            InversionFilter,
            LabelSet,
            Select,
        )
        from bokeh.plotting import figure

        self.dash = dash
        self.model = dash.model
        self.follow = not session  # follow the longest-running live session until one is chosen
        self.session = session or None
        self.decisions_seen = (0, 0)
        self._choices_at = 0.0
        self._graph_version: tuple[str | None, int] | None = None

        self.summary = Div(text="", name="agents-summary", sizing_mode="stretch_width")
        table = functools.partial(_table, formatters={})  # the page's tables share formatters

        self.sessions_src = ColumnDataSource({c: [] for c in SESSION_COLUMNS}, name="agents-sessions")
        self.sessions_sync = SessionsSync(self.sessions_src)
        # One source, two views: live sessions on top (oldest first: the slowest), the latest
        # completed below; a row moves between them when its state cell is patched. The
        # browser filters (and sorts, by a click on a header), the server sends rows once.
        columns = [
            ("session", "session", None), ("state", "state", None),
            ("pct", "progress", HTMLTemplateFormatter(template=_BAR)),
            ("age_s", "age s", "0.00"), ("current", "current component", None), ("open", "open calls", "0"),
            ("retries", "retries", "0"), ("failed", "failed", "0"), ("tenant", "tenant", None),
        ]
        widths = {"session": 190, "pct": 90, "current": 110}
        done = GroupFilter(column_name="state", group="completed")
        self.sessions_table = table(self.sessions_src, columns, 240, "agents-sessions-table", widths,
                                     CDSView(filter=InversionFilter(operand=done)))
        self.completed_table = table(self.sessions_src, columns, 160, "agents-completed-table", widths,
                                      CDSView(filter=done))
        self.sessions_src.selected.on_change("indices", self._on_select_row)

        self.components_src = ColumnDataSource({c: [] for c in COMPONENT_COLUMNS}, name="agents-components")
        self.components_table = table(self.components_src, [
            ("component", "component", None), ("kind", "kind", None), ("replicas", "replicas", "0"),
            ("slots", "capacity (slots)", "0"),
            ("queued", "queued", "0"), ("per_replica", "ready queue per replica", None),
            ("running", "running", "0"), ("busy", "utilization", "0.0%"),
            ("service_rate", "service rate /s per busy slot", "0.00"),
            ("throughput", "done /s", "0.00"), ("arrival_rate", "arrivals /s", "0.00"),
            ("mean_queue_s", "mean queue s", "0.000"), ("mean_service_s", "mean service s", "0.000"),
            ("capacity_x", "capacity x", "0.00"), ("bottleneck", "bottleneck", None),
        ], 200, "agents-components-table", {"per_replica": 160, "bottleneck": 140, "kind": 90})

        self.engines_src = ColumnDataSource({c: [] for c in ENGINE_COLUMNS}, name="agents-engines")
        self.engines_table = table(self.engines_src, [
            ("worker", "worker", None), ("model", "model", None), ("engine", "engine", None),
            ("sessions", "sessions bound", "0"), ("running", "running", "0"), ("waiting", "waiting", "0"),
            ("held", "held for room (model)", "0"), ("bound", "calls bound", "0"),
            ("working_set", "admitted working sets", None),
            ("kv_device", "KV device", None), ("kv_capacity", "KV device capacity", None),
            ("kv_referenced", "blocks referenced", "0,0"), ("kv_retained", "blocks retained", "0,0"),
            ("kv_evictable", "blocks evictable", "0,0"), ("kv_blocks", "blocks", "0,0"),
            ("kv_host", "KV host", None), ("kv_disk", "KV disk", None), ("hit_rate", "prefix hit rate", "0.0%"),
            ("cached_tokens", "cached tokens", "0,0"), ("recomputed_tokens", "recomputed tokens", "0,0"),
            ("offloaded", "offloaded", None), ("restored", "restored", None), ("evictions", "evictions", "0"),
            ("kv_control", "per-session KV control", None), ("stats_age_s", "stats age s", "0.0"),
        ], 160, "agents-engines-table", {"worker": 110, "engine": 110})

        # Time series, sampled by the scheduler whether or not a page is open (timeseries.py):
        # a new page gets the kept window at once, then each new sample.
        self.ts_seen = 0
        self.ts_src = ColumnDataSource({c: [] for c in TS_COLUMNS}, name="agents-timeseries")
        # The time plots share one time axis (zoom or pan one, they all follow) and one ticker
        # and formatter: fewer models on the page, each of which costs every message to the
        # browser a little (see _formatter).
        shared_x = DataRange1d(syncable=False)
        ticker, tick_format = DatetimeTicker(), DatetimeTickFormatter()

        def time_figure(**kw: Any) -> Any:
            f = figure(x_axis_type="datetime", x_range=shared_x, **kw)
            f.xaxis.ticker, f.xaxis.formatter = ticker, tick_format
            f.xgrid.ticker = ticker
            return f

        # Every model of the page costs each message to the browser (Bokeh serializes references
        # to all of them per message): the time series' lines share one view of their source
        # and have no selection or muted copies of their glyph (nothing selects or mutes them).
        ts_view = CDSView()

        def ts_line(fig: Any, col: str, label: str, color: str) -> None:
            r = fig.line("t_ms", col, source=self.ts_src, line_width=1.5, color=color, legend_label=label, view=ts_view)
            r.nonselection_glyph = r.muted_glyph = None

        ts_figs = []
        for title, lines in (
                ("sessions and calls waiting", (("live_sessions", "live sessions", "#1e88e5"),
                                                ("admission_waiting", "held for admission", "#fb8c00"),
                                                ("engine_running", "engine running", "#43a047"),
                                                ("engine_waiting", "engine waiting", "#e53935"))),
                ("session latency (s, completed in the last window)", (("latency_p50_s", "P50", "#43a047"),
                                                                       ("latency_p95_s", "P95", "#fb8c00"),
                                                                       ("latency_p99_s", "P99", "#e53935"))),
                ("throughput", (("completions_per_s", "sessions completed /s", "#1e88e5"),)),
                ("LLM tokens /s", (("tokens_per_s", "tokens /s", "#8e24aa"),)),
                ("prefix-cache hit rate (LLM calls of the last sample)", (("hit_rate", "hit rate", "#43a047"),)),
                ("KV blocks on the engines' devices", (("kv_referenced_blocks", "referenced", "#1e88e5"),
                                                       ("kv_retained_blocks", "retained (pinned)", "#fb8c00"),
                                                       ("kv_evictable_blocks", "evictable (cached)", "#43a047"))),
                ("KV bytes (device, host)", (("kv_device_bytes", "device", "#00897b"),
                                             ("kv_host_bytes", "host", "#8e24aa")))):
            f = time_figure(height=180, sizing_mode="stretch_width", title=title, tools="", toolbar_location=None)
            _no_sync_back(f)
            for col, label, color in lines:
                ts_line(f, col, label, color)
            f.legend.location, f.legend.label_text_font_size, f.legend.background_fill_alpha = "top_left", "8pt", 0.5
            ts_figs.append(f)
        self.ts_figs = ts_figs

        self.control_div = Div(text="", name="agents-control", sizing_mode="stretch_width")
        self._control_head: Any = ()
        self._control_at = 0.0
        self._summary_at = 0.0
        # control-loop pass times: from the time series (one message per refresh less)
        ticks_fig = time_figure(height=200, sizing_mode="stretch_width", title="control-loop passes (ms, per sample)",
                                tools="", toolbar_location=None)
        _no_sync_back(ticks_fig)
        for col, label, color in (("control_pass_p50_ms", "median", "#1e88e5"), ("control_pass_max_ms", "longest",
                                                                                  "#e53935")):
            ts_line(ticks_fig, col, label, color)
        ticks_fig.legend.location, ticks_fig.legend.label_text_font_size = "top_left", "8pt"
        self.decisions_src = ColumnDataSource({c: [] for c in DECISION_COLUMNS}, name="agents-decisions")
        self.decisions_table = table(self.decisions_src, [
            ("time", "time", None), ("action", "action", None), ("policy", "policy", None),
            ("details", "details", None),
        ], 200, "agents-decisions-table", {"details": 300})

        self.errors_seen = 0
        self.errors_src = ColumnDataSource({c: [] for c in ERROR_COLUMNS}, name="agents-errors")
        link = HTMLTemplateFormatter(template='<a href="<%= link %>" target="_blank">task page</a>')
        self.errors_table = table(self.errors_src, [
            ("time", "time", None), ("session", "session", None), ("call", "call", None),
            ("component", "component", None), ("worker", "worker", None), ("error", "error", None),
            ("link", "Dask", link),
        ], 160, "agents-errors-table", {"session": 150, "call": 200, "error": 420, "link": 70})
        self.errors_title = Div(text="", name="agents-errors-title", sizing_mode="stretch_width")

        self.timeline_src = ColumnDataSource({c: [] for c in TIMELINE_COLUMNS}, name="agents-timeline")
        self.timeline_version: tuple[str | None, int] | None = None
        self._growing: list[int] = []  # rows of the timeline whose call still runs
        tl = figure(height=260, sizing_mode="stretch_width", tools="xpan,xwheel_zoom,reset", toolbar_location="above",
                    x_axis_type="datetime", y_range=FactorRange(), name="agents-timeline-plot",
                    title="session timeline: each call on its worker (hatched red: retry /, erred x)")
        tl.x_range.syncable = False
        bars = tl.hbar(y="lane", left="start_ms", right="end_ms", height=0.6, source=self.timeline_src,
                       fill_color="color", line_color="line", hatch_pattern="hatch", hatch_color="#e53935",
                       hatch_alpha=0.8)
        tl.add_tools(HoverTool(renderers=[bars], tooltips=[
            ("call", "@key"), ("component", "@component.@method"), ("state", "@state"), ("on", "@lane"),
            ("seconds", "@duration"), ("", "@mark")]))
        self.timeline = tl

        self.graph_title = Div(text="", name="agents-graph-title", sizing_mode="stretch_width")
        self.select = Select(title="session graph", value="", options=[("", "(longest-running live session)")],
                             name="agents-graph-select", width=420)
        self.select.on_change("value", self._on_select)
        self.nodes_src = ColumnDataSource({c: [] for c in ("key", "component", "method", "state", "color", "x", "y",
                                                            "worker", "duration", "retry")},
                                          name="agents-graph-nodes")
        self.edges_src = ColumnDataSource({"xs": [], "ys": [], "kind": [], "color": [], "dash": []},
                                          name="agents-graph-edges")
        g = figure(height=360, sizing_mode="stretch_width", tools="pan,wheel_zoom,reset",
                   x_axis_label="depth", toolbar_location="above", name="agents-graph")
        _no_sync_back(g)
        g.yaxis.visible = False
        g.x_range.range_padding = 0.25
        g.y_range.range_padding = 0.15
        g.ygrid.visible = False
        g.multi_line("xs", "ys", source=self.edges_src, line_color="color", line_dash="dash", line_alpha=0.7)
        nodes = g.scatter("x", "y", source=self.nodes_src, size=16, fill_color="color", line_color="#333333")
        g.add_layout(LabelSet(x="x", y="y", text="component", source=self.nodes_src, x_offset=9, y_offset=-5,
                              text_font_size="9px"))
        g.add_tools(HoverTool(renderers=[nodes], tooltips=[
            ("call", "@key"), ("component", "@component.@method"), ("state", "@state"), ("worker", "@worker"),
            ("service s", "@duration"), ("", "@retry")]))
        legend = Div(text=" ".join(
            f'<span style="display:inline-block;width:10px;height:10px;background:{c};margin:0 3px"></span>{s}'
            for s, c in STATE_COLORS.items()), sizing_mode="stretch_width")

        def h(text: str) -> Any:
            return Div(text=f"<h3 style='margin:12px 0 4px 0'>{text}</h3>", sizing_mode="stretch_width")

        self.root = column(
            self.summary,
            row(*self.ts_figs[:3], sizing_mode="stretch_width"),
            row(*self.ts_figs[3:], sizing_mode="stretch_width"),
            row(column(h("Live sessions"), self.sessions_table, h("Completed sessions (latest)"),
                       self.completed_table, sizing_mode="stretch_width"),
                column(h("Session graph"), self.select, self.graph_title, g, legend, self.timeline,
                       sizing_mode="stretch_width"),
                sizing_mode="stretch_width"),
            h("Errors"), self.errors_title, self.errors_table,
            h("Components"), self.components_table,
            h("Engines and KV"), self.engines_table,
            h("Control loop"), self.control_div,
            row(ticks_fig, self.decisions_table, sizing_mode="stretch_width"),
            sizing_mode="stretch_width", name="agents-root",
        )

    # -- interaction -------------------------------------------------------------------------
    def _on_select(self, attr: str, old: str, new: str) -> None:
        self.follow = not new
        self.session = new or None
        self.dash.timed(self._update_graph)

    def _on_select_row(self, attr: str, old: list, new: list) -> None:
        if new and 0 <= new[0] < len(self.sessions_sync.keys):
            sid = self.sessions_sync.keys[new[0]]
            if sid not in dict(self.select.options):
                self.select.options = [*self.select.options, (sid, sid)]
            self.select.value = sid

    # -- refresh -----------------------------------------------------------------------------
    def update(self) -> None:
        """Refresh every section (timed: :meth:`Dashboard.stats`); everything that changed
        goes to the browser as one message."""
        self.dash.timed(self._held_update)

    def _held_update(self) -> None:
        doc = self.root.document
        if doc is None:
            self._update()
            return
        doc.hold("combine")
        try:
            self._update()
        finally:
            doc.unhold()

    def _update(self) -> None:
        now = time.time()
        m = self.model
        view = self._section("sessions", lambda: m.sessions(now))
        if view is not None:
            self._section("sessions table", lambda: self.sessions_sync.sync(view, now))
        self._section("components", lambda: _small_sync(self.components_src, m.components(now), COMPONENT_COLUMNS))
        self._section("engines", lambda: _small_sync(self.engines_src, m.engines(now), ENGINE_COLUMNS))
        self._section("control loop", lambda: self._update_control(now))
        self._section("time series", self._update_timeseries)
        self._section("session choices", lambda: self._update_choices(now))
        self._section("session graph", self._update_graph)
        self._section("timeline", lambda: self._update_timeline(now))
        self._section("errors", self._update_errors)
        if view is not None:
            self._section("summary", lambda: self._update_summary(view, now))

    def _section(self, name: str, fn: Any) -> Any:
        """Run one section's refresh; if it fails, the others still run. An exception here
        would fail the whole page (a page load answers 500) and every later refresh.
        Logged in full the first time a section fails, at debug level after that."""
        try:
            return fn()
        except Exception:
            agg = getattr(self.dash.plugin, "aggregates", None)
            if agg is not None:
                agg.skipped += 1
            first = name not in self.dash.failed_sections
            self.dash.failed_sections.add(name)
            if first:
                logger.exception("dask-agents: the Agents page left out its %s section", name)
            else:
                logger.debug("dask-agents: the Agents page left out its %s section again", name, exc_info=True)
            return None

    def _update_summary(self, view: Any, now: float) -> None:
        p = self.dash.plugin
        state = p.state
        live = view.live
        text = (f"<b>dask-agents</b> &nbsp; sessions live: <b>{live}</b> &nbsp; completed: "
                f"{state.sessions_completed} &nbsp; calls open: {sum(max(n, 0) for n in state.open_per_component.values())}"
                f" &nbsp; calls seen: {sum(state.calls_per_component.values())} &nbsp; agents workers: "
                f"{len(p.ready_workers)} &nbsp; rows shown: {len(self.sessions_sync.keys)}")
        # Its counts move at every refresh, and each text change is one more message to the
        # browser (each costs the scheduler as much as a table patch, whatever its size): re-sent
        # at most every TEXT_EVERY_S; the live sessions are also in the time series, every second.
        if self.summary.text != text and (not self.summary.text or now - self._summary_at >= TEXT_EVERY_S):
            self._summary_at = now
            self.summary.text = text

    def _update_control(self, now: float) -> None:
        m = self.model
        st = m.control_summary()
        if st:
            ms = (lambda v: "—" if v is None else f"{v * 1000:.2f} ms")
            applied = ", ".join(f"{k}: {v}" for k, v in sorted(st.get("applied", {}).items())) or "none"
            rejected = ", ".join(f"{k}: {v}" for k, v in sorted(st.get("rejected", {}).items())) or "none"
            drains = st.get("drains", {})
            stable = (f"{'running' if st['running'] else 'stopped'} every {st['interval'] * 1000:.0f} ms; policies "
                      f"{', '.join(st['policies']) or 'none'}<br>applied: {applied}; rejected: {rejected}; "
                      f"engine moves (reallocation): {drains.get('completed', 0)} done, "
                      f"{len(drains.get('in_progress', {}))} in progress; policy errors: {st['policy_errors']}")
            passes = (f"<br>passes {st['ticks']}; pass last {ms(st['tick_seconds_last'])}, p50 "
                      f"{ms(st['tick_seconds_p50'])}, p99 {ms(st['tick_seconds_p99'])}, max {ms(st['tick_seconds_max'])}"
                      f" (as of {time.strftime('%H:%M:%S', time.localtime(now))}; each pass over time: the plot)")
        else:
            stable, passes = "no control loop", ""
        # The pass and action counters move at every refresh; each text change is one more
        # message to the browser (and one costs as much as a table patch): re-sent at most every
        # TEXT_EVERY_S (the passes are also in the plot, every second), a change of the loop's
        # state or policies or a new policy error at once.
        head = (st.get("running"), tuple(st.get("policies", ())), st.get("policy_errors")) if st else None
        if (head != self._control_head or now - self._control_at >= TEXT_EVERY_S) and stable + passes != self.control_div.text:
            self._control_head = head
            self._control_at = now
            self.control_div.text = stable + passes
        self.decisions_seen, rows = m.new_decisions(self.decisions_seen)
        if rows:  # newest on top (a stream only appends: the small table is replaced)
            old = self.decisions_src.data
            self.decisions_src.data = {c: ([r[c] for r in reversed(rows)] + list(old[c]))[:m.decisions]
                                       for c in DECISION_COLUMNS}

    def _update_timeseries(self) -> None:
        ts = getattr(self.dash.plugin, "timeseries", None)
        if ts is None:
            return
        self.ts_seen, rows = ts.since(self.ts_seen)
        if rows:
            data = {c: [r[c] for r in rows] for c in TS_COLUMNS if c != "t_ms"}
            data["t_ms"] = [r["time"] * 1000 for r in rows]  # Bokeh's datetime axis: ms since the epoch
            self.ts_src.stream(data, rollover=ts.samples.maxlen)

    def _update_errors(self) -> None:
        state = self.dash.plugin.state
        self.errors_seen, rows = self.model.errors(self.errors_seen)
        if rows:  # newest on top
            old = self.errors_src.data
            n = state.errors.maxlen or len(state.errors)
            self.errors_src.data = {c: ([r[c] for r in reversed(rows)] + list(old[c]))[:n] for c in ERROR_COLUMNS}
        text = (f"calls failed: <b>{state.calls_erred}</b> &nbsp; sessions completed with a failed call: "
                f"<b>{state.sessions_failed}</b> &nbsp; (newest first; the last {state.errors.maxlen} kept)")
        if self.errors_title.text != text:
            self.errors_title.text = text

    def _update_timeline(self, now: float) -> None:
        m = self.model
        sid = m.pick_session() if self.follow else self.session
        s = self.dash.plugin.state.sessions.get(sid) if sid else None
        if s is not None and self.timeline_version == (sid, s.version):
            # nothing new in the session: only the bars of its running calls grow (one patch)
            if self._growing:
                end = now * 1000
                self.timeline_src.patch({"end_ms": [(i, end) for i in self._growing]})
            return
        got = m.timeline(sid, now)
        if got is None:
            if self.timeline_version != (sid, -1):
                self.timeline_version = (sid, -1)
                self._growing = []
                self.timeline_src.data = {c: [] for c in TIMELINE_COLUMNS}
                self.timeline.y_range.factors = []
            return
        version, cols = got
        self.timeline_version = (sid, version)
        self._growing = [i for i, st in enumerate(cols["state"]) if st not in TERMINAL]
        lanes = sorted(set(cols["lane"]))
        if list(self.timeline.y_range.factors) != lanes:
            self.timeline.y_range.factors = lanes
        self.timeline_src.data = cols
        retries = sum(1 for x in cols["mark"] if x == "retry")
        self.timeline.title.text = (f"session {sid} timeline: {len(cols['key'])} calls on {len(lanes)} lanes, "
                                    f"{retries} {'retry' if retries == 1 else 'retries'} (hatched /), "
                                    f"{sum(1 for x in cols['mark'] if x == 'erred')} erred (hatched x)")

    def _update_choices(self, now: float) -> None:
        if now - self._choices_at < 5 * self.model.interval:
            return
        self._choices_at = now
        options = [("", "(longest-running live session)"), *self.model.session_choices()]
        if self.session and self.session not in dict(options):
            options.append((self.session, self.session))
        if options != [tuple(o) if not isinstance(o, str) else (o, o) for o in self.select.options]:
            self.select.options = options

    def _update_graph(self) -> None:
        m = self.model
        sid = m.pick_session() if self.follow else self.session
        got = m.graph(sid)
        if got is None:
            key = (sid, -1)
            if key != self._graph_version:
                self._graph_version = key
                self.nodes_src.data = {c: [] for c in self.nodes_src.data}
                self.edges_src.data = {c: [] for c in self.edges_src.data}
                # the id may come from the page's URL: escaped, it is text, never markup
                self.graph_title.text = f"session {html.escape(str(sid))}: unknown or expired" if sid else "no session yet"
            return
        version, layout = got
        if (sid, version) == self._graph_version:
            return
        self._graph_version = (sid, version)
        self.nodes_src.data = layout["nodes"]
        self.edges_src.data = layout["edges"]
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(layout["counts"].items()))
        shown = "" if layout["shown"] == layout["calls"] else f" (newest {layout['shown']} shown)"
        self.graph_title.text = (f"session <b>{html.escape(str(sid))}</b> ({layout['state']}): {layout['calls']} calls{shown}, "
                                 f"{layout['progress']} done; {counts}")
