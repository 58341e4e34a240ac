"""End-to-end benchmark of agentic workflows on EMULATED resources, frameworks side by side in one run.

Three workflows (``--workflow swe`` (default), ``finance``, ``router``, or ``all``: swe, finance,
router in that order): Open-SWE (below), Financial Analyst and Router (their sections further
down); each has its own summary entry, table and plots. Open-SWE runs under arrival scenarios
(``--scenarios``, below) with seeds and paired ratios: ``summary.swe.<scenario>``; finance and
router keep their single scenario and seed: ``summary.finance``, ``summary.router``.

Every number this prints or stores is EMULATED: the LLM engines are the cost model of
``worker_plugin/emulated.py`` and the tools sleep latencies drawn from ``kv/tool_latency``'s
priors. The comparison is between frameworks driving the same emulated resources with the same
requests; it says nothing about real GPUs.

What is measured
----------------
Open-loop load: requests (one Open-SWE session each: planner -> developers in parallel with
doc-search and code-exec tools -> tester -> seeded retries; ``benchmarks/e2e_swe.py``) arrive by
a seeded arrival process (the scenario's) at each offered load. Per variant, scenario, seed and
load: mean, P50, P95, P99 request latency (arrival to completion), throughput, whether the load
was sustained, the engines' prefix-cache hit rate (token-weighted, ``kv_hit_rate``), the prompt
tokens they computed per request (``prefill_tokens_per_request``: not served from their prefix
cache), how the decode work split between the two replicas (``busiest_engine_share``: 0.5 is
even), and for dask-agents the admission's counters and waits during the run (``admission``:
``counts`` (admitted, held, bound, rebound, waited_out, ...), ``wait_p50_s``/``wait_p99_s`` of
the sessions admitted in the run; the variant entry's ``admission`` has
``da.control(client).stats()["admission"]`` over the cluster's life), for the cap baseline its
driver-side waits for an engine slot (``cap_stats``); per variant and seed the highest load
sustained.

Scenarios, seeds and paired ratios (Open-SWE)
---------------------------------------------
``--scenarios`` (comma list; default all three), every variant on the same requests and arrivals:

- ``stationary``: Poisson arrivals at the offered load (the unit-rate gaps of
  ``e2e_swe.poisson_arrivals`` scaled by the load).
- ``bursty``: a two-state Markov-modulated Poisson process (``e2e_swe.mmpp_arrivals``): the rate
  alternates between 2x and 0.5x the offered load, each state held for an exponential time of
  mean 1.5 s (2x) and 3 s (0.5x) in --quick, 5 s and 10 s in the full run; 1:2, so the
  time-average rate is the offered load. Seeded; the first state is drawn from the stationary
  distribution.
- ``phase``: a phase shift of the requests (``e2e_swe.phase_specs``): Poisson arrivals, the first
  half of the requests as drawn, the second half with their repository context 2x longer (the
  same seeded text, longer; cut back only where a prompt would not fit ``max_model_len``): ~6k
  instead of ~4k fresh prompt tokens per request and ~1.5x the KV working set from mid-run on.

``--seeds N`` (default 1 in --quick, 3 in the full run; seeds ``--seed``, ``--seed``+1, ...): each
seed draws new requests (``make_specs(n, seed)``) and arrivals. The summary's ratios are paired:
per scenario, load and seed, dask-agents against a baseline on that seed's requests and
arrivals; reported as the median over seeds (``<key>``) with the spread (``<key>_spread``:
``min``, ``max``, ``n``, ``per_seed``), never the best seed; ``by_load`` has them at every load.

Capacity: the derived capacity (``results.swe.capacity_rps``, printed) is the highest stationary
load the best static configuration (``dask``) sustains (median over seeds), or the calibration
load when that is the only stationary load of the run; every load is printed as below / at /
above it. --quick runs stationary at 3 and 6 requests/s (below, above) and bursty and phase at 6
(above; bursty's 2x phases far above it); the full run runs every scenario at 3, 5 and 7
(below, at, above).

Workload: every LLM prompt carries its session's history, as agent prompts do (details and
statistics in ``e2e_swe``'s docstring): the system prompt, the issue's repository context
(1.5k-3k tokens, seeded), the plan, the developer's subtask, doc-search answer, earlier
attempt and failure log, or the tester's view of every current patch. ~5.8 LLM calls and
~3,050 prompt tokens per call (quick run, 16 requests), of which 77% are reusable from the session's
earlier calls and the shared system prompt (a perfect cache's hit rate; Copilot's coding
agent: 86% cached), and ~18.5 output tokens per call. So an engine that already holds a
session's KV prefills ~0.02-0.05 s of a call instead of ~0.3 s: where each call runs matters
(prompts that shared only the system prompt would not exercise that).

Resources (identical for every variant)
---------------------------------------
- 2 replicas of one EMULATED engine (model ``coder``; the class
  ``dask_agents.worker_plugin.emulated.EmulatedEngineHost`` in every variant): max_batch 8, 20 ms per
  iteration (+0.05 ms per running sequence), 0.1 ms per non-cached prompt token (no chunked
  prefill), 2048 KV blocks of 16 tokens per replica with vLLM-style prefix reuse (~8
  sessions' histories; 9-10 sessions are in flight at the quick run's higher load), engine
  time scale 0.5 (wall time is half the emulated time); why these figures: ``e2e_swe.ENGINE``.
  The best plain-Dask configuration sustains 5 requests/s and not 8 (measured with the faithful
  engine of issue 14: incremental allocation, preemption, chunked prefill; the derived
  capacity is printed by every run).
- Tools: file_io (doc search) and code_exec latencies from SAGA's priors x 0.1.
- Threads: Dask variants run 2 worker processes (each hosting one engine), agents and tools on
  the workers' threads; peers run tools on 32 threads (= 2 x 16) and agents as coroutines.
- The same requests in every variant: subtask counts, which tester round fails (the rule of
  examples/swe/workflow.py), every tool latency, every prompt (built by ``e2e_swe`` from the
  spec, outputs included) and the arrival times are drawn up front from seeded RNGs. Each run
  (variant x load) uses the same requests with ids prefixed by an 8-character digest of the
  run: the id precedes everything request-specific in a prompt, so prompt lengths are
  identical everywhere and a run's prompts never hit the session-specific cache of an earlier
  run (the shared system prompt is cached everywhere after the warm-up).

Variants
--------
``dask``           plain Dask, no dask-agents (``e2e_baselines.py``): futures passed between
                   tasks, nested waits through ``worker_client()``, LLM tasks call the engine
                   their worker hosts (a small plain WorkerPlugin). Its best static configuration
                   (threads per worker; LLM slots as worker resources; ``routing``: ``none``, or
                   ``session_sticky``, where every LLM task of a request is pinned to one engine
                   worker, chosen at the request's start as the one with the fewest requests
                   pinned, via ``workers=[addr], allow_other_workers=False``: the KV-reuse rule
                   the peers get under the same name) is chosen by a sweep at the calibration
                   load and reported (``results.swe.sweeps.dask``, ``results.swe.scenarios
                   .<scenario>.variants.dask.best_config``). Sweep entries differing only in
                   ``routing`` share a cluster. The sweep runs once (stationary, first seed); its
                   best configuration runs every scenario, seed and load on one fresh cluster.
``dask-capped``    the hand-tuned cap baseline: the best static configuration's cluster (the
                   same one, after ``dask``'s runs) with ``session_sticky`` routing plus a cap on
                   the requests live per engine (``e2e_baselines.CappedPinner``): a request starts
                   only once an engine worker has fewer than ``cap`` requests live, holds that
                   slot until it ends (released on error too), and waits FIFO for the first engine
                   with a free slot (its wait counts in its latency). ``cap`` is swept (2, 4, 6, 8
                   in --quick; 2, 4, 6, 8, 12 in the full run) at each scenario's reference load on
                   every seed, and the best by the static sweep's score (requests lost, then runs
                   not sustained, then the median mean latency) is kept for that scenario, chosen
                   AFTER THE FACT on the very requests it is scored on: a cap no user could tune in
                   advance (``summary.swe.<scenario>.tuned_cap``, ``results.swe.sweeps
                   .dask-capped.<scenario>``).
``dask-agents``    the Open-SWE components (``e2e_swe.py``: examples/swe/workflow.py's agents
                   reading the pre-drawn spec) with ``da.install(client, models=["coder"])``,
                   every default control policy on, admission and late binding of LLM calls on
                   (``agents.scheduler.admission``, defaults), 16 threads per worker (not tuned).
``dask-agents-no-admission``  the same with ``agents.scheduler.admission.enabled: False`` (LLM
                   calls go to an engine as soon as Dask places them).
``dask-agents-no-<policy>``  the same with one policy off (prioritize, balance, reallocate,
                   batching). This workflow has one model and no batchable component, so
                   ``reallocate`` and ``batching`` have nothing to act on: those two ablations
                   show the run-to-run noise. Not in the default variant set (``--variants``).
``ray``            Ray 2.x async engine actors + threaded tool actors, agents as coroutines in
                   the driver (``e2e_peers.py``); best engine-routing rule of a small sweep.
``langgraph``      LangGraph StateGraph with Send for the parallel developers, engines as
                   in-process objects; best engine-routing rule of a small sweep.
Peers that are not importable are skipped, and the output and JSON say so; unless ``--no-peers``
(skip them on purpose) is given, a peer that was asked for and did not run makes the benchmark
exit non-zero (3) at the end, after writing the JSON. A swept variant's number at the
calibration load of the stationary scenario's first seed is its sweep run (same procedure:
warm-up, then the load); its other points run afterwards on a fresh cluster (Dask) or on the
same instance (peers).

Cluster shape and why: Dask variants use ``LocalCluster(n_workers=2, processes=True)``. On
2 cores, in-process workers (``processes=False``) would put the scheduler, both workers, both
engines and the load generator behind one GIL, i.e. on one core, while Ray (processes) gets
both; worker processes also keep each engine's stepping thread away from the scheduler's
event loop, as on a real cluster. The scheduler and the load generator share the main
process (LocalCluster's layout) in both Dask variants alike.

Definitions
-----------
- latency: completion time minus the request's *scheduled* arrival time (driver lag counts).
- ideal latency of a request: its critical path with no queueing and no framework overhead
  (``e2e_swe.ideal_latency``), a lower bound.
- offered (realized): (n - 1) / (last arrival - first arrival) of the arrivals actually used.
- measured window: the completed requests in arrival order without the first 25% of the run's
  arrivals (warm-up: they find the system empty); F and L are its first and last thirds.
- throughput: offered (realized) / b, with the grouped completion slope b = (mean over L of
  (finish_i - ideal_i) - the same over F) / (mean arrival over L - mean arrival over F)
  (``completion_slope``; inf when b <= 0). A system that keeps up has a stationary excess
  delay (b = 1: completions track arrivals); an overloaded one falls behind by (b - 1) seconds
  per second, so it completes requests b times slower than they arrive. Subtracting each
  request's own ideal latency keeps a short run's drain and the heavy tool tail (the same draws
  in every variant) from reading as lost throughput; comparing group means, not a least-squares
  line over all requests, keeps a few end points (the empty-system start, the last requests
  finishing together when the arrivals stop) from flattening the slope.
  ``raw_throughput_rps`` = completed / (last finish - first arrival) is stored too (in a quick
  run it is ~0.55-0.8 x offered for every variant: the drain is a large part of the run).
- latency growth (printed per run, not stored): (mean latency / mean ideal latency over L) /
  (the same over F). Engines that batch a backlog and finish it together hide saturation from
  any throughput estimate in a run of a few seconds, but not from the latency: it grows from F
  to L while a backlog builds (> 1.5), or shrinks when F waited in a backlog that L found
  cleared (< 1/1.5).
- sustained: every request completed, AND throughput >= 0.9 x offered (realized), AND latency
  growth within (1/1.5, 1.5), AND P99 latency <= ``p99_bound_factor`` (3) x the P99 of the
  requests' ideal latencies. (``config.sustained`` states the rule.)
- summary ratios are taken at the reference load (the calibration load; ``summary.swe
  .reference_load_rps``): mean_speedup_vs_X = mean(X) / mean(dask-agents); p99_reduction_vs_X
  = 1 - P99(dask-agents) / P99(X); sustained_load_ratio_vs_X = highest sustained load of
  dask-agents / that of X (null when X sustained none of the loads, or X was skipped). Open-SWE
  (``summary.swe.<scenario>``), each per seed then the median with its spread: X =
  ``best_static`` (``dask``), ``tuned_cap`` (``dask-capped``), ``ray``, ``langgraph``, e.g.
  ``mean_speedup_vs_best_static``, ``p99_reduction_vs_tuned_cap``; a null comparison says why
  in ``null_reasons`` (peer not installed, failed, or ``--no-peers``). Beside them:
  ``tuned_cap``, ``ablations`` (``mean_ratio_off_vs_on`` = mean(ablation) / mean(dask-agents)),
  ``admission`` (dask-agents' admission at the reference load: counters summed over seeds,
  waits the median over seeds), ``at_reference`` (per variant the medians of mean and P99
  latency, KV hit rate and prefilled tokens per request). Finance and router: the same keys
  with X = ``dask``, ``ray``, ``langgraph``, one seed (``summary.<workflow>``).

Financial Analyst workflow (``--workflow finance``)
--------------------------------------------------
``benchmarks/e2e_finance.py`` (its docstring has the details): examples/finance's workflow, one
session per request: 4 analysts in parallel (an EMULATED ``db_query`` tool call from SAGA's
db_query prior x 0.1, then an LLM call), a summarizer (one LLM call), then the user's 1-2
follow-up questions in the same session, each after a think-time pause (0.3-1.2 s in --quick,
1-3 s in the full run; drawn up front). Every prompt carries the session's history: system
prompt, session id, the company's report (~600 tokens of figures + 1.5k-3k tokens of seeded
notes), then the call's own part; a follow-up extends the previous call's prompt (the summary,
earlier questions and answers), so it prefills ~60-100 tokens on the replica holding its
session's KV and ~2.5k-4k elsewhere. 6.35 LLM calls and ~3,300 prompt tokens per call (quick,
seed 0); a perfect prefix cache would serve 80% of the prompt tokens (97% of the follow-ups').
Same methodology as Open-SWE (Poisson arrivals, warm-up, the sustained rule, the same requests
and prompts in every variant with run-unique ids), with these differences:

- request latency = arrival to completion *minus the request's think time* (the user's pauses
  are the same everywhere and would only dilute differences; ``config.finance.latency``); the
  ideal latency excludes them too (``e2e_finance.ideal_latency``). ``raw_throughput_rps``
  counts wall time, pauses included.
- engines: 2 replicas of the Open-SWE engine's cost model at time scale 1.0 (wall = emulated
  time); the best static configurations saturate near 4 requests/s (quick loads 2 and 4).
- variants: ``dask`` (plain Dask, its best static configuration swept as Open-SWE's: threads,
  ``llm_slots``, and ``routing`` ``none`` / ``session_sticky``, the request pinned to one
  engine worker through its pauses), ``dask-agents`` (the finance components
  ``FinanceAnalyst``/``FinanceSummarizer``, all policies), ``dask-agents-no-prioritize``,
  ``dask-agents-no-balance`` (one model and no batchable component: ``reallocate`` and
  ``batching`` cannot act here, so they are not ablated), ``ray`` and ``langgraph`` (the same
  logic on e2e_peers' machinery; LangGraph: a StateGraph per session's analysis, ``Send`` one
  analyst per aspect, then a one-node follow-up graph per question after the pause; routing
  ``least_loaded`` / ``session_sticky`` (+ ``round_robin`` in the full run) by the same sweep).
- per run, the prefix-cache hit rate per call role as the engines reported it to the calls
  (``analysis_kv_hit_rate``, ``summary_kv_hit_rate``, ``followup_kv_hit_rate``: did the
  session's KV survive the pause where the follow-up ran?) and ``followup_mean_s`` (from the
  question, after the pause); printed as a second table.

Router workflow (``--workflow router``)
---------------------------------------
``benchmarks/e2e_router.py`` (its docstring has the details): examples/router's Router workflow
over skewed phases of the Azure LLM 2023 trace (coding-dominant, chat-dominant, coding-dominant;
95% one label per phase; arrival times rescaled to the offered load), EMULATED engines for the
two models ``chat`` and ``coder`` on 4 engine workers. Variants: ``dask`` (plain Dask, the best
STATIC chat/coder split of the 4 workers, swept 1/3, 2/2, 3/1, LLM tasks session-pinned to their
model's workers), ``dask-agents`` (all policies, starting 2/2; reallocation may move workers),
``dask-agents-no-reallocate``, ``ray`` and ``langgraph`` (the same logic: a classifier call on
``coder``, then the chat branch (one ``chat`` call) or the coding branch (draft call, EMULATED
code_exec, final call); 4 engine replicas hosting both models, the best STATIC chat/coder split
of them chosen by plain Dask's sweep (1/3, 2/2, 3/1 at the calibration load), a request's calls
session-sticky within its model's replicas; Ray: engine-replica actors, the logic a coroutine in
the driver; LangGraph: classify -> conditional edge -> chat | code). Per run, ``reassign_done``
counts the reallocations (``reassign-done`` events of ``client.get_events("agents-control")``)
and ``phases`` gives the mean and P99 latency per phase. The quick run has 180 requests (60 per
phase, ~10 s each at 6/s); with the peers' split sweeps that is 11 runs, ~7 minutes on 2 cores
(shorter phases would change what reallocation can do, see ``e2e_router.QUICK``). The trace
files must be in ``../shared/traces`` (or ``$DASK_AGENTS_TRACES``).

Reproduce
---------
::

    .venv/bin/python benchmarks/e2e.py --quick --json benchmarks/results/e2e-quick.json
    .venv/bin/python benchmarks/e2e.py --quick --no-peers --workflow swe --scenarios stationary,bursty,phase \
        --json /tmp/e2e-quick-scen.json
    .venv/bin/python benchmarks/e2e.py --json benchmarks/results/e2e.json
    .venv/bin/python benchmarks/e2e.py --json e2e-bursty.json --scenarios bursty --seeds 5 --caps 4,6,8 \
        --variants dask,dask-capped,dask-agents,dask-agents-no-admission --no-peers
    .venv/bin/python benchmarks/e2e.py --quick --workflow finance --json benchmarks/results/e2e-finance-quick.json
    .venv/bin/python benchmarks/e2e.py --quick --workflow router --json benchmarks/results/e2e-router-quick.json
    .venv/bin/python benchmarks/e2e.py --quick --workflow all --json benchmarks/results/e2e-all-quick.json

Quick vs full (Open-SWE): --quick: 24 requests per point, 1 seed, stationary at 3 and 6
requests/s, bursty and phase at 6, a 5-entry static sweep, caps 2/4/6/8, variants dask,
dask-capped, dask-agents, dask-agents-no-admission (+ ray, langgraph unless --no-peers): 29 runs,
~6-7 minutes on 2 cores with --no-peers. Full: 300 requests per point, 3 seeds, every scenario at
3, 5 and 7 requests/s, the 12-entry static sweep, caps 2/4/6/8/12, the same variants (the
policy ablations through --variants): several hours (~6 h without peers). Finance takes about
5 minutes in --quick, router ~7 (their presets in their modules).

Noise: one run per point and seed on a shared 2-core machine; with one seed (--quick) the
spread is a single value and says nothing about noise: differences of 10-20% in mean latency
between variants that should tie (e.g. the reallocate/batching ablations in Open-SWE) are
usual at 16-24 requests per run; the full run's three seeds and 300 requests are the figures
to quote. The completion-slope throughput of a short or bursty run is noisy (it can read well
above the offered load: a burst's backlog that clears within the window); the latency
percentiles and the sustained verdict are the figures to read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from concurrent.futures import wait as wait_futures
from typing import Any, Callable

# Run as a script (`python benchmarks/e2e.py`): make the repository importable.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
# Peers must not phone home (tracing, usage stats): loopback only.
for _k, _v in {"RAY_USAGE_STATS_ENABLED": "0", "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false",
               "LANGCHAIN_TRACING": "false", "RAY_DEDUP_LOGS": "0"}.items():
    os.environ.setdefault(_k, _v)

import dask  # noqa: E402
import distributed  # noqa: E402

from benchmarks.legacy import e2e_swe as swe  # noqa: E402
from dask_agents import stats  # noqa: E402

POLICIES = ("prioritize", "balance", "reallocate", "batching")
THREADS_AGENTS = 16
PEER_TOOL_THREADS = 32
# No dashboard; the scheduler's small HTTP server (health, metrics) on a free loopback port.
NO_DASHBOARD = {"dashboard_address": "127.0.0.1:0"}
P99_BOUND_FACTOR = 3.0
SUSTAIN_FRACTION = 0.9
WARMUP_FRACTION = 0.25  # the first quarter of a run's arrivals is left out of throughput and growth
LATENCY_GROWTH_MAX = 1.5  # latency of the last third vs the first third: within (1/1.5, 1.5)
EMULATED_NOTE = ("EMULATED: LLM engines are a cost model (worker_plugin/emulated.py) and tools sleep "
                 "latencies from kv/tool_latency priors; no real model or tool ran")

# Loads: the best plain-Dask configuration sustains 5 requests/s and not 8 (e2e_swe.ENGINE on the
# faithful emulated engine), so the quick run's higher (reference) load is above capacity, its
# lower one at about half of it.
# Sweep entries that differ only in ``routing`` share one cluster (adjacent entries, as the peers'
# routings share one instance): warm-up before the first only.
# Scenarios (--scenarios): ``scenario_loads`` overrides ``loads`` per scenario (the reference load
# is always added); ``caps``: the cap baseline's sweep (requests live per engine); ``seeds``: the
# default of --seeds; ``variants``: the default variant set of the Open-SWE workflow.
SCENARIOS = ("stationary", "bursty", "phase")
PEERS = ("ray", "langgraph")
CORE_VARIANTS = ["dask", "dask-capped", "dask-agents", "dask-agents-no-admission"]
QUICK = {"loads": [3.0, 6.0], "requests": 24, "calibration_load": 6.0, "warmup": 4,
         "dask_sweep": [{"threads": 16, "llm_slots": None, "routing": "none"},
                        {"threads": 16, "llm_slots": None, "routing": "session_sticky"},
                        {"threads": 16, "llm_slots": 8, "routing": "none"},
                        {"threads": 32, "llm_slots": None, "routing": "none"},
                        {"threads": 32, "llm_slots": None, "routing": "session_sticky"}],
         "peer_sweep": ["least_loaded", "session_sticky"],
         "scenario_loads": {"bursty": [6.0], "phase": [6.0]}, "caps": [2, 4, 6, 8], "seeds": 1,
         "mmpp_hold_s": list(swe.MMPP_HOLD_QUICK), "phase_context_factor": swe.PHASE_CONTEXT_FACTOR,
         "variants": CORE_VARIANTS + list(PEERS)}
FULL = {"loads": [3.0, 5.0, 7.0], "requests": 300, "calibration_load": 5.0, "warmup": 8,
        "dask_sweep": [{"threads": t, "llm_slots": s, "routing": r} for t in (8, 16, 32) for s in (None, 8)
                       for r in ("none", "session_sticky")],
        "peer_sweep": ["round_robin", "least_loaded", "session_sticky"],
        "scenario_loads": {}, "caps": [2, 4, 6, 8, 12], "seeds": 3,
        "mmpp_hold_s": list(swe.MMPP_HOLD_FULL), "phase_context_factor": swe.PHASE_CONTEXT_FACTOR,
        "variants": CORE_VARIANTS + list(PEERS)}


def close_quietly(*things: Any) -> None:
    """Close clients, clusters and config contexts in order, ignoring errors (best-effort teardown)."""
    for c in things:
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()


# -- statistics --------------------------------------------------------------------------------

def ideal_of(spec) -> float:
    """A request's ideal latency: its own ``ideal_latency()`` (router specs) or the swe model's."""
    f = getattr(spec, "ideal_latency", None)
    return f() if callable(f) else swe.ideal_latency(spec)


def check_outcome(spec, out: dict) -> None:
    f = getattr(spec, "check_outcome", None)
    if callable(f):
        f(out)
    else:
        swe.check_outcome(spec, out)


percentile = stats.percentile  # e2e_router and others read it from here


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def window_stats(records: list[dict], specs: list[swe.RequestSpec], offered: float) -> dict:
    """Completion slope, throughput and latency growth over a run's measured window (docstring).

    The window: the completed requests after the warm-up fraction, in arrival order; its first
    and last thirds are compared as groups, so one request's heavy tool tail, or engines
    finishing a batch of requests together, moves a group's mean rather than an end point."""
    ideal = {s.id: ideal_of(s) for s in specs}
    done = sorted((r for r in records if r.get("ok")), key=lambda r: r["arrival"])
    measured = done[int(len(specs) * WARMUP_FRACTION):]
    g = len(measured) // 3
    out = {"slope": float("nan"), "throughput": float("nan"), "latency_growth": float("nan")}
    if g < 1:
        return out
    first, last = measured[:g], measured[-g:]
    d_a = _mean([r["arrival"] for r in last]) - _mean([r["arrival"] for r in first])
    # (finish - ideal) tracks arrival one-to-one while the system keeps up.
    # (arrival + latency is the finish, less the user's think time where a workflow has one)
    d_d = (_mean([r["arrival"] + r["latency"] - ideal[r["id"]] for r in last])
           - _mean([r["arrival"] + r["latency"] - ideal[r["id"]] for r in first]))
    if d_a > 0:
        out["slope"] = d_d / d_a
        out["throughput"] = offered / out["slope"] if out["slope"] > 0 else float("inf")

    def slowdown(rs: list[dict]) -> float:  # latency relative to the group's own ideal work
        return _mean([r["latency"] for r in rs]) / _mean([ideal[r["id"]] for r in rs])

    out["latency_growth"] = slowdown(last) / slowdown(first)
    return out


