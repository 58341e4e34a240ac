"""Plots from telemetry: ``dask-agents report TELEMETRY.parquet -o report/``.

Writes PNGs (matplotlib, Agg):

- ``latency_cdf.png``: CDF of session latency (first call created -> last call finished),
  one curve per workflow;
- ``component_times.png``: per component, mean queueing time (runnable -> started) beside
  mean service time (started -> finished), with P95 markers;
- ``kv_residency.png``: KV bytes resident over time per tier (summed over engines), from the
  engines' samples (``da.telemetry(client, table="kv")``), when there are any.

The plotting functions take plain data so benchmarks draw with the same code:
``plot_latency_cdf({"dask": [...], "dask-agents": [...]}, "out.png")``.

A workflow is the ``workflow`` column when the telemetry has one, else the session's tenant,
else the component of the session's first call (the entry agent). Numbers from emulated
engines or tools are labelled EMULATED in the titles.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import click

from dask_agents.client_api import posix_seconds
from dask_agents.stats import percentiles


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is in the bench/test extras
        raise RuntimeError("dask-agents report needs matplotlib (pip install 'dask-agents[bench]')") from e
    return plt


# -- telemetry files ------------------------------------------------------------------------------

def _read(path: str) -> Any:
    """A telemetry table from parquet or csv, its timestamps as POSIX seconds."""
    import pandas as pd

    if path.endswith(".csv"):
        return posix_seconds(pd.read_csv(path))
    try:
        return posix_seconds(pd.read_parquet(path))
    except ImportError as e:
        raise RuntimeError(f"reading {path} needs pyarrow (pip install pyarrow), or give a .csv") from e


def kv_path(path: str) -> str:
    """Where :func:`save_telemetry` puts the KV samples beside a calls file."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.kv{ext}"


REQUIRED = ("session", "component", "created", "started", "finished")
"""Columns of ``da.telemetry(client)`` the plots read."""


def load_telemetry(path: str, kv: str | None = None) -> tuple[Any, Any]:
    """(calls, kv samples or None) from a parquet (or csv) file and its ``.kv`` sibling;
    ValueError naming the missing columns when ``path`` is not a ``da.telemetry`` calls table."""
    calls = _read(path)
    missing = [c for c in REQUIRED if c not in calls.columns]
    if missing:
        raise ValueError(f"{path} is not a da.telemetry calls table: it has no {', '.join(missing)} column"
                         f"{'s' if len(missing) > 1 else ''} (write one with "
                         "dask_agents.report.save_telemetry(client, path))")
    kv = kv or kv_path(path)
    return calls, (_read(kv) if os.path.exists(kv) else None)


def save_telemetry(client: Any, path: str) -> list[str]:
    """Write ``da.telemetry(client)`` to ``path`` (parquet, or csv by extension) and the KV
    samples beside it (``<stem>.kv.<ext>``, when there are any); returns the paths written."""
    from dask_agents.client_api import telemetry

    written = []
    for df, p in ((telemetry(client), path), (telemetry(client, table="kv"), kv_path(path))):
        if p != path and df.empty:
            continue
        if p.endswith(".csv"):
            df.to_csv(p, index=False)
        else:
            df.to_parquet(p, index=False)
        written.append(p)
    return written


# -- derived tables --------------------------------------------------------------------------------

def session_latencies(calls: Any) -> Any:
    """One row per session: workflow, created, finished, latency_s (sessions with calls that
    all finished; others are still running or failed and have no latency)."""
    import pandas as pd

    df = posix_seconds(calls[calls["session"].notna()])
    if df.empty:
        return pd.DataFrame(columns=["session", "workflow", "created", "finished", "latency_s"])
    df = df.sort_values("created")
    g = df.groupby("session", sort=False)
    out = pd.DataFrame({
        "created": g["created"].min(), "finished": g["finished"].max(),
        "complete": g["finished"].apply(lambda s: bool(s.notna().all())),
        "entry": g["component"].first(),
    })
    if "workflow" in df.columns:
        out["workflow"] = g["workflow"].first()
    elif "tenant" in df.columns and df["tenant"].notna().any():
        out["workflow"] = g["tenant"].first().fillna(out["entry"])
    else:
        out["workflow"] = out["entry"]
    out = out[out["complete"]]
    out["latency_s"] = out["finished"] - out["created"]
    return out.reset_index()[["session", "workflow", "created", "finished", "latency_s"]]


def component_times(calls: Any) -> Any:
    """Per component: calls, mean/P95 queueing and service seconds (calls with worker times)."""
    import pandas as pd

    df = posix_seconds(calls)
    num = (lambda c: pd.to_numeric(df[c], errors="coerce") if c in df.columns else pd.Series(float("nan"), df.index))
    df["queue_s"] = num("queue_s").fillna(num("started") - num("ready"))
    df["service_s"] = num("service_s").fillna(num("finished") - num("started"))
    df = df[df["service_s"].notna()]
    if df.empty:
        return pd.DataFrame(columns=["component", "calls", "queue_mean", "queue_p95", "service_mean", "service_p95"])
    g = df.groupby("component")
    out = pd.DataFrame({
        "calls": g.size(), "queue_mean": g["queue_s"].mean(), "queue_p95": g["queue_s"].quantile(0.95),
        "service_mean": g["service_s"].mean(), "service_p95": g["service_s"].quantile(0.95),
    }).reset_index()
    return out.sort_values("service_mean", ascending=False)


