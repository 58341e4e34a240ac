"""benchmarks/call_times.py: the same call in two runs is paired by role and prompt length, and
the difference of its engine time (received -> finished) is summarized per role."""

from __future__ import annotations

from benchmarks.call_times import hop_summary, paired


def _row(role: str, plen: int, started: float, ended: float, cached: int = 0) -> tuple:
    return (role, plen), {"role": role, "plen": plen, "started": started, "ended": ended, "cached": cached}


def test_calls_are_paired_by_role_and_prompt_and_their_engine_times_compared():
    base = dict([_row("analyst", 100, 0.0, 0.5), _row("analyst", 200, 1.0, 1.4), _row("summary", 300, 2.0, 3.0),
                 _row("analyst", 999, 0.0, 9.0)])  # a call only the base made: no pair
    other = dict([_row("analyst", 100, 5.0, 5.52, cached=16), _row("analyst", 200, 1.1, 1.51),
                  _row("summary", 300, 2.0, 2.99)])
    out = paired(base, other)
    assert out["analyst"]["calls"] == 2 and out["summary"]["calls"] == 1
    assert abs(out["analyst"]["diff_ms_mean"] - 15.0) < 1e-6  # +20 ms and +10 ms
    assert abs(out["summary"]["diff_ms_median"] + 10.0) < 1e-6
    assert out["analyst"]["cached_diff_mean"] == 8.0


def test_agent_hops_are_summarized_by_a_requests_first_second_and_later_waits():
    hops = [{"gather": 0, "in_ms": 9.0, "out_ms": 12.0}, {"gather": 0, "in_ms": 7.0, "out_ms": 2.0},
            {"gather": 1, "in_ms": 2.0, "out_ms": 3.0}, {"gather": 2, "in_ms": 1.0, "out_ms": 1.0},
            {"gather": 5, "in_ms": 3.0, "out_ms": 5.0}]
    out = hop_summary(hops)
    assert out["first"] == {"waits": 2, "in_ms_mean": 8.0, "out_ms_mean": 7.0}
    assert out["second"]["waits"] == 1 and out["later"] == {"waits": 2, "in_ms_mean": 2.0, "out_ms_mean": 3.0}
