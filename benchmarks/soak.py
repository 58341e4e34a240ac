"""Load and soak: thousands of concurrent sessions on EMULATED engines, then memory back to baseline.

What runs
---------
A scheduler process (``dask scheduler --preload dask_agents.preload``) and two worker
processes (``dask worker --nworkers 2 --preload dask_agents.preload``), each hosting an
EMULATED engine for model ``emu`` (``worker_plugin/emulated.py``; numbers are emulation, not a
real engine). This process drives sessions through an asynchronous client. Each session is
one request of a small agent workflow, all in ``async with da.session(...)``:

    Planner.plan (a stateful agent: one instance per session, released at session end)
    -> llm("emu").generate (its KV stays on the engine that served the session)
    -> web_api_tool (an EMULATED tool, SAGA's latency prior x ``agents.emulation.time-scale``)
    -> Planner.finish (same instance) -> llm("emu").generate (a KV hit on the same engine)

Sessions run in ``--rounds`` rounds; in each, ``--concurrent`` sessions are open at once
(they all start together, so the live-session count reaches the round's size) until
``--sessions`` sessions have run in all. Completed sessions are kept for
``agents.scheduler.session-retention`` (set small here: ``--retention``), then dropped.

What is measured
----------------
Memory of the scheduler and of each worker process: RSS (``psutil``) and the sizes of
dask-agents' structures, found by walking the plugins' containers (``len`` of every dict,
set, list and deque reachable from the plugin, two levels deep: WorkflowState calls and
sessions, bindings, placements, KV hints, telemetry aggregates, view index, instances,
engines' per-session state...), plus Dask's own task tables. Sampled at **baseline** (after
a warm-up round has expired), every ``--sample`` seconds during the load (**peak**: the
maximum), and **after** each round once retention has passed and ``gc.collect()`` ran.

Verdicts in ``summary``: ``structures_back_to_baseline`` (every per-session structure is
back to its baseline size after the last round: nothing retained per session beyond the
retention window), ``gc_objects`` (live Python objects after ``gc.collect()``: flat from
round to round when nothing leaks), ``gc_type_growth`` (the object types that grew most, to
find a leak), ``rss_drift_mb_per_1000_sessions`` (slope of the after-round RSS over the
rounds after the first) and ``rss_back_near_baseline`` (final RSS within
``--rss-tolerance-mb`` of baseline per process).

RSS is not expected to come back all the way, and keeps creeping for a while, because of
bounded structures Dask itself keeps: ``dask.utils.key_split`` caches the prefix of every
key it has seen, up to 100,000 keys (every dask-agents call has a unique key, so the cache
fills after 20,000 five-call sessions; reported as ``dask.key_split_cache``), and each comm
keeps its last ``distributed.admin.low-level-log-length`` (1,000) batches of messages, which
hold the compute-task messages' run specs (``--dask-log-length`` lowers it). Freed memory
also stays in Python's allocator pools rather than going back to the OS.

Reproduce::

    .venv/bin/python benchmarks/soak.py --quick --json benchmarks/results/soak-quick.json
    .venv/bin/python benchmarks/soak.py --json benchmarks/results/soak.json

``--quick``: 2,000 sessions in 4 rounds of 500 concurrent (about 2-3 minutes on 2 cores);
the full run: 10,000 sessions in 5 rounds of 2,000 concurrent.

One long session (``--long-session N``)
---------------------------------------
What one runaway session costs the scheduler: N cheap tool calls in one session (``--wave``
in flight at once, each future dropped once done), then, on the same cluster, the same N calls
as plain ``client.submit`` work (what Dask itself keeps per call). The scheduler's RSS is
sampled (after ``gc.collect()``) every tenth of the run; ``summary`` has the bytes per call
while the session is open (its call records are kept until it ends, for its graph and
telemetry), the same for plain Dask, the RSS left after the session ended and
``--retention`` passed, and what a second session of as many calls adds to it (nothing much
when the first left nothing held: its memory is reused from the allocator's pools)::

    .venv/bin/python benchmarks/soak.py --long-session 100000 --json benchmarks/results/soak-long-session.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.processes import start_scheduler, stop_processes  # noqa: E402

import psutil  # noqa: E402
from distributed import Client  # noqa: E402

import dask_agents as da  # noqa: E402
from dask_agents import emulation  # noqa: E402

EMU = {"emu": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
               "emulation": {"max_batch": 256, "decode-s-per-step": 0.002, "prefill-s-per-token": 1e-6}}}


@da.agent(stateful=True)
class Planner:
    """A stateful agent: remembers its session's plan between calls."""

    def __init__(self) -> None:
        self.plan_text = ""

    def plan(self, issue: str) -> str:
        self.plan_text = f"plan for {issue}: look it up, then answer"
        return self.plan_text

    def finish(self, answer: Any, found: Any) -> str:
        return f"{self.plan_text} -> {len(str(answer))} chars, {found['kind']}"


