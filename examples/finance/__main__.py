"""``python -m examples.finance``: run concurrent Financial Analyst requests on a LocalCluster, then
print one row per request and a summary.

``--engine real`` (default) hosts the real vLLM CPU engine (model ``coder``: the built-in tiny
dummy-weight Llama) on each worker; ``--engine emulated`` registers model ``coder`` (and ``chat``)
as the EMULATED engine (a cost model: every LLM number it yields is EMULATED and labeled so).
``--time-scale`` scales the emulated tools, the emulated engine and the users' think time.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from examples.common import agents_page, call_columns, emulated_models, wait_for_telemetry  # noqa: E402


def table(outcomes, df):
    """One row per request (pandas)."""
    import pandas as pd

    rows = []
    for o in outcomes:
        calls = df[df["session"] == o.session]
        llm = calls[calls["kind"] == "llm"]
        fu_llm = llm[llm["creator"].isin(set(calls.loc[calls["method"] == "follow_up", "key"]))]
        rows.append({
            "request": o.request.id, "latency_s": round(o.latency, 2), "analysis_s": round(o.analysis_latency, 2),
            "followup_s": round(sum(o.follow_up_latencies) / max(len(o.follow_up_latencies), 1), 3),
            **call_columns(calls),
            "followups": len(o.follow_ups),
            "followup_prompt": int(fu_llm["prompt_tokens"].fillna(0).sum()),
            "followup_cached": int(fu_llm["cached_tokens"].fillna(0).sum()),
        })
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.finance", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests (sessions)")
    parser.add_argument("--engine", choices=("real", "emulated"), default="real")
    parser.add_argument("--workers", type=int, default=2, help="workers, each hosting an engine")
    parser.add_argument("--threads", type=int, default=16, help="threads per worker (agents mostly wait)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=0.1,
                        help="wall seconds per emulated second (tools, emulated engine, think time)")
    args = parser.parse_args()

    import dask
    from distributed import Client, LocalCluster

    import dask_agents as da
    from examples.finance.workflow import analyze_company, make_requests

    settings = {"agents.emulation.time-scale": args.time_scale}
    if args.engine == "emulated":  # before the cluster: the workers get this config
        settings["agents.llm.models"] = emulated_models(args.time_scale)
    t_start = time.time()
    with dask.config.set(settings), \
            LocalCluster(n_workers=args.workers, threads_per_worker=args.threads, processes=True,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        da.install(client, models=["coder"])
        engine = ("EMULATED engine (cost model)" if args.engine == "emulated"
                  else "vLLM CPU, tiny dummy-weight Llama")
        print(f"Agents page: {agents_page(client)}")
        print(f"cluster: {args.workers} workers x {args.threads} threads, model 'coder' ({engine}) on each; "
              f"time scale {args.time_scale:g}; loading engines...", flush=True)
        da.llm("coder").generate("warm up", max_tokens=1).value(600)  # first engine is up
        requests = make_requests(args.requests, args.seed)
        t0 = time.time()
        with ThreadPoolExecutor(max(1, args.requests)) as pool:
            outcomes = list(pool.map(lambda r: analyze_company(client, r, time_scale=args.time_scale), requests))
        wall = time.time() - t0
        df = wait_for_telemetry(client)

    emulated = bool(df["emulated"].eq(True).any()) or any(o.emulated for o in outcomes)
    tag = "EMULATED " if emulated else ""
    t = table(outcomes, df)
    print()
    if emulated:
        print("EMULATED: LLM latencies and token counts below come from the emulated engine (a cost model)")
    print(t.to_string(index=False))
    hit = t["cached_tokens"].sum() / max(t["prompt_tokens"].sum(), 1)
    fu_hit = t["followup_cached"].sum() / max(t["followup_prompt"].sum(), 1)
    print()
    print(f"{tag}{len(outcomes)} concurrent requests, {int(t['calls'].sum())} calls, wall {wall:.1f}s, "
          f"mean latency {t['latency_s'].mean():.2f}s (think time included), mean analysis {t['analysis_s'].mean():.2f}s, "
          f"mean follow-up {t['followup_s'].mean():.3f}s, prefix-cache hit rate {hit:.0%} overall, "
          f"{fu_hit:.0%} on follow-ups (token-weighted); total {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
