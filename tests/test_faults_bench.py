"""The fault benchmark (benchmarks/faults.py) at a small scale: 6 concurrent Open-SWE-shaped
sessions on 3 worker processes, one worker SIGKILLed mid-run. Every answer is checked against
the one computed locally: no session may get a wrong answer or hang. Never asserts on speed."""

from __future__ import annotations

import pytest

from benchmarks import faults
from tests import fault_components as fc

pytestmark = pytest.mark.timeout(240)


def test_expected_answers_are_deterministic_and_depend_on_every_step():
    a, b = fc.swe_expected("r1", 42), fc.swe_expected("r1", 42)
    assert a == b and fc.swe_expected("r2", 42) != a
    # the stateful trajectory: a repeated step is counted, a conflicting one raises, and a fresh
    # instance (missing the earlier steps) has another digest
    t, fresh = fc.Trajectory(), fc.Trajectory()
    t.record("plan", "p")
    t.record("dev0.a0", "x")
    assert t.record("dev0.a0", "x") == 2 and t.summary()["repeats"] == 1
    with pytest.raises(ValueError, match="recorded twice"):
        t.record("dev0.a0", "y")
    fresh.record("dev0.a0", "x")
    assert fresh.summary()["digest"] != t.summary()["digest"]
    reqs = faults.make_requests(faults.Config(sessions=6))
    assert [r.expected for r in reqs] == [r.expected for r in faults.make_requests(faults.Config(sessions=6))]
    assert any(r.expected["retries"] > 0 for r in faults.make_requests(faults.Config(sessions=30)))


def test_is_clear_needs_a_da_error_or_a_lost_connection_naming_the_call():
    from distributed.client import FutureCancelledError

    import dask_agents as da

    key = "SWETester-" + "0" * 32
    assert faults.is_clear(da.InstanceLostError("Trajectory.record (session s-1): lost"), "s-1")
    assert not faults.is_clear(da.InstanceLostError("lost"), "s-1")  # names neither session nor call
    assert faults.is_clear(FutureCancelledError(key, "scheduler-connection-lost",
                                                "Client lost the connection to the scheduler."), "s-1")
    assert not faults.is_clear(FutureCancelledError(key, "lost dependencies"), "s-1")
    assert not faults.is_clear(RuntimeError(f"s-1 {key}"), "s-1")


def test_a_worker_killed_mid_run_gives_no_wrong_answer_and_no_hang():
    cfg = faults.Config(sessions=6, workers=3, threads=4, spread=2.0, time_scale=3.0, kill_at=1.5,
                        retire_at=None, disconnect_at=None, timeout=60.0)
    doc = faults.run(cfg, log=lambda *a: None)
    s = doc["summary"]
    assert s["sessions"] == 6
    assert s["wrong_results"] == 0 and s["hung"] == 0 and s["failed_unclear"] == 0, doc["requests"]
    assert s["completed_correct"] + s["failed_with_clear_error"] == 6
    (kill,) = [e for e in doc["events"] if e["event"] == "kill"]
    assert kill["instances_on_worker"] >= 1  # it held session instances when it died
    assert kill["removed_t"] is not None and kill["worker"] not in doc["plugin"]["workers"]
    assert doc["plugin"]["recovery"]["workers_lost"] >= 1
    # every failed first attempt was retried in a new session, and retries that succeeded are correct
    for r in doc["requests"]:
        if r["attempts"][0]["outcome"] != "correct":
            assert len(r["attempts"]) == 2 and r["attempts"][1]["session"] != r["attempts"][0]["session"]


def test_a_scheduler_restarted_under_load_gives_no_wrong_answer_and_no_hang():
    """``dask scheduler`` SIGKILLed and started again on its port mid-run: in-flight calls fail
    with ``da.CallLostError``, sessions begun before fail their stateful calls; every request
    retried in a new session completes correctly (the restarted cluster serves it)."""
    cfg = faults.Config(sessions=6, workers=2, threads=4, spread=2.0, time_scale=3.0, kill_at=None,
                        retire_at=None, disconnect_at=None, restart_at=1.5, timeout=90.0, scenario="restart")
    doc = faults.run(cfg, log=lambda *a: None)
    s = doc["summary"]
    assert s["wrong_results"] == 0 and s["hung"] == 0 and s["failed_unclear"] == 0, doc["requests"]
    assert s["completed_correct"] == 6, doc["requests"]
    (restart,) = [e for e in doc["events"] if e["event"] == "restart"]
    assert restart["scheduler_after"] != restart["scheduler_before"] and restart["open_sessions"] >= 1
    first = [r["attempts"][0] for r in doc["requests"]]
    assert any(a["outcome"] == "clear_error" for a in first)  # the restart hit sessions in flight
    for a in first:
        if a["outcome"] != "correct":
            assert a["error_type"] in ("CallLostError", "InstanceLostError", "CallFailedError"), a
            assert restart["scheduler_before"] in a["error"] or "restarted" in a["error"], a


# Each fault of issue 27 alone on real worker processes (faults.py --scenarios, scaled down):
# no wrong answer, no hang, no unclear failure, and none at all where nothing needs to fail.
_SMALL = {"sessions": 6, "workers": 3, "threads": 4, "spread": 2.0, "time_scale": 3.0, "timeout": 60.0}
_AT = {"retire": {"retire_at": 1.5}, "blip": {"disconnect_at": 1.5}, "graph-fault": {"plugin_fault_at": 1.5},
       "transition-fault": {"plugin_fault_at": 1.5}, "lifetime": {"lifetime": 4.0, "lifetime_stagger": 1.0},
       "adapt": {"sessions": 4, "spread": 1.0}}


@pytest.mark.parametrize("scenario", list(_AT))
def test_each_fault_alone_on_worker_processes(scenario):
    cfg = faults.Config(**_SMALL, scenario=scenario)
    for k, v in {**faults.SCENARIOS[scenario], **_AT[scenario]}.items():
        setattr(cfg, k, v)
    doc = faults.run(cfg, log=lambda *a: None)
    s = doc["summary"]
    assert s["wrong_results"] == 0 and s["hung"] == 0 and s["failed_unclear"] == 0, doc["requests"]
    assert s["completed_correct"] + s["failed_with_clear_error"] == s["sessions"]
    if scenario in faults.NO_FAILURES:  # a graceful scale-down and a blip fail no session
        assert s["failed"] == 0, doc["requests"]
    assert not any(e["event"] == "fault-injection-failed" for e in doc["events"]), doc["events"]
