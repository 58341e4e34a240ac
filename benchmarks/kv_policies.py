"""KV policies against the offline optimum: recomputed prefill tokens and hit rate, in one run.

What is measured
----------------
Each trace is replayed (``dask_agents.kv.offline.simulator``, open loop: every policy sees the same block-access
sequence) under LRU (vLLM's prefix cache), WA-LRU (SAGA), Nalar's idle-time policy and ours,
side by side with

``optimum``
    :func:`dask_agents.kv.offline.optimal.lower_bound`: Bélády's MIN on the same accesses with all tiers' capacity,
    keeping every running step's blocks while it runs. A true lower bound on every policy's
    recomputed prefill tokens (see ``kv/offline/optimal.py`` for why, and for prefix chains).
``offline``
    :class:`dask_agents.kv.offline.optimal.Offline`, the cost-aware offline *schedule*: a feasible replay that knows
    the future (an upper bound on the best feasible schedule). Where it equals ``optimum`` the
    bound is the true optimum of the simulator's rules.

``ratio`` = a policy's recomputed prefill tokens / the optimum's (its competitive ratio);
``excess`` = the same over the avoidable part only (minus first uses and prompt tails, which no
memory avoids). Hit rate is token-weighted: reused prompt tokens / prompt tokens.

Traces (three families)
-----------------------
``generated``  agent sessions shaped like the GitHub Copilot coding-agent dataset card
               (:class:`dask_agents.kv.offline.traces.GenParams`: 3.95 turns per session, 7.83 LLM calls and 7.3 tool
               calls per turn, 86% of prompt tokens cached, SAGA's tool latencies).
``telemetry``  recorded here: a dask-agents run (in-process cluster, EMULATED engine and tools,
               time scale 0.01) of coding-agent-like sessions with growing prompts, read back from
               ``da.telemetry(client)`` (saved as CSV beside the JSON) by
               :func:`dask_agents.kv.offline.traces.load_telemetry`. ``--telemetry PATH`` replays a saved frame instead.
``mooncake``   the Mooncake synthetic trace the package ships (or ``$DASK_AGENTS_TRACES``), all 3993
               requests; skipped (and said so) when absent.

Each family is replayed a second time without session ends (``<family>-no-ends``,
:meth:`dask_agents.kv.offline.traces.Trace.without_session_ends`): on the derived traces (Mooncake,
telemetry) the end of a session is hindsight (its last request seen), so a policy's result
with it overstates what it knows online.

Memory sizes
------------
Accelerator only (no host tier: what vLLM's prefix cache has), at several sizes per trace
between its *running peak* (the most blocks its running steps pin at once: the least memory
that serves every step) and its *live peak* (the most blocks its live sessions' latest prompts
hold: above it nothing but finished sessions is ever evicted): running + f x (live - running)
for f in ``--fractions`` (default 0.05, 0.1, 0.25, 0.5). The summary uses these. A second,
tiered configuration (accelerator at the second fraction plus an equal host tier, 25 GB/s)
reports offload/prefetch bytes and restore stall; there every policy that offloads recomputes
about the optimum's tokens and stall is what differs.

Reproduce
---------
::

    .venv/bin/python benchmarks/kv_policies.py --quick --json benchmarks/results/kv-policies-quick.json
    .venv/bin/python benchmarks/kv_policies.py --json benchmarks/results/kv-policies.json

``--quick`` (60 generated sessions, 24 recorded sessions) takes about 6 minutes on 2 cores (every
family twice: with and without session ends); the full run (200 and 64) longer. ``--plot``
(default: next to the JSON) writes a PNG of hit rate vs accelerator memory.

JSON output
-----------
``{"config", "traces": {family: trace summary}, "results": [rows], "summary", "details"}``.
``summary[family]`` holds each policy's recomputed-token ratio to the optimum (``ours``,
``wa_lru``, ``nalar``, ``lru``): the geometric mean over the accelerator-only sizes.
``details[family]`` adds the worst size, the excess ratios, the offline schedule's ratio, the
tiered configuration's stall and bytes per policy, and an ablation: WA-LRU's order with its
thresholds at 1.0 (``wa_lru_demand_only``), which separates what its ordering costs from what
its proactive soft-threshold evictions cost.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import sys
import threading
import time
from dataclasses import replace
from typing import Any

# Run as a script (`python benchmarks/kv_policies.py`): make the repository importable.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from dask_agents.kv.runtime.blocks import CostModel, Tier, Tiers  # noqa: E402
from dask_agents.kv.runtime.policies import Params  # noqa: E402
from dask_agents.kv.offline.replay import OFFLINE, ONLINE, OPTIMUM, Row, format_table, plot, replay, write_json  # noqa: E402
from dask_agents.kv.offline.traces import GenParams, Trace, generate, load_mooncake, load_telemetry, mooncake_path  # noqa: E402

QUICK = {"generated_sessions": 60, "telemetry_sessions": 24}
FULL = {"generated_sessions": 200, "telemetry_sessions": 64}
FRACTIONS = (0.05, 0.1, 0.25, 0.5)
TELEMETRY_TIME_SCALE = 0.01
KINDS = ("file_io", "code_exec", "web_api", "db_query")


# -- (b) a recorded dask-agents run ------------------------------------------------------------
def _session(client, i: int, seed: int, start_delay: float) -> None:
    """One EMULATED coding-agent session: turns of LLM calls on a growing history, tool calls in
    between, a user's think time between turns."""
    import dask_agents as da
    from dask_agents import emulation

    rng = random.Random(f"{seed}:{i}")
    time.sleep(start_delay)
    llm = da.llm("emu")
    tools = {k: da.stub(getattr(emulation, f"{k}_tool")) for k in KINDS}
    system = "You are a careful coding agent. Read the repository, plan, edit, run the tests. " * 60
    history = f"\nTask {i}: " + "r" * rng.randint(2000, 6000)
    with da.session(client, name=f"kv{i}"):
        for _ in range(rng.randint(2, 5)):
            history += "\nUser: " + "u" * rng.randint(100, 600)
            calls = rng.randint(3, 8)
            for c in range(calls):
                r = llm.generate(system + history, max_tokens=rng.randint(20, 200), seed=c).value(300)
                history += "\nAssistant: " + "a" * r.output_tokens
                if c < calls - 1:
                    tools[rng.choice(KINDS)]("q", seed=rng.randint(0, 10**9)).value(300)
                    history += "\nTool: " + "t" * int(rng.lognormvariate(6.5, 1.0))
            time.sleep(rng.uniform(20, 120) * TELEMETRY_TIME_SCALE)  # the user reads and answers