async def one_session(client: Client, i: int, think: float = 1.0) -> None:
    """One request: stateful agent, LLM, tool, agent again, LLM again."""
    planner = da.stub(Planner)
    tool = da.stub(emulation.web_api_tool)
    async with da.session(client, name=f"soak{i}"):
        plan = await planner.plan(f"issue {i}")
        first = await da.llm("emu").generate(f"You are a helpful agent. {plan}", max_tokens=8)
        found = await tool(f"search {i}", seed=i)
        await asyncio.sleep(think * (i % 7) / 3)  # the user reads before the follow-up: the session stays open
        summary = await planner.finish(first.text, found)
        await da.llm("emu").generate(f"You are a helpful agent. {plan} {summary}", max_tokens=4)


@da.tool
def step(i: int) -> int:
    """One cheap call of a long session (``--long-session``)."""
    return i


def plain_step(i: int) -> int:
    return i


# -- what is measured ------------------------------------------------------------------------------

_OURS = ("dask_agents",)  # every module of ours installs under it


def _container_sizes(obj: Any, prefix: str, out: dict, depth: int, seen: set) -> None:
    """``len`` of every container attribute of ``obj`` (and of dask-agents objects inside, to
    ``depth`` levels); dicts of containers also get their total inner size (``name[*]``)."""
    from collections import deque as _deque

    if id(obj) in seen:
        return
    seen.add(id(obj))
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names.extend(s for s in getattr(cls, "__slots__", ()) if isinstance(s, str))
    for name in names:
        try:
            v = getattr(obj, name)
        except Exception:
            continue
        key = f"{prefix}.{name}"
        if isinstance(v, (dict, set, frozenset, list, _deque)):
            out[key] = len(v)
            if isinstance(v, dict) and v:
                inner = [x for _, x in zip(range(3), v.values())]
                if all(isinstance(x, (dict, set, list, _deque)) for x in inner):
                    out[key + "[*]"] = sum(len(x) for x in v.values())
                elif depth > 0 and all(type(x).__module__.startswith(_OURS) for x in inner):
                    for k, x in list(v.items())[:8]:  # a few engine hosts, slots...
                        _container_sizes(x, f"{key}[{k}]", out, depth - 1, seen)
        elif depth > 0 and type(v).__module__.startswith(_OURS) and hasattr(v, "__dict__") or (
                depth > 0 and type(v).__module__.startswith(_OURS) and hasattr(type(v), "__slots__")):
            _container_sizes(v, key, out, depth - 1, seen)


def _types(out: dict) -> None:
    """Live objects per type (where a leak would show which objects pile up)."""
    import gc
    from collections import Counter

    counts = Counter(type(o).__name__ for o in gc.get_objects())
    out["types"] = dict(counts.most_common(40))


def _scheduler_sizes(dask_scheduler: Any = None, types: bool = False) -> dict:
    import gc

    gc.collect()
    p = dask_scheduler.plugins["dask-agents"]
    from dask.utils import key_split

    out: dict = {"dask.tasks": len(dask_scheduler.tasks), "dask.clients": len(dask_scheduler.clients),
                 # Dask's LRU cache of key prefixes: every call's unique key, up to 100,000
                 "dask.key_split_cache": key_split.cache_info().currsize}
    _container_sizes(p, "plugin", out, 3, set())
    out["live_sessions"] = sum(1 for s in p.state.sessions.values() if s.state != "completed")
    out["gc.objects"] = len(gc.get_objects())  # back to baseline: RSS drift is the allocator's, not a leak
    if types:
        _types(out)
    return out