def load_metrics(records: list[dict], specs: list[swe.RequestSpec], rate: float) -> dict:
    """Latency percentiles, throughput and the sustained verdict of one run (see the docstring)."""
    n = len(specs)
    ideal = {s.id: ideal_of(s) for s in specs}
    arrivals = [r["arrival"] for r in records]
    done = [r for r in records if r.get("ok")]
    lat = [r["latency"] for r in done]
    span_a = max(arrivals) - min(arrivals) if len(arrivals) > 1 else float("nan")
    offered = (n - 1) / span_a if n > 1 and span_a > 0 else rate
    w = window_stats(records, specs, offered)
    slope, thr, growth = w["slope"], w["throughput"], w["latency_growth"]
    raw = len(done) / (max(r["finish"] for r in done) - min(arrivals)) if done else float("nan")
    ideal_sorted = sorted(ideal.values())
    bound = P99_BOUND_FACTOR * percentile(ideal_sorted, 99)
    p99 = percentile(lat, 99)
    ok = len(done) == n
    sustained = bool(ok and thr >= SUSTAIN_FRACTION * offered
                     and 1.0 / LATENCY_GROWTH_MAX < growth < LATENCY_GROWTH_MAX and p99 <= bound)
    excess = [r["latency"] - ideal[r["id"]] for r in done]
    return {
        "offered_rps": rate, "offered_realized_rps": offered, "requests": n, "completed": len(done),
        "failed": [r.get("error") for r in records if not r.get("ok")][:5],
        "mean_s": statistics.fmean(lat) if lat else float("nan"), "p50_s": percentile(lat, 50),
        "p95_s": percentile(lat, 95), "p99_s": p99, "max_s": max(lat) if lat else float("nan"),
        "throughput_rps": thr, "raw_throughput_rps": raw, "completion_slope": slope, "sustained": sustained,
        "p99_bound_s": bound, "mean_excess_over_ideal_s": statistics.fmean(excess) if excess else float("nan"),
        "ideal_mean_s": statistics.fmean(ideal.values()), "wall_s": None,
        "latencies_s": sorted(round(x, 4) for x in lat),  # the CDF plot's data
    }


