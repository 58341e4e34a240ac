"""``python -m examples.swe``: run concurrent Open-SWE requests on a LocalCluster with a real
vLLM CPU engine per worker, then print one row per request and the dashboard address.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.swe", description=__doc__)
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests (sessions)")
    parser.add_argument("--engine", choices=("real", "emulated"), default="real",
                        help="real: a vLLM CPU engine (tiny dummy-weight Llama) per worker; emulated: the "
                             "EMULATED cost model (its LLM numbers are labeled so)")
    parser.add_argument("--workers", type=int, default=2, help="workers, each hosting an engine")
    parser.add_argument("--threads", type=int, default=16, help="threads per worker (agents mostly wait)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated issues")
    parser.add_argument("--log-level", default="ERROR",
                        help="vLLM's and torch's logs on the workers (agents.llm.log-level; its default is WARNING)")
    args = parser.parse_args()

    import pandas as pd
    from distributed import Client, LocalCluster

    import dask_agents as da
    from examples.common import agents_page, call_columns, emulated_models, wait_for_telemetry
    from examples.swe.workflow import make_issues, solve

    import dask

    dask.config.set({"agents.llm.log-level": args.log_level})  # the workers inherit the config
    if args.engine == "emulated":
        dask.config.set({"agents.llm.models": emulated_models(1.0, ("coder",))})
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", args.log_level.upper())  # and the environment
    t_start = time.time()
    with LocalCluster(n_workers=args.workers, threads_per_worker=args.threads, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        da.install(client, models=["coder"])
        print(f"Agents page: {agents_page(client)}")
        engine = "EMULATED engine (cost model)" if args.engine == "emulated" else "vLLM CPU, tiny dummy-weight Llama"
        print(f"cluster: {args.workers} workers x {args.threads} threads, model 'coder' ({engine}) on each; "
              "loading engines...", flush=True)
        da.llm("coder").generate("warm up", max_tokens=1).value(600)  # first engine is up
        issues = make_issues(args.requests, args.seed)
        t0 = time.time()
        with ThreadPoolExecutor(args.requests) as pool:
            outcomes = list(pool.map(lambda i: solve(client, i), issues))
        wall = time.time() - t0

        n_calls = sum(len(da.telemetry(client, o.session)) for o in outcomes)
        df = wait_for_telemetry(client)
        ctl = da.control(client).stats()

    rows = []
    for o in outcomes:
        calls = df[df["session"] == o.session]
        rows.append({"request": o.issue.id, "latency_s": round(o.latency, 2), "retries": o.retries,
                     "passed": o.passed, **call_columns(calls)})
    table = pd.DataFrame(rows)
    tag = "EMULATED " if args.engine == "emulated" else ""
    print()
    if tag:
        print("EMULATED: LLM latencies and token counts below come from the emulated engine (a cost model)")
    print(table.to_string(index=False))
    hit = table["cached_tokens"].sum() / max(table["prompt_tokens"].sum(), 1)
    print()
    print(f"{tag}{len(outcomes)} concurrent requests, {n_calls} calls, wall {wall:.1f}s, "
          f"mean latency {table['latency_s'].mean():.2f}s, p95 {table['latency_s'].quantile(0.95):.2f}s, "
          f"prefix-cache hit rate {hit:.0%} (token-weighted); total {time.time() - t_start:.0f}s")
    p99 = ctl["tick_seconds_p99"]
    print(f"control loop: {ctl['ticks']} passes, p99 pass {p99 * 1e3 if p99 else 0:.1f} ms, "
          f"actions applied {ctl['applied'] or 'none'}")


if __name__ == "__main__":
    main()
