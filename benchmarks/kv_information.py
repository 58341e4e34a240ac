"""How much of ours' distance from the KV optimum is information (when a session comes back) and
how much is mechanism: the same policy with better knowledge of return times, on one trace.

What runs
---------
A trace (the shipped Mooncake synthetic trace and, with ``--telemetry``, a recorded one; each with
and without session ends) is replayed
by ``dask_agents.kv.offline``'s simulator at ``kv_policies.py``'s accelerator-only sizes (running
peak + f x (live peak - running peak), f = 0.05, 0.1, 0.25, 0.5) with four versions of ``ours``
that differ only in what they know of a paused session's return:

``online``      ``Ours`` as shipped: the pause distribution of the session's wait key, learned as
                the replay goes (``AgentGraph``), censored by the sessions still paused.
``pretrained``  the same, its graph fed every pause and transition of the whole trace before the
                replay starts: the best this feature set (step label, time paused) can learn.
``last_gap``    ``online`` with the session's previous pause as a feature (step labels split by its
                log2 bucket): a per-session history online policies could use.
``exact``       a paused session's next use is its true next arrival (an oracle): what the
                mechanism (session order, tail first, drops at session end) reaches when the
                prediction is perfect.

Each row: recomputed tokens over the optimum's (``lower_bound``; on these traces the offline
schedule meets it), per size and their geometric mean (``kv_policies.py``'s summary statistic).
SIMULATED; deterministic.

Reproduce::

    .venv/bin/python benchmarks/kv_information.py --telemetry benchmarks/results/kv-telemetry-quick.csv \
        --json benchmarks/results/kv-information.json
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import math
import os
import sys
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.kv_policies import gmean, sizes  # noqa: E402

FRACTIONS = (0.05, 0.1, 0.25, 0.5)
VARIANTS = ("online", "pretrained", "last_gap", "exact")


def _exact_ours(trace):
    """``Ours`` whose paused sessions' next use is their true next arrival."""
    from dask_agents.kv.runtime.policies import Ours
    from dask_agents.kv.runtime.view import PAUSED

    arrivals = {sid: [st.at for st in steps] for sid, steps in trace.sessions().items()}

    class Exact(Ours):
        name = "ours_exact"

        @classmethod
        def next_use(cls, view, s, open_pauses=None, memo=None):
            if s.state != PAUSED:
                return super().next_use(view, s, open_pauses, memo)
            a = arrivals[s.id]
            i = bisect.bisect_right(a, view.now)
            return a[i] - view.now if i < len(a) else math.inf

    return Exact


def with_last_gap(trace):
    """``trace`` with each step labelled by its position and the log2 bucket of the session's
    previous pause (known online when the step arrives)."""
    from dask_agents.kv.offline.traces import Trace

    steps = []
    for ss in trace.sessions().values():
        prev = None
        for x, y in zip(ss, ss[1:] + [None]):
            node = x.node if prev is None else f"{x.node}|{int(math.log2(max(prev, 1.0)))}"
            steps.append(dataclasses.replace(x, node=node))
            if y is not None:
                prev = y.at - x.end
    return Trace(trace.name, trace.family, trace.block_size, tuple(steps), trace.meta)


def replay(trace, variant: str, acc: int, cost, params, tick: float, min_samples: int) -> int:
    """Recomputed tokens of one ``variant`` at ``acc`` accelerator bytes."""
    from dask_agents.kv.offline.simulator import Simulator
    from dask_agents.kv.runtime.aeg import AgentGraph
    from dask_agents.kv.runtime.blocks import Tier, Tiers
    from dask_agents.kv.runtime.policies import Ours

    tiers = Tiers(Tier("accelerator", acc))
    policy = _exact_ours(trace)(params) if variant == "exact" else Ours(params)
    sim = Simulator(with_last_gap(trace) if variant == "last_gap" else trace, tiers, policy, cost, tick, min_samples)
    if variant == "pretrained":
        for ss in trace.sessions().values():
            for x, y in zip(ss, ss[1:]):
                sim.graph.observe_pause(x.node, AgentGraph.key(x.node, x.tool), y.at - x.end)
                sim.graph.observe_transition(x.node, y.node, 1.0)
            if ss[-1].last:
                sim.graph.observe_end(ss[-1].node)
    return sim.run().recomputed_tokens


def run(trace, cost, params, tick: float, min_samples: int) -> dict[str, Any]:
    """Every variant at every size: ratios to the optimum and their geometric mean."""
    from dask_agents.kv.offline.optimal import lower_bound
    from dask_agents.kv.runtime.blocks import Tier, Tiers

    accs = sizes(trace, cost, FRACTIONS)
    bounds = [lower_bound(trace, Tiers(Tier("accelerator", a)), cost).recomputed_tokens for a in accs]
    out: dict[str, Any] = {"accelerator_bytes": accs, "optimum_tokens": bounds}
    for v in VARIANTS:
        ratios = [replay(trace, v, a, cost, params, tick, min_samples) / b for a, b in zip(accs, bounds)]
        out[v] = {"ratio": ratios, "ratio_gmean": gmean(ratios)}
        print(f"  {trace.name[:40]:40s} {v:10s} " + " ".join(f"{r:.3f}" for r in ratios)
              + f"  gmean {out[v]['ratio_gmean']:.3f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every variant on the trace with and without session ends; print and write JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--limit", type=int, help="only the first N requests of the Mooncake trace")
    p.add_argument("--telemetry", metavar="CSV", help="also a recorded telemetry trace (kv_policies.py's, e.g. "
                   "benchmarks/results/kv-telemetry-quick.csv)")
    args = p.parse_args(argv)

    import dask_agents.config as c
    from dask_agents.kv.offline.replay import write_json
    from dask_agents.kv.offline.traces import load_mooncake, mooncake_path
    from dask_agents.kv.runtime.blocks import CostModel
    from dask_agents.kv.runtime.policies import Params

    cost = CostModel.from_config()  # as kv_policies.py replays it
    trace = load_mooncake(mooncake_path(), limit=args.limit, decode_s_per_token=cost.decode_s_per_token)
    params, tick, min_samples = Params.from_config(), c.seconds("kv.tick"), int(c.get("kv.min-samples"))
    print("recomputed tokens / the optimum's at running + f x (live - running), f = "
          + ", ".join(map(str, FRACTIONS)) + " (SIMULATED)")
    traces = {"mooncake": trace}
    if args.telemetry:
        from benchmarks.kv_policies import TELEMETRY_TIME_SCALE
        from dask_agents.kv.offline.traces import load_telemetry

        traces["telemetry"] = load_telemetry(args.telemetry, cost.block_size, TELEMETRY_TIME_SCALE)
    results = {}
    for name, t in traces.items():
        results[name] = {"with_ends": run(t, cost, params, tick, min_samples),
                         "without_ends": run(t.without_session_ends(), cost, params, tick, min_samples)}
    if args.json:
        write_json(args.json, {"config": {"traces": {k: t.name for k, t in traces.items()}, "fractions": FRACTIONS,
                                          "tick_s": tick, "min_samples": min_samples, "label": "SIMULATED"},
                               "results": results})
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