def cache_delta(before: list[dict], after: list[dict]) -> dict:
    """Prefix-cache hit rate (token-weighted) and prefill tokens of the engines during one run."""
    q = sum(a.get("queries", 0) for a in after) - sum(b.get("queries", 0) for b in before)
    h = sum(a.get("hits", 0) for a in after) - sum(b.get("hits", 0) for b in before)
    pf = sum(a.get("prefill_tokens", 0) for a in after) - sum(b.get("prefill_tokens", 0) for b in before)
    ev = sum(a.get("evictions", 0) for a in after) - sum(b.get("evictions", 0) for b in before)
    # Decode tokens each replica produced in the run (how evenly the load was spread).
    share = ([a.get("decode_tokens", 0) - b.get("decode_tokens", 0) for a, b in zip(after, before)]
             if len(after) == len(before) else [])
    busiest = max(share) / sum(share) if share and sum(share) > 0 else float("nan")
    return {"engines": len(after), "kv_hit_rate": h / q if q else float("nan"), "prompt_tokens": q,
            "prefill_tokens": pf, "evictions": ev, "decode_tokens_per_engine": share,
            "busiest_engine_share": busiest}


# -- load generators ---------------------------------------------------------------------------

def make_record(spec, arrival: float, finish: float, out: dict | None, err: str | None) -> dict:
    """One request's record. ``latency`` = finish - arrival, less the user's think time
    (``spec.pause_s``, the finance workflow's pauses before its follow-ups; 0 elsewhere): the
    pauses are the user's, the same in every variant. ``stats``: what the request reported of
    its LLM calls (finance: prompt and cached tokens per role), if anything."""
    rec = {"id": spec.id, "arrival": arrival, "finish": finish,
           "latency": finish - arrival - getattr(spec, "pause_s", 0.0), "ok": err is None, "error": err}
    if isinstance(out, dict) and "stats" in out:
        rec["stats"] = out["stats"]
    return rec


def _record(spec: swe.RequestSpec, arrival: float, t0: float, fn: Callable[[], dict]) -> dict:
    out = None
    try:
        out = fn()
        check_outcome(spec, out)
        err = None
    except Exception as e:  # a failed request is recorded, never fatal
        err = f"{type(e).__name__}: {e}"[:300]
    return make_record(spec, arrival, time.perf_counter() - t0, out, err)


def drive_threads(solve: Callable[[swe.RequestSpec], dict], specs: list[swe.RequestSpec],
                  arrivals: list[float], timeout: float) -> list[dict]:
    """Open-loop driver for blocking clients: each request starts at its arrival, in its own thread."""
    records: list[dict | None] = [None] * len(specs)
    pool = ThreadPoolExecutor(max_workers=max(1, len(specs)), thread_name_prefix="e2e-request")
    t0 = time.perf_counter() + 0.05

    def one(i: int) -> None:
        records[i] = _record(specs[i], arrivals[i], t0, lambda: solve(specs[i]))

    futs = []
    for i, a in enumerate(arrivals):
        delay = t0 + a - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        futs.append(pool.submit(one, i))
    wait_futures(futs, timeout=max(0.0, t0 + arrivals[-1] + timeout - time.perf_counter()))
    pool.shutdown(wait=False, cancel_futures=True)
    return [r if r is not None else {"id": s.id, "arrival": a, "finish": float("nan"), "latency": float("nan"),
                                     "ok": False, "error": "timed out"}
            for r, s, a in zip(records, specs, arrivals)]


async def drive_async(solve, specs: list[swe.RequestSpec], arrivals: list[float], timeout: float) -> list[dict]:
    """Open-loop driver for asyncio peers: each request is a task started at its arrival."""
    import asyncio

    t0 = time.perf_counter() + 0.05
    records: list[dict | None] = [None] * len(specs)

    async def one(i: int) -> None:
        spec, out = specs[i], None
        try:
            out = await solve(spec)
            check_outcome(spec, out)
            err = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}"[:300]
        records[i] = make_record(spec, arrivals[i], time.perf_counter() - t0, out, err)

    tasks = []
    for i, a in enumerate(arrivals):
        delay = t0 + a - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + arrivals[-1] + timeout - time.perf_counter()))
    for t in pending:
        t.cancel()
    return [r if r is not None else {"id": s.id, "arrival": a, "finish": float("nan"), "latency": float("nan"),
                                     "ok": False, "error": "timed out"}
            for r, s, a in zip(records, specs, arrivals)]


# -- Dask backends -----------------------------------------------------------------------------

class DaskBackend:
    """Plain Dask (no dask-agents): 2 worker processes, each hosting one EMULATED engine.

    ``engine``: its emulation parameters (default: the Open-SWE engine); ``solve(client, spec,
    llm_slots, pinner)``: the workflow's plain-Dask driver (default: Open-SWE's)."""

    kind = "dask"

    def __init__(self, threads: int = 16, llm_slots: int | None = None, workers: int = 2, routing: str = "none",
                 engine: dict | None = None, solve: Callable | None = None, cap: int | None = None):
        from benchmarks.legacy.e2e_baselines import ROUTINGS

        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r} (known: {', '.join(ROUTINGS)})")
        self.threads, self.llm_slots, self.workers, self.routing = threads, llm_slots, workers, routing
        self.engine, self.solve = engine, solve
        # dask-capped: at most ``cap`` requests live per engine worker (session-sticky; driver-side,
        # so it can change between runs on one cluster, as ``routing`` does)
        self.cap = cap
        self.cluster = self.client = None
        self.worker_addrs: list[str] = []
        self._pinner = None

    def describe(self) -> dict:
        return {"framework": f"dask/distributed {distributed.__version__}, no dask-agents",
                "cluster": f"LocalCluster(n_workers={self.workers}, threads_per_worker={self.threads}, processes=True)",
                "threads": self.threads, "llm_slots": self.llm_slots,
                "llm_placement": (f"LLM tasks need resource LLM=1; each worker has LLM={self.llm_slots}"
                                  if self.llm_slots else "LLM tasks on any worker thread"),
                "routing": self.routing,
                "llm_routing": (f"session_sticky, capped: a request starts only once an engine worker has fewer "
                                f"than {self.cap} requests live (FIFO wait in the driver, slot held for the "
                                f"request's life), then its LLM tasks are pinned there"
                                if self.cap else
                                "session_sticky: a request's LLM tasks pinned to one engine worker (fewest requests "
                                "pinned at its start), workers=[addr], allow_other_workers=False"
                                if self.routing == "session_sticky" else "none: Dask places every LLM task"),
                "cap": self.cap, "stealing": "Dask default (on)"}

    def __enter__(self) -> "DaskBackend":
        from distributed import Client, LocalCluster

        from benchmarks.legacy.e2e_baselines import EngineHostPlugin

        kw = {"resources": {"LLM": self.llm_slots}} if self.llm_slots else {}
        self.cluster = LocalCluster(n_workers=self.workers, threads_per_worker=self.threads, processes=True,
                                    dashboard_address=None, scheduler_kwargs=NO_DASHBOARD, **kw)
        self.client = Client(self.cluster)
        self.client.register_plugin(EngineHostPlugin(self.engine))
        self.client.wait_for_workers(self.workers)
        self.worker_addrs = sorted(self.client.scheduler_info()["workers"])  # each hosts one engine
        return self

    def __exit__(self, *exc: Any) -> None:
        close_quietly(self.client, self.cluster)

    def engine_stats(self) -> list[dict]:
        from benchmarks.legacy.e2e_baselines import engine_stats

        return [s for s in self.client.run(engine_stats).values() if s is not None]

    def run(self, specs, arrivals, timeout: float) -> list[dict]:
        from benchmarks.legacy.e2e_baselines import CappedPinner, SessionPinner, solve_dask

        if self.cap:
            pinner = CappedPinner(self.worker_addrs, self.cap)
        else:
            pinner = SessionPinner(self.worker_addrs) if self.routing == "session_sticky" else None
        self._pinner = pinner
        solve = self.solve or solve_dask
        try:
            return drive_threads(lambda s: solve(self.client, s, self.llm_slots, pinner), specs, arrivals, timeout)
        finally:
            if isinstance(pinner, CappedPinner):
                pinner.close()  # a run that timed out: requests still waiting for a slot give up

    def probe(self) -> None:
        return None

    def run_extra(self, probe: Any = None) -> dict:
        """Per-run extras: the cap baseline's driver-side waits for an engine slot."""
        from benchmarks.legacy.e2e_baselines import CappedPinner

        return {"cap_stats": self._pinner.stats()} if isinstance(self._pinner, CappedPinner) else {}

    def extra(self) -> dict:
        return {}


def _admission_state(dask_scheduler) -> dict | None:
    """``run_on_scheduler`` helper: the admission's counters and the waits of its latest
    admissions (one per admitted session, oldest first; at most the last 1000)."""
    from dask_agents.scheduler_plugin.plugin import NAME

    adm = getattr(dask_scheduler.plugins.get(NAME), "admission", None)
    if adm is None:
        return None
    return {"enabled": bool(adm.enabled), "counts": dict(adm.counts), "waits": list(adm.waits)}


def admission_delta(before: dict | None, after: dict | None) -> dict:
    """One run's admission: counters (after - before) and the admitted sessions' waits."""
    import numpy as np

    if after is None:
        return {"error": "no admission state on the scheduler"}
    b = (before or {}).get("counts", {})
    counts = {k: v - b.get(k, 0) for k, v in after["counts"].items() if v - b.get(k, 0)}
    k = counts.get("admitted", 0)
    waits = np.asarray(after["waits"][-k:] if k else [], dtype=float)
    return {"enabled": after["enabled"], "counts": counts,
            "wait_p50_s": percentile(waits, 50) if waits.size else None,
            "wait_p99_s": percentile(waits, 99) if waits.size else None,
            "wait_max_s": float(waits.max()) if waits.size else None}