def _worker_sizes(dask_worker: Any = None, types: bool = False) -> dict:
    import gc

    gc.collect()
    p = dask_worker.plugins["dask-agents"]
    from dask.utils import key_split

    out: dict = {"dask.tasks": len(dask_worker.state.tasks), "dask.data": len(dask_worker.data),
                 "dask.key_split_cache": key_split.cache_info().currsize}
    _container_sizes(p, "plugin", out, 4, set())
    try:
        from dask_agents.worker_plugin.plugin import engine_report

        for model, host in p.engines._hosts.items():  # noqa: SLF001
            rep = engine_report(host)
            out[f"engine[{model}].kv_bytes_device"] = (rep.get("kv_bytes") or {}).get("device", 0)
            out[f"engine[{model}].running"] = rep.get("running") or 0
            out[f"engine[{model}].waiting"] = rep.get("waiting") or 0
    except Exception as e:  # best effort
        out["engine_report_error"] = str(e)
    out["gc.objects"] = len(gc.get_objects())
    if types:
        _types(out)
    return out


async def sample(client: Client, procs: dict[str, psutil.Process], types: bool = False) -> dict:
    """RSS (MB) of the scheduler and each worker, and every structure's size."""
    sched = await client.run_on_scheduler(_scheduler_sizes, types=types)
    workers = await client.run(_worker_sizes, types=types)
    rss = {name: p.memory_info().rss / 2**20 for name, p in procs.items()}
    return {"time": time.time(), "rss_mb": rss, "scheduler": sched, "workers": workers}


# -- the run --------------------------------------------------------------------------------------

def start_cluster(tmp: str, args: argparse.Namespace, log: Any) -> tuple[list[subprocess.Popen], str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]),
           "DASK_AGENTS__LLM__MODELS": json.dumps(EMU), "DASK_AGENTS__WORKER__MODELS": '["emu"]',
           "DASK_AGENTS__EMULATION__TIME_SCALE": str(args.time_scale),
           "DASK_AGENTS__SCHEDULER__SESSION_RETENTION": f"{args.retention}s",
           "DASK_AGENTS__SCHEDULER__HOUSEKEEPING_INTERVAL": "500ms",
           "DASK_AGENTS__DASHBOARD__ENABLED": "False",
           "DASK_AGENTS__DASHBOARD__WINDOW": f"{args.window}s",
           "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    if args.dask_log_length is not None:  # Dask's own debug logs (message logs of its comms, events)
        env["DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH"] = str(args.dask_log_length)
    sched, info = start_scheduler(tmp, env, log, dashboard=False)
    address = info["address"]
    workers = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", "2", "--nthreads",
         str(args.nthreads), "--preload", "dask_agents.preload", "--no-dashboard", "--memory-limit", "0"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    return [sched, workers], address


async def run_round(client: Client, first: int, n: int, concurrent: int, procs: dict, every: float,
                    peaks: list, think: float) -> dict:
    """``n`` sessions, ``concurrent`` open at once; samples memory while they run."""
    sem = asyncio.Semaphore(concurrent)
    errors: list[str] = []
    done = 0

    async def go(i: int) -> None:
        nonlocal done
        async with sem:
            try:
                await asyncio.wait_for(one_session(client, i, think), timeout=600)
                done += 1
            except Exception as e:  # counted and reported, never silently dropped
                errors.append(f"{type(e).__name__}: {e}"[:300])

    t0 = time.monotonic()
    tasks = [asyncio.ensure_future(go(first + k)) for k in range(n)]
    max_live = 0
    while not all(t.done() for t in tasks):
        await asyncio.wait(tasks, timeout=every)
        s = await sample(client, procs)
        max_live = max(max_live, s["scheduler"]["live_sessions"])
        peaks.append(s)
    wall = time.monotonic() - t0
    return {"sessions": n, "completed": done, "errors": len(errors), "error_samples": errors[:5],
            "wall_s": wall, "sessions_per_s": n / wall, "max_live_sessions": max_live}


async def settle(client: Client, procs: dict, retention: float) -> dict:
    """Wait past retention (and the workers' end-of-session messages), then sample."""
    await asyncio.sleep(retention + 2.0)
    for _ in range(30):  # until nothing per session is left open (or 15 s more)
        s = await sample(client, procs, types=True)
        if s["scheduler"]["live_sessions"] == 0 and s["scheduler"].get("plugin.state.sessions", 0) == 0:
            return s
        await asyncio.sleep(0.5)
    return s


