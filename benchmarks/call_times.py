"""Where a variant's time goes, call by call: one e2e unit per variant, run in turn (``--reps``
times, interleaved), every LLM call's engine time (received -> finished, as the agent saw it)
recorded wherever the agent ran, then the calls paired across variants by role and prompt length
(every variant sends the same prompts, so a pair is the same call) and the differences summarized
per role. A gap in the engines' time shows here call by call, apart from the framework's hops
(``overhead_parts_s`` in the units' metrics; also here by a request's first, second and later
waits for agents, in wall ms).

    python benchmarks/call_times.py --workflow finance --job 2/24 --variants ray,dask-agents \\
        --choices benchmarks/results/e2e-finance-choose.json --reps 3 --json out.json

The recording is a Dask worker preload (this file: ``dask_setup``) and the same patch in the
driver (agents that are driver threads); it wraps the harness's agent contexts, nothing of the
product. EMULATED engines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV_DIR = "AGENTS_CALL_TIMES_DIR"


def record() -> None:
    """Wrap the harness's agent contexts so that every LLM call appends its times to a file of
    this process under ``$AGENTS_CALL_TIMES_DIR`` (idempotent)."""
    from benchmarks.e2e import program
    from benchmarks.e2e.variants import agents, common

    if getattr(program.AgentClock, "_call_times", False):
        return
    out_dir, last, lock = os.environ[_ENV_DIR], threading.local(), threading.Lock()
    path = os.path.join(out_dir, f"{os.getpid()}.jsonl")
    add = program.AgentClock.add

    def add_and_keep(self: Any, issued: float, started: float, ended: float, returned: float,
                     kind: str = "llm") -> None:
        last.times = (issued, started, ended, returned)
        add(self, issued, started, ended, returned, kind)

    program.AgentClock.add = add_and_keep
    program.AgentClock._call_times = True

    def wrap(cls: Any) -> None:
        llm = cls.llm

        def timed(self: Any, call: Any) -> Any:
            out = llm(self, call)
            i, s, e, r = last.times
            row = {"role": call.role, "plen": len(call.prompt), "issued": i, "started": s, "ended": e,
                   "returned": r, "cached": out.cached_tokens}
            with lock, open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            return out

        cls.llm = timed

    wrap(agents._Ctx)
    wrap(common.ThreadCtx)

    gather = program.Recorder.add_gather

    def add_gather(self: Any, issued: list, results: list, returned: float) -> None:
        # (in the driver) a request's n-th wait for agents: the critical branch's hop in and out
        n = self.__dict__.setdefault("_call_times_n", 0)
        self._call_times_n = n + 1
        if results:
            i = max(range(len(results)), key=lambda j: results[j].ended)
            row = {"gather": n, "agents": len(results), "in_ms": (results[i].started - issued[i]) * 1e3,
                   "out_ms": (returned - results[i].ended) * 1e3}
            with lock, open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
        gather(self, issued, results, returned)

    program.Recorder.add_gather = add_gather


def dask_setup(worker: Any = None) -> None:
    """Worker preload: record the worker's agents' calls."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    record()


def _load(out_dir: str) -> tuple[dict[tuple, dict], list[dict]]:
    """The LLM calls by (role, prompt length), and the agent hops of each request's waits."""
    rows: dict[tuple, dict] = {}
    hops: list[dict] = []
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as f:
            for line in f:
                r = json.loads(line)
                if "gather" in r:
                    hops.append(r)
                else:
                    rows[(r["role"], r["plen"])] = r
    return rows, hops


def hop_summary(hops: list[dict]) -> dict:
    """Mean agent hop in and out (wall ms) of a request's first wait, second, and later ones."""
    by: dict[str, list[dict]] = defaultdict(list)
    for h in hops:
        by[("first", "second")[h["gather"]] if h["gather"] < 2 else "later"].append(h)
    return {k: {"waits": len(v), "in_ms_mean": round(statistics.mean(h["in_ms"] for h in v), 2),
                "out_ms_mean": round(statistics.mean(h["out_ms"] for h in v), 2)} for k, v in by.items()}


def paired(base: dict, other: dict) -> dict:
    """Per role: the calls of both runs, and ``other``'s engine time minus ``base``'s (ms)."""
    by: dict[str, list[float]] = defaultdict(list)
    cached: dict[str, list[int]] = defaultdict(list)
    for k in sorted(set(base) & set(other)):
        a, b = base[k], other[k]
        by[k[0]].append(((b["ended"] - b["started"]) - (a["ended"] - a["started"])) * 1e3)
        cached[k[0]].append(b["cached"] - a["cached"])
    return {role: {"calls": len(v), "diff_ms_median": round(statistics.median(v), 2),
                   "diff_ms_mean": round(statistics.mean(v), 2),
                   "cached_diff_mean": round(statistics.mean(cached[role]), 1)} for role, v in by.items()}


def _mean_body(rows: dict) -> dict:
    by: dict[str, list[float]] = defaultdict(list)
    for (role, _), r in rows.items():
        by[role].append((r["ended"] - r["started"]) * 1e3)
    return {role: round(statistics.mean(v), 1) for role, v in by.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workflow", required=True)
    ap.add_argument("--job", required=True, help="the unit, as e2e.py measure's --job K/N")
    ap.add_argument("--choices", required=True)
    ap.add_argument("--variants", required=True, help="comma list; the first is the base of the pairs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            got = {}
            for v in variants[rep % len(variants):] + variants[:rep % len(variants)]:  # order rotated
                out_dir = os.path.join(tmp, f"{v}-{rep}")
                os.makedirs(out_dir)
                unit = os.path.join(tmp, f"{v}-{rep}.json")
                env = {**os.environ, _ENV_DIR: out_dir, "PYTHONPATH": ROOT,
                       "DASK_DISTRIBUTED__WORKER__PRELOAD": json.dumps([os.path.abspath(__file__)])}
                cli = ["measure", "--workflow", a.workflow, "--job", a.job, "--choices", a.choices,
                       "--variants", v, "--json", unit]
                code = (f"import sys; sys.path.insert(0, {ROOT!r}); from benchmarks import call_times; "
                        f"call_times.record(); from benchmarks.e2e.cli import main; sys.exit(main({cli!r}))")
                subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
                with open(unit) as f:
                    m = json.load(f)["units"][0]["metrics"]
                rows, hops = _load(out_dir)
                got[v] = {"rows": rows, "hops": hops, "mean_s": m["mean_s"], "overhead_parts_s": m["overhead_parts_s"]}
            base = got[variants[0]]["rows"]
            run = {"rep": rep, "order": list(got), "mean_s": {v: round(g["mean_s"], 3) for v, g in got.items()},
                   "engine_time_ms_mean": {v: _mean_body(g["rows"]) for v, g in got.items()},
                   "overhead_parts_s": {v: {k: round(x, 4) for k, x in g["overhead_parts_s"].items()}
                                        for v, g in got.items()},
                   "agent_hops_wall_ms": {v: hop_summary(g["hops"]) for v, g in got.items()},
                   "paired_vs_" + variants[0]: {v: paired(base, g["rows"]) for v, g in got.items() if v != variants[0]}}
            runs.append(run)
            print(json.dumps(run))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workflow": a.workflow, "job": a.job, "variants": variants, "reps": a.reps,
                       "engines": "EMULATED", "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