def _agents_engine_stats(dask_worker) -> dict | None:
    plugin = dask_worker.plugins.get("dask-agents")
    engines = getattr(plugin, "engines", None)
    if engines is None or swe.MODEL not in engines.hosted:
        return None
    return engines.start(swe.MODEL).stats()  # start() returns the running host


class AgentsBackend:
    """dask-agents installed, EMULATED model ``coder`` hosted on both workers; ``disabled`` policy off.

    ``entry``: the model's ``agents.llm.models`` entry (default: the Open-SWE engine's);
    ``solve(client, spec)``: the workflow's dask-agents driver (default: Open-SWE's)."""

    kind = "dask-agents"

    def __init__(self, disabled: str | None = None, threads: int = THREADS_AGENTS, workers: int = 2,
                 entry: dict | None = None, solve: Callable | None = None):
        self.disabled, self.threads, self.workers = disabled, threads, workers
        self.entry, self.solve = entry, solve
        self.cluster = self.client = None
        self._config: contextlib.ExitStack | None = None

    def settings(self) -> dict:
        out: dict = {"agents.llm.models": {swe.MODEL: self.entry or swe.model_entry()}}
        if self.disabled == "admission":  # dask-agents-no-admission: LLM calls go to engines at once
            out["agents.scheduler.admission.enabled"] = False
        elif self.disabled:
            out[f"agents.control.policies.{self.disabled}.enabled"] = False
        return out

    def describe(self) -> dict:
        import dask_agents as da

        return {"framework": f"dask-agents {da.__version__} on dask/distributed {distributed.__version__}",
                "cluster": f"LocalCluster(n_workers={self.workers}, threads_per_worker={self.threads}, processes=True)",
                "threads": self.threads, "install": f"da.install(client, models=[{swe.MODEL!r}])",
                "policies_off": [self.disabled] if self.disabled and self.disabled != "admission" else [],
                "admission": self.disabled != "admission"}

    def __enter__(self) -> "AgentsBackend":
        from distributed import Client, LocalCluster

        import dask_agents as da

        self._config = contextlib.ExitStack()
        # Before the cluster: the worker processes get this config (the model registry).
        self._config.enter_context(dask.config.set(self.settings()))
        self.cluster = LocalCluster(n_workers=self.workers, threads_per_worker=self.threads, processes=True,
                                    dashboard_address=None, scheduler_kwargs=NO_DASHBOARD)
        self.client = Client(self.cluster)
        da.install(self.client, models=[swe.MODEL])
        return self

    def __exit__(self, *exc: Any) -> None:
        close_quietly(self.client, self.cluster, self._config)

    def engine_stats(self) -> list[dict]:
        return [s for s in self.client.run(_agents_engine_stats).values() if s is not None]

    def run(self, specs, arrivals, timeout: float) -> list[dict]:
        solve = self.solve or swe.solve_agents
        return drive_threads(lambda s: solve(self.client, s), specs, arrivals, timeout)

    def probe(self) -> dict | None:
        try:
            return self.client.run_on_scheduler(_admission_state)
        except Exception:  # stats are a nice-to-have
            return None

    def run_extra(self, probe: Any = None) -> dict:
        """Per-run extras: the admission's counters and waits during the run."""
        try:
            return {"admission": admission_delta(probe, self.client.run_on_scheduler(_admission_state))}
        except Exception as e:
            return {"admission": {"error": repr(e)}}

    def extra(self) -> dict:
        """The control loop's and the admission's counters over the cluster's life (warm-up included)."""
        import dask_agents as da

        try:
            st = da.control(self.client).stats()
            adm = st.get("admission") or {}
            return {"control": {k: st.get(k) for k in ("policies", "ticks", "tick_seconds_p50", "tick_seconds_p99",
                                                           "policy_errors", "applied", "rejected")},
                    "admission": {k: adm.get(k) for k in ("enabled", "counts", "wait_p50_s", "wait_p99_s")}}
        except Exception as e:  # stats are a nice-to-have
            return {"control": {"error": repr(e)}}


# -- running a variant ---------------------------------------------------------------------------

def specs_for(base: list[swe.RequestSpec], tag: str) -> list[swe.RequestSpec]:
    """The same requests with ids prefixed by a fixed-length digest of ``tag``: fresh
    session-specific prompt text for every run (the id precedes everything request-specific in
    a prompt, and the engine's block hashes are chained), the same prompt lengths everywhere."""
    import hashlib

    prefix = hashlib.sha1(tag.encode()).hexdigest()[:8]
    return [swe.with_id(s, f"{prefix}-{s.issue.id}") for s in base]


def load_key(rate: float) -> str:
    return format(rate, "g")


@dataclass(frozen=True)
class Workflow:
    """What the generic runners need of a Poisson-arrival workflow (Open-SWE by default; the
    finance workflow builds its own in ``e2e_finance.workflow``).

    ``make_specs(n, seed)``: the base requests; ``specs_for(base, tag)``: the same requests with
    run-unique ids; ``arrivals(n, rate, seed)``: arrival offsets; ``dask_backend(**cfg)``: plain
    Dask with a sweep entry's configuration; ``agents_backend(disabled)``: dask-agents with one
    policy off (None: all on); ``make_peer(name, tool_threads, routing)``: a peer backend;
    ``policies``: the policies whose ablations run; ``run_metrics(records, specs)``: extra
    metrics of one run (or None); ``phase_specs(specs, factor)``: the ``phase`` scenario's
    requests (None: the workflow has no phase scenario)."""

    name: str
    make_specs: Callable
    specs_for: Callable
    arrivals: Callable
    dask_backend: Callable
    agents_backend: Callable
    make_peer: Callable
    policies: tuple = POLICIES
    run_metrics: Callable | None = None
    phase_specs: Callable | None = None


def _swe_peer(name: str, tool_threads: int = PEER_TOOL_THREADS, routing: str = "least_loaded"):
    from benchmarks.legacy import e2e_peers

    return e2e_peers.make(name, tool_threads=tool_threads, routing=routing)


def swe_workflow() -> Workflow:
    return Workflow("swe", swe.make_specs, specs_for, swe.poisson_arrivals, DaskBackend,
                    lambda disabled=None: AgentsBackend(disabled=disabled), _swe_peer,
                    phase_specs=swe.phase_specs)


def run_loads(backend, base: list[swe.RequestSpec], loads: list[float], seed: int, warmup: int,
              tag: str, log: Callable[[str], None], measured: dict | None = None,
              wf: Workflow | None = None) -> dict:
    """Warm the backend up, then run every load in ascending order; metrics per load.

    ``measured``: loads already measured for this configuration (its sweep run), kept as they are."""
    wf = wf or swe_workflow()
    out: dict[str, dict] = dict(measured or {})
    loads = [r for r in loads if load_key(r) not in out]
    if not loads:
        return out
    if warmup:
        warm_up(backend, wf, warmup, seed, tag)
    for rate in sorted(loads):
        out[load_key(rate)] = run_point(backend, wf, base, wf.arrivals(len(base), rate, seed), rate,
                                        f"{tag}-L{load_key(rate)}", log, label=tag)
    return out


def warm_up(backend, wf: Workflow, n: int, seed: int, tag: str) -> None:
    """``n`` requests of their own (seed + 10000), 0.25 s apart: engines, caches of the shared
    system prompt and the clients warm before anything is measured."""
    warm = wf.specs_for(wf.make_specs(n, seed + 10_000), f"{tag}-warm")
    backend.run(warm, [0.25 * i for i in range(len(warm))], timeout=120)


def run_point(backend, wf: Workflow, base: list, arrivals: list[float], rate: float, tag: str,
              log: Callable[[str], None], label: str | None = None) -> dict:
    """One measured run: ``base``'s requests (ids made unique by ``tag``) at ``arrivals``.

    Metrics of :func:`load_metrics`, the engines' counters during the run (:func:`cache_delta`;
    ``prefill_tokens_per_request``: prompt tokens the engines computed, i.e. not served from
    their prefix cache, per request), the backend's per-run extras (dask-agents: ``admission``;
    the cap baseline: ``cap_stats``) and the workflow's own run metrics."""
    specs = wf.specs_for(base, tag)
    before = backend.engine_stats()
    probe = backend.probe() if hasattr(backend, "probe") else None
    t = time.perf_counter()
    records = backend.run(specs, arrivals, timeout=max(60.0, 10 * len(specs) / rate))
    wall = time.perf_counter() - t
    m = load_metrics(records, specs, rate)
    m["wall_s"] = wall
    m.update(cache_delta(before, backend.engine_stats()))
    m["prefill_tokens_per_request"] = m["prefill_tokens"] / len(specs) if specs else float("nan")
    if hasattr(backend, "run_extra"):
        m.update(backend.run_extra(probe))
    if wf.run_metrics is not None:
        m.update(wf.run_metrics(records, specs))
    growth = window_stats(records, specs, m["offered_realized_rps"])["latency_growth"]
    fu = (f" follow-up kv {m['followup_kv_hit_rate']:.0%}"
          if isinstance(m.get("followup_kv_hit_rate"), float) and math.isfinite(m["followup_kv_hit_rate"]) else "")
    more = ""
    if isinstance(m.get("admission"), dict) and m["admission"].get("wait_p99_s") is not None:
        more = f" adm wait p99 {m['admission']['wait_p99_s']:.2f}s"
    elif isinstance(m.get("cap_stats"), dict) and m["cap_stats"].get("wait_p99_s") is not None:
        more = f" cap wait p99 {m['cap_stats']['wait_p99_s']:.2f}s"
    log(f"    {label or tag:36s} load {rate:4g}/s: mean {m['mean_s']:.2f}s p99 {m['p99_s']:.2f}s "
        f"thr {m['throughput_rps']:.2f}/s growth x{growth:.2f} kv {m.get('kv_hit_rate', float('nan')):.0%}{fu} "
        f"prefill/req {m['prefill_tokens_per_request']:.0f}{more} "
        f"{'sustained' if m['sustained'] else 'NOT sustained'} "
        f"({m['completed']}/{m['requests']} done, {wall:.1f}s)")
    return m


def max_sustained(loads: dict[str, dict]) -> float:
    """Highest offered load sustained (0.0 if none)."""
    ok = [m["offered_rps"] for m in loads.values() if m.get("sustained")]
    return max(ok) if ok else 0.0


def sweep_score(m: dict) -> tuple:
    """Best static configuration: all requests done, then sustained, then lowest mean latency."""
    mean = m["mean_s"] if math.isfinite(m["mean_s"]) else float("inf")
    return (m["completed"] < m["requests"], not m["sustained"], mean)


def run_variant(name: str, make_backend: Callable[[], Any], base, loads, seed, warmup, log,
                measured: dict | None = None, wf: Workflow | None = None) -> dict:
    t = time.perf_counter()
    with make_backend() as b:
        res = {"description": b.describe(),
               "loads": run_loads(b, base, loads, seed, warmup, name if wf is None or wf.name == "swe"
                                  else f"{wf.name}-{name}", log, measured, wf)}
        res.update(b.extra())
    res["max_sustained_rps"] = max_sustained(res["loads"])
    res["wall_s"] = time.perf_counter() - t
    return res


def run_dask_sweep(configs: list[dict], base, load: float, seed: int, warmup: int, log,
                   wf: Workflow | None = None) -> list[dict]:
    """Plain Dask's static configurations at the calibration load. Each cluster shape (threads,
    llm_slots) runs on a fresh cluster, warmed up once; adjacent entries that differ only in
    ``routing`` (a driver-side choice) reuse it, as the peers' routings share one instance."""
    wf = wf or swe_workflow()
    out = []
    with contextlib.ExitStack() as stack:
        b, shape = None, None
        for cfg in configs:
            routing = cfg.get("routing", "none")
            cfg_shape = {k: v for k, v in cfg.items() if k != "routing"}
            fresh = b is None or cfg_shape != shape
            if fresh:
                stack.close()
                b, shape = stack.enter_context(wf.dask_backend(**cfg)), cfg_shape
            b.routing = routing
            tag = f"dask-sweep-t{cfg['threads']}-s{cfg['llm_slots']}-{routing}"
            if wf.name != "swe":
                tag = f"{wf.name}-{tag}"
            m = run_loads(b, base, [load], seed, warmup if fresh else 0, tag, log, wf=wf)[load_key(load)]
            out.append({"config": cfg, "metrics": m})
    return out


def peer_available(name: str) -> tuple[bool, str]:
    """Whether a peer framework can be imported (and its version, or why not)."""
    import importlib

    try:
        mod = importlib.import_module(name)
        if name == "langgraph":
            from importlib.metadata import version

            return True, version("langgraph")
        return True, getattr(mod, "__version__", "?")
    except Exception as e:
        return False, f"not importable ({type(e).__name__}: {e})"


