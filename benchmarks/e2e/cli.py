"""``python benchmarks/e2e.py``: the command line of the end-to-end benchmark.

Phases: ``all`` (default: choose, then measure every unit, then summarize), ``choose`` (the
sweeps: writes the chosen configurations, ``--json``), ``measure`` (``--choices FILE`` from a
choose run, ``--job K/N`` for a slice of the units: writes the units' results), ``merge FILES``
(joins choose and measure files of one plan: writes the summary, tables and plots),
``reference`` (the zero-overhead reference, :mod:`benchmarks.e2e.zero_overhead`: of the units in
the files given, or with ``--rates`` at those loads; ``--engine KNOB=VALUE`` changes the
engine; ``--order fcfs,srpt`` adds an oracle's queue order). Every number is EMULATED; the time
scale is printed with every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from typing import Any, Callable

from benchmarks.e2e import report, runner
from benchmarks.e2e.profile import profile
from benchmarks.e2e.program import Setup

VARIANTS = ["dask", "dask-capped", "dask-ttl", "dask-agents", "dask-agents-no-admission", "ray", "langgraph"]
ABLATIONS = ["dask-agents-no-prioritize", "dask-agents-no-balance"]
QUICK = {"time_scale": 0.05, "requests": 16, "workflows": ["swe"],
         "scenarios": {"swe": ["stationary"], "finance": ["stationary"], "router": ["skew"]},
         "factors": [0.8, 1.2], "seeds": [0], "variants": VARIANTS, "probe_rps": 0.15,
         "static_sweep": [{"threads": 64, "llm_slots": None, "routing": "session_sticky"}],
         "capacity_ladder": [0.1, 0.2], "caps": [12], "ttls": [30.0], "peer_routings": ["session_sticky"],
         "deadline_s": 240.0, "replicas": 2}
"""A smoke run of the whole pipeline under 10 minutes: one value per knob (no real sweep), 16
requests, one seed, time scale 0.05 (framework overhead x20 against the engine's times): its
numbers say the harness works, not where dask-agents stands."""
FULL = {"time_scale": 0.1, "requests": 60, "workflows": ["swe", "finance", "router"],
        "scenarios": {"swe": ["stationary", "bursty", "phase"], "finance": ["stationary", "bursty"],
                      "router": ["skew"]},
        "factors": [0.5, 0.8, 1.0, 1.2], "seeds": [0, 1, 2], "variants": VARIANTS + ABLATIONS,
        "probe_rps": {"swe": 0.15, "finance": 0.2, "router": 1.0},
        "static_sweep": [{"threads": 64, "llm_slots": s, "routing": r} for s in (None, 32)
                         for r in ("none", "session_sticky")],
        "capacity_ladder": {"swe": [0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4],
                            "finance": [0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8],
                            "router": [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]}, "caps": [4, 8, 12, 16, 24],
        "ttls": [5.0, 20.0, 60.0, 180.0], "peer_routings": ["least_loaded", "session_sticky"],
        "deadline_s": 1800.0, "sweep_deadline_s": 300.0, "replicas": 2}
"""The full run: every workflow and scenario, loads 0.5-1.2 of the derived capacity, 3 seeds,
every variant and two ablations; time scale 0.1. Split with ``--job K/N`` (see the module
docstring and benchmarks/README.md)."""


def workflow(name: str) -> Any:
    import importlib

    return importlib.import_module(f"benchmarks.e2e.workflows.{name}").WORKFLOW


CHOOSE_ONLY = ("workflows", "static_sweep", "capacity_ladder", "caps", "ttls", "peer_routings", "probe_rps",
               "sweep_deadline_s")
"""Preset keys only the choose phase reads: files merged into one result may differ in them
(each workflow's choices and sweeps are recorded with it)."""


def make_setup(wf: Any, preset: dict, engine_profile: str = "realistic") -> Setup:
    """The resources every variant gets: the engine profile (REALISTIC unless ``--profile``
    says otherwise), the replicas split evenly over the workflow's models, the preset's time
    scale."""
    models = tuple(getattr(wf, "models", ("coder",)))
    per = max(1, preset["replicas"] // len(models))
    return Setup(engine=profile(engine_profile), replicas=per * len(models), models=tuple((m, per) for m in models),
                 time_scale=preset["time_scale"], max_model_len=131072, tool_threads=64)


def factory_for(setup: Setup, choices: dict) -> Callable[..., Callable]:
    """``factory(name, scenario, override=None)`` -> a zero-argument constructor of the variant
    with the chosen configuration (``override`` replaces a knob: the sweeps)."""
    def factory(name: str, scenario: str, override: dict | None = None) -> Callable:
        o = dict(override or {})
        static = choices.get("static") or {"threads": 64, "llm_slots": None, "routing": "session_sticky"}
        picks = (choices.get("per_scenario") or {}).get(scenario, {}).get(name, None)

        def make() -> Any:
            if name == "dask":
                from benchmarks.e2e.variants.dask_plain import PlainDask
                return PlainDask(setup, **{**static, **o})
            if name in ("dask-capped", "dask-ttl"):
                from benchmarks.e2e.variants.dask_plain import PlainDask
                key = "cap" if name == "dask-capped" else "ttl"
                value = o.get(key, picks)
                if value is None:
                    raise ValueError(f"{name}: no {key} chosen for scenario {scenario!r} (run the choose phase)")
                return PlainDask(setup, threads=static["threads"], llm_slots=static["llm_slots"],
                                 routing="session_sticky", **{key: value})
            if name.startswith("dask-agents@"):  # the product with its own knobs set: dask-agents@KEY=VALUE,...
                from benchmarks.e2e.variants.agents import DaskAgents
                return DaskAgents(setup, overrides=parse_overrides(name[len("dask-agents@"):]), name=name)
            if name.startswith("dask-agents"):
                from benchmarks.e2e.variants.agents import DaskAgents
                return DaskAgents(setup, disabled=name[len("dask-agents-no-"):] if name != "dask-agents" else None)
            if name in runner.PEERS:
                routing = o.get("routing", picks or "session_sticky")
                if name == "ray":
                    from benchmarks.e2e.variants.ray_peer import RayPeer
                    return RayPeer(setup, routing=routing)
                from benchmarks.e2e.variants.langgraph_peer import LangGraphPeer
                return LangGraphPeer(setup, routing=routing)
            if name == "inprocess":
                from benchmarks.e2e.variants.common import InProcess
                return InProcess(setup)
            raise ValueError(f"unknown variant {name!r}")

        return make

    return factory


def parse_overrides(text: str) -> dict:
    """``KEY=VALUE,...`` of a ``dask-agents@...`` variant: ``agents.KEY`` set to VALUE (read as
    YAML: numbers, booleans, durations as strings) for that variant only."""
    import yaml

    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"dask-agents@{text}: expected KEY=VALUE,... (agents.* keys), got {part!r}")
        out[f"agents.{key.strip()}"] = yaml.safe_load(value)
    return out


def check_peers(variants: list[str], no_peers: bool) -> list[str]:
    """The variants to run: peers dropped only with ``--no-peers``; a peer that cannot import fails."""
    if no_peers:
        return [v for v in variants if v not in runner.PEERS]
    for p in (v for v in variants if v in runner.PEERS):
        try:
            __import__({"ray": "ray", "langgraph": "langgraph"}[p])
        except ImportError as e:
            raise SystemExit(f"peer {p} is not installed ({e}); install the peers extra (make bench) "
                             f"or pass --no-peers to leave peers out on purpose") from None
    return variants


def jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def config(preset: dict, mode: str) -> dict:
    return {"mode": mode, "preset": preset, "python": platform.python_version(), "cpus": os.cpu_count(),
            "emulated": "EMULATED: engines are worker_plugin/emulated.py's cost model; tools sleep",
            "time_scale": preset["time_scale"], "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "code": code_provenance()}


SUBPACKAGES = ("dask_agents.scheduler_plugin", "dask_agents.worker_plugin", "dask_agents.kv")


def code_provenance(modules: dict[str, str] | None = None) -> dict:
    """Which checkout the measured code comes from: the root of ``dask_agents`` and the git
    commit there (``dirty`` if it has changes). Refuses (SystemExit) a run whose subpackages
    import from another checkout: an editable install maps them to the checkout it was made
    from, so a second worktree on ``PYTHONPATH`` would otherwise run a mix of two trees (its
    workers start later and import whatever that other tree holds then)."""
    import importlib
    import subprocess

    if modules is None:
        modules = {m: importlib.import_module(m).__file__ for m in ("dask_agents",) + SUBPACKAGES}
    root = os.path.dirname(os.path.dirname(os.path.realpath(modules["dask_agents"])))
    stray = {m: f for m, f in modules.items() if not os.path.realpath(f).startswith(root + os.sep)}
    if stray:
        raise SystemExit(f"e2e: {', '.join(stray)} import from outside {root} ({stray}): link them into "
                         f"{root}/dask_agents/ (ln -s ../scheduler_plugin ...) or install that checkout")

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except Exception:
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"root": root, "commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/e2e.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", nargs="?", default="all", choices=["all", "choose", "measure", "merge", "reference"])
    ap.add_argument("files", nargs="*", help="merge: the choose and measure JSON files; reference: files with units")
    ap.add_argument("--quick", action="store_true", help="the quick preset (under 10 minutes)")
    ap.add_argument("--workflow", action="append", help="only these workflows (repeatable)")
    ap.add_argument("--variants", help="comma list (default: the preset's)")
    ap.add_argument("--seeds", type=int, help="number of seeds (0..N-1)")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--time-scale", type=float)
    ap.add_argument("--choices", help="measure: the choose phase's JSON")
    ap.add_argument("--job", help="measure: K/N, the K-th of N slices of the units")
    ap.add_argument("--no-peers", action="store_true", help="leave Ray and LangGraph out on purpose")
    ap.add_argument("--profile", default="realistic", choices=["realistic", "small"],
                    help="the engine profile (benchmarks/e2e/profile.py; small: the previous regime's)")
    ap.add_argument("--rates", help="reference: replay at these loads (comma list, requests/s) instead of files' units")
    ap.add_argument("--scenario", help="reference --rates: the scenario (default: the workflow's first)")
    ap.add_argument("--engine", action="append", default=[], metavar="KNOB=VALUE",
                    help="reference: an engine parameter changed (EmulationParams, e.g. max_batch=8)")
    ap.add_argument("--order", default="fcfs",
                    help="reference: the engines' queue orders, a comma list of fcfs, sjf, srpt (an oracle's)")
    ap.add_argument("--json", help="write the results here (and PNGs beside it)")
    a = ap.parse_args(argv)
    preset = dict(QUICK if a.quick else FULL)
    for key, val in (("requests", a.requests), ("time_scale", a.time_scale)):
        if val is not None:
            preset[key] = val
    if a.seeds is not None:
        if a.seeds < 1:
            raise SystemExit("--seeds needs at least 1")
        preset["seeds"] = list(range(a.seeds))
    if a.workflow:
        preset["workflows"] = a.workflow
    if a.variants:
        preset["variants"] = a.variants.split(",")
    if a.phase == "merge":
        return merge(a.files, a.json)
    if a.phase == "reference" and a.rates:
        return reference_at(preset, a.rates, a.scenario, a.engine, a.profile, a.json, a.order)
    if a.phase == "reference":
        return reference(a.files, a.json, preset["requests"], a.engine, a.order)
    preset["variants"] = check_peers(preset["variants"], a.no_peers)
    log = lambda s: print(s, flush=True)  # noqa: E731
    mode = "quick" if a.quick else "full"
    log(f"e2e ({mode}, {a.phase}): EMULATED, time scale {preset['time_scale']} (wall s per emulated s, engines "
        f"and tools alike); latencies in emulated seconds")
    out: dict[str, Any] = {"config": {**config(preset, mode), "profile": a.profile}, "choices": {}, "sweeps": {},
                           "units": [], "setups": {}}
    choices_in = json.load(open(a.choices))["choices"] if a.choices else {}
    job = tuple(int(x) for x in a.job.split("/")) if a.job else None
    for name in preset["workflows"]:
        wf = workflow(name)
        preset["scenarios"] = {**preset["scenarios"], name: preset["scenarios"].get(name, list(wf.scenarios))}
        setup = make_setup(wf, preset, a.profile)
        out["setups"][name] = setup.describe()
        log(f"{name}: {setup.describe()}")
        chosen = choices_in.get(name)
        if a.phase in ("all", "choose"):
            wpreset = {**preset, "scenarios": preset["scenarios"][name]}
            for key in ("probe_rps", "capacity_ladder"):  # per workflow where the preset says so
                if isinstance(preset[key], dict):
                    wpreset[key] = preset[key][name]
            res = runner.choose(wf, setup, wpreset, lambda ch: factory_for(setup, ch), log)
            chosen, out["sweeps"][name] = res["chosen"], res["sweeps"]
            log(f"{name}: chose {chosen}")
        if chosen is None:
            raise SystemExit(f"measure needs the choose phase's choices for {name} (--choices FILE)")
        out["choices"][name] = chosen
        if a.phase in ("all", "measure"):
            plan = {"scenarios": preset["scenarios"][name], "factors": preset["factors"], "seeds": preset["seeds"],
                    "variants": preset["variants"], "capacity_rps": chosen["capacity_rps"],
                    "requests": preset["requests"], "deadline_s": preset["deadline_s"]}
            out["units"] += runner.measure(wf, setup, plan, factory_for(setup, chosen), job, log)
    if a.phase == "all":
        out["summary"] = report.summarize(out["units"], **kv_context(out["units"], preset["requests"], out["setups"]),
                                          references=references(out["units"], preset["requests"], out["setups"]))
        print(report.table(out["summary"]))
    if a.json:
        if out.get("summary"):
            out["plots"] = report.plot(out["summary"], os.path.splitext(a.json)[0])
        with open(a.json, "w") as f:
            json.dump(jsonable(out), f, indent=1)
        log(f"wrote {a.json}")
    return 0


def kv_context(units: list[dict], requests: int, setups: dict, workflows: dict | None = None) -> dict:
    """``report.summarize``'s KV context of a run: per workflow, scenario and seed the requests'
    mean KV footprint and mean think time (the same requests, regenerated from their seeds) and
    per workflow the device KV and the host tier of all its engines (tokens)."""
    from benchmarks.e2e.ideal import kv_footprint, run_shared

    footprints: dict = {}
    think: dict = {}
    for wf_name, sc, seed in sorted({(u["workflow"], u["scenario"], u["seed"]) for u in units}):
        if wf_name not in setups:  # (files without their setups: no KV context for them)
            continue
        wf = (workflows or {}).get(wf_name) or workflow(wf_name)
        engine = setups[wf_name]["engine"]
        specs = wf.make_specs(requests, seed, sc)
        shared = run_shared(wf, specs)
        fp = [kv_footprint(wf, spec, engine, shared) for spec in specs]
        footprints.setdefault(wf_name, {}).setdefault(sc, {})[str(seed)] = sum(fp) / len(fp)
        think.setdefault(wf_name, {}).setdefault(sc, {})[str(seed)] = sum(map(getattr(wf, "think_s", lambda spec: 0.0), specs)) / len(specs)

    def tokens(st: dict, key: str) -> int:
        return int(st["engine"].get(key) or 0) * int(st["engine"].get("block_size") or 16) * st["replicas"]

    return {"footprints": footprints, "think_s": think,
            "kv_tokens": {name: tokens(st, "kv_blocks") for name, st in setups.items()},
            "host_tokens": {name: tokens(st, "host_kv_blocks") for name, st in setups.items()}}


def setup_of(described: dict) -> Setup:
    """The Setup a run recorded (``Setup.describe()``)."""
    return Setup(engine=dict(described["engine"]), replicas=described["replicas"],
                 models=tuple(described["models"].items()), time_scale=described["time_scale"],
                 max_model_len=described["max_model_len"], tool_threads=described["tool_threads"],
                 entry=described.get("entry"))


def references(units: list[dict], requests: int, setups: dict, workflows: dict | None = None,
               order: str = "fcfs") -> dict:
    """``report.summarize``'s zero-overhead references: per workflow, scenario, load factor and
    seed, the unit's requests replayed on its engines in virtual time with no framework
    (:func:`benchmarks.e2e.zero_overhead.unit_reference`; deterministic, so computed here from
    the units' seeds and rates), the engines' queues in ``order``. None for a real engine's run
    (no cost model to replay)."""
    from benchmarks.e2e.zero_overhead import unit_reference

    out: dict = {}
    for wf_name, sc, f, seed, rate in sorted({(u["workflow"], u["scenario"], u["factor"], u["seed"], u["rate_rps"])
                                              for u in units}):
        if wf_name not in setups or setups[wf_name].get("entry"):
            continue
        wf = (workflows or {}).get(wf_name) or workflow(wf_name)
        ref = unit_reference(wf, setup_of(setups[wf_name]), sc, rate, seed, requests, order=order)
        out.setdefault(wf_name, {}).setdefault(sc, {}).setdefault(f, {})[str(seed)] = ref
    return out


def engine_knobs(knobs: list[str] | None) -> dict:
    """``--engine KNOB=VALUE`` arguments as engine parameters (VALUE is JSON: 8, false, 0.5)."""
    out = {}
    for x in knobs or []:
        k, eq, v = x.partition("=")
        if not eq or not k:
            raise SystemExit(f"--engine takes KNOB=VALUE, got {x!r}")
        try:
            out[k] = json.loads(v)
        except ValueError:
            raise SystemExit(f"--engine {x!r}: the value is not JSON (8, 0.5, false)") from None
    return out


def with_engine(setup: Setup, changed: dict) -> Setup:
    """``setup`` with ``changed`` engine parameters."""
    return Setup(engine={**setup.engine, **changed}, replicas=setup.replicas, models=setup.models,
                 time_scale=setup.time_scale, max_model_len=setup.max_model_len, tool_threads=setup.tool_threads,
                 entry=setup.entry)


def queue_orders(orders: str) -> list[str]:
    """``--order``'s comma list, checked (:data:`benchmarks.e2e.zero_overhead.ORDERS`)."""
    from benchmarks.e2e.zero_overhead import ORDERS

    got = [o for o in orders.split(",") if o]
    bad = [o for o in got if o not in ORDERS]
    if bad or not got:
        raise SystemExit(f"--order takes a comma list of {', '.join(ORDERS)}; got {orders!r}")
    return got


def reference(files: list[str], path: str | None, requests: int, knobs: list[str] | None = None,
              orders: str = "fcfs") -> int:
    """The zero-overhead reference of every unit in ``files`` (any JSON with ``units``, a
    diagnostic's too: each unit's setup is the one its variant recorded, with ``knobs``
    (``KNOB=VALUE``) changed on its engine) and each point's mean against it, once per queue
    order in ``orders`` (the first one's in ``references``, every one's in
    ``references_by_order``); ``requests``: the units' requests per point (the preset's unless
    given)."""
    if not files:
        raise SystemExit("reference needs files with units")
    changed = engine_knobs(knobs)
    order_list = queue_orders(orders)
    units = [u for f in files for u in json.load(open(f)).get("units", [])]
    setups = {}
    for u in units:
        got = (u["metrics"].get("variant") or {}).get("setup")
        if setups.setdefault(u["workflow"], got) != got:
            raise SystemExit(f"reference: {u['workflow']} units ran on different setups")
    setups = {w: {**st, "engine": {**st["engine"], **changed}} for w, st in setups.items()}
    by_order = {o: references(units, requests, setups, order=o) for o in order_list}
    rows = []
    for u in units:
        for o, refs in by_order.items():
            r = refs.get(u["workflow"], {}).get(u["scenario"], {}).get(u["factor"], {}).get(str(u["seed"]))
            if r is None:
                continue
            m = u["metrics"]
            rows.append({k: u[k] for k in ("workflow", "scenario", "factor", "seed", "variant", "rate_rps")}
                        | {"order": o, "mean_s": m["mean_s"], "ideal_mean_s": m["ideal_mean_s"],
                           "zero_overhead_mean_s": r["mean_s"], "zero_overhead_prefill_tokens": r["prefill_tokens"],
                           "mean_vs_zero_overhead": m["mean_s"] / r["mean_s"],
                           "zero_overhead_vs_ideal": r["mean_s"] / m["ideal_mean_s"]})
            print(f"  {u['workflow']} {u['scenario']} x{u['factor']:g} seed {u['seed']} {u['variant']:28s} "
                  f"mean {m['mean_s']:7.2f} s  zero-overhead ({o}) {r['mean_s']:7.2f} s "
                  f"({rows[-1]['mean_vs_zero_overhead']:.3f}x)  ideal {m['ideal_mean_s']:7.2f} s "
                  f"({rows[-1]['zero_overhead_vs_ideal']:.2f}x)")
    points = gaps_by_order(units, by_order)
    for (wf, sc, lk), p in points.items():
        print(f"  {wf} {sc} {lk}: best baseline {p['best_baseline']}; share of its gap to the ideal closed by "
              + ", ".join(f"zero overhead ({o}) {report.fmt(g['median'], '.2f')} [{report.fmt(g['min'], '.2f')}, "
                          f"{report.fmt(g['max'], '.2f')}]" for o, g in p["zero_overhead_gap_closed_mean"].items()))
    if path:
        with open(path, "w") as f:
            json.dump(jsonable({"what": "zero-overhead references (benchmarks/e2e/zero_overhead.py) of the units of "
                                        + ", ".join(files), "engine_changed": changed, "requests": requests,
                                "references": by_order[order_list[0]], "references_by_order": by_order,
                                "points": [{"workflow": wf, "scenario": sc, "load": lk, **p}
                                           for (wf, sc, lk), p in points.items()],
                                "rows": rows}),
                      f, indent=1)
    return 0


def gaps_by_order(units: list[dict], by_order: dict) -> dict:
    """Per (workflow, scenario, load) of ``units`` with baselines: the best baseline's (the
    summary's) and, per queue order, the share of its gap to the ideal that the zero-overhead
    replay closes (``report.summarize``'s ``zero_overhead_gap_closed_mean``: median over seeds,
    min, max)."""
    out: dict = {}
    for o, refs in by_order.items():
        for wf, scs in report.summarize(units, references=refs).items():
            for sc, loads in scs.items():
                for lk, e in loads.items():
                    if lk.startswith("x") and e.get("zero_overhead_gap_closed_mean"):
                        p = out.setdefault((wf, sc, lk), {"best_baseline": e["best_baseline"],
                                                          "zero_overhead_gap_closed_mean": {}})
                        p["zero_overhead_gap_closed_mean"][o] = e["zero_overhead_gap_closed_mean"]
    return out


def reference_at(preset: dict, rates: str, scenario: str | None, knobs: list[str], engine_profile: str,
                 path: str | None, orders: str = "fcfs") -> int:
    """The zero-overhead reference of each workflow at ``rates`` for every seed, on the run's
    engine with ``knobs`` (``KNOB=VALUE``, JSON values) changed, against the ideal bound of the
    same requests on the run's own engine: what no framework beats by cutting overhead; once per
    queue order in ``orders`` (an oracle's, :mod:`benchmarks.e2e.zero_overhead`); and whether the
    replay sustains the load by the runner's test (``zero_overhead_sustained``): a load no
    framework sustains even so is beyond every scheduler's capacity on these engines."""
    import statistics

    from benchmarks.e2e import stats
    from benchmarks.e2e.runner import arrivals, ideals
    from benchmarks.e2e.zero_overhead import replay

    changed = engine_knobs(knobs)
    order_list = queue_orders(orders)
    rows = []
    for name in preset["workflows"]:
        wf = workflow(name)
        sc = scenario or wf.scenarios[0]
        base = make_setup(wf, preset, engine_profile)
        setup = with_engine(base, changed)
        for rate in (float(x) for x in rates.split(",")):
            for seed in preset["seeds"]:
                specs = wf.make_specs(preset["requests"], seed, sc)
                offsets = arrivals(wf, sc, len(specs), rate, seed)
                ideal_of = ideals(wf, specs, base)
                w = stats.window([{"arrival": t, "ideal": ideal_of[s.id][0]} for t, s in zip(offsets, specs)])
                ideal_mean = statistics.fmean(r["ideal"] for r in w)
                for o in order_list:
                    ref = replay(wf, specs, offsets, setup, order=o)
                    # the runner's test of a sustained load, on the replay's latencies (nothing fails here)
                    sustained = stats.point_metrics(
                        [{"arrival": t, "latency": x, "ideal": ideal_of[s.id][0], "ok": True, "overhead_s": 0.0}
                         for t, x, s in zip(offsets, ref["latencies_s"], specs)], rate, {}, 0)["sustained"]
                    rows.append({"workflow": name, "scenario": sc, "rate_rps": rate, "seed": seed, "order": o,
                                 "ideal_mean_s": ideal_mean, "zero_overhead_mean_s": ref["mean_s"],
                                 "zero_overhead_p99_s": ref["p99_s"],
                                 "zero_overhead_vs_ideal": ref["mean_s"] / ideal_mean,
                                 "zero_overhead_sustained": sustained, "oracle_misses": ref["oracle_misses"]})
                    print(f"  {name} {sc} {rate:g}/s seed {seed} ({o}): zero-overhead mean {ref['mean_s']:.2f} s, "
                          f"ideal {ideal_mean:.2f} s ({ref['mean_s'] / ideal_mean:.3f}x), sustained {sustained}",
                          flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(jsonable({"what": "zero-overhead references at given loads (benchmarks/e2e/zero_overhead.py)",
                                "engine_changed": changed, "requests": preset["requests"], "rows": rows}), f, indent=1)
    return 0


def merge(files: list[str], path: str | None) -> int:
    """Join choose/measure files of one plan into one result with its summary."""
    if not files:
        raise SystemExit("merge needs the files to join")
    parts = [json.load(open(f)) for f in files]
    out: dict[str, Any] = {"config": parts[0]["config"], "choices": {}, "sweeps": {}, "units": [], "setups": {},
                           "merged_from": files}
    def plan_of(part: dict) -> dict:  # what the measure phase runs (the choose-only knobs may differ)
        return {k: v for k, v in part["config"].get("preset", {}).items() if k not in CHOOSE_ONLY}

    plan = plan_of(parts[0])
    for f, p in zip(files, parts):
        other = plan_of(p)
        if other != plan:
            raise SystemExit(f"merge: {f} was run with another plan (preset) than {files[0]}")
        if p["config"].get("profile", "realistic") != parts[0]["config"].get("profile", "realistic"):
            raise SystemExit(f"merge: {f} was run on another engine profile than {files[0]}")
        for k in ("choices", "sweeps", "setups"):
            for wf, v in p.get(k, {}).items():
                if k != "sweeps" and wf in out[k] and out[k][wf] != v:
                    raise SystemExit(f"merge: {k} of {wf} differ between files: not one plan")
                out[k][wf] = v
        out["units"] += p.get("units", [])
    keys = [(u["workflow"], u["scenario"], u["factor"], u["seed"], u["variant"]) for u in out["units"]]
    if len(keys) != len(set(keys)):
        raise SystemExit("merge: a unit appears twice (overlapping jobs)")
    requests = out["config"]["preset"]["requests"]
    out["summary"] = report.summarize(out["units"], **kv_context(out["units"], requests, out["setups"]),
                                      references=references(out["units"], requests, out["setups"]))
    print(report.table(out["summary"]))
    if path:
        out["plots"] = report.plot(out["summary"], os.path.splitext(path)[0])
        with open(path, "w") as f:
            json.dump(jsonable(out), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
