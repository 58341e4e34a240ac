"""How long ``dask-agents replay`` takes: every online policy and the offline schedule (and the
optimum) at several accelerator sizes, on one generated trace, with and without session ends.

Issue 29's goal is a 12k-request trace at 4 sizes in under 2 minutes each way. The trace here
is generated (:class:`dask_agents.kv.offline.traces.GenParams`; 360 sessions give about 12k
steps), so the run needs no file. SIMULATED: no engine runs; the wall times are this machine's.

    .venv/bin/python benchmarks/replay_speed.py --json benchmarks/results/replay-speed.json
    .venv/bin/python benchmarks/replay_speed.py --sessions 100 --sizes 10%     # a quick look

``--budget-s`` stops a direction (with or without ends) once it has run that long and reports
what finished (``complete: false``): the old code ran past 25 CPU-minutes without ends.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dask_agents.kv.offline.replay import ONLINE, replay, resolve_tiers, write_json  # noqa: E402
from dask_agents.kv.offline.traces import GenParams, generate  # noqa: E402
from dask_agents.kv.runtime.blocks import CostModel  # noqa: E402


class _OverBudget(Exception):
    pass


def run(sessions: int, sizes: list[str], budget_s: float, seed: int = 0) -> dict:
    """Time the replays; one entry per direction (with and without session ends)."""
    base = generate(GenParams(sessions=sessions, seed=seed))
    cost = CostModel.from_config()
    out: dict = {"trace": {"generator": f"GenParams(sessions={sessions}, seed={seed})", "steps": len(base.steps),
                           "peak_footprint_blocks": base.peak_footprint()},
                 "sizes": sizes, "policies": list(ONLINE) + ["offline", "optimum"], "runs": {}}
    for ends in (True, False):
        trace = base if ends else base.without_session_ends()
        tiers = [resolve_tiers(f"accelerator={s}", trace, cost) for s in sizes]
        rows: list[dict] = []
        t0 = time.perf_counter()

        def progress(row) -> None:
            rows.append({"tiers": row.tiers, "policy": row.policy, "wall_s": row.wall_s, "ratio": row.ratio})
            print(f"  {'ends' if ends else 'no ends':8s} {row.tiers[:32]:32s} {row.policy:8s} "
                  f"{row.wall_s:7.2f} s  ratio {row.ratio:.4f}", flush=True)
            if time.perf_counter() - t0 > budget_s:
                raise _OverBudget

        try:
            replay(trace, ONLINE, tiers, cost, progress=progress)
            complete = True
        except _OverBudget:
            complete = False
        wall = time.perf_counter() - t0
        key = "with_session_ends" if ends else "without_session_ends"
        out["runs"][key] = {"wall_s": round(wall, 2), "complete": complete, "rows": rows}
        print(f"{key}: {wall:.1f} s{'' if complete else ' (stopped at the budget)'}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=360, help="generated sessions (360: about 12k steps)")
    p.add_argument("--sizes", default="5%,10%,25%,50%", help="accelerator sizes, shares of the peak footprint")
    p.add_argument("--budget-s", type=float, default=1800.0, help="stop a direction after this long")
    p.add_argument("--json", metavar="PATH", help="write the result here")
    a = p.parse_args(argv)
    result = run(a.sessions, [s.strip() for s in a.sizes.split(",") if s.strip()], a.budget_s)
    result["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    if a.json:
        print("wrote", write_json(a.json, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