def run_peer(name: str, preset: dict, base, loads, seed, warmup, log,
             wf: Workflow | None = None) -> tuple[dict, list[dict]]:
    """Sweep a peer's routing rule at the calibration load, then run every load with the best."""
    wf = wf or swe_workflow()
    cal = preset["calibration_load"]
    pre = "" if wf.name == "swe" else f"{wf.name}-"
    t = time.perf_counter()
    with wf.make_peer(name, tool_threads=PEER_TOOL_THREADS) as b:
        sweep = []
        for routing in preset["peer_sweep"]:
            b.routing = routing
            m = run_loads(b, base, [cal], seed, warmup if not sweep else 0, f"{pre}{name}-sweep-{routing}", log,
                          wf=wf)
            sweep.append({"config": {"routing": routing}, "metrics": m[load_key(cal)]})
        chosen = min(sweep, key=lambda r: sweep_score(r["metrics"]))
        best = chosen["config"]
        b.routing = best["routing"]
        res = {"description": b.describe(),
               "loads": run_loads(b, base, loads, seed, 0, f"{pre}{name}", log, {load_key(cal): chosen["metrics"]},
                                  wf=wf)}
    res["best_config"] = best
    res["max_sustained_rps"] = max_sustained(res["loads"])
    res["wall_s"] = time.perf_counter() - t
    return res, sweep


# -- scenarios, seeds, the cap baseline (the Open-SWE workflow's main path) ------------------------

def scenario_loads(preset: dict, scenario: str) -> list[float]:
    """The offered loads of ``scenario``: ``preset["scenario_loads"][scenario]`` or ``loads``, with
    the reference (calibration) load always among them."""
    loads = (preset.get("scenario_loads") or {}).get(scenario) or preset["loads"]
    return sorted(set(loads) | {preset["calibration_load"]})


def scenario_specs(wf: Workflow, preset: dict, scenario: str, seed: int) -> list:
    """The requests of ``scenario`` for ``seed`` (the phase scenario: the second half's context longer)."""
    base = wf.make_specs(preset["requests"], seed)
    if scenario == "phase":
        if wf.phase_specs is None:
            raise ValueError(f"the {wf.name} workflow has no phase scenario")
        base = wf.phase_specs(base, preset.get("phase_context_factor", swe.PHASE_CONTEXT_FACTOR))
    elif scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})")
    return base


def scenario_arrivals(wf: Workflow, preset: dict, scenario: str, n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets of ``scenario``: Poisson (stationary, phase) or the two-state MMPP (bursty)."""
    if scenario == "bursty":
        return swe.mmpp_arrivals(n, rate, seed, tuple(preset.get("mmpp_hold_s", swe.MMPP_HOLD_QUICK)))
    if scenario in SCENARIOS:
        return wf.arrivals(n, rate, seed)
    raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})")


class Points:
    """Every measured point of a scenario run (scenario x seed x load), its requests drawn once:
    every variant runs exactly these requests at exactly these arrivals."""

    def __init__(self, wf: Workflow, preset: dict, scenarios: list[str], seeds: list[int]):
        self.wf, self.preset, self.scenarios, self.seeds = wf, preset, list(scenarios), list(seeds)
        self.loads = {sc: scenario_loads(preset, sc) for sc in self.scenarios}
        self.specs = {(sc, seed): scenario_specs(wf, preset, sc, seed) for sc in self.scenarios for seed in self.seeds}

    def arrivals(self, sc: str, seed: int, rate: float) -> list[float]:
        return scenario_arrivals(self.wf, self.preset, sc, len(self.specs[(sc, seed)]), rate, seed)

    def each(self):
        for sc in self.scenarios:
            for seed in self.seeds:
                for rate in self.loads[sc]:
                    yield sc, seed, rate


def _slot(store: dict, sc: str, name: str, seed: int) -> dict:
    return store[sc].setdefault(name, {}).setdefault("seeds", {}).setdefault(str(seed), {"loads": {}})["loads"]


def _run_points(name: str, backend, pts: Points, store: dict, log, only: Callable | None = None,
                measured: dict | None = None, tag: str | None = None) -> None:
    """Run ``backend`` at every point (``only(sc, seed, rate)``: a subset) not measured yet;
    ``measured``: {(scenario, seed, load key): metrics} already measured (a sweep's run)."""
    for sc, seed, rate in pts.each():
        if only is not None and not only(sc, seed, rate):
            continue
        slot, key = _slot(store, sc, name, seed), load_key(rate)
        if key in slot:
            continue
        if measured and (sc, seed, key) in measured:
            slot[key] = measured[(sc, seed, key)]
            continue
        t = f"{tag or name}-{sc}-s{seed}"
        slot[key] = run_point(backend, pts.wf, pts.specs[(sc, seed)], pts.arrivals(sc, seed, rate), rate,
                              f"{t}-L{key}", log, label=t)


def multi_score(ms: list[dict]) -> tuple:
    """:func:`sweep_score` over seeds: requests lost, then runs not sustained, then the median mean latency."""
    means = [m["mean_s"] if math.isfinite(m["mean_s"]) else float("inf") for m in ms]
    return (sum(m["completed"] < m["requests"] for m in ms), sum(not m["sustained"] for m in ms),
            statistics.median(means) if means else float("inf"))


def _tune_cap(b, pts: Points, sc: str, caps: list[int], store: dict, log) -> tuple[int, list[dict]]:
    """The cap baseline's sweep at the reference load of ``sc`` (every seed), the best cap by
    :func:`multi_score`; the chosen cap's runs become the variant's runs there."""
    cal, rows = pts.preset["calibration_load"], []
    key = load_key(cal)
    for cap in caps:
        b.cap = cap
        row = {"cap": cap, "seeds": {}}
        for seed in pts.seeds:
            t = f"dask-cap{cap}-{sc}-s{seed}"
            row["seeds"][str(seed)] = run_point(b, pts.wf, pts.specs[(sc, seed)], pts.arrivals(sc, seed, cal), cal,
                                                f"{t}-L{key}", log, label=t)
        rows.append(row)
    best = min(rows, key=lambda r: multi_score(list(r["seeds"].values())))
    for seed in pts.seeds:
        _slot(store, sc, "dask-capped", seed)[key] = best["seeds"][str(seed)]
    return best["cap"], rows


def run_scenarios(preset: dict, variants: list[str], scenarios: list[str], seeds: list[int],
                  log: Callable[[str], None] = print, wf: Workflow | None = None) -> dict:
    """Every selected variant at every point (scenario x seed x load) of ``preset``, on the same
    requests and arrivals; returns ``{"capacity_rps", "capacity_note", "scenarios": {scenario:
    {"loads_rps", "seeds", "variants": {name: {..., "seeds": {seed: {"loads", "max_sustained_rps"}}}}}},
    "sweeps"}``. Order: plain Dask's static sweep (stationary, first seed, calibration load), its
    best configuration at every point, the cap baseline on that cluster (caps swept at each
    scenario's reference load, the best kept), then each dask-agents variant and each peer on a
    cluster (instance) of its own, warmed up once."""
    wf = wf or swe_workflow()
    pts = Points(wf, preset, scenarios, seeds)
    cal, warmup, key = preset["calibration_load"], preset["warmup"], load_key(preset["calibration_load"])
    store: dict[str, dict] = {sc: {} for sc in scenarios}
    sweeps: dict[str, Any] = {}
    extras: dict[str, dict] = {}
    stationary = scenario_specs(wf, preset, "stationary", seeds[0])
    t_start = time.perf_counter()

    if {"dask", "dask-capped"} & set(variants):
        if not preset["dask_sweep"]:
            raise ValueError("plain Dask needs a non-empty dask_sweep")
        log(f"  plain Dask: static-configuration sweep (stationary, seed {seeds[0]}, {cal:g} requests/s)")
        sweeps["dask"] = run_dask_sweep(preset["dask_sweep"], stationary, cal, seeds[0], warmup, log, wf)
        chosen = min(sweeps["dask"], key=lambda r: sweep_score(r["metrics"]))
        best = chosen["config"]
        log(f"  plain Dask: best static configuration {best}")
        measured = {("stationary", seeds[0], key): chosen["metrics"]} if "stationary" in scenarios else {}
        t = time.perf_counter()
        with wf.dask_backend(**best) as b:
            warm_up(b, wf, warmup, seeds[0], "dask")
            if "dask" in variants:
                _run_points("dask", b, pts, store, log, measured=measured)
                for sc in scenarios:
                    store[sc]["dask"].update(description=b.describe(), best_config=best)
            if "dask-capped" in variants:
                caps = [int(c) for c in preset.get("caps") or [4]]
                sweeps["dask-capped"] = {}
                b.routing = "session_sticky"  # a per-engine cap needs the request's engine
                for sc in scenarios:
                    log(f"  dask-capped ({sc}): caps {caps} at {cal:g} requests/s")
                    cap, rows = _tune_cap(b, pts, sc, caps, store, log)
                    sweeps["dask-capped"][sc] = rows
                    log(f"  dask-capped ({sc}): tuned cap {cap} requests live per engine")
                    b.cap = cap
                    _run_points("dask-capped", b, pts, store, log, only=lambda s, seed, rate, sc=sc: s == sc)
                    store[sc]["dask-capped"].update(description=b.describe(), tuned_cap=cap,
                                                    best_config={**best, "routing": "session_sticky", "cap": cap})
                b.cap, b.routing = None, best.get("routing", "none")
        extras["dask+dask-capped"] = {"wall_s": time.perf_counter() - t}  # one cluster

    agents = [v for v in variants if v == "dask-agents" or v.startswith("dask-agents-no-")]
    for name in agents:
        off = None if name == "dask-agents" else name[len("dask-agents-no-"):]
        if off is not None and off not in (*wf.policies, "admission"):
            log(f"  {name}: skipped (not an ablation of the {wf.name} workflow)")
            continue
        t = time.perf_counter()
        with wf.agents_backend(disabled=off) as b:
            warm_up(b, wf, warmup, seeds[0], name)
            _run_points(name, b, pts, store, log)
            desc, extra = b.describe(), b.extra()
        for sc in scenarios:
            store[sc][name].update(description=desc, **extra)
        extras[name] = {"wall_s": time.perf_counter() - t}

    for peer in PEERS:
        if peer not in variants:
            continue
        ok, info = peer_available(peer)
        if not ok:
            log(f"  {peer}: SKIPPED, {info}")
            for sc in scenarios:
                store[sc][peer] = {"skipped": info}
            sweeps[peer] = []
            continue
        try:
            with wf.make_peer(peer, tool_threads=PEER_TOOL_THREADS) as b:
                rows = []
                for routing in preset["peer_sweep"]:
                    b.routing = routing
                    if not rows:
                        warm_up(b, wf, warmup, seeds[0], peer)
                    m = run_point(b, wf, stationary, wf.arrivals(len(stationary), cal, seeds[0]), cal,
                                  f"{peer}-sweep-{routing}-L{key}", log, label=f"{peer}-sweep-{routing}")
                    rows.append({"config": {"routing": routing}, "metrics": m})
                chosen = min(rows, key=lambda r: sweep_score(r["metrics"]))
                b.routing = chosen["config"]["routing"]
                sweeps[peer] = rows
                measured = {("stationary", seeds[0], key): chosen["metrics"]} if "stationary" in scenarios else {}
                _run_points(peer, b, pts, store, log, measured=measured)
                for sc in scenarios:
                    store[sc][peer].update(description=b.describe(), best_config=chosen["config"], version=info)
        except Exception as e:  # a broken peer install must not lose the other results
            log(f"  {peer}: FAILED ({type(e).__name__}: {e}); reported as skipped")
            for sc in scenarios:
                store[sc][peer] = {"skipped": f"failed: {type(e).__name__}: {e}"[:300]}
            sweeps[peer] = []

    for sc in scenarios:
        for v in store[sc].values():
            for per in (v.get("seeds") or {}).values():
                per["max_sustained_rps"] = max_sustained(per["loads"])
    cap_rps, note = derive_capacity(store, seeds, cal)
    return {"capacity_rps": cap_rps, "capacity_note": note, "wall_s": time.perf_counter() - t_start,
            "variant_wall_s": {k: v["wall_s"] for k, v in extras.items()},
            "scenarios": {sc: {"loads_rps": pts.loads[sc], "seeds": list(seeds), "variants": store[sc]}
                          for sc in scenarios},
            "sweeps": sweeps}


def derive_capacity(store: dict, seeds: list[int], cal: float) -> tuple[float | None, str]:
    """The derived capacity: the highest load the best static configuration (``dask``) sustains in
    the stationary scenario (median over seeds); the calibration load when that is the only
    stationary load it ran; None when it did not run there."""
    v = (store.get("stationary") or {}).get("dask")
    if not v or v.get("skipped") or not v.get("seeds"):
        return None, "not derived: plain Dask did not run the stationary scenario"
    per = [p["max_sustained_rps"] for p in v["seeds"].values()]
    loads = {k for p in v["seeds"].values() for k in p["loads"]}
    if loads == {load_key(cal)}:
        return cal, "the calibration load (the only stationary load of this run)"
    med = statistics.median(per)
    if med <= 0:
        return 0.0, "plain Dask's best static configuration sustained none of the stationary loads"
    return med, (f"highest stationary load plain Dask's best static configuration sustained "
                 f"(median over {len(per)} seed(s))")


def load_position(rate: float, capacity: float | None) -> str:
    """``below``, ``at`` or ``above`` the derived capacity (``?`` when it is unknown)."""
    if not capacity:
        return "?"
    return "at" if abs(rate - capacity) < 1e-9 else ("below" if rate < capacity else "above")


# -- paired ratios over seeds --------------------------------------------------------------------

def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def spread(xs: list[float | None]) -> dict:
    """The median of the paired ratios and their spread: ``{"median", "min", "max", "n",
    "per_seed"}`` (non-finite values are kept in ``per_seed`` as None and left out of the rest;
    never a best-of)."""
    per = [_finite(x) for x in xs]
    vals = [x for x in per if x is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "per_seed": per}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals), "per_seed": per}


