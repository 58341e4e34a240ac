"""How well ``dask-agents whatif`` predicts a run it did not see (EMULATED engines and tools).

    .venv/bin/python benchmarks/whatif.py --json benchmarks/results/whatif.json [--quick]

1. Record: the yardstick's Open-SWE workflow (``benchmarks/e2e/workflows/swe.py``: contexts
   growing to 30-64k tokens, tools from milliseconds to minutes; Poisson arrivals) on
   dask-agents (the yardstick's ``dask-agents`` variant) with ONE engine worker of the
   realistic profile (``benchmarks/e2e/profile.py``); its ``da.telemetry`` is the recording.
2. Calibrate the what-if model on it and replay it on its own allocation (the self-check).
3. Predict the same workload on TWO engine workers (``--replicas coder=2``) and at a higher load.
4. Run both for real, and compare prediction with measurement.

The JSON's ``summary`` holds the relative errors of the predicted mean and P95 session latency
for the self-check and for each unseen allocation. Engines and tools are EMULATED at time scale
``TIME_SCALE`` (wall seconds per emulated second, engines and tools alike); every latency here
is in wall seconds, what the recording shows and the model predicts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TIME_SCALE = 0.1
# loads in emulated requests/s: one realistic engine sustains about half the two-engine
# capacity of the yardstick's choose phase (benchmarks/results/e2e-swe-choose.json)
QUICK = {"requests": 12, "load": 0.04, "high_load": 0.06}
FULL = {"requests": 32, "load": 0.04, "high_load": 0.06}


def run(workers: int, rate: float, n: int, seed: int) -> tuple[Any, dict]:
    """One real run on ``workers`` engine workers; (telemetry of its sessions, the driver's
    latency summary in wall seconds)."""
    import pandas as pd

    import dask_agents as da
    from benchmarks.e2e import runner, stats
    from benchmarks.e2e.profile import profile
    from benchmarks.e2e.program import Setup
    from benchmarks.e2e.variants.agents import DaskAgents
    from benchmarks.e2e.workflows.swe import WORKFLOW as wf

    setup = Setup(engine=profile("realistic"), replicas=workers, models=(("coder", workers),), time_scale=TIME_SCALE)
    specs = wf.make_specs(n, seed, "stationary")
    offsets = runner.poisson(n, rate, seed)
    with DaskAgents(setup) as variant:
        t0 = time.time()
        records = runner.drive(variant, wf, specs, offsets, TIME_SCALE, deadline_s=600.0)
        failed = [r for r in records if not r.get("ok")]
        if failed:
            raise RuntimeError(f"{len(failed)} request(s) failed on {workers} worker(s): {failed[0].get('error')}")
        deadline = time.time() + 30
        while True:  # the workers' exact timings arrive in batches
            df = da.telemetry(variant.client)
            df = df[df["created"] >= pd.Timestamp(t0, unit="s", tz="UTC")]
            # the workers' reports (exact start times, tokens) trail the scheduler's transitions
            if (len(df) and df[["started", "finished"]].notna().all(axis=None)
                    and df.loc[df["kind"] == "llm", "output_tokens"].notna().all()):
                break
            if time.time() > deadline:
                raise RuntimeError("telemetry did not complete within 30 s")
            time.sleep(0.5)
    lat = sorted(r["finish_wall"] - r["arrival_wall"] for r in records)
    driver = {"mean_s": sum(lat) / len(lat), "p50_s": stats.percentile(lat, 50), "p95_s": stats.percentile(lat, 95),
              "p99_s": stats.percentile(lat, 99)}
    return pd.DataFrame(df), driver


def compare(pred: dict, measured: dict) -> dict:
    """Relative errors of the predicted mean and P95 session latency."""
    return {k: (pred[k] - measured[k]) / measured[k] for k in ("mean_s", "p95_s")}


def main(argv: list[str] | None = None) -> int:
    from dask_agents import whatif as w

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", required=True)
    p.add_argument("--quick", action="store_true", help="fewer requests (a few minutes)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    size = QUICK if args.quick else FULL
    n, load, high = size["requests"], size["load"], size["high_load"]
    config = {"workload": "Open-SWE (benchmarks/e2e/workflows/swe.py), EMULATED engine (realistic profile) and tools",
              "time_scale": TIME_SCALE, "requests": n,
              "recorded": {"engine_workers": 1, "load_rps": load},
              "unseen": [{"engine_workers": 2, "load_rps": load}, {"engine_workers": 2, "load_rps": high}],
              "seed": args.seed, "python": platform.python_version(), "cpus": os.cpu_count(), "emulated": True}
    print("config:", json.dumps(config))
    t = time.time()
    frame, rec_driver = run(1, load, n, args.seed)
    scripts = w.scripts_from_frame(frame)
    fits = w.calibrate(scripts)
    check = w.validate(scripts, fits)
    print(f"recorded 1 worker @ {load:g}/s: {len(scripts)} of {n} sessions whole in telemetry; calibration "
          + ", ".join(f"{m}: {f.decode_s_per_step * 1e3:.2f} ms/step + {f.decode_s_per_seq * 1e3:.3f} ms/seq, "
                      f"{f.prefill_s_per_token * 1e6:.1f} us/prefill token, R^2 {f.r2:.2f}" for m, f in fits.items()))
    # measured = the scheduler's view (first call created -> last call finished), what the
    # replay predicts; the clients' end-to-end latency adds submission and result transfer
    rows = [("1 worker (self-check)", load, check["predicted"], check["measured"], rec_driver)]
    for entry in config["unseen"]:
        rate = entry["load_rps"]
        pred = w.predict(scripts, fits, {"coder": 2}, load_scale=rate / load).summary()
        unseen, driver = run(2, rate, n, args.seed)
        rows.append((f"2 workers @ {rate:g}/s", rate, pred, w.recorded(w.scripts_from_frame(unseen)), driver))
    print(f"\n{'allocation':24s} {'pred mean':>10s} {'meas mean':>10s} {'err':>6s} {'pred P95':>9s} "
          f"{'meas P95':>9s} {'err':>6s} {'client mean':>12s}   (EMULATED)")
    out_rows = []
    for name, rate, pred, meas, driver in rows:
        err = compare(pred, meas)
        print(f"{name:24s} {pred['mean_s']:10.2f} {meas['mean_s']:10.2f} {err['mean_s']:+6.0%} {pred['p95_s']:9.2f} "
              f"{meas['p95_s']:9.2f} {err['p95_s']:+6.0%} {driver['mean_s']:12.2f}")
        out_rows.append({"allocation": name, "load_rps": rate, "predicted": pred, "measured": meas,
                         "client_measured": {k: driver[k] for k in ("mean_s", "p50_s", "p95_s", "p99_s")},
                         "errors": err})
    summary = {"self_check_mean_error": out_rows[0]["errors"]["mean_s"],
               "unseen_mean_error": [r["errors"]["mean_s"] for r in out_rows[1:]],
               "unseen_p95_error": [r["errors"]["p95_s"] for r in out_rows[1:]],
               "max_abs_unseen_mean_error": max(abs(r["errors"]["mean_s"]) for r in out_rows[1:])}
    print("\nsummary:", json.dumps(summary), f"\ntotal wall {time.time() - t:.0f}s")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"config": config, "calibration": {m: vars(f) for m, f in fits.items()},
                   "validation": check, "rows": out_rows, "summary": summary}, fh, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
