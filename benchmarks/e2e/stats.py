"""Metrics of one run (a point: one variant, workflow, scenario, load and seed) and the paired
statistics over seeds. Every time here is EMULATED seconds (wall seconds / time scale).

Point metrics (:func:`point_metrics`), over the measured window (the requests in arrival order
without the first ``WARMUP_FRACTION`` of them: they found empty engines and cold caches):
mean, P50, P95, P99 latency (arrival to completion, the user's think time left out), the ideal
mean and P99 of the same requests, the overhead share (framework overhead on each request's
critical path over its latency, averaged), throughput from the completion slope and the
``sustained`` verdict (every request completed, throughput >= 0.9 x offered, latency of the
window's last third within 1.5x of its first third's relative to their ideal, P99 <= 3 x the
ideal P99). Engine counters (all requests of the point): token-weighted hit rate, prefill
tokens, recomputed tokens, and prefill against the floor (what an engine with unbounded KV
prefills: :mod:`benchmarks.e2e.ideal`'s perfect cache).

Paired statistics (:func:`spread`, :func:`paired`): per seed, then the median over seeds with
``min``/``max``/``n``/``per_seed`` beside it; never the best seed.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

from dask_agents.stats import percentile

WARMUP_FRACTION = 0.25
SUSTAIN_FRACTION = 0.9
LATENCY_GROWTH_MAX = 1.5
P99_BOUND_FACTOR = 3.0


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def window(records: list[dict]) -> list[dict]:
    """The measured window: requests in arrival order without the warm-up fraction."""
    rs = sorted(records, key=lambda r: r["arrival"])
    return rs[int(len(rs) * WARMUP_FRACTION):]


def completion_slope(done: list[dict]) -> float:
    """(finish - ideal) of the window's last third vs its first third, per second of arrivals:
    1 when completions keep up with arrivals, b > 1 when the system falls behind by b - 1
    seconds per second."""
    g = len(done) // 3
    if g < 1:
        return math.nan
    first, last = done[:g], done[-g:]
    d_a = _mean([r["arrival"] for r in last]) - _mean([r["arrival"] for r in first])
    d_d = (_mean([r["arrival"] + r["latency"] - r["ideal"] for r in last])
           - _mean([r["arrival"] + r["latency"] - r["ideal"] for r in first]))
    return d_d / d_a if d_a > 0 else math.nan


def point_metrics(records: list[dict], offered: float, counters: dict, floor_prefill: int) -> dict:
    """One point's metrics. ``records``: per request ``arrival`` (emulated s), ``latency`` (a
    failed request's censored where it was given up), ``ideal``, ``overhead_s`` (emulated), ``ok``,
    optionally ``overhead_parts`` (``overhead_s`` by part: ``benchmarks.e2e.program.Recorder.parts``
    and ``session``); ``counters``: the engines' counter deltas summed; ``floor_prefill``: the prefill tokens of a
    perfect cache for the same requests. Latency statistics cover every request of the window,
    failed ones included (censored), against the ideal of the same requests."""
    w = window(records)
    done = [r for r in w if r.get("ok")]
    lat = [r["latency"] for r in w]
    ideal = sorted(r["ideal"] for r in w)
    slope = completion_slope(done)
    # throughput: the offered load while completions keep up (slope <= 1), less when they fall behind
    thr = offered / max(slope, 1.0) if math.isfinite(slope) else math.nan
    g = len(done) // 3
    growth = math.nan
    if g >= 1:
        rel = [r["latency"] / r["ideal"] for r in done]
        growth = _mean(rel[-g:]) / _mean(rel[:g])
    p99, bound = percentile(lat, 99), P99_BOUND_FACTOR * percentile(ideal, 99)
    all_ok = all(r.get("ok") for r in records)
    sustained = bool(all_ok and thr >= SUSTAIN_FRACTION * offered
                     and 1 / LATENCY_GROWTH_MAX < growth < LATENCY_GROWTH_MAX and p99 <= bound)
    q, h = counters.get("queries", 0), counters.get("hits", 0)
    prefill = counters.get("prefill_tokens", 0)
    return {
        "requests": len(records), "completed": sum(bool(r.get("ok")) for r in records), "window": len(w),
        "censored": len(w) - len(done), "failed": [r.get("error") for r in records if not r.get("ok")][:3],
        "offered_rps": offered, "mean_s": _mean(lat), "p50_s": percentile(lat, 50), "p95_s": percentile(lat, 95),
        "p99_s": p99, "ideal_mean_s": _mean(ideal), "ideal_p99_s": percentile(ideal, 99),
        "overhead_share": _mean([r["overhead_s"] / r["latency"] for r in done if r["latency"] > 0]),
        # where the overhead is paid: mean emulated seconds per completed request, by part
        "overhead_parts_s": {k: sum(r.get("overhead_parts", {}).get(k, 0.0) for r in done) / len(done)
                             for k in sorted({k for r in done for k in r.get("overhead_parts", {})})},
        "throughput_rps": thr, "completion_slope": slope, "latency_growth": growth, "sustained": sustained,
        "p99_bound_s": bound, "hit_rate": h / q if q else math.nan, "prefill_tokens": prefill,
        "recomputed_tokens": counters.get("recomputed_tokens", 0), "preemptions": counters.get("preemptions", 0),
        "host_hits": counters.get("host_hits", 0), "evictions": counters.get("evictions", 0),
        "floor_prefill_tokens": floor_prefill, "queried_tokens": q,
        "prefill_vs_floor": prefill / floor_prefill if floor_prefill else math.nan,
        # wall seconds the engines' busy steps took per second they should have taken (1.0: on
        # pace; above: slowed by what shares their process or cores); lag dropped, per paced s
        "engine_pace": counters["busy_wall_s"] / counters["paced_s"] if counters.get("paced_s") else math.nan,
        "engine_dropped_lag": (counters.get("dropped_lag_s", 0) / counters["paced_s"]
                               if counters.get("paced_s") else math.nan),
        # mean lateness of a busy step's end (its tokens, finished requests) in wall ms
        "engine_late_ms": (1000 * counters.get("woke_late_s", 0) / counters["steps"]
                           if counters.get("steps") else math.nan),
        "latencies_s": sorted(round(x, 3) for x in lat),
    }


def counter_delta(before: list[dict], after: list[dict]) -> dict:
    """The engines' numeric counters, after - before, summed over engines."""
    out: dict[str, float] = {}
    for b, a in zip(before, after):
        for k, v in a.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(b.get(k), (int, float)):
                out[k] = out.get(k, 0) + v - b[k]
    return out


def finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def spread(per_seed: dict[str, Any]) -> dict:
    """The median over seeds with its spread (``min``, ``max``, ``n``, ``per_seed``)."""
    xs = [v for v in (finite(x) for x in per_seed.values()) if v is not None]
    return {"median": statistics.median(xs) if xs else None, "min": min(xs) if xs else None,
            "max": max(xs) if xs else None, "n": len(xs), "per_seed": dict(per_seed)}


def paired(a: dict[str, dict], b: dict[str, dict], f: Callable[[dict, dict], float | None]) -> dict:
    """``f(a[seed], b[seed])`` for every seed both have, as a :func:`spread`."""
    return spread({s: f(a[s], b[s]) for s in sorted(set(a) & set(b))})


def ratio(key: str) -> Callable[[dict, dict], float | None]:
    """other / ours on ``key`` (a speedup of ours when > 1)."""
    def f(ours: dict, other: dict) -> float | None:
        x, y = finite(ours.get(key)), finite(other.get(key))
        return y / x if x and y is not None else None
    return f


def gap_closed(key: str, ideal_key: str) -> Callable[[dict, dict], float | None]:
    """(best baseline - variant) / (best baseline - ideal) on ``key``: 1 reaches the ideal bound,
    0 ties the best baseline, < 0 is worse than it. None when the best baseline is at or below the
    ideal bound (nothing to close: a bound that is not a bound there, reported as None, not hidden:
    the spread's ``n`` counts the seeds that had a value)."""
    def f(variant: dict, best: dict) -> float | None:
        v, b, i = finite(variant.get(key)), finite(best.get(key)), finite(best.get(ideal_key))
        if v is None or b is None or i is None or b - i <= 0:
            return None
        return (b - v) / (b - i)
    return f
