"""Running the benchmark: points, the choose phase (sweeps), the measure phase (fresh runs,
variants interleaved within each seed), jobs and merge.

- A **point** runs one freshly started variant on one request set with open-loop arrivals and
  returns :func:`benchmarks.e2e.stats.point_metrics` (emulated seconds).
- The **choose phase** only picks configurations, on sweep seeds (``SWEEP_SEED`` + i) whose
  requests no measurement uses: plain Dask's best static configuration at the probe load; the
  capacity (the highest load of a ladder the best static configuration sustains); per scenario
  at the capacity the cap, the TTL and the peers' routing. Its runs are kept under ``sweeps``
  and never reported as measurements; they are given up ``sweep_deadline_s`` after their last
  arrival (a configuration that needs longer has lost already: it scores as not sustained).
- The **measure phase** is a list of units (scenario, load factor, seed); a unit runs every
  variant on the same requests and arrivals, in an order rotated from unit to unit, each on a
  fresh instance. ``--job K/N`` runs every N-th unit from the K-th; ``merge`` joins the jobs'
  files (they must share one plan) and summarizes.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from typing import Any, Callable

from benchmarks.e2e import stats
from benchmarks.e2e.ideal import ideal, run_shared
from benchmarks.e2e.program import Setup

SWEEP_SEED = 1000
LADDER_STEP, LADDER_EXTRA = 1.25, 6
"""A capacity ladder whose top load is sustained grows by this factor, at most this many times:
the capacity is the highest load sustained below one that is not (the finance ladder's top, 0.8/s,
was sustained once the emulator cached blocks as vLLM does, and said nothing beyond it)."""
BASELINES = ("dask", "dask-capped", "dask-ttl", "ray", "langgraph")
PEERS = ("ray", "langgraph")


# -- arrivals ---------------------------------------------------------------------------------------

def poisson(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (emulated s) at ``rate``/s: the same unit-rate gaps at every rate."""
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0) / rate
    return out


def mmpp(n: int, rate: float, seed: int, hold_s: tuple = (60.0, 120.0), factors: tuple = (2.0, 0.5)) -> list[float]:
    """Bursty arrivals: a two-state Markov-modulated Poisson process, ``factors`` x ``rate`` held
    for exponential times of mean ``hold_s`` (emulated s); 2x for 1/3 of the time and 0.5x for
    2/3 averages to ``rate``. The first state is drawn from the stationary distribution."""
    rng = random.Random(f"mmpp-{seed}")
    state = 0 if rng.random() < hold_s[0] / sum(hold_s) else 1
    t, end, out = 0.0, rng.expovariate(1 / hold_s[state]), []
    while len(out) < n:
        gap = rng.expovariate(rate * factors[state])
        if t + gap > end:  # memoryless: restart the gap in the next state
            t, state = end, 1 - state
            end = t + rng.expovariate(1 / hold_s[state])
            continue
        t += gap
        out.append(t)
    return [x - out[0] for x in out]


def arrivals(wf: Any, scenario: str, n: int, rate: float, seed: int) -> list[float]:
    own = getattr(wf, "arrivals", None)
    if callable(own):
        return own(scenario, n, rate, seed)
    return mmpp(n, rate, seed, getattr(wf, "mmpp_hold_s", (60.0, 120.0))) if scenario == "bursty" \
        else poisson(n, rate, seed)


# -- one point ---------------------------------------------------------------------------------------

def drive(variant: Any, wf: Any, specs: list, offsets: list[float], time_scale: float, deadline_s: float) -> list[dict]:
    """Start each request at its arrival (emulated offsets x ``time_scale``) in its own thread and
    wait for all or the deadline (wall seconds after the last arrival). Returns a snapshot of
    the records taken then (wall times): a request still running is recorded as timed out, and
    nothing it does later changes the result. Time spent entering and leaving the request's
    session (opening it with the scheduler, a capped baseline's wait for a slot) is framework
    overhead on the critical path, added to the request's ``overhead_wall``."""
    records: list[dict] = [{} for _ in specs]
    lock = threading.Lock()
    done = threading.Semaphore(0)
    closed = [False]

    def one(i: int, t_arrival: float) -> None:
        spec, rec = specs[i], {"id": specs[i].id, "arrival_wall": t_arrival}
        try:
            t0 = time.time()
            with variant.session(spec.id, models_of(wf, spec)) as rt:
                t1 = time.time()
                value = wf.program(rt, spec)
                t2 = time.time()
            wf.check(spec, value)
            t3 = time.time()
            rec.update(ok=True, finish_wall=t3, overhead_wall=rt.rec.overhead_s + (t1 - t0) + (t3 - t2),
                       overhead_parts_wall={**rt.rec.parts, "session": (t1 - t0) + (t3 - t2)})
        except BaseException as e:  # noqa: BLE001  (any failure is the request's, recorded)
            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:300], finish_wall=time.time())
        finally:
            with lock:
                if not closed[0]:
                    records[i] = rec
            done.release()

    t0 = time.time() + 0.2
    for i, off in enumerate(offsets):
        at = t0 + off * time_scale
        delay = at - time.time()
        if delay > 0:
            time.sleep(delay)
        records[i] = {"id": specs[i].id, "arrival_wall": at}
        threading.Thread(target=one, args=(i, at), daemon=True, name=f"e2e-request-{i}").start()
    end = t0 + offsets[-1] * time_scale + deadline_s
    for _ in specs:
        if not done.acquire(timeout=max(0.0, end - time.time())):
            break
    with lock:
        closed[0] = True
        now = time.time()
        out = [dict(r) for r in records]
    for rec in out:
        if "finish_wall" not in rec:
            rec.update(ok=False, error="timeout: not finished by the point's deadline", finish_wall=now)
    return out


