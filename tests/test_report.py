"""``dask-agents report``: plots from telemetry files; the plotting code benchmarks share."""

from __future__ import annotations

import math
import os

import pandas as pd
import pytest
from click.testing import CliRunner

pytest.importorskip("matplotlib")

from dask_agents import report  # noqa: E402
from dask_agents.client_api import COLUMNS, KV_COLUMNS  # noqa: E402


def fake_calls() -> pd.DataFrame:
    """Two workflows (entry components Planner and Router), a retry, one session still running."""
    rows = []
    t = 1000.0
    for i in range(6):
        sid = f"s{i}"
        entry = "Planner" if i < 4 else "Router"
        for j, comp in enumerate([entry, "Developer", "llm.coder"]):
            created = t + i + j * 0.1
            ready = created + 0.01
            started = ready + 0.05 * (j + 1)
            finished = started + 0.2 * (j + 1) + 0.1 * i
            rows.append({"key": f"{comp}-{i}-{j}", "session": sid, "component": comp, "kind": "agent",
                         "state": "finished", "created": created, "ready": ready, "started": started,
                         "finished": finished, "emulated": comp.startswith("llm"), "retry": False})
    rows.append({"key": "Developer-run", "session": "s9", "component": "Developer", "state": "processing",
                 "created": t, "ready": t, "started": None, "finished": None})
    df = pd.DataFrame(rows)
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = None
    return df[COLUMNS]


def fake_kv() -> pd.DataFrame:
    rows = []
    for k in range(10):
        for w in ("w1", "w2"):
            rows.append({"time": 1000.0 + k, "worker": w, "model": "coder", "tier": "device",
                         "bytes": (k + 1) * 2**20, "capacity_bytes": 64 * 2**20})
    return pd.DataFrame(rows, columns=KV_COLUMNS)


def test_session_latencies_and_workflows():
    lat = report.session_latencies(fake_calls())
    assert set(lat["session"]) == {f"s{i}" for i in range(6)}  # s9 has not finished: no latency
    assert set(lat["workflow"]) == {"Planner", "Router"}
    s0 = lat.set_index("session").loc["s0"]
    calls = fake_calls()
    own = calls[calls["session"] == "s0"]
    assert s0["latency_s"] == pytest.approx(own["finished"].max() - own["created"].min())


def test_component_times_split_queueing_and_service():
    t = report.component_times(fake_calls()).set_index("component")
    assert t.loc["Developer", "calls"] == 6
    assert t.loc["llm.coder", "queue_mean"] == pytest.approx(0.15)
    assert t.loc["Planner", "service_mean"] == pytest.approx(0.2 + 0.1 * 1.5)


def test_report_command_writes_the_plots(tmp_path):
    calls_path = str(tmp_path / "telemetry.parquet")
    fake_calls().to_parquet(calls_path, index=False)
    fake_kv().to_parquet(report.kv_path(calls_path), index=False)
    out = tmp_path / "report"
    result = CliRunner().invoke(report.report_command, [calls_path, "-o", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("latency_cdf.png", "component_times.png", "kv_residency.png"):
        p = out / name
        assert p.exists() and p.stat().st_size > 5000, name
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in result.output


def test_report_without_kv_samples_says_so(tmp_path):
    path = str(tmp_path / "t.csv")
    fake_calls().to_csv(path, index=False)
    result = CliRunner().invoke(report.report_command, [path, "-o", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path / "r")) == ["component_times.png", "latency_cdf.png"]
    assert "no KV samples" in result.output


def test_report_with_nothing_finished_fails_clearly(tmp_path):
    path = str(tmp_path / "t.csv")
    fake_calls().iloc[-1:].to_csv(path, index=False)
    result = CliRunner().invoke(report.report_command, [path, "-o", str(tmp_path / "r")])
    assert result.exit_code != 0 and "no finished calls" in result.output


def test_benchmarks_can_plot_their_own_latencies(tmp_path):
    out = report.plot_latency_cdf({"dask": [1.0, 2.0, 3.0], "dask-agents": [0.5, 1.0, 1.5]},
                                  str(tmp_path / "cdf.png"), title="bench")
    assert os.path.getsize(out) > 5000


def test_report_on_a_file_that_is_not_telemetry_names_the_missing_columns(tmp_path):
    path = str(tmp_path / "other.csv")
    pd.DataFrame({"time": [1.0, 2.0], "value": [3, 4]}).to_csv(path, index=False)
    result = CliRunner().invoke(report.report_command, [path, "-o", str(tmp_path / "r")])
    assert result.exit_code != 0
    assert ("is not a da.telemetry calls table: it has no session, component, created, started, finished "
            "columns") in result.output
    assert "Error: 'session'" not in result.output


def test_telemetry_times_are_datetimes_and_files_read_back_as_seconds(tmp_path):
    """``da.telemetry`` gives datetimes; its CSV/parquet files (ISO strings there) and older
    files in POSIX seconds all read back as the same seconds for report and whatif."""
    import pandas as pd

    from dask_agents.client_api import posix_seconds
    from dask_agents.report import _read

    secs = pd.DataFrame({"created": [1_700_000_000.25, 1_700_000_001.5], "started": [1_700_000_000.5, None],
                         "kind": ["tool", "llm"]})
    dt = secs.copy()
    for c in ("created", "started"):
        dt[c] = pd.to_datetime(dt[c], unit="s", utc=True)
    assert str(dt["started"].dtype) == "datetime64[ns, UTC]" and dt["started"].isna().iloc[1]
    for frame in (dt, secs):
        for ext in (".csv", ".parquet"):
            path = str(tmp_path / f"t{ext}")
            frame.to_csv(path, index=False) if ext == ".csv" else frame.to_parquet(path, index=False)
            back = _read(path)
            assert back["created"].tolist() == pytest.approx(secs["created"].tolist())
            assert back["started"].iloc[0] == pytest.approx(1_700_000_000.5) and math.isnan(back["started"].iloc[1])
    assert posix_seconds(dt)["created"].tolist() == pytest.approx(secs["created"].tolist())
    assert posix_seconds(dt)["kind"].tolist() == ["tool", "llm"]  # other columns untouched