def _emulated(df: Any) -> bool:
    return df is not None and "emulated" in df.columns and bool(df["emulated"].fillna(False).astype(bool).any())


# -- plots (shared with benchmarks) ----------------------------------------------------------------

def plot_latency_cdf(latencies: Mapping[str, Sequence[float]], path: str, title: str = "session latency CDF",
                     xlabel: str = "latency (s)") -> str:
    """CDF curves, one per name (e.g. workflow or benchmark variant), with P50/P95/P99 in the legend."""
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, xs in latencies.items():
        x = np.sort(np.asarray([v for v in xs if v == v], dtype=float))
        if not len(x):
            continue
        y = np.arange(1, len(x) + 1) / len(x)
        p50, p95, p99 = percentiles(x, [50, 95, 99])
        ax.step(x, y, where="post", label=f"{name} (n={len(x)}, P50 {p50:.2f}, P95 {p95:.2f}, P99 {p99:.2f})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of sessions")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    if ax.lines:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_component_times(table: Any, path: str, title: str = "queueing vs service time per component") -> str:
    """Grouped bars per component: mean queueing and mean service seconds, P95 as markers
    (``table`` from :func:`component_times`)."""
    import numpy as np

    plt = _plt()
    n = len(table)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * n + 2), 5))
    x = np.arange(n)
    w = 0.38
    ax.bar(x - w / 2, table["queue_mean"], w, label="queueing (mean)", color="#fb8c00")
    ax.bar(x + w / 2, table["service_mean"], w, label="service (mean)", color="#1e88e5")
    ax.scatter(x - w / 2, table["queue_p95"], marker="_", s=200, color="#8d4e00", label="queueing P95", zorder=3)
    ax.scatter(x + w / 2, table["service_p95"], marker="_", s=200, color="#0d47a1", label="service P95", zorder=3)
    ax.set_xticks(x, [f"{c}\n({k} calls)" for c, k in zip(table["component"], table["calls"])], fontsize=8)
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_kv_residency(kv: Any, path: str, title: str = "KV residency over time") -> str:
    """KV bytes per tier over time, summed over engines (each engine's last sample holds
    until its next one); ``kv``: time, worker, model, tier, bytes (``table="kv"``)."""
    import numpy as np

    kv = posix_seconds(kv)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5))
    t0 = float(kv["time"].min())
    times = np.sort(kv["time"].unique())
    for tier, df in kv.groupby("tier", sort=False):
        total = np.zeros(len(times))
        for _, series in df.groupby(["worker", "model"]):
            series = series.sort_values("time")
            idx = np.searchsorted(series["time"].to_numpy(), times, side="right") - 1
            vals = np.where(idx >= 0, series["bytes"].to_numpy()[np.clip(idx, 0, None)], 0)
            total += vals
        ax.step(times - t0, total / 2**20, where="post", label=f"{tier}")
    if "capacity_bytes" in kv.columns and kv["capacity_bytes"].notna().any():
        cap = kv.dropna(subset=["capacity_bytes"]).groupby(["worker", "model", "tier"])["capacity_bytes"].last()
        for tier, c in cap.groupby(level="tier").sum().items():
            ax.axhline(c / 2**20, linestyle=":", color="grey", linewidth=1)
            ax.annotate(f"{tier} capacity", (0, c / 2**20), fontsize=7, color="grey", va="bottom")
    ax.set_xlabel("seconds since first sample")
    ax.set_ylabel("MiB resident")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(calls: Any, kv: Any, out: str) -> list[str]:
    """Every plot the data allows into directory ``out``; returns the files written."""
    os.makedirs(out, exist_ok=True)
    tag = " (EMULATED)" if _emulated(calls) else ""
    files = []
    lat = session_latencies(calls)
    if not lat.empty:
        groups = {w: list(df["latency_s"]) for w, df in lat.groupby("workflow")}
        files.append(plot_latency_cdf(groups, os.path.join(out, "latency_cdf.png"),
                                      f"session latency CDF per workflow{tag}"))
    times = component_times(calls)
    if not times.empty:
        files.append(plot_component_times(times, os.path.join(out, "component_times.png"),
                                          f"queueing vs service time per component{tag}"))
    if kv is not None and not kv.empty:
        files.append(plot_kv_residency(kv, os.path.join(out, "kv_residency.png"), f"KV residency over time{tag}"))
    return files


@click.command("report")
@click.argument("telemetry", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", "out", default="report", show_default=True, type=click.Path(file_okay=False),
              help="Directory to write the PNGs into (created if missing).")
@click.option("--kv", "kv", default=None, type=click.Path(exists=True, dir_okay=False),
              help="KV samples file (default: TELEMETRY's .kv sibling, if present).")
def report_command(telemetry: str, out: str, kv: str | None) -> None:
    """Write PNG plots from a telemetry file (parquet or csv of ``da.telemetry(client)``;
    ``dask_agents.report.save_telemetry(client, path)`` writes one)."""
    try:
        calls, kv_df = load_telemetry(telemetry, kv)
        files = write_report(calls, kv_df, out)
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        raise click.ClickException(str(e)) from e
    if not files:
        raise click.ClickException(f"{telemetry}: no finished calls to plot")
    for f in files:
        click.echo(f"wrote {f}")
    if kv_df is None or kv_df.empty:
        click.echo("no KV samples: kv_residency.png skipped (engines that report KV bytes write them; "
                   "see da.telemetry(client, table='kv'))")