def models_of(wf: Any, spec: Any) -> tuple | None:
    """The models a request calls (None: every model of the run)."""
    f = getattr(wf, "models_of", None)
    return tuple(f(spec)) if callable(f) else None


def run_point(make: Callable[[], Any], wf: Any, specs: list, offsets: list[float], rate: float, setup: Setup,
              ideal_of: dict, deadline_s: float) -> dict:
    """One point on a freshly started variant (see the module docstring). A request that failed
    or timed out counts with its latency censored at the moment it was given up (a lower bound
    of what it would have taken), so losing slow requests never lowers a variant's latency; the
    point is then not sustained."""
    t_start = time.time()
    with make() as v:
        ready = time.time()
        before = v.engine_stats()
        recs = drive(v, wf, specs, offsets, setup.time_scale, deadline_s)
        after = v.engine_stats()
        described = v.describe()
    scale = setup.time_scale
    rows = []
    for spec, off, r in zip(specs, offsets, recs):
        lat, prefill = ideal_of[spec.id]
        row = {"id": spec.id, "arrival": off, "ideal": lat, "ok": bool(r.get("ok")), "error": r.get("error"),
               "latency": (r["finish_wall"] - r["arrival_wall"]) / scale - wf.think_s(spec)}
        row["overhead_s"] = r["overhead_wall"] / scale if r.get("ok") else math.nan
        row["overhead_parts"] = {k: v / scale for k, v in r.get("overhead_parts_wall", {}).items()}
        rows.append(row)
    floor = sum(ideal_of[s.id][1] for s in specs)
    m = stats.point_metrics(rows, rate, stats.counter_delta(before, after), floor)
    m.update(start_s=ready - t_start, wall_s=time.time() - ready, variant=described)
    # per engine (replica order): seconds its busy steps should have taken and decode tokens,
    # so that an uneven spread of the work over the engines shows
    m["engine_paced_s"] = [round(a.get("paced_s", 0) - b.get("paced_s", 0), 3) for b, a in zip(before, after)]
    m["engine_decode_tokens"] = [a.get("decode_tokens", 0) - b.get("decode_tokens", 0) for b, a in zip(before, after)]
    return m


def ideals(wf: Any, specs: list, setup: Setup) -> dict:
    """Request id -> (ideal latency, floor prefill tokens) for a request set."""
    shared = run_shared(wf, specs)
    return {s.id: ideal(wf, s, setup.engine, shared) for s in specs}


def score(m: dict) -> tuple:
    """A configuration's score in a sweep: requests lost, then not sustained, then mean latency."""
    mean = m["mean_s"] if isinstance(m.get("mean_s"), float) and math.isfinite(m["mean_s"]) else math.inf
    return (m["requests"] - m["completed"], not m["sustained"], mean)


# -- plans ---------------------------------------------------------------------------------------------

def units(scenarios: list[str], factors: list[float], seeds: list[int]) -> list[tuple]:
    """The measure phase's units in a fixed order (seed-major, so a partial run has whole seeds)."""
    return [(sc, f, s) for s in seeds for sc in scenarios for f in factors]


def job_slice(all_units: list, job: tuple[int, int] | None) -> list:
    """Job ``K/N``: every N-th unit from the K-th (1-based)."""
    if job is None:
        return all_units
    k, n = job
    if not 1 <= k <= n:
        raise ValueError(f"--job K/N needs 1 <= K <= N, got {k}/{n}")
    return all_units[k - 1::n]


def rotated(variants: list[str], unit_index: int) -> list[str]:
    """Variants in the order one unit runs them: rotated by one per unit, so no variant always
    runs first or last (drift on a shared machine spreads over all)."""
    i = unit_index % len(variants)
    return variants[i:] + variants[:i]


