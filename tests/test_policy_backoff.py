"""A policy that keeps raising backs off (scheduler_plugin/watchdog.py): it is skipped for 1, 2,
4... passes up to a cap, its traceback is logged once per streak, and its ``policy-error``
events stay rare enough not to push the real decisions out of the ``agents-control`` topic.

The passes are driven inline (``ControlLoop.tick``) on the watchdog tests' fake plugin: the
backoff counts passes, so nothing here depends on time.
"""

from __future__ import annotations

import logging
from typing import Any

from dask_agents.scheduler_plugin.actions import Route
from tests.test_watchdog import kinds, make_loop


class Flaky:
    """A policy that raises while ``broken``; records the passes it was called in."""

    def __init__(self) -> None:
        self.broken = True
        self.calls: list[int] = []
        self.pass_no = 0

    def __call__(self, view: Any) -> list:
        self.calls.append(self.pass_no)
        if self.broken:
            raise RuntimeError("policy bug")
        return []


def passes(ctl: Any, flaky: Flaky, n: int) -> None:
    for _ in range(n):
        flaky.pass_no += 1
        ctl.tick()


def test_a_raising_policy_backs_off_exponentially_up_to_a_cap_and_resets_on_success():
    flaky = Flaky()
    ctl = make_loop({"flaky": flaky})
    ctl.watchdog.POLICY_BACKOFF_MAX = 8
    passes(ctl, flaky, 60)
    # skipped for 1, 2, 4, then the cap of 8 passes between runs
    assert flaky.calls == [1, 3, 6, 11, 20, 29, 38, 47, 56]
    assert ctl.policy_errors == 9 and "policy bug" in ctl.errors["flaky"]
    assert ctl.stats()["failing_policies"] == {"flaky": {"failures": 9, "skip_passes": 4}}
    flaky.broken = False  # fixed: its next run (after the 4 passes still to skip) succeeds ...
    passes(ctl, flaky, 10)
    assert flaky.calls[9:] == [65, 66, 67, 68, 69, 70]  # ... and from then on it runs every pass
    assert kinds(ctl, "policy-recovered") == [kinds(ctl, "policy-recovered")[0]]
    assert kinds(ctl, "policy-recovered")[0]["failures"] == 9 and not ctl.stats()["failing_policies"]
    flaky.broken = True  # a new streak starts from the shortest backoff again
    passes(ctl, flaky, 4)
    assert flaky.calls[15:] == [71, 73]


def test_the_other_policies_run_every_pass_meanwhile():
    flaky, seen = Flaky(), []
    ctl = make_loop({"flaky": flaky, "fine": lambda view: seen.append(1) or []})
    passes(ctl, flaky, 20)
    assert len(seen) == 20 and flaky.calls == [1, 3, 6, 11, 20]
    out = ctl.tick()
    assert out["applied"] == {"fine": 0} and out["skipped"] == ["flaky"]  # skipped while backing off


def test_the_traceback_is_logged_once_then_a_summary_line_with_the_count(caplog):
    flaky = Flaky()
    ctl = make_loop({"flaky": flaky})
    ctl.watchdog.POLICY_BACKOFF_MAX = 1
    ctl.watchdog.ERROR_LOG_INTERVAL = float("inf")  # no summary yet
    with caplog.at_level(logging.INFO, logger="dask_agents.scheduler_plugin.watchdog"):
        passes(ctl, flaky, 20)
    assert len(flaky.calls) == 10
    records = [r for r in caplog.records if "flaky" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None  # one traceback for the streak
    assert "policy bug" in caplog.text
    caplog.clear()
    ctl.watchdog.ERROR_LOG_INTERVAL = 0.0  # a summary as often as it is allowed: one per failure here
    with caplog.at_level(logging.INFO, logger="dask_agents.scheduler_plugin.watchdog"):
        passes(ctl, flaky, 4)
    lines = [r for r in caplog.records if "flaky" in r.getMessage()]
    assert len(lines) == 2 and all(r.exc_info is None for r in lines)  # one line each, no traceback
    assert "11 times in a row (10 since the last report)" in lines[0].getMessage()
    assert "12 times in a row (1 since the last report)" in lines[1].getMessage()
    assert "RuntimeError: policy bug" in lines[1].getMessage()


def test_policy_error_events_do_not_push_decisions_out_of_the_topic():
    flaky = Flaky()
    ctl = make_loop({"flaky": flaky, "router": lambda view: [Route("tools", ())]})
    passes(ctl, flaky, 200)
    events = [e for topic, e in ctl.host.roster.scheduler.events if topic == "agents-control"]
    errors = [e for e in events if e["action"] == "policy-error"]
    # one event per run, so one per backoff period (runs at passes 1, 3, 6, 11, 20, 37, 70, 135,
    # 200: not 200 events), each carrying the streak so far and the next backoff
    assert flaky.calls == [1, 3, 6, 11, 20, 37, 70, 135, 200]
    assert [e["failures"] for e in errors] == list(range(1, 10))
    assert [e["skip_passes"] for e in errors[:7]] == [1, 2, 4, 8, 16, 32, 64]
    assert all(e["policy"] == "flaky" and "policy bug" in e["error"] for e in errors)
    assert sum(e["action"] == "route" for e in events) == 200  # the decisions are all there
