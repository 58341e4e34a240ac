"""``python -m examples.router``: replay a slice of the Azure LLM 2023 trace (code + conversation)
through the Router workflow on a LocalCluster, then print one row per request and a summary.

``--engine real`` (default) uses the real vLLM CPU engine (model ``coder``: the built-in tiny
dummy-weight Llama) for every role, chat included, with prompts and outputs capped small;
``--engine emulated`` registers models ``chat`` and ``coder`` as EMULATED engines (a cost model:
every LLM number they yield is EMULATED and labeled so) and uses the trace's sizes (capped at
``--max-prompt-tokens``/``--max-output-tokens``).

``--time-scale`` scales the arrival times, the emulated tools and the emulated engine (0.1:
ten times faster than the trace). ``--skewed`` replaces the natural mix by phases in which one
branch dominates (>90%), then the other. The trace files ship with the package (CC-BY 4.0, see
:mod:`examples.router.trace`); ``--traces`` or ``DASK_AGENTS_TRACES`` points elsewhere.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from examples.common import agents_page, call_columns, emulated_models, wait_for_telemetry  # noqa: E402


def table(outcomes, df):
    """One row per request (pandas)."""
    import pandas as pd

    rows = []
    for o in outcomes:
        calls = df[df["session"] == o.session]
        llm = calls[calls["kind"] == "llm"]
        rows.append({
            "request": o.request.id, "label": o.request.label, "branch": o.branch, "phase": o.request.phase,
            "arrival_s": round(o.request.at, 3), "latency_s": round(o.latency, 3),
            "models": ",".join(sorted(llm["component"].str.removeprefix("llm.").unique())),
            **call_columns(calls),
        })
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.router", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests to replay (default: 32 emulated, 4 real)")
    parser.add_argument("--engine", choices=("real", "emulated"), default="real")
    parser.add_argument("--workers", type=int, default=2, help="workers, each hosting the engines")
    parser.add_argument("--threads", type=int, default=16, help="threads per worker (agents mostly wait)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=0.1,
                        help="wall seconds per trace/emulated second (arrivals, tools, emulated engine)")
    parser.add_argument("--start", type=float, default=260.0,
                        help="trace second to start from (code traffic is bursty: from 260 both labels alternate)")
    parser.add_argument("--skewed", action="store_true", help="phases dominated by one branch, then the other")
    parser.add_argument("--phases", type=int, default=2, help="phases with --skewed")
    parser.add_argument("--traces", default=None, help="trace directory (default $DASK_AGENTS_TRACES, else the package's copy)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="prompt cap (default 8192 emulated, 256 real)")
    parser.add_argument("--max-output-tokens", type=int, default=None, help="output cap (default 512 emulated, 8 real)")
    args = parser.parse_args()
    real = args.engine == "real"
    n = args.requests if args.requests is not None else (4 if real else 32)
    max_prompt = args.max_prompt_tokens or (256 if real else 8192)
    max_output = args.max_output_tokens or (8 if real else 512)

    import dask
    from distributed import Client, LocalCluster

    import dask_agents as da
    from examples.router.trace import Trace, skewed
    from examples.router.workflow import Models, make_requests, replay

    trace = Trace.load(args.traces)
    if args.skewed:
        arrivals = skewed(trace, n, phases=args.phases, seed=args.seed, start_s=args.start, time_scale=args.time_scale)
    else:
        arrivals = trace.window(args.start, trace.duration + 1).head(n).scaled(args.time_scale)
    requests = make_requests(arrivals, seed=args.seed, max_prompt_tokens=max_prompt, max_output_tokens=max_output)
    models = Models(router="coder", chat="coder", code="coder") if real else Models()

    settings = {"agents.emulation.time-scale": args.time_scale}
    if not real:  # before the cluster: the workers get this config
        settings["agents.llm.models"] = emulated_models(args.time_scale)
    hosted = sorted({models.router, models.chat, models.code})
    t_start = time.time()
    with dask.config.set(settings), \
            LocalCluster(n_workers=args.workers, threads_per_worker=args.threads, processes=True,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        da.install(client, models=hosted)
        engine = "EMULATED engines (cost model)" if not real else "vLLM CPU, tiny dummy-weight Llama"
        print(f"Agents page: {agents_page(client)}")
        print(f"cluster: {args.workers} workers x {args.threads} threads, models {hosted} ({engine}) on each; "
              f"roles {models}; loading engines...", flush=True)
        for m in hosted:
            da.llm(m).generate("warm up", max_tokens=1).value(600)
        print(f"replaying {len(requests)} requests ({'skewed phases' if args.skewed else f'trace from {args.start:g}s'}), "
              f"{arrivals.duration:.2f}s of arrivals at time scale {args.time_scale:g}...", flush=True)
        t0 = time.time()
        outcomes = replay(client, requests, models)
        wall = time.time() - t0
        df = wait_for_telemetry(client)

    emulated = bool(df["emulated"].eq(True).any()) or any(o.emulated for o in outcomes)
    tag = "EMULATED " if emulated else ""
    t = table(outcomes, df)
    print()
    if emulated:
        print("EMULATED: LLM latencies and token counts below come from the emulated engines (a cost model)")
    print(t.to_string(index=False))
    hit = t["cached_tokens"].sum() / max(t["prompt_tokens"].sum(), 1)
    per_branch = ", ".join(f"{b} {len(g)} (mean {g['latency_s'].mean():.2f}s, p95 {g['latency_s'].quantile(0.95):.2f}s)"
                           for b, g in t.groupby("branch"))
    correct = sum(o.branch == ("code" if o.request.label == "code" else "chat") for o in outcomes)
    print()
    print(f"{tag}{len(outcomes)} requests, {int(t['calls'].sum())} calls, wall {wall:.1f}s; branches: {per_branch}; "
          f"routed as labeled {correct}/{len(outcomes)}; mean latency {t['latency_s'].mean():.2f}s, "
          f"p95 {t['latency_s'].quantile(0.95):.2f}s, prefix-cache hit rate {hit:.0%} (token-weighted); "
          f"total {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