def _point(v: dict | None, seed: str, key: str) -> dict | None:
    return (((v or {}).get("seeds") or {}).get(seed) or {}).get("loads", {}).get(key)


def paired_ratios(ours: dict, other: dict, key: str, seeds: list) -> dict[str, dict]:
    """Per seed (the same requests and arrivals in both), at load ``key``: mean speedup
    mean(other) / mean(ours) and P99 reduction 1 - P99(ours) / P99(other); :func:`spread` of each."""
    mean, p99 = [], []
    for seed in map(str, seeds):
        a, b = _point(ours, seed, key), _point(other, seed, key)
        if a is None or b is None:
            mean.append(None)
            p99.append(None)
            continue
        am, bm, ap, bp = (_finite(a.get("mean_s")), _finite(b.get("mean_s")),
                          _finite(a.get("p99_s")), _finite(b.get("p99_s")))
        mean.append(bm / am if am and bm is not None else None)
        p99.append(1.0 - ap / bp if bp and ap is not None else None)
    return {"mean_speedup": spread(mean), "p99_reduction": spread(p99)}


def paired_sustained(ours: dict, other: dict, seeds: list) -> dict:
    """Per seed: highest load sustained by ``ours`` / that of ``other`` (None where other sustained none)."""
    out = []
    for seed in map(str, seeds):
        a, b = ((ours.get("seeds") or {}).get(seed) or {}), ((other.get("seeds") or {}).get(seed) or {})
        so, sb = a.get("max_sustained_rps"), b.get("max_sustained_rps")
        out.append(so / sb if so is not None and sb else None)
    return spread(out)


BASELINES = {"best_static": "dask", "tuned_cap": "dask-capped", "ray": "ray", "langgraph": "langgraph"}


def _baseline_reason(variants: dict, name: str, no_peers: bool) -> str | None:
    """Why a comparison with ``name`` is null (None: it is not)."""
    if "dask-agents" not in variants:
        return "dask-agents did not run"
    v = variants.get(name)
    if v is None:
        if name in PEERS and no_peers:
            return "not run: --no-peers (peers skipped on purpose)"
        return f"{name} was not among the variants run"
    if v.get("skipped"):
        return f"skipped: {v['skipped']}"
    return None


def summarize_scenario(sc_res: dict, ref_load: float, no_peers: bool = False) -> dict:
    """One scenario's summary: dask-agents vs each baseline (medians of paired per-seed ratios at
    the reference load, their spread beside them as ``<key>_spread``, every load under
    ``by_load``), the tuned cap, the ablations, the admission counters, and per variant the
    medians of mean/P99 latency, KV hit rate and prefilled tokens per request at the reference load."""
    variants, seeds, ref = sc_res["variants"], sc_res["seeds"], load_key(ref_load)
    loads = [load_key(x) for x in sc_res["loads_rps"]]
    ours = variants.get("dask-agents")
    out: dict[str, Any] = {"reference_load_rps": ref_load, "loads_rps": sc_res["loads_rps"], "seeds": seeds,
                           "emulated": True, "null_reasons": {}}
    by_load: dict[str, dict] = {k: {} for k in loads}
    for label, name in BASELINES.items():
        reason = _baseline_reason(variants, name, no_peers)
        if reason:
            out["null_reasons"][label] = reason
            for m in ("mean_speedup", "p99_reduction", "sustained_load_ratio"):
                out[f"{m}_vs_{label}"] = None
                out[f"{m}_vs_{label}_spread"] = None
            continue
        other = variants[name]
        for k in loads:
            r = paired_ratios(ours, other, k, seeds)
            by_load[k][f"mean_speedup_vs_{label}"] = r["mean_speedup"]
            by_load[k][f"p99_reduction_vs_{label}"] = r["p99_reduction"]
        r = paired_ratios(ours, other, ref, seeds)
        sus = paired_sustained(ours, other, seeds)
        for m, sp in (("mean_speedup", r["mean_speedup"]), ("p99_reduction", r["p99_reduction"]),
                      ("sustained_load_ratio", sus)):
            out[f"{m}_vs_{label}"] = sp["median"]
            out[f"{m}_vs_{label}_spread"] = {k: sp[k] for k in ("min", "max", "n", "per_seed")}
    out["by_load"] = by_load
    capped = variants.get("dask-capped") or {}
    out["tuned_cap"] = capped.get("tuned_cap")
    abl = {}
    for name, v in variants.items():
        if not name.startswith("dask-agents-no-") or v.get("skipped") or ours is None:
            continue
        r = paired_ratios(ours, v, ref, seeds)  # mean(ablation) / mean(dask-agents) = off / on
        abl[name[len("dask-agents-no-"):]] = {
            "mean_ratio_off_vs_on": r["mean_speedup"]["median"], "mean_ratio_spread": r["mean_speedup"],
            "p99_ratio_off_vs_on": _p99_ratio(v, ours, ref, seeds),
            "sustained_load_ratio_on_vs_off": paired_sustained(ours, v, seeds)["median"]}
    out["ablations"] = abl
    at_ref: dict[str, dict] = {}
    for name, v in variants.items():
        if v.get("skipped"):
            continue
        ms = [m for m in (_point(v, str(s), ref) for s in seeds) if m is not None]
        if not ms:
            continue
        at_ref[name] = {k: spread([m.get(k) for m in ms])["median"]
                        for k in ("mean_s", "p99_s", "kv_hit_rate", "prefill_tokens_per_request")}
        at_ref[name]["sustained_runs"] = f"{sum(bool(m.get('sustained')) for m in ms)}/{len(ms)}"
        at_ref[name]["max_sustained_rps"] = spread([p.get("max_sustained_rps")
                                                    for p in v.get("seeds", {}).values()])["median"]
    out["at_reference"] = at_ref
    out["admission"] = admission_summary(ours, ref, seeds) if ours else None
    out["max_sustained_rps"] = {k: v2["max_sustained_rps"] for k, v2 in at_ref.items()}
    out["skipped"] = {k: v["skipped"] for k, v in variants.items() if v.get("skipped")}
    return out


def _p99_ratio(off: dict, on: dict, key: str, seeds: list) -> float | None:
    xs = []
    for seed in map(str, seeds):
        a, b = _point(off, seed, key), _point(on, seed, key)
        xs.append(a["p99_s"] / b["p99_s"] if a and b and _finite(a.get("p99_s")) and _finite(b.get("p99_s"))
                  and b["p99_s"] else None)
    return spread(xs)["median"]


def admission_summary(v: dict, key: str, seeds: list) -> dict:
    """dask-agents' admission at the reference load: counters summed over seeds, waits (p50, p99
    of the admitted sessions' waits per run) as the median over seeds."""
    counts: dict[str, int] = {}
    p50, p99 = [], []
    for seed in map(str, seeds):
        a = (_point(v, seed, key) or {}).get("admission") or {}
        for k, n in (a.get("counts") or {}).items():
            counts[k] = counts.get(k, 0) + n
        p50.append(a.get("wait_p50_s"))
        p99.append(a.get("wait_p99_s"))
    return {"counts": counts, "wait_p50_s": spread(p50)["median"], "wait_p99_s": spread(p99)["median"],
            "enabled": (v.get("admission") or {}).get("enabled")}


def summarize_scenarios(wres: dict, ref_load: float, no_peers: bool = False) -> dict:
    """``summary.<workflow>``: run-wide fields, then one entry per scenario (:func:`summarize_scenario`)."""
    out: dict[str, Any] = {"reference_load_rps": ref_load, "capacity_rps": wres.get("capacity_rps"),
                           "capacity_note": wres.get("capacity_note"), "scenarios": list(wres["scenarios"]),
                           "seeds": next(iter(wres["scenarios"].values()))["seeds"] if wres["scenarios"] else [],
                           "emulated": True}
    for sc, r in wres["scenarios"].items():
        out[sc] = summarize_scenario(r, ref_load, no_peers)
    return out


def print_scenarios(workflow: str, wres: dict, summary: dict) -> None:
    """The tables of a scenario run: per scenario, every variant x seed x load, the cap sweep, the summary."""
    cap_rps = wres.get("capacity_rps")
    print()
    print(f"EMULATED results, workflow {workflow!r}, by scenario (latency in s, throughput in requests/s; KV hit: "
          "prefix-cache hit rate, token-weighted; prefill/req: prompt tokens computed per request; wait p99: "
          "dask-agents' admission wait, or the cap baseline's wait for an engine slot)")
    print(f"  derived capacity: {fmt(cap_rps, 'g')} requests/s ({wres.get('capacity_note')})")
    for sc, r in wres["scenarios"].items():
        print()
        print(f"  scenario {sc!r}: loads {', '.join(f'{x:g} ({load_position(x, cap_rps)})' for x in r['loads_rps'])}"
              f", seeds {r['seeds']}")
        hdr = (f"    {'variant':26s} {'seed':>4s} {'load':>5s} {'mean':>7s} {'p50':>7s} {'p99':>7s} {'thr':>6s} "
               f"{'done':>7s} {'KV hit':>6s} {'prefill/req':>11s} {'wait p99':>8s} {'sustained':>9s}")
        print(hdr)
        print("    " + "-" * (len(hdr) - 4))
        for name, v in r["variants"].items():
            if v.get("skipped"):
                print(f"    {name:26s} skipped: {v['skipped']}")
                continue
            label = name + (f" (cap {v['tuned_cap']})" if v.get("tuned_cap") else "")
            for seed, per in v.get("seeds", {}).items():
                for key, m in sorted(per["loads"].items(), key=lambda kv: float(kv[0])):
                    w = (m.get("admission") or m.get("cap_stats") or {}).get("wait_p99_s")
                    print(f"    {label:26s} {seed:>4s} {key:>5s} {fmt(m.get('mean_s')):>7s} "
                          f"{fmt(m.get('p50_s')):>7s} {fmt(m.get('p99_s')):>7s} {fmt(m.get('throughput_rps')):>6s} "
                          f"{m.get('completed', 0):>3d}/{m.get('requests', 0):<3d} "
                          f"{fmt(m.get('kv_hit_rate'), '.0%'):>6s} "
                          f"{fmt(m.get('prefill_tokens_per_request'), '.0f'):>11s} {fmt(w):>8s} "
                          f"{'yes' if m.get('sustained') else 'no':>9s}")
        rows = (wres.get("sweeps", {}).get("dask-capped") or {}).get(sc) or []
        if rows:
            print(f"    cap sweep (requests live per engine) at {summary['reference_load_rps']:g} requests/s:")
            for row in rows:
                ms = list(row["seeds"].values())
                print(f"      cap {row['cap']:>3d}: mean {', '.join(fmt(m['mean_s']) for m in ms)} "
                      f"p99 {', '.join(fmt(m['p99_s']) for m in ms)} "
                      f"sustained {sum(bool(m['sustained']) for m in ms)}/{len(ms)}")
        s = summary[sc]
        print(f"    summary (EMULATED; at {summary['reference_load_rps']:g} requests/s; median of paired per-seed "
              "ratios [min, max]):")
        for label in BASELINES:
            if label in s["null_reasons"]:
                print(f"      vs {label:12s} null: {s['null_reasons'][label]}")
                continue
            parts = []
            for m in ("mean_speedup", "p99_reduction", "sustained_load_ratio"):
                sp = s[f"{m}_vs_{label}_spread"]
                parts.append(f"{m} {fmt(s[f'{m}_vs_{label}'], '.3f')} "
                             f"[{fmt(sp['min'], '.3f')}, {fmt(sp['max'], '.3f')}]")
            print(f"      vs {label:12s} " + "; ".join(parts))
        if s.get("tuned_cap") is not None:
            print(f"      tuned cap (chosen after the fact): {s['tuned_cap']} requests live per engine")
        for p, a in s["ablations"].items():
            print(f"      without {p:12s} mean x{fmt(a['mean_ratio_off_vs_on'], '.3f')}, "
                  f"p99 x{fmt(a['p99_ratio_off_vs_on'], '.3f')}")
        if s.get("admission"):
            a = s["admission"]
            print(f"      dask-agents admission: counts {a['counts']}, wait p50 {fmt(a['wait_p50_s'], '.3f')}s "
                  f"p99 {fmt(a['wait_p99_s'], '.3f')}s")
    print()