def record_telemetry(path: str, sessions: int, seed: int = 0) -> str:
    """Run ``sessions`` EMULATED sessions on an in-process dask-agents cluster and save
    ``da.telemetry(client)`` as CSV at ``path``."""
    import dask
    from distributed import Client, LocalCluster

    import dask_agents as da

    emu = {"emu": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte", "max-model-len": 131072,
                   "kv-cache-memory-bytes": "64 GiB", "emulation": {"time_scale": TELEMETRY_TIME_SCALE}}}
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in range(sessions):
        delays.append(t)
        t += rng.expovariate(1 / 40) * TELEMETRY_TIME_SCALE  # a session every 40 emulated seconds
    with dask.config.set({"agents.llm.models": emu, "agents.emulation.time-scale": TELEMETRY_TIME_SCALE}):
        with LocalCluster(n_workers=1, processes=False, threads_per_worker=max(8, sessions + 4),
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            da.install(client, models=["emu"])
            threads = [threading.Thread(target=_session, args=(client, i, seed, d), daemon=True)
                       for i, d in enumerate(delays)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            frame = da.telemetry(client)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    frame.to_csv(path, index=False)
    return path


# -- the sweep ---------------------------------------------------------------------------------
def sizes(trace: Trace, cost: CostModel, fractions) -> list[int]:
    """Accelerator bytes at ``running + f x (live - running)`` blocks for each fraction."""
    running, live = trace.peak_running(), trace.peak_footprint()
    return [math.ceil(running + f * (live - running)) * cost.bytes_per_block for f in fractions]


def run_family(trace: Trace, cost: CostModel, params: Params, fractions, tick: float) -> tuple[list[Row], list[Row]]:
    """Accelerator-only rows at every size, and tiered rows at the second size."""
    host = Tiers.from_config().host
    acc_only = [Tiers(Tier("accelerator", b)) for b in sizes(trace, cost, fractions)]

    def progress(r: Row) -> None:
        print(f"    {r.tiers:34s} {r.policy:8s} ratio {r.ratio:6.3f}  hit {r.hit_rate:.3f}  ({r.wall_s:.1f}s)",
              file=sys.stderr, flush=True)

    rows = replay(trace, ONLINE, acc_only, cost, params, tick, progress=progress)
    second = acc_only[min(1, len(acc_only) - 1)]
    tiered = Tiers(second.accelerator, replace(host, capacity=second.accelerator.capacity))
    rows_t = replay(trace, ONLINE, [tiered], cost, params, tick, progress=progress)
    return rows, rows_t


def walru_demand_only(trace: Trace, cost: CostModel, params: Params, fractions, tick: float) -> list[float]:
    """Ablation: WA-LRU's order with its thresholds at 1.0 (evicting only when an arrival needs
    room), at the accelerator-only sizes; ratios to the optimum."""
    from dataclasses import replace as dc_replace

    from dask_agents.kv.offline.optimal import lower_bound
    from dask_agents.kv.runtime.policies import WALRU
    from dask_agents.kv.offline.simulator import Simulator

    p = dc_replace(params, theta_low=1.0, theta_high=1.0)
    out = []
    for b in sizes(trace, cost, fractions):
        t = Tiers(Tier("accelerator", b))
        out.append(Simulator(trace, t, WALRU(p), cost, tick).run().recomputed_tokens
                   / lower_bound(trace, t, cost).recomputed_tokens)
    return out


def gmean(xs: list[float]) -> float:
    """Geometric mean."""
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def summarize(rows: list[Row], tiered: list[Row]) -> tuple[dict, dict]:
    """``summary[family][policy]`` (geometric-mean ratio) and ``details``."""
    summary: dict[str, dict[str, float]] = {}
    details: dict[str, dict[str, Any]] = {}
    for family in dict.fromkeys(r.family for r in rows):
        fam = [r for r in rows if r.family == family]
        summary[family] = {p: gmean([r.ratio for r in fam if r.policy == p])
                           for p in ("ours", "wa_lru", "nalar", "lru")}
        d: dict[str, Any] = {}
        for p in list(ONLINE) + [OFFLINE]:
            mine = [r for r in fam if r.policy == p]
            d[p] = {"ratio_gmean": gmean([r.ratio for r in mine]), "ratio_worst": max(r.ratio for r in mine),
                    "excess_ratio_gmean": gmean([max(r.excess_ratio, 1e-9) for r in mine
                                                 if r.excess_ratio is not None]),
                    "hit_rate_mean": sum(r.hit_rate for r in mine) / len(mine)}
            t = [r for r in tiered if r.family == family and r.policy == p]
            if t:
                d[p]["tiered"] = {"ratio": t[0].ratio, "hit_rate": t[0].hit_rate, "stall_s": t[0].stall_s,
                                  "bytes_offloaded": t[0].bytes_offloaded, "bytes_prefetched": t[0].bytes_prefetched,
                                  "bytes_restored": t[0].bytes_restored}
        details[family] = d
    return summary, details


def print_summary(summary: dict, details: dict) -> None:
    """The closing table: per family, each policy's ratio to the optimum."""
    print("\n  recomputed prefill tokens / optimum (geometric mean over accelerator sizes; worst in brackets)")
    hdr = f"  {'trace family':12s}" + "".join(f" {p:>16s}" for p in ("ours", "wa_lru", "nalar", "lru", "offline"))
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for family, d in details.items():
        cells = "".join(f" {d[p]['ratio_gmean']:7.3f} ({d[p]['ratio_worst']:5.3f})"
                        for p in ("ours", "wa_lru", "nalar", "lru", OFFLINE))
        print(f"  {family:12s}{cells}")
    print("\n  ablation: WA-LRU's order with thresholds at 1.0 (evicts only on demand)")
    for family, d in details.items():
        a = d.get("wa_lru_demand_only")
        if a:
            print(f"  {family:12s} {a['ratio_gmean']:7.3f} ({a['ratio_worst']:5.3f})")
    print("\n  tiered (accelerator + equal host tier): restore stall s (ratio)")
    for family, d in details.items():
        cells = "".join(f" {d[p]['tiered']['stall_s']:8.1f} ({d[p]['tiered']['ratio']:5.3f})"
                        for p in ("ours", "wa_lru", "nalar", "lru", OFFLINE) if "tiered" in d[p])
        print(f"  {family:12s}{cells}")
    print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--plot", metavar="PNG", help="hit rate vs accelerator memory (default: next to --json)")
    p.add_argument("--quick", action="store_true", help="smaller traces (about 6 minutes)")
    p.add_argument("--telemetry", metavar="PATH", help="replay this saved da.telemetry frame instead of recording one")
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS),
                   help="accelerator sizes as fractions from the running peak (0) to the live peak (1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    t_start = time.perf_counter()

    import dask_agents.config as agents_config

    cost = CostModel.from_config()
    params = Params.from_config()
    tick = agents_config.seconds("kv.tick")
    traces: dict[str, Trace] = {}
    notes: dict[str, str] = {}
    print("  building traces", file=sys.stderr, flush=True)
    traces["generated"] = generate(GenParams(sessions=preset["generated_sessions"], seed=args.seed,
                                             block_size=cost.block_size,
                                             prefill_tokens_per_s=cost.prefill_tokens_per_s,
                                             decode_s_per_token=cost.decode_s_per_token))
    tel_path = args.telemetry
    if tel_path is None:
        out_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else os.getcwd()
        tel_path = os.path.join(out_dir, "kv-telemetry" + ("-quick" if args.quick else "") + ".csv")
        t0 = time.perf_counter()
        record_telemetry(tel_path, preset["telemetry_sessions"], args.seed)
        notes["telemetry"] = (f"recorded {preset['telemetry_sessions']} EMULATED sessions in "
                              f"{time.perf_counter() - t0:.1f}s to {tel_path}")
    traces["telemetry"] = load_telemetry(tel_path, cost.block_size, TELEMETRY_TIME_SCALE)
    try:
        traces["mooncake"] = load_mooncake(mooncake_path(), decode_s_per_token=cost.decode_s_per_token)
    except FileNotFoundError as e:
        notes["mooncake"] = f"skipped: {e}"

    # The session-end signal: known on generated traces, hindsight on derived ones (the last
    # request seen); every family is replayed without it too (family "<name>-no-ends").
    for family in list(traces):
        traces[f"{family}-no-ends"] = traces[family].without_session_ends()
    rows: list[Row] = []
    tiered: list[Row] = []
    for family, trace in traces.items():
        print(f"  {family}: {trace.name}", file=sys.stderr, flush=True)
        r, t = run_family(trace, cost, params, args.fractions, tick)
        rows += r
        tiered += t
    summary, details = summarize(rows, tiered)
    for family, trace in traces.items():
        ablation = walru_demand_only(trace, cost, params, args.fractions, tick)
        details[family]["wa_lru_demand_only"] = {"ratio_gmean": gmean(ablation), "ratio_worst": max(ablation)}

    config = {
        "mode": "quick" if args.quick else "full",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "block_size": cost.block_size,
        "bytes_per_block": cost.bytes_per_block,
        "prefill_tokens_per_s": cost.prefill_tokens_per_s,
        "params": {k: getattr(params, k) for k in params.__dataclass_fields__},
        "tick_s": tick,
        "fractions": args.fractions,
        "sizes": "accelerator = running peak + f x (live peak - running peak) blocks; tiered: + equal host",
        "telemetry_time_scale": TELEMETRY_TIME_SCALE,
        "notes": notes,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    print("  configuration:")
    for k, v in config.items():
        print(f"    {k:22s} {v}")
    print()
    for family, trace in traces.items():
        s = trace.summary()
        print(f"  {family}: {s['sessions']} sessions, {s['steps']} steps, "
              f"{s['prompt_tokens'] / 1e6:.1f}M prompt tokens, "
              f"unlimited-cache hit rate {s['unlimited_cache_hit_rate']:.3f}, running peak {s['peak_running_blocks']} "
              f"/ live peak {s['peak_footprint_blocks']} blocks")
    print()
    print(format_table(rows + tiered))
    print_summary(summary, details)
    if args.json:
        path = write_json(args.json, {"config": config, "traces": {f: t.summary() for f, t in traces.items()},
                                      "results": rows + tiered, "summary": summary, "details": details})
        print(f"wrote {path}")
    png = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if png:
        print(f"wrote {plot([r for r in rows if r.policy in (OPTIMUM, *ONLINE)], png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