def _flat(s: dict) -> dict[str, float]:
    """One flat dict of every number in a sample (workers by index, sorted by address)."""
    out = {f"scheduler:{k}": v for k, v in s["scheduler"].items() if isinstance(v, (int, float))}
    for i, addr in enumerate(sorted(s["workers"])):
        out.update({f"worker{i}:{k}": v for k, v in s["workers"][addr].items() if isinstance(v, (int, float))})
    return out


# Structures that are bounded by design (rings, caches, per-worker or per-component tables),
# not per session: they may stay above baseline after load without being a leak. ``_lru`` and
# ``_ref`` are the emulated engine's prefix cache (blocks, bounded by its KV capacity; the
# emulated engine has no per-session KV to release, vLLM engines invalidate a session's KV
# at its end); ``_ended`` in the KV hints is a guard set cleared at 10,000.
BOUNDED = ("key_split_cache", "_lru", "_ref", "started", "stats", "recent", "tick_seconds", "view_seconds", "kv_samples", "kv_decisions", "incidents", "engines",
           "queue", "service", "tokens", "durations", "edges", "calls_per_component", "open_per_component",
           "completed_per_component", "open_by_state", "terminal_per_component", "_kv_actions", "assigned",
           "_ended", "dask.clients", "_shared", "kv_bytes_device", "gone", "_idle_since", "bound",
           "open_placed", "applied", "rejected", "policies", "stream", "tick", "rejections", "rejected_reasons",
           "requested", "refused", "failing", "policy_seconds", "tombstones")


def _bounded(name: str) -> bool:
    leaf = name.split(":", 1)[1]
    parts = leaf.replace("[*]", "").split(".")
    return any(p in BOUNDED or p.split("[")[0] in BOUNDED for p in parts[-2:])


async def run(args: argparse.Namespace, log_path: str) -> dict:
    tmp = tempfile.mkdtemp(prefix="agents-soak-")
    log = open(log_path, "w")
    popen, address = start_cluster(tmp, args, log)
    try:
        async with Client(address, asynchronous=True, timeout="60s") as client:
            await client.wait_for_workers(2, timeout=120)
            await da.install(client)
            pids = await client.run(os.getpid)
            procs = {"scheduler": psutil.Process(popen[0].pid)}
            for i, addr in enumerate(sorted(pids)):
                procs[f"worker{i}"] = psutil.Process(pids[addr])
            print(f"  warm-up: {args.warmup} sessions", flush=True)
            warm = await run_round(client, 10**7, args.warmup, args.warmup, procs, args.sample, [], args.think)
            baseline = await settle(client, procs, max(args.retention, 2 * args.window))
            print(f"  baseline RSS MB: { {k: round(v, 1) for k, v in baseline['rss_mb'].items()} }", flush=True)
            rounds, afters, peaks = [], [], []
            first = 0
            per_round = args.sessions // args.rounds
            for r in range(args.rounds):
                res = await run_round(client, first, per_round, args.concurrent, procs, args.sample, peaks, args.think)
                first += per_round
                after = await settle(client, procs, max(args.retention, 2 * args.window))
                res["after_rss_mb"] = after["rss_mb"]
                rounds.append(res)
                afters.append(after)
                print(f"  round {r + 1}/{args.rounds}: {res['completed']}/{per_round} sessions in {res['wall_s']:.1f}s "
                      f"({res['sessions_per_s']:.1f}/s), max live {res['max_live_sessions']}, errors {res['errors']}; "
                      f"after: RSS MB { {k: round(v, 1) for k, v in after['rss_mb'].items()} }", flush=True)
    finally:
        stop_processes(list(reversed(popen)), log, tmp)
    return {"warmup": warm, "baseline": baseline, "rounds": rounds, "afters": afters, "peaks": peaks}


async def _rss_of(client: Client, proc: psutil.Process) -> float:
    import gc

    def collect(dask_scheduler: Any = None) -> int:
        return gc.collect()

    await client.run_on_scheduler(collect)
    return proc.memory_info().rss / 2**20