# -- summary, table, plots -----------------------------------------------------------------------

def ratios(ours: dict, other: dict | None, ref: str) -> dict[str, float | None]:
    """mean speedup, P99 reduction and sustained-load ratio of ``ours`` vs ``other`` at ``ref``."""
    if other is None or other.get("skipped") or ref not in other.get("loads", {}) or ref not in ours.get("loads", {}):
        return {"mean_speedup": None, "p99_reduction": None, "sustained_load_ratio": None}
    a, b = ours["loads"][ref], other["loads"][ref]

    def finite(x: float) -> float | None:
        return x if isinstance(x, (int, float)) and math.isfinite(x) else None

    so, sb = ours["max_sustained_rps"], other["max_sustained_rps"]
    return {"mean_speedup": finite(b["mean_s"] / a["mean_s"]) if a["mean_s"] else None,
            "p99_reduction": finite(1.0 - a["p99_s"] / b["p99_s"]) if b["p99_s"] else None,
            "sustained_load_ratio": (so / sb) if sb > 0 else None}


def summarize(variants: dict[str, dict], ref_load: float) -> dict:
    """Top-level summary for one workflow: dask-agents vs plain Dask and each peer, ablations."""
    ref = load_key(ref_load)
    ours = variants.get("dask-agents")
    out: dict[str, Any] = {"reference_load_rps": ref_load, "emulated": True}
    for other in ("dask", "ray", "langgraph"):
        r = ratios(ours, variants.get(other), ref) if ours else ratios({}, None, ref)
        out[f"mean_speedup_vs_{other}"] = r["mean_speedup"]
        out[f"p99_reduction_vs_{other}"] = r["p99_reduction"]
        out[f"sustained_load_ratio_vs_{other}"] = r["sustained_load_ratio"]
    abl = {}
    for p in POLICIES:
        v = variants.get(f"dask-agents-no-{p}")
        if ours and v and ref in v.get("loads", {}) and ref in ours["loads"]:
            abl[p] = {"mean_ratio_off_vs_on": v["loads"][ref]["mean_s"] / ours["loads"][ref]["mean_s"],
                      "p99_ratio_off_vs_on": v["loads"][ref]["p99_s"] / ours["loads"][ref]["p99_s"],
                      "max_sustained_rps_off": v["max_sustained_rps"]}
    out["ablations"] = abl
    out["max_sustained_rps"] = {k: v.get("max_sustained_rps") for k, v in variants.items() if not v.get("skipped")}
    out["skipped"] = {k: v["skipped"] for k, v in variants.items() if v.get("skipped")}
    return out


def print_config(config: dict) -> None:
    print()
    print(f"dask-agents end-to-end benchmark: workflow {config.get('workflow', 'swe')} on EMULATED resources")
    print(f"  {EMULATED_NOTE}")
    print("-" * 100)
    for k, v in config.items():
        if isinstance(v, dict):
            print(f"  {k}:")
            for kk, vv in v.items():
                print(f"      {kk:28s} {vv}")
        else:
            print(f"  {k:32s} {v}")
    print()


def fmt(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan"
    return format(x, spec)


def print_table(workflow: str, variants: dict, sweeps: dict, summary: dict) -> None:
    print()
    print(f"EMULATED results, workflow {workflow!r} (latency in s, throughput in requests/s; KV hit: prefix-cache "
          "hit rate, token-weighted; busiest: share of decode tokens on the busiest engine replica, 50% = even)")
    hdr = (f"  {'variant':28s} {'load':>5s} {'mean':>7s} {'p50':>7s} {'p95':>7s} {'p99':>7s} {'thr':>6s} "
           f"{'raw thr':>7s} {'done':>7s} {'KV hit':>7s} {'busiest':>7s} {'sustained':>9s}")
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for name, v in variants.items():
        if v.get("skipped"):
            print(f"  {name:28s} skipped: {v['skipped']}")
            continue
        for key, m in sorted(v["loads"].items(), key=lambda kv: float(kv[0])):
            print(f"  {name:28s} {key:>5s} {fmt(m['mean_s']):>7s} {fmt(m['p50_s']):>7s} {fmt(m['p95_s']):>7s} "
                  f"{fmt(m['p99_s']):>7s} {fmt(m['throughput_rps']):>6s} {fmt(m['raw_throughput_rps']):>7s} "
                  f"{m['completed']:>3d}/{m['requests']:<3d} {fmt(m.get('kv_hit_rate'), '.0%'):>7s} "
                  f"{fmt(m.get('busiest_engine_share'), '.0%'):>7s} {'yes' if m['sustained'] else 'no':>9s}")
        print(f"  {'':28s} highest load sustained: {fmt(v['max_sustained_rps'], 'g')}/s")
    roles = [(name, key, m) for name, v in variants.items() if not v.get("skipped")
             for key, m in sorted(v["loads"].items(), key=lambda kv: float(kv[0])) if "followup_kv_hit_rate" in m]
    if roles:
        print()
        print("  EMULATED prefix-cache hit rate per call role (token-weighted, as the engines reported it to the calls) "
              "and mean follow-up latency (from the question, after the user's pause):")
        print(f"    {'variant':28s} {'load':>5s} {'analysts':>8s} {'summary':>8s} {'follow-up':>9s} {'fu mean s':>9s}")
        for name, key, m in roles:
            print(f"    {name:28s} {key:>5s} {fmt(m.get('analysis_kv_hit_rate'), '.0%'):>8s} "
                  f"{fmt(m.get('summary_kv_hit_rate'), '.0%'):>8s} {fmt(m.get('followup_kv_hit_rate'), '.0%'):>9s} "
                  f"{fmt(m.get('followup_mean_s'), '.3f'):>9s}")
    for peer, rows in sweeps.items():
        if not rows:
            continue
        print()
        print(f"  static-configuration sweep of {peer} at the calibration load:")
        for r in rows:
            m = r["metrics"]
            print(f"    {json.dumps(r['config']):44s} mean {fmt(m['mean_s'])} p99 {fmt(m['p99_s'])} "
                  f"thr {fmt(m['throughput_rps'])} done {m['completed']}/{m['requests']} "
                  f"{'sustained' if m['sustained'] else 'not sustained'}")
    print()
    print(f"  summary (EMULATED; at the reference load {summary['reference_load_rps']:g} requests/s):")
    for k, v in summary.items():
        if k in ("ablations", "max_sustained_rps", "skipped", "reference_load_rps", "emulated"):
            continue
        print(f"    {k:36s} {fmt(v, '.3f')}")
    for p, a in summary["ablations"].items():
        print(f"    without {p:28s} mean x{a['mean_ratio_off_vs_on']:.3f}, p99 x{a['p99_ratio_off_vs_on']:.3f}, "
              f"highest sustained {a['max_sustained_rps_off']:g}/s")
    for k, v in summary["skipped"].items():
        print(f"    {k} skipped: {v}")
    print()


def plot(path_stem: str, workflow: str, variants: dict) -> tuple[list[str], str | None]:
    """Latency-vs-load and throughput-vs-load PNGs next to the JSON (None note if impossible)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return [], f"plots skipped: matplotlib unavailable ({type(e).__name__}: {e})"
    files = []
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for name, v in variants.items():
        if v.get("skipped"):
            continue
        pts = sorted((float(k), m) for k, m in v["loads"].items())
        x = [p for p, _ in pts]
        style = "-" if name in ("dask", "dask-agents", "ray", "langgraph") else ":"
        axes[0].plot(x, [m["mean_s"] for _, m in pts], style, marker="o", label=name)
        axes[1].plot(x, [m["p99_s"] for _, m in pts], style, marker="o", label=name)
        axes[2].plot(x, [m["throughput_rps"] for _, m in pts], style, marker="o", label=name)
    realized = {}  # the arrivals actually used (the same in every variant)
    for v in variants.values():
        for k, m in (v.get("loads") or {}).items():
            realized.setdefault(float(k), m.get("offered_realized_rps"))
    pts = sorted((k, r) for k, r in realized.items() if r is not None)
    if pts:
        axes[2].plot([k for k, _ in pts], [r for _, r in pts], "k--", linewidth=0.8, label="offered (realized)")
        axes[2].legend(fontsize=7)
    for ax, title in zip(axes, ("mean latency (s)", "P99 latency (s)", "throughput (requests/s)")):
        ax.set_xlabel("offered load (requests/s)")
        ax.set_title(f"{title}, EMULATED")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{workflow} workflow on EMULATED engines and tools: latency and throughput vs load")
    fig.tight_layout()
    out = f"{path_stem}_{workflow}_latency.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    files.append(out)
    # per-request latency CDFs at the highest load every variant ran (dask_agents/report.py's
    # plotting, the same as `dask-agents report`)
    from dask_agents.report import plot_latency_cdf

    ran = [v for v in variants.values() if not v.get("skipped") and v.get("loads")]
    common = set.intersection(*(set(v["loads"]) for v in ran)) if ran else set()
    if common:
        top = max(common, key=float)
        cdfs = {name: v["loads"][top].get("latencies_s") or [] for name, v in variants.items()
                if not v.get("skipped") and top in (v.get("loads") or {})}
        files.append(plot_latency_cdf(cdfs, f"{path_stem}_{workflow}_cdf.png",
                                      title=f"{workflow}: request latency CDF at {float(top):g} req/s, EMULATED",
                                      xlabel="request latency (s)"))
    return files, None


# -- main ------------------------------------------------------------------------------------------

def run_benchmark(preset: dict, variants: list[str], seed: int = 0,
                  log: Callable[[str], None] = print, wf: Workflow | None = None) -> tuple[dict, dict]:
    """Run the selected variants of a Poisson-arrival workflow (default: swe); returns (variants, sweeps)."""
    wf = wf or swe_workflow()
    base = wf.make_specs(preset["requests"], seed)
    loads = sorted(preset["loads"])
    cal = preset["calibration_load"]
    label = "" if wf.name == "swe" else f" ({wf.name})"
    out: dict[str, dict] = {}
    sweeps: dict[str, list] = {}
    if "dask" in variants:
        log(f"  plain Dask{label}: static-configuration sweep at the calibration load")
        sweeps["dask"] = run_dask_sweep(preset["dask_sweep"], base, cal, seed, preset["warmup"], log, wf)
        chosen = min(sweeps["dask"], key=lambda r: sweep_score(r["metrics"]))
        best = chosen["config"]
        log(f"  plain Dask{label}: best static configuration {best}")
        out["dask"] = run_variant("dask", lambda: wf.dask_backend(**best), base, loads, seed, preset["warmup"], log,
                                  {load_key(cal): chosen["metrics"]}, wf)
        out["dask"]["best_config"] = best
    if "dask-agents" in variants:
        out["dask-agents"] = run_variant("dask-agents", wf.agents_backend, base, loads, seed, preset["warmup"], log,
                                         wf=wf)
    for p in (*wf.policies, "admission"):
        name = f"dask-agents-no-{p}"
        if name in variants:
            out[name] = run_variant(name, lambda p=p: wf.agents_backend(disabled=p), base, loads, seed,
                                    preset["warmup"], log, wf=wf)
    for peer in PEERS:
        if peer not in variants:
            continue
        ok, info = peer_available(peer)
        if not ok:
            log(f"  {peer}{label}: SKIPPED, {info}")
            out[peer] = {"skipped": info}
            sweeps[peer] = []
            continue
        try:
            out[peer], sweeps[peer] = run_peer(peer, preset, base, loads, seed, preset["warmup"], log, wf)
            out[peer]["version"] = info
        except Exception as e:  # a broken peer install must not lose the other results
            log(f"  {peer}{label}: FAILED ({type(e).__name__}: {e}); reported as skipped")
            out[peer] = {"skipped": f"failed: {type(e).__name__}: {e}"[:300]}
            sweeps[peer] = []
    return out, sweeps


ALL_VARIANTS = (["dask", "dask-capped", "dask-agents", "dask-agents-no-admission"]
                + [f"dask-agents-no-{p}" for p in POLICIES] + list(PEERS))


def build_config(preset: dict, mode: str, seed: int, variants: list[str], scenarios: list[str] | None = None,
                 seeds: list[int] | None = None) -> dict:
    base = swe.make_specs(preset["requests"], seed)
    scenarios = list(scenarios or ["stationary"])
    seeds = list(seeds or [seed])
    desc = {"stationary": "Poisson arrivals at the offered load",
            "bursty": (f"two-state MMPP: {swe.MMPP_FACTORS[0]:g}x / {swe.MMPP_FACTORS[1]:g}x the offered load, "
                       f"exponential holding times of mean {preset.get('mmpp_hold_s', swe.MMPP_HOLD_QUICK)} s "
                       "(time-average = the offered load)"),
            "phase": (f"Poisson; the second half of the requests with their repository context "
                      f"{preset.get('phase_context_factor', swe.PHASE_CONTEXT_FACTOR):g}x longer (capped to fit "
                      f"max_model_len)")}
    sc_cfg = {}
    for sc in scenarios:
        sc_cfg[sc] = {"arrivals": desc.get(sc, "?"), "loads_rps": scenario_loads(preset, sc)}
        if sc == "phase":
            ph = swe.phase_specs(base, preset.get("phase_context_factor", swe.PHASE_CONTEXT_FACTOR))
            half = len(ph) // 2
            sc_cfg[sc]["second_half"] = swe.describe_specs(ph[half:]) if ph[half:] else None
    return {
        "emulated": True, "note": EMULATED_NOTE, "mode": mode, "workflow": "swe", "seed": seed,
        "python": sys.version.split()[0], "dask": dask.__version__, "distributed": distributed.__version__,
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "variants": variants, "loads_rps": sorted(preset["loads"]), "requests_per_load": preset["requests"],
        "warmup_requests": preset["warmup"], "calibration_load_rps": preset["calibration_load"],
        "reference_load_rps": preset["calibration_load"],
        "scenarios": sc_cfg, "seeds": seeds, "caps": preset.get("caps"),
        "engine": {"replicas": 2, "model": swe.MODEL, **swe.ENGINE, "max_model_len": swe.MAX_MODEL_LEN,
                   "prefix_caching": True, "class": "dask_agents.worker_plugin.emulated.EmulatedEngineHost"},
        "tools": {"doc_search": "file_io prior (P50/P95/P99 45/320/1200 ms)",
                  "code_exec": "code_exec prior (P50/P95/P99 180/2400/28000 ms)",
                  "time_scale": swe.TOOL_TIME_SCALE},
        "requests": swe.describe_specs(base),
        "threads": {"dask-agents": f"2 workers x {THREADS_AGENTS}", "dask": "swept",
                    "peers_tool_threads": PEER_TOOL_THREADS},
        "dask_sweep": preset["dask_sweep"], "peer_sweep": preset["peer_sweep"],
        "sustained": f"all done; measured window = requests after the first {WARMUP_FRACTION:.0%} of arrivals; "
                     f"throughput (first vs last third of the window) >= {SUSTAIN_FRACTION} x offered (realized); "
                     f"latency growth (last third vs first third, each relative to its ideal latency) within "
                     f"(1/{LATENCY_GROWTH_MAX}, {LATENCY_GROWTH_MAX}); "
                     f"P99 <= {P99_BOUND_FACTOR} x P99 of ideal latencies",
        "p99_bound_factor": P99_BOUND_FACTOR,
    }


def jsonable(x: Any) -> Any:
    """``x`` with non-finite floats as None (strict JSON) and tuples as lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def write_json(path: str, config: dict, results: dict, sweeps: dict, summary: dict, workflow: str = "swe") -> dict:
    """Write ``{"config", "results", "summary"}`` (strict JSON); returns the document."""
    doc = jsonable({"config": config, "results": {workflow: {"variants": results, "sweeps": sweeps}},
                    "summary": summary})
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str, allow_nan=False)
    return doc