def measure(wf: Any, setup: Setup, plan: dict, factory: Callable[[str, str], Callable], job: tuple | None,
            log: Callable[[str], None]) -> list[dict]:
    """Run this job's units; returns their results (one dict per unit and variant)."""
    out = []
    all_units = units(plan["scenarios"], plan["factors"], plan["seeds"])
    for sc, f, seed in job_slice(all_units, job):
        idx = all_units.index((sc, f, seed))
        rate = plan["capacity_rps"] * f
        specs = wf.make_specs(plan["requests"], seed, sc)
        offs = arrivals(wf, sc, len(specs), rate, seed)
        ideal_of = ideals(wf, specs, setup)
        for name in rotated(list(plan["variants"]), idx):
            m = run_point(factory(name, sc), wf, specs, offs, rate, setup, ideal_of, plan["deadline_s"])
            log(f"  {wf.name} {sc} x{f:g} seed {seed} {name:28s} mean {m['mean_s']:8.1f} s  P99 {m['p99_s']:8.1f} s  "
                f"hit {m['hit_rate']:.2f}  sustained {m['sustained']}  ({m.get('wall_s', 0):.0f} s)")
            out.append({"workflow": wf.name, "scenario": sc, "factor": f, "seed": seed, "variant": name,
                        "rate_rps": rate, "metrics": m})
    return out


def choose(wf: Any, setup: Setup, preset: dict, factory_for: Callable[[dict], Callable[[str, str], Callable]],
           log: Callable[[str], None]) -> dict:
    """The choose phase (module docstring): returns the chosen configurations and every sweep run."""
    sweeps: dict[str, Any] = {"static": [], "capacity": [], "scenarios": {}}
    seed = SWEEP_SEED
    n = preset["requests"]

    def point(make: Callable, sc: str, rate: float, s: int = seed) -> dict:
        specs = wf.make_specs(n, s, sc)
        offs = arrivals(wf, sc, n, rate, s)
        return run_point(make, wf, specs, offs, rate, setup, ideals(wf, specs, setup),
                         preset.get("sweep_deadline_s", preset["deadline_s"]))

    chosen: dict[str, Any] = {}
    factory = factory_for(chosen)
    base = wf.scenarios[0]  # stationary where the workflow has it (router: its skew)
    best = None
    for cfg in preset["static_sweep"]:
        m = point(factory("dask", base, cfg), base, preset["probe_rps"])
        sweeps["static"].append({"config": cfg, "metrics": m})
        log(f"  sweep static {cfg}: mean {m['mean_s']:.1f} s sustained {m['sustained']}")
        if best is None or score(m) < score(best[1]):
            best = (cfg, m)
    chosen["static"] = best[0]
    capacity, ladder, top_sustained = None, list(preset["capacity_ladder"]), False
    for rate in ladder:  # (grows while its top is sustained: a capacity is a load it does not sustain above)
        m = point(factory("dask", base), base, rate)
        sweeps["capacity"].append({"rate_rps": rate, "metrics": m})
        log(f"  capacity ladder {rate:g}/s: sustained {m['sustained']} mean {m['mean_s']:.1f} s")
        if not m["sustained"]:
            break
        capacity = rate
        if rate == ladder[-1]:
            if len(ladder) < len(preset["capacity_ladder"]) + LADDER_EXTRA:
                ladder.append(round(rate * LADDER_STEP, 6))
            else:
                top_sustained = True
    chosen["capacity_rps"] = capacity if capacity is not None else preset["capacity_ladder"][0] / 2
    chosen["capacity_note"] = (
        "no ladder load sustained: half the lowest" if capacity is None else
        f"every ladder load sustained ({base}), up to {capacity:g}/s: the capacity is at least this" if top_sustained
        else f"highest ladder load the best static configuration sustained ({base})")
    for sc in preset["scenarios"]:
        rate, picks = chosen["capacity_rps"], {}
        for name, key, values in (("dask-capped", "cap", preset["caps"]), ("dask-ttl", "ttl", preset["ttls"]),
                                  ("ray", "routing", preset["peer_routings"]),
                                  ("langgraph", "routing", preset["peer_routings"])):
            if name not in preset["variants"]:
                continue
            runs = []
            for v in values:
                m = point(factory(name, sc, {key: v}), sc, rate)
                runs.append({key: v, "metrics": m})
                log(f"  sweep {sc} {name} {key}={v}: mean {m['mean_s']:.1f} s sustained {m['sustained']}")
            picks[name] = min(runs, key=lambda r: score(r["metrics"]))[key]
            sweeps["scenarios"].setdefault(sc, {})[name] = runs
        chosen.setdefault("per_scenario", {})[sc] = picks
    return {"chosen": chosen, "sweeps": sweeps}


def median_or_none(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
