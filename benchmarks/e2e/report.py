"""The summary of a run (from measure-phase units only), its tables and plots.

``summarize(units)`` -> per workflow, scenario and load (``x<factor>`` of the capacity): the
ideal bound (``ideal_mean_s``, ``ideal_p99_s``), per variant the medians over seeds with their
spread of mean/P50/P99 latency, sustained, hit rate, prefill against the floor and overhead
share, ``best_baseline`` (the baseline with the lowest median mean), per variant
``gap_closed_mean``/``gap_closed_p99`` against it, ``sustained_load_ratio_vs_best_static`` and
``mean_speedup_vs_<variant>`` (dask-agents against every other variant, paired per seed), and
per scenario the KV-bound proof at 0.8 of capacity. With the zero-overhead references of the
units (:mod:`benchmarks.e2e.zero_overhead`: the same requests on the same engines in virtual
time, no framework at all), also ``zero_overhead_mean_s``/``zero_overhead_p99_s``, per variant
``mean_vs_zero_overhead`` (what of a variant's distance from the ideal bound is the load itself)
and ``zero_overhead_gap_closed_mean`` (the share of the best baseline's gap to the ideal that
taking every framework's overhead away closes: what is left beyond it, only the engines' own
scheduling could win).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from benchmarks.e2e import stats
from benchmarks.e2e.runner import BASELINES

OURS = "dask-agents"
KEYS = ("mean_s", "p50_s", "p99_s", "sustained", "hit_rate", "prefill_vs_floor", "overhead_share", "throughput_rps")
PROOF_FACTOR = 0.8


def _index(units: list[dict]) -> dict:
    """workflow -> scenario -> factor -> variant -> seed -> metrics."""
    out: Any = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(dict))))
    for u in units:
        out[u["workflow"]][u["scenario"]][u["factor"]][u["variant"]][str(u["seed"])] = u["metrics"]
    return out


def _max_sustained(per_factor: dict, variant: str) -> dict[str, float]:
    """Per seed, the highest load factor the variant sustained (0 if none)."""
    best: dict[str, float] = {}
    for f, vs in per_factor.items():
        for seed, m in vs.get(variant, {}).items():
            best[seed] = max(best.get(seed, 0.0), f if m.get("sustained") else 0.0)
    return best


def summarize_point(vs: dict, sustained_max: dict, refs: dict | None = None) -> dict:
    """One workflow x scenario x load (``refs``: seed -> its zero-overhead reference)."""
    any_v = next(iter(vs.values()))
    out: dict[str, Any] = {
        "ideal_mean_s": stats.spread({s: m["ideal_mean_s"] for s, m in any_v.items()}),
        "ideal_p99_s": stats.spread({s: m["ideal_p99_s"] for s, m in any_v.items()}),
        "variants": {v: {k: stats.spread({s: (float(m[k]) if isinstance(m.get(k), bool) else m.get(k))
                                          for s, m in per.items()}) for k in KEYS} for v, per in vs.items()},
    }
    if refs:
        out["zero_overhead_mean_s"] = stats.spread({s: r["mean_s"] for s, r in refs.items()})
        out["zero_overhead_p99_s"] = stats.spread({s: r["p99_s"] for s, r in refs.items()})
        for v, per in vs.items():
            # ratio(key)(a, b) is b / a: the variant's mean over the reference's
            out["variants"][v]["mean_vs_zero_overhead"] = stats.paired(refs, per, stats.ratio("mean_s"))
    base = [b for b in BASELINES if b in vs and out["variants"][b]["mean_s"]["median"] is not None]
    best = min(base, key=lambda b: out["variants"][b]["mean_s"]["median"]) if base else None
    out["best_baseline"] = best
    if best is not None:
        out["gap_closed_mean"] = {v: stats.paired(vs[v], vs[best], stats.gap_closed("mean_s", "ideal_mean_s"))
                                  for v in vs}
        out["gap_closed_p99"] = {v: stats.paired(vs[v], vs[best], stats.gap_closed("p99_s", "ideal_p99_s"))
                                 for v in vs}
        if refs:  # the share of the gap that taking every framework's overhead away would close
            out["zero_overhead_gap_closed_mean"] = stats.paired(refs, vs[best], stats.gap_closed("mean_s", "ideal_mean_s"))
    static = sustained_max.get("dask", {})
    out["sustained_load_ratio_vs_best_static"] = {
        v: stats.spread({s: (x / static[s] if static.get(s) else None) for s, x in sustained_max.get(v, {}).items()})
        for v in vs}
    if OURS in vs:
        for v in vs:
            if v != OURS:
                out[f"mean_speedup_vs_{v}"] = stats.paired(vs[OURS], vs[v], stats.ratio("mean_s"))
                out[f"p99_speedup_vs_{v}"] = stats.paired(vs[OURS], vs[v], stats.ratio("p99_s"))
    return out


def kv_bound_proof(per_factor: dict, footprints: dict | None = None, kv_tokens: int | None = None,
                   think_s: dict | None = None, host_tokens: int | None = None) -> dict:
    """At 0.8 of capacity: the best static configuration's hit rate against the perfect cache's
    (1 - floor / prompt tokens queried), and its prefill against the floor. The regime bites if
    the hit rate is >= 20 points below, or prefill >= 1.3x the floor. With ``footprints`` (seed ->
    the requests' mean KV footprint in tokens) and ``kv_tokens`` (the engines' device KV, all
    replicas), also why: the live working set by Little's law (throughput x a session's life x
    footprint) against the device KV, and with ``host_tokens`` (the host tier, all replicas)
    against both tiers. A session's life is its latency plus its users' think time (``think_s``:
    seed -> the requests' mean), since a session paused for its user keeps its KV unless evicted."""
    vs = per_factor.get(PROOF_FACTOR, {}).get("dask")
    if not vs:
        return {"holds": None, "why": f"no plain-Dask run at {PROOF_FACTOR} of capacity"}
    gaps, ratios, live = {}, {}, {}
    for s, m in vs.items():
        q = m.get("queried_tokens") or 0
        perfect = 1 - m["floor_prefill_tokens"] / q if q else math.nan
        gaps[s] = perfect - m["hit_rate"] if math.isfinite(perfect) else None
        ratios[s] = m.get("prefill_vs_floor")
        fp, thr, mean = (footprints or {}).get(s), stats.finite(m.get("throughput_rps")), stats.finite(m.get("mean_s"))
        life = mean + (think_s or {}).get(s, 0.0) if mean else None
        live[s] = thr * life * fp if fp and thr and life else None
    g, r = stats.spread(gaps), stats.spread(ratios)
    holds = (g["median"] is not None and g["median"] >= 0.20) or (r["median"] is not None and r["median"] >= 1.3)
    out = {"holds": bool(holds), "hit_rate_gap_to_perfect": g, "prefill_vs_floor": r,
           "rule": "hit rate >= 20 points below a perfect cache's, or prefill >= 1.3x the floor"}
    if footprints and kv_tokens:
        out["live_working_set_vs_device_kv"] = stats.spread({s: x / kv_tokens if x else None for s, x in live.items()})
        if host_tokens:
            out["live_working_set_vs_device_and_host_kv"] = stats.spread(
                {s: x / (kv_tokens + host_tokens) if x else None for s, x in live.items()})
            out["host_kv_tokens"] = host_tokens
        out["footprint_tokens"] = stats.spread(dict(footprints))
        out["device_kv_tokens"] = kv_tokens
        if think_s:
            out["think_s"] = stats.spread(dict(think_s))
    return out


def check_same_resources(units: list[dict]) -> None:
    """Every point of a workflow ran on the same Setup (engine profile, replicas, host tier, time
    scale), as its variant recorded it; raise ValueError naming the first that did not."""
    first: dict[str, Any] = {}
    for u in units:
        got = (u["metrics"].get("variant") or {}).get("setup")
        want = first.setdefault(u["workflow"], got)
        if got != want:
            raise ValueError(f"{u['workflow']}: {u['variant']} (seed {u['seed']}, {u['scenario']}) ran on other "
                             f"resources than the rest: {got} != {want}")


def summarize(units: list[dict], footprints: dict | None = None, kv_tokens: dict | None = None,
              references: dict | None = None, think_s: dict | None = None, host_tokens: dict | None = None) -> dict:
    """The summary (module docstring). ``footprints``: workflow -> scenario -> seed -> mean KV
    footprint of the requests (tokens); ``kv_tokens``: workflow -> device KV of all its engines
    (tokens); with both, the KV-bound proof says how much of the device KV the live requests need
    (``think_s``: workflow -> scenario -> seed -> the requests' mean think time, in their lives;
    ``host_tokens``: workflow -> the host tier of all its engines, tokens).
    ``references``: workflow -> scenario -> load factor -> seed -> the unit's zero-overhead
    reference (:func:`benchmarks.e2e.zero_overhead.unit_reference`)."""
    check_same_resources(units)
    out: dict[str, Any] = {}
    for wf, scs in _index(units).items():
        for sc, per_factor in scs.items():
            variants = {v for vs in per_factor.values() for v in vs}
            smax = {v: _max_sustained(per_factor, v) for v in variants}
            refs = ((references or {}).get(wf) or {}).get(sc) or {}
            entry = {f"x{f:g}": summarize_point(vs, smax, refs.get(f)) for f, vs in sorted(per_factor.items())}
            entry["kv_bound_proof"] = kv_bound_proof(per_factor, ((footprints or {}).get(wf) or {}).get(sc),
                                                     (kv_tokens or {}).get(wf), ((think_s or {}).get(wf) or {}).get(sc),
                                                     (host_tokens or {}).get(wf))
            out.setdefault(wf, {})[sc] = entry
    return out


def fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def table(summary: dict, label: str = "EMULATED") -> str:
    """A text table per workflow x scenario x load: medians over seeds, [min, max] of ratios."""
    lines = []
    for wf, scs in summary.items():
        for sc, loads in scs.items():
            for lk, e in loads.items():
                if not lk.startswith("x"):
                    continue
                zo = (e.get("zero_overhead_mean_s") or {}).get("median")
                lines.append(f"\n{wf} / {sc} / load {lk} of capacity: ideal mean {fmt(e['ideal_mean_s']['median'])} s, "
                             f"P99 {fmt(e['ideal_p99_s']['median'])} s; "
                             + (f"zero-overhead mean {fmt(zo)} s; " if zo is not None else "")
                             + f"best baseline {e['best_baseline']} ({label})")
                lines.append(f"  {'variant':28s} {'mean':>7s} {'P99':>7s} {'hit':>5s} {'pf/floor':>8s} {'ovh':>5s} "
                             f"{'sust':>4s} {'gap_mean':>8s} {'gap_p99':>8s}")
                for v, m in e["variants"].items():
                    g = e.get("gap_closed_mean", {}).get(v, {}).get("median")
                    g99 = e.get("gap_closed_p99", {}).get(v, {}).get("median")
                    med = {k: m[k]["median"] for k in KEYS}
                    lines.append(f"  {v:28s} {fmt(med['mean_s']):>7s} {fmt(med['p99_s']):>7s} "
                                 f"{fmt(med['hit_rate'], '.2f'):>5s} {fmt(med['prefill_vs_floor'], '.2f'):>8s} "
                                 f"{fmt(med['overhead_share'], '.2f'):>5s} {fmt(med['sustained'], '.1f'):>4s} "
                                 f"{fmt(g, '.2f'):>8s} {fmt(g99, '.2f'):>8s}")
                for k, s in e.items():
                    if k.startswith("mean_speedup_vs_"):
                        lo, hi = fmt(s["min"], ".2f"), fmt(s["max"], ".2f")
                        lines.append(f"  {OURS} {k}: {fmt(s['median'], '.2f')} [{lo}, {hi}]")
            p = loads.get("kv_bound_proof", {})
            lines.append(f"  KV-bound proof ({wf}/{sc}): holds={p.get('holds')} "
                         f"hit-rate gap {fmt((p.get('hit_rate_gap_to_perfect') or {}).get('median'), '.2f')}, "
                         f"prefill/floor {fmt((p.get('prefill_vs_floor') or {}).get('median'), '.2f')}, "
                         f"live working set / device KV "
                         f"{fmt((p.get('live_working_set_vs_device_kv') or {}).get('median'), '.2f')}, "
                         f"/ device and host KV "
                         f"{fmt((p.get('live_working_set_vs_device_and_host_kv') or {}).get('median'), '.2f')}")
    return "\n".join(lines)


def plot(summary: dict, stem: str, label: str = "EMULATED") -> list[str]:
    """Mean and P99 latency against load per variant, one PNG per workflow x scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for wf, scs in summary.items():
        for sc, loads in scs.items():
            fs = sorted((float(k[1:]), e) for k, e in loads.items() if k.startswith("x"))
            if not fs:
                continue
            fig, axes = plt.subplots(1, 2, figsize=(10, 4))
            for ax, key in zip(axes, ("mean_s", "p99_s")):
                for v in fs[0][1]["variants"]:
                    ys = [e["variants"].get(v, {}).get(key, {}).get("median") for _, e in fs]
                    ax.plot([f for f, _ in fs], [y if y is not None else math.nan for y in ys], marker="o", label=v)
                ideal = "ideal_mean_s" if key == "mean_s" else "ideal_p99_s"
                ax.plot([f for f, _ in fs], [e[ideal]["median"] for _, e in fs], "k--", label="ideal bound")
                zero = "zero_overhead_" + key
                if all(zero in e for _, e in fs):
                    ax.plot([f for f, _ in fs], [e[zero]["median"] for _, e in fs], "k:", label="zero overhead")
                ax.set_xlabel("offered load (x capacity)")
                ax.set_ylabel(f"{key[:-2]} latency (emulated s)")
                ax.set_title(f"{wf} / {sc}: {key[:-2]} ({label})")
            axes[0].legend(fontsize=7)
            fig.tight_layout()
            path = f"{stem}_{wf}_{sc}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            paths.append(path)
    return paths