def base_config(mode: str, seed: int, workflow: str) -> dict:
    """The run-wide part of the configuration (every workflow)."""
    return {"emulated": True, "note": EMULATED_NOTE, "mode": mode, "workflow": workflow, "seed": seed,
            "python": sys.version.split()[0], "dask": dask.__version__, "distributed": distributed.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count()}


WORKFLOWS = ("swe", "finance", "router")  # --workflow all: in this order


def missing_peers(all_results: dict) -> dict[str, str]:
    """Peers that were asked for but did not run (``{"<workflow>/<peer>": reason}``)."""
    out = {}
    for w, r in all_results.items():
        if "scenarios" in r:
            for sc, sr in r["scenarios"].items():
                for peer in PEERS:
                    v = sr["variants"].get(peer)
                    if v is not None and v.get("skipped"):
                        out.setdefault(f"{w}/{peer}", v["skipped"])
        else:
            for peer in PEERS:
                v = r["variants"].get(peer)
                if v is not None and v.get("skipped"):
                    out[f"{w}/{peer}"] = v["skipped"]
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.legacy import e2e_finance as finance
    from benchmarks.legacy import e2e_router as router

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", required=True, help="write the results as JSON to PATH (plots beside it)")
    p.add_argument("--quick", action="store_true", help="fewer loads, requests, caps and seeds (minutes on 2 cores)")
    p.add_argument("--workflow", default="swe", choices=[*WORKFLOWS, "all"],
                   help="workflow to run: swe (default), finance (parallel analysts, summary, delayed follow-ups), "
                        "router (skewed phases, 2 models on 4 engine workers), all (swe, finance, router)")
    p.add_argument("--variants", help=f"comma-separated subset of {','.join(ALL_VARIANTS)} (default: the preset's)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated arrival scenarios of the swe workflow, of {','.join(SCENARIOS)} "
                        "(default: all three; finance and router run their own single scenario)")
    p.add_argument("--seeds", type=int, help="seeds per point (new requests and arrivals each; default 1 with "
                                             "--quick, 3 otherwise); ratios are paired per seed")
    p.add_argument("--caps", help="comma-separated caps (requests live per engine) of the dask-capped sweep")
    p.add_argument("--no-peers", action="store_true",
                   help="skip Ray and LangGraph on purpose (without it a peer that cannot run fails the exit code)")
    p.add_argument("--loads", help="comma-separated offered loads in requests/s (overrides the preset, every scenario)")
    p.add_argument("--requests", type=int, help="requests per load (overrides the preset)")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--kv-blocks", type=int, help="KV blocks per Open-SWE engine replica (default: "
                   f"e2e_swe.ENGINE's {swe.ENGINE['kv_blocks']}); fewer: a KV-bound engine")
    args = p.parse_args(argv)
    if args.kv_blocks is not None:
        if args.kv_blocks < 64:
            p.error("--kv-blocks must be >= 64")
        swe.ENGINE["kv_blocks"] = args.kv_blocks  # read when each variant builds its engines

    workflows = list(WORKFLOWS) if args.workflow == "all" else [args.workflow]
    scenarios = [x for x in args.scenarios.split(",") if x]
    bad = [x for x in scenarios if x not in SCENARIOS]
    if bad or not scenarios:
        p.error(f"unknown scenarios {bad} (known: {', '.join(SCENARIOS)})")
    presets = {"swe": dict(QUICK if args.quick else FULL),
               "finance": dict(finance.QUICK if args.quick else finance.FULL),
               "router": dict(router.QUICK if args.quick else router.FULL)}
    for preset in presets.values():
        if args.loads:
            preset["loads"] = [float(x) for x in args.loads.split(",")]
            preset["scenario_loads"] = {}
            if preset["calibration_load"] not in preset["loads"]:
                preset["calibration_load"] = max(preset["loads"])
        if args.requests:
            preset["requests"] = args.requests
    if args.caps:
        presets["swe"]["caps"] = [int(x) for x in args.caps.split(",")]
    n_seeds = args.seeds if args.seeds is not None else presets["swe"].get("seeds", 1)
    if n_seeds < 1:
        p.error("--seeds must be >= 1")
    seeds = [args.seed + i for i in range(n_seeds)]
    per_workflow = {"swe": ALL_VARIANTS, "finance": finance.VARIANTS, "router": router.VARIANTS}
    known = set().union(*per_workflow.values())
    asked = args.variants.split(",") if args.variants else None
    unknown = set(asked or ()) - known
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}")
    defaults = {"swe": presets["swe"].get("variants", ALL_VARIANTS), "finance": finance.VARIANTS,
                "router": router.VARIANTS}
    variants = {w: [v for v in (asked or defaults[w]) if v in vs and not (args.no_peers and v in PEERS)]
                for w, vs in per_workflow.items()}

    t0 = time.perf_counter()
    mode = "quick" if args.quick else "full"
    if "swe" in workflows:
        config = build_config(presets["swe"], mode, args.seed, variants["swe"], scenarios, seeds)
        config["workflow"] = args.workflow
    else:
        config = base_config(mode, args.seed, args.workflow)
    config["no_peers"] = args.no_peers
    if "finance" in workflows:
        config["finance"] = finance.build_config(presets["finance"], args.seed, variants["finance"])
    if "router" in workflows:
        config["router"] = router.build_config(presets["router"], args.seed, variants["router"])
    print_config(config)
    all_results: dict[str, dict] = {}
    summary: dict[str, Any] = {}
    log = lambda s: print(s, flush=True)  # noqa: E731
    for w in workflows:
        if w == "swe":
            log(f"swe workflow: scenarios {scenarios}, seeds {seeds}, variants {variants['swe']}")
            all_results[w] = run_scenarios(presets["swe"], variants["swe"], scenarios, seeds, log=log)
            summary[w] = summarize_scenarios(all_results[w], presets["swe"]["calibration_load"], args.no_peers)
            log(f"  derived capacity: {fmt(all_results[w]['capacity_rps'], 'g')} requests/s "
                f"({all_results[w]['capacity_note']})")
            continue
        if w == "finance":
            log("finance workflow (parallel analysts, summary, delayed follow-ups; EMULATED engines and db_query; "
                f"stationary arrivals, seed {args.seed} only)")
            results, sweeps = finance.run_benchmark(presets["finance"], variants["finance"], args.seed, log=log)
        else:
            log(f"router workflow (skewed phases, EMULATED chat + coder engines on 4 workers; seed {args.seed} only)")
            results, sweeps = router.run_benchmark(presets["router"], variants["router"], args.seed, log=log)
        all_results[w] = {"variants": results, "sweeps": sweeps}
        summary[w] = summarize(results, presets[w]["calibration_load"])
        if args.no_peers:
            for peer in PEERS:
                summary[w]["skipped"].setdefault(peer, "not run: --no-peers (peers skipped on purpose)")
    config["wall_s"] = time.perf_counter() - t0
    summary["wall_s"] = config["wall_s"]
    summary["emulated"] = True
    for w in workflows:
        if "scenarios" in all_results[w]:
            print_scenarios(w, all_results[w], summary[w])
        else:
            print_table(w, all_results[w]["variants"], all_results[w]["sweeps"], summary[w])

    path = os.path.abspath(args.json)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    stem = os.path.splitext(path)[0]
    plots: list[str] = []
    for w in workflows:
        if "scenarios" in all_results[w]:  # one figure per scenario, the first seed's runs
            views = {sc: (f"{w}_{sc}", {name: {"loads": v["seeds"][str(seeds[0])]["loads"]}
                                        if not v.get("skipped") else {"skipped": v["skipped"]}
                                        for name, v in r["variants"].items()})
                     for sc, r in all_results[w]["scenarios"].items()}
        else:
            views = {w: (w, all_results[w]["variants"])}
        for name, vs in views.values():
            files, note = plot(stem, name, vs)
            plots += files
            if note:
                config["plots_note"] = note
                print(f"  {note}")
    config["plots"] = [os.path.basename(f) for f in plots]
    doc = jsonable({"config": config, "results": all_results, "summary": summary})
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str, allow_nan=False)
    print(f"wrote {path}" + (f" and {', '.join(plots)}" if plots else ""))
    print(f"wall {config['wall_s']:.0f}s")
    missing = missing_peers(all_results) if not args.no_peers else {}
    if missing:
        print("ERROR: peer frameworks were asked for but did not run (the JSON above records them as skipped):",
              file=sys.stderr)
        for k, why in missing.items():
            print(f"  {k}: {why}", file=sys.stderr)
        print("  install them, or pass --no-peers to skip the peers on purpose", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