async def long_session(client: Client, proc: psutil.Process, n: int, wave: int, agents: bool) -> dict:
    """``n`` calls of one session (``agents``: stub calls in a ``da.session``; else plain
    ``client.submit`` calls, Dask's own cost for the same work), ``wave`` in flight at once,
    each future dropped once done (the driver keeps nothing); the scheduler's RSS sampled
    every tenth of the run. Per-call cost = growth / calls."""
    marks, errors = [], 0
    start_rss = await _rss_of(client, proc)
    t0 = time.monotonic()
    tool = da.stub(step)

    async def waves(sid: str | None) -> None:
        nonlocal errors
        done = 0
        while done < n:
            k = min(wave, n - done)
            futs = ([tool(done + j) for j in range(k)] if agents
                    else [client.submit(plain_step, done + j, pure=False) for j in range(k)])
            res = await asyncio.gather(*futs, return_exceptions=True)
            errors += sum(1 for r in res if isinstance(r, BaseException))
            del futs, res
            done += k
            if done % max(wave, n // 10) == 0 or done == n:
                sizes = await client.run_on_scheduler(_scheduler_sizes) if agents else {}
                marks.append({"calls": done, "s": time.monotonic() - t0, "rss_mb": await _rss_of(client, proc),
                              "plugin_calls": sizes.get("plugin.state.calls"), "dask_tasks": sizes.get("dask.tasks")})
                print(f"    {'session' if agents else 'plain Dask'}: {done} calls, {marks[-1]['s']:.1f}s, "
                      f"scheduler RSS {marks[-1]['rss_mb']:.1f} MB", flush=True)

    if agents:
        async with da.session(client, name="long") as s:
            await waves(s.id)
    else:
        await waves(None)
    wall = time.monotonic() - t0
    open_rss = marks[-1]["rss_mb"]
    return {"calls": n, "errors": errors, "wall_s": wall, "calls_per_s": n / wall, "rss_before_mb": start_rss,
            "rss_open_mb": open_rss, "bytes_per_call_open": (open_rss - start_rss) * 2**20 / n, "marks": marks}


async def run_long(args: argparse.Namespace, log_path: str) -> dict:
    """``--long-session N``: one session of N calls, then the same calls as plain Dask work,
    alternated (plain first), on the same cluster; the scheduler's memory per call."""
    tmp = tempfile.mkdtemp(prefix="agents-soak-")
    log = open(log_path, "w")
    popen, address = start_cluster(tmp, args, log)
    out: dict = {}
    try:
        async with Client(address, asynchronous=True, timeout="60s") as client:
            await client.wait_for_workers(2, timeout=120)
            await da.install(client)
            proc = psutil.Process(popen[0].pid)
            # warm both paths (imports, caches) before anything is measured
            await long_session(client, proc, 2 * args.wave, args.wave, agents=False)
            await long_session(client, proc, 2 * args.wave, args.wave, agents=True)
            await asyncio.sleep(args.retention + 2)
            out["plain"] = await long_session(client, proc, args.long_session, args.wave, agents=False)
            out["session"] = ses = await long_session(client, proc, args.long_session, args.wave, agents=True)
            await asyncio.sleep(args.retention + 2)  # the session completes and is dropped after retention
            sizes = await client.run_on_scheduler(_scheduler_sizes)
            ses["rss_after_end_mb"] = await _rss_of(client, proc)
            ses["plugin_calls_after_end"] = sizes.get("plugin.state.calls")
            ses["plugin_sessions_after_end"] = sizes.get("plugin.state.sessions")
            ses["gc_objects_after_end"] = sizes.get("gc.objects")
            # a second session of the same size: it reuses what the first freed (the allocator
            # keeps freed memory in its pools) if nothing of the first is still held
            out["second"] = again = await long_session(client, proc, args.long_session, args.wave, agents=True)
            await asyncio.sleep(args.retention + 2)
            sizes = await client.run_on_scheduler(_scheduler_sizes)
            again["rss_after_end_mb"] = await _rss_of(client, proc)
            again["gc_objects_after_end"] = sizes.get("gc.objects")
            again["plugin_calls_after_end"] = sizes.get("plugin.state.calls")
    finally:
        stop_processes(list(reversed(popen)), log, tmp)
    plain, ses = out["plain"], out["session"]
    out["summary"] = {
        "calls": args.long_session, "errors": plain["errors"] + ses["errors"],
        "session_bytes_per_call_open": round(ses["bytes_per_call_open"]),
        "plain_dask_bytes_per_call": round(plain["bytes_per_call_open"]),
        "session_rss_growth_mb": round(ses["rss_open_mb"] - ses["rss_before_mb"], 1),
        "session_rss_after_end_minus_before_mb": round(ses["rss_after_end_mb"] - ses["rss_before_mb"], 1),
        "session_calls_per_s": round(ses["calls_per_s"], 1), "plain_calls_per_s": round(plain["calls_per_s"], 1),
        "plugin_calls_after_end": ses["plugin_calls_after_end"],
        "second_session_rss_growth_mb": round(out["second"]["rss_open_mb"] - ses["rss_after_end_mb"], 1),
        "gc_objects_after_first_and_second": [ses["gc_objects_after_end"], out["second"]["gc_objects_after_end"]],
        "emulated": True,
    }
    return out


def summarize(out: dict, args: argparse.Namespace) -> dict:
    base, final = out["baseline"], out["afters"][-1]
    fb, ff = _flat(base), _flat(final)
    fpeak: dict[str, float] = {}
    for s in out["peaks"] + out["afters"]:
        for k, v in _flat(s).items():
            fpeak[k] = max(fpeak.get(k, v), v)
    structures = {k: {"baseline": fb.get(k, 0), "peak": fpeak.get(k, fb.get(k, 0)), "final": ff.get(k, 0)}
                  for k in sorted(set(fb) | set(ff) | set(fpeak))}
    leaked = {k: v for k, v in structures.items()
              if v["final"] > v["baseline"] and not _bounded(k)
              and k.split(":", 1)[1] not in ("live_sessions", "gc.objects")}
    objects = {k.split(":", 1)[0]: v for k, v in structures.items() if k.endswith(":gc.objects")}
    names = list(base["rss_mb"])
    rss = {n: {"baseline": base["rss_mb"][n], "peak": max(s["rss_mb"][n] for s in out["peaks"] + out["afters"]),
               "final": final["rss_mb"][n]} for n in names}
    # drift: after-round RSS slope over the rounds after the first (the first one also warms
    # allocator pools and caches up to their bounds)
    drift = {}
    per_round = args.sessions // args.rounds
    for n in names:
        ys = [a["rss_mb"][n] for a in out["afters"][1:]]
        if len(ys) >= 2:
            xs = list(range(len(ys)))
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            drift[n] = slope * 1000 / per_round
        else:
            drift[n] = None
    # object types that grew most from baseline to the end (scheduler, first worker)
    growth = {}
    for who, b, f in (("scheduler", base["scheduler"], final["scheduler"]),
                      ("worker0", *(s["workers"][sorted(s["workers"])[0]] for s in (base, final)))):
        bt, ft = b.get("types", {}), f.get("types", {})
        diff = {t: ft[t] - bt.get(t, 0) for t in ft if ft[t] - bt.get(t, 0) > 0}
        growth[who] = dict(sorted(diff.items(), key=lambda kv: -kv[1])[:10])
    completed = sum(r["completed"] for r in out["rounds"])
    errors = sum(r["errors"] for r in out["rounds"])
    return {
        "sessions": completed + errors, "completed": completed, "errors": errors,
        "max_live_sessions": max(r["max_live_sessions"] for r in out["rounds"]),
        "sessions_per_s": completed / sum(r["wall_s"] for r in out["rounds"]),
        "rss_mb": rss,
        "rss_drift_mb_per_1000_sessions": drift,
        "rss_back_near_baseline": all(v["final"] - v["baseline"] <= args.rss_tolerance_mb for v in rss.values()),
        "structures_back_to_baseline": not leaked,
        # Python objects alive (after gc.collect()) per process: a leak keeps them growing
        "gc_objects": objects,
        "gc_type_growth": growth,
        "leaked_structures": leaked,
        "peak_structures": {k: v["peak"] for k, v in structures.items() if v["peak"] >= 100},
        "calls_per_session": 5, "emulated": True,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="2,000 sessions in 4 rounds of 500 (a few minutes)")
    p.add_argument("--sessions", type=int, default=None, help="sessions in all (default 10000; quick 2000)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5; quick 4)")
    p.add_argument("--concurrent", type=int, default=None, help="sessions open at once (default 2000; quick 500)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up sessions before the baseline")
    p.add_argument("--retention", type=float, default=2.0, help="agents.scheduler.session-retention, seconds")
    p.add_argument("--window", type=float, default=2.0,
                   help="agents.dashboard.window, seconds (per-call reports are kept for two windows)")
    p.add_argument("--time-scale", type=float, default=0.02, help="agents.emulation.time-scale for the tools")
    p.add_argument("--think", type=float, default=1.0, help="mean user pause inside a session, seconds (0 to 2x)")
    p.add_argument("--dask-log-length", type=int, default=None,
                   help="distributed.admin.low-level-log-length (Dask's default 1000 messages per comm log)")
    p.add_argument("--nthreads", type=int, default=64, help="threads per worker process")
    p.add_argument("--sample", type=float, default=3.0, help="seconds between memory samples under load")
    p.add_argument("--rss-tolerance-mb", type=float, default=64.0, help="final RSS this close to baseline passes")
    p.add_argument("--log", default=None, help="cluster log (default: a temporary file)")
    p.add_argument("--long-session", type=int, default=None, metavar="N",
                   help="instead: one session of N cheap calls, and the same N as plain Dask work; the "
                        "scheduler's memory per call")
    p.add_argument("--wave", type=int, default=1000, help="--long-session: calls in flight at once")
    args = p.parse_args(argv)
    args.sessions = args.sessions or (2000 if args.quick else 10_000)
    args.rounds = args.rounds or (4 if args.quick else 5)
    args.concurrent = args.concurrent or (500 if args.quick else 2000)
    import dask

    dask.config.set({"agents.llm.models": EMU})  # this client validates model names too
    log_path = args.log or os.path.join(tempfile.gettempdir(), f"agents-soak-{os.getpid()}.log")
    config = {k: v for k, v in vars(args).items() if k not in ("json", "log")}
    print(f"soak: {config}; EMULATED engines and tools; cluster log {log_path}", flush=True)
    t0 = time.monotonic()
    if args.long_session:
        res = asyncio.run(run_long(args, log_path))
        s = res["summary"]
        print(f"\none session of {s['calls']} calls: the scheduler grew {s['session_rss_growth_mb']} MB while it was "
              f"open ({s['session_bytes_per_call_open']} bytes per call; plain Dask, the same calls: "
              f"{s['plain_dask_bytes_per_call']} bytes per call); after its end and retention "
              f"{s['session_rss_after_end_minus_before_mb']} MB above before (allocator pools: a second session "
              f"of as many calls grew it {s['second_session_rss_growth_mb']} MB more; live objects after each "
              f"{s['gc_objects_after_first_and_second']}); {s['session_calls_per_s']} calls/s "
              f"(plain Dask {s['plain_calls_per_s']}); errors {s['errors']}")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({**res, "config": config, "machine": {"cpus": os.cpu_count(),
                           "python": platform.python_version()}}, f, indent=1, default=str)
        return 0 if s["errors"] == 0 else 1
    out = asyncio.run(run(args, log_path))
    summary = summarize(out, args)
    summary["wall_s"] = time.monotonic() - t0
    print(f"\n{summary['completed']} sessions completed ({summary['errors']} errors), up to "
          f"{summary['max_live_sessions']} live at once, {summary['sessions_per_s']:.1f} sessions/s")
    print(f"{'process':10s} {'baseline MB':>12s} {'peak MB':>9s} {'final MB':>9s} {'drift MB/1k sessions':>21s}")
    for n, v in summary["rss_mb"].items():
        d = summary["rss_drift_mb_per_1000_sessions"].get(n)
        print(f"{n:10s} {v['baseline']:12.1f} {v['peak'] or 0:9.1f} {v['final']:9.1f} "
              f"{d if d is None else round(d, 2)!s:>21s}")
    print(f"structures back to baseline: {summary['structures_back_to_baseline']}"
          + (f" (above: {summary['leaked_structures']})" if summary["leaked_structures"] else ""))
    print("Python objects (baseline -> peak -> final): "
          + ", ".join(f"{n} {v['baseline']} -> {v['peak']} -> {v['final']}" for n, v in summary["gc_objects"].items()))
    print(f"object types that grew most (baseline -> final): {summary['gc_type_growth']}")
    print(f"largest structures at peak: {summary['peak_structures']}")
    print(f"wall {summary['wall_s']:.0f}s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "config": config, "machine": {"cpus": os.cpu_count(),
                       "python": platform.python_version()},
                       "rounds": out["rounds"], "warmup": out["warmup"],
                       "baseline": out["baseline"], "afters": out["afters"],
                       "peaks": out["peaks"][-50:]}, f, indent=1, default=str)
    return 0 if summary["errors"] == 0 and summary["structures_back_to_baseline"] else 1


if __name__ == "__main__":
    sys.exit(main())
