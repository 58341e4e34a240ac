"""Workflow-aware KV management on a real vLLM engine: agent sessions with tool pauses under KV
memory pressure, side by side in one run.

What runs
---------
A real in-process vLLM CPU engine (``builtin:tiny-llama``: 2 layers, dummy weights, prompts as
token ids; 128-token blocks of 128 KiB) serves ``--sessions`` concurrent agent sessions shaped
like Open-SWE: a shared system prompt, a per-session task, then a planner step, developer
steps and tester steps (a failed test sends the session back to a developer). Each step is one
LLM call on the session's whole history; after it the session waits on a tool (planner:
file_io or web_api, developer: file_io or code_exec, tester: code_exec) whose latency is drawn
from ``dask_agents.kv.runtime.tool_latency``'s prior for that kind and multiplied by ``--time-scale``; the tool's
output and the model's output are appended to the history. Sessions start a little apart.

Every variant replays the *same* sessions (contents, tool kinds, latencies and output lengths
are drawn from ``--seed`` before any variant runs) on a fresh engine with the same settings
except its KV policy:

``prefix_caching``  vLLM's prefix cache alone (``kv-policy: none``): LRU eviction, no lower tier.
``wa_lru``          SAGA: WA-LRU order, tool-aware TTL pins, thresholds, speculative prefetch.
``nalar``           Nalar Alg. 3: drop at session end, offload by predicted idle time, prefetch.
``ours``            the full dask-agents policy (``dask_agents.kv.runtime.policies.Ours``).
``lru_host``        LRU order with the same host tier: workflow-blind offloading, what vLLM's native
                    offloading or LMCache give anyone (the baseline that matters).

The managed variants have a host-memory tier (``--host``) and receive the hints the global
controller sends (``EngineHost.kv_hint``): ``paused`` on the tool kind when a step ends,
``running`` when the next step starts, ``finished`` at the end. The device KV (``--device``) is
smaller than what the sessions' live KV needs at once: that is the pressure.

What is measured (per variant)
------------------------------
Recomputed prefill tokens (prompt tokens - vLLM's ``num_cached_tokens``, summed), the
token-weighted hit rate (cached / prompt tokens), task completion time per session (first call
to end of its last step; mean and P95), the LLM calls' mean latency, bytes moved between tiers
(device -> host offloads, host -> device restores, prefetched or on demand), the CPU time of
the engine's stepping thread and the manager's share of it.

``summary`` holds the full policy's (``ours``) ratios, each the median of paired per-round
ratios (every round runs every variant on fresh engines, in a rotated order) with its range
and every round's value under ``<key>_spread``, never a variant's best round:
``recompute_reduction_vs_lru_host`` and ``mean_tct_speedup_vs_lru_host`` (against LRU with the
same bounded host tier), ``recompute_reduction_vs_prefix_caching`` and
``mean_tct_speedup_vs_prefix_caching`` (against vLLM's prefix cache alone), and
``restore_stall_s`` (median per round of the time requests waited for on-demand restores);
``recompute_floor_tokens`` (what no policy avoids, with unbounded KV memory: ``recompute_floor``)
and ``recompute_reduction_bound_vs_<baseline>`` (the baseline's recomputed / the floor: no
policy's reduction against that baseline can be larger);
``per_variant`` holds the same for every variant, and ``goal`` the issue's targets.

Noise: on this shared 2-core machine a variant's wall time moved by 2-10x between rounds when
other processes ran (the load average before and after is in the JSON); the recompute numbers
do not move. The per-round ratios show how much a single round can be trusted.

Calibration: this model prefills about 50k tokens/s here and decodes one step in about 1.3 ms,
so a 3000-token prompt costs about 60 ms cold and 30 ms with its prefix cached; tool pauses are
the priors x 0.05 (a few ms to a few seconds), so the LLM's time matters in a session's TCT.

Reproduce::

    .venv/bin/python benchmarks/engine_kv.py --quick --json benchmarks/results/engine-kv-quick.json
    .venv/bin/python benchmarks/engine_kv.py --json benchmarks/results/engine-kv.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dask.utils import format_bytes

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from dask_agents.stats import percentile  # noqa: E402

VARIANTS = ("prefix_caching", "lru_host", "wa_lru", "nalar", "ours")
POLICY = {"prefix_caching": "none", "wa_lru": "wa_lru", "nalar": "nalar", "ours": "ours", "lru_host": "lru",
          "lmcache": "none", "offload_lru": "lru", "offload_ours": "ours"}
# "lmcache" (GPU: benchmarks/gpu_check.sh): vLLM's AsyncLLM with LMCache's CPU tier under it
# (engine: vllm-async, kv-connector: lmcache); no hints reach it (LMCache is workflow-blind).
# "offload_lru" / "offload_ours" (GPU only: vLLM refuses its OffloadingConnector on CPU): AsyncLLM
# with vLLM's own host tier (kv-connector: offloading), evicting by vLLM's LRU or by our policy
# (kv/runtime/offload_policy.py, fed the sessions' hints with the requests).
QUICK = {"sessions": 8, "steps": (5, 7), "task": (768, 1280), "tool_out": (192, 384), "rounds": 5}
FULL = {"sessions": 12, "steps": (5, 8), "task": (768, 1280), "tool_out": (192, 384), "rounds": 9}
TOOLS = {"planner": ("file_io", "web_api"), "developer": ("file_io", "code_exec"), "tester": ("code_exec",)}
OUTPUT_TOKENS = (8, 16, 24)  # the model's output per step (decode is a fixed cost no KV policy changes)
BLOCK_TOKENS, BLOCK_BYTES = 128, 128 * 1024  # the tiny model's KV block
VOCAB = (3, 1000)  # token ids the tiny model takes (< its vocabulary of 1024, past the specials)


@dataclass(frozen=True)
class Step:
    """One LLM step of a scripted session, and the tool wait after it."""

    node: str
    max_tokens: int
    tool: str | None  # None: the last step
    pause_s: float
    tool_tokens: tuple[int, ...]


@dataclass(frozen=True)
class Script:
    """One session: its task tokens, its steps, when it starts (seconds after the run starts)."""

    id: str
    start_s: float
    task: tuple[int, ...]
    steps: tuple[Step, ...]


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randint(*VOCAB) for _ in range(n))


def scripts(n: int, steps: tuple[int, int], task: tuple[int, int], tool_out: tuple[int, int],
            time_scale: float, seed: int, stagger_s: float, system: int = 0, max_len: int = 4096) -> list[Script]:
    """``n`` Open-SWE-shaped sessions (see the module docstring), fully drawn from ``seed``;
    a session ends early rather than outgrow the model's context (``max_len``)."""
    from dask_agents.kv.runtime.tool_latency import PRIORS

    out = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        k = rng.randint(*steps)
        task_tokens = _tokens(rng, rng.randint(*task))
        nodes = ["planner"]
        while len(nodes) < k:
            if nodes[-1] == "tester" and rng.random() < 0.5:
                nodes.append("developer")  # the tests failed: back to a developer
            elif nodes[-1] == "developer" and rng.random() < 0.4:
                nodes.append("tester")
            else:
                nodes.append("developer")
        body = []
        length = system + len(task_tokens)
        for j, node in enumerate(nodes):
            max_tokens = rng.choice(OUTPUT_TOKENS)
            tool_tokens = _tokens(rng, rng.randint(*tool_out))
            grown = length + max_tokens + len(tool_tokens)
            last = j == k - 1 or grown + max(OUTPUT_TOKENS) > max_len
            kind = None if last else rng.choice(TOOLS[node])
            pause = PRIORS[kind].sample(rng) * time_scale if kind else 0.0
            body.append(Step(node, max_tokens, kind, pause, () if last else tool_tokens))
            if last:
                break
            length = grown
        out.append(Script(f"s{i}", i * stagger_s, task_tokens, tuple(body)))
    return out


def recompute_floor(plan: list[Script], system: int, block: int = BLOCK_TOKENS) -> int:
    """Prefill tokens no KV policy can avoid on ``plan``, with unbounded KV memory: each
    session's first prompt past the shared system prompt (the system prompt once), then at every
    step what the previous step left uncached. vLLM caches full blocks only, and never the last
    sampled token's KV; a prompt reuses at most its first ``len - 1`` tokens (so a prompt that
    ends on a block boundary recomputes its last block)."""
    total, warm = 0, False
    for sc in plan:
        length, cached = system + len(sc.task), (system // block) * block if warm else 0
        for st in sc.steps:
            total += length - min(cached, (length - 1) // block * block)
            warm = True
            cached = (length + st.max_tokens - 1) // block * block
            length += st.max_tokens + len(st.tool_tokens)
    return total


@dataclass
class Outcome:
    """What one variant measured."""

    variant: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    calls: int = 0
    call_s: list[float] = field(default_factory=list)
    tct_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    engine_cpu_s: float = 0.0  # CPU time of the engine's stepping thread: the work, whatever the machine's load
    kv: dict[str, Any] = field(default_factory=dict)
    manager: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def recomputed_tokens(self) -> int:
        """Prompt tokens prefilled (not served from the prefix cache)."""
        return self.prompt_tokens - self.cached_tokens

    def summary(self) -> dict[str, Any]:
        """The numbers the table and the JSON show."""
        tct = sorted(self.tct_s)
        kv = self.kv
        return {"variant": self.variant, "policy": POLICY[self.variant], "calls": self.calls,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "recomputed_tokens": self.recomputed_tokens,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "tct_mean_s": sum(tct) / len(tct) if tct else math.nan,
                "tct_p95_s": percentile(tct, 95), "call_mean_s": sum(self.call_s) / max(1, len(self.call_s)),
                "bytes_offloaded": kv.get("offloaded_bytes", 0), "bytes_restored": kv.get("restored_bytes", 0),
                "bytes_restored_on_demand": kv.get("restored_on_demand_bytes", 0),
                "bytes_spilled": kv.get("spilled_bytes", 0), "restore_stall_s": kv.get("restore_stall_seconds", 0.0),
                "wall_s": self.wall_s,
                "engine_cpu_s": self.engine_cpu_s,
                "manager_s": self.manager.get("tick_seconds", 0.0) + self.manager.get("room_seconds", 0.0),
                "sessions": len(tct), "errors": len(self.errors)}


def paired(by_round: list[dict[str, dict]], base: str, variant: str, key: str) -> list[float]:
    """Per round where both ran: ``base``'s ``key`` / ``variant``'s (> 1: the variant has less)."""
    return [rd[base][key] / max(rd[variant][key], 1e-12) for rd in by_round if base in rd and variant in rd]


def spread(xs: list[float]) -> dict[str, Any]:
    """Median of the paired per-round ratios, their range and every one of them."""
    return {"median": statistics.median(xs) if xs else None, "min": min(xs, default=None),
            "max": max(xs, default=None), "n": len(xs), "per_round": xs}


def _merge(a: Outcome, b: Outcome) -> Outcome:
    """Pool two rounds of one variant."""
    kv = {k: a.kv.get(k, 0) + b.kv.get(k, 0) for k in set(a.kv) | set(b.kv) if isinstance(b.kv.get(k, 0), (int, float))}
    mgr = {k: a.manager.get(k, 0) + b.manager.get(k, 0) for k in ("tick_seconds", "room_seconds")}
    return Outcome(a.variant, a.prompt_tokens + b.prompt_tokens, a.cached_tokens + b.cached_tokens,
                   a.calls + b.calls, a.call_s + b.call_s, a.tct_s + b.tct_s, a.wall_s + b.wall_s,
                   a.engine_cpu_s + b.engine_cpu_s, kv, mgr, a.errors + b.errors)


def settings(variant: str, args: argparse.Namespace) -> Any:
    """The engine settings of one variant (only the policy differs; prefix caching alone has no
    host tier, as vLLM has none)."""
    from dask_agents.model_settings import ModelSettings

    policy = POLICY[variant]
    extra: dict = {}
    if variant == "lmcache":
        from dask.utils import parse_bytes

        # LMCache reads its configuration from the environment: a CPU tier of --host bytes
        os.environ.setdefault("LMCACHE_LOCAL_CPU", "True")
        os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", str(parse_bytes(args.host) / 2**30))
        os.environ.setdefault("LMCACHE_CHUNK_SIZE", "128")
        extra = {"engine": "vllm-async", "kv_connector": "lmcache"}
    elif variant.startswith("offload_"):
        extra = {"engine": "vllm-async", "kv_connector": "offloading"}
    return ModelSettings(model="builtin:tiny-llama", load_format="dummy", tokenizer="byte", dtype="bfloat16",
                         max_model_len=args.max_model_len, kv_cache_memory_bytes=args.device,
                         kv_host_bytes=0 if policy == "none" else args.host, kv_policy=policy,
                         scheduling="fcfs", **extra)


def _thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` has used (Linux; 0.0 where the clock is not available)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, TypeError):
        return 0.0


def run_variant(variant: str, plan: list[Script], args: argparse.Namespace) -> Outcome:
    """Serve ``plan`` on a fresh engine running ``variant``'s KV policy."""
    from dask_agents.worker_plugin.engines import make_host

    host = make_host(f"bench-{variant}", settings(variant, args))
    host.start()
    host.wait_loaded(600)
    out = Outcome(variant)
    lock = threading.Lock()
    counter = iter(range(10**9))
    try:
        hint = getattr(host, "kv_hint", lambda *a, **k: None)  # AsyncLLM (lmcache) takes none
        # warm the kernels up (session-less: its blocks are nobody's and go first)
        host.submit("warmup", list(_tokens(random.Random(-1), 300)), host.sampling_params(4, 0.0, None),
                    None).result(300)

        def session(sc: Script, t0: float) -> None:
            time.sleep(max(0.0, t0 + sc.start_s - time.monotonic()))
            start = time.monotonic()
            history = list(SYSTEM) + list(sc.task)
            try:
                for j, st in enumerate(sc.steps):
                    if j:
                        hint(sc.id, "running", node=st.node)
                    c0 = time.monotonic()
                    res = host.submit(f"{sc.id}-{j}-{next(counter)}", history,
                                      host.sampling_params(st.max_tokens, 0.0, None), sc.id).result(600)
                    dt = time.monotonic() - c0
                    with lock:
                        out.calls += 1
                        out.prompt_tokens += len(history)
                        out.cached_tokens += int(res.num_cached_tokens or 0)
                        out.call_s.append(dt)
                    history += list(res.outputs[0].token_ids)
                    if st.tool is None:
                        hint(sc.id, "finished", node=st.node)
                        break
                    hint(sc.id, "paused", node=st.node, wait_key=st.tool)
                    time.sleep(st.pause_s)  # the tool runs
                    history += list(st.tool_tokens)
                with lock:
                    out.tct_s.append(time.monotonic() - start)
            except Exception as e:  # reported, never hidden
                with lock:
                    out.errors.append(f"{sc.id}: {type(e).__name__}: {e}")

        cpu0 = _thread_cpu(host._thread)
        t0 = time.monotonic()
        threads = [threading.Thread(target=session, args=(sc, t0), daemon=True) for sc in plan]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out.wall_s = time.monotonic() - t0
        out.engine_cpu_s = _thread_cpu(host._thread) - cpu0
        if hasattr(host, "kv_call"):
            out.kv = host.kv_call(lambda kv: kv.stats.as_dict()).result(60)
        if host.kv_manager is not None:
            out.manager = host.kv_call(lambda kv: host.kv_manager.report()).result(60)
    finally:
        host.close()
    return out


SYSTEM: tuple[int, ...] = ()


def format_table(rows: list[dict]) -> str:
    """The side-by-side table."""
    from dask.utils import format_bytes

    hdr = (f"{'variant':16s} {'recomputed':>10s} {'hit':>6s} {'TCT mean':>9s} {'TCT P95':>8s} {'call':>6s} "
           f"{'offloaded':>10s} {'restored':>10s} {'engine CPU':>10s} {'manager':>8s} {'wall':>6s}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(f"{r['variant']:16s} {r['recomputed_tokens']:10d} {r['hit_rate']:6.1%} {r['tct_mean_s']:8.2f}s "
                     f"{r['tct_p95_s']:7.2f}s {r['call_mean_s']:5.2f}s {format_bytes(r['bytes_offloaded']):>10s} "
                     f"{format_bytes(r['bytes_restored']):>10s} {r['engine_cpu_s']:9.1f}s {r['manager_s']:7.2f}s "
                     f"{r['wall_s']:5.1f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the configuration and the table; write JSON if asked."""
    global SYSTEM
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="fewer, shorter sessions, one round (under 5 minutes)")
    p.add_argument("--sessions", type=int, help="concurrent sessions")
    p.add_argument("--rounds", type=int, help="rounds over all variants (rotated order), pooled")
    p.add_argument("--device", default="5 MiB", help="device KV memory (128 KiB a block)")
    p.add_argument("--host", default="12 MiB", help="host-memory tier of the managed variants (bounded: less "
                   "than the sessions' total KV, printed as sessions_kv_total)")
    p.add_argument("--system-tokens", type=int, default=512, help="shared system prompt length")
    p.add_argument("--time-scale", type=float, default=0.05, help="tool latencies x this (the priors are real seconds)")
    p.add_argument("--stagger", type=float, default=0.05, help="seconds between session starts")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tick", default="50ms", help="agents.kv.tick of the managed variants")
    p.add_argument("--variants", nargs="+", choices=sorted(POLICY), help="run only these")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up run")
    args = p.parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    if args.sessions:
        size["sessions"] = args.sessions
    if args.rounds:
        size["rounds"] = args.rounds
    variants = list(args.variants or VARIANTS)

    import dask

    import dask_agents  # noqa: F401  (agents.* defaults)

    SYSTEM = _tokens(random.Random(f"{args.seed}:system"), args.system_tokens)
    plan = scripts(size["sessions"], size["steps"], size["task"], size["tool_out"], args.time_scale, args.seed,
                   args.stagger, args.system_tokens, args.max_model_len)
    config = {"model": "builtin:tiny-llama (2 layers, dummy weights, bf16, 128-token blocks of 128 KiB)",
              "device_kv": args.device, "host_tier": args.host, "sessions": size["sessions"],
              "steps_per_session": size["steps"], "task_tokens": size["task"], "tool_output_tokens": size["tool_out"],
              "system_tokens": args.system_tokens, "time_scale": args.time_scale, "stagger_s": args.stagger,
              "rounds": size["rounds"], "tick": args.tick, "seed": args.seed, "variants": variants,
              "calls": sum(len(s.steps) for s in plan),
              "tool_pause_s_total": round(sum(st.pause_s for s in plan for st in s.steps), 2),
              "sessions_kv_total": format_bytes(BLOCK_BYTES * sum(math.ceil((len(s.task) + sum(
                  st.max_tokens + len(st.tool_tokens) for st in s.steps)) / BLOCK_TOKENS) for s in plan)
                  + BLOCK_BYTES * math.ceil(args.system_tokens / BLOCK_TOKENS)),
              "final_prompt_tokens_max": max(args.system_tokens + len(s.task) + sum(
                  st.max_tokens + len(st.tool_tokens) for st in s.steps) for s in plan),
              "machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"}
    print("engine KV benchmark (real vLLM CPU engine)")
    for k, v in config.items():
        print(f"  {k}: {v}")
    t_start = time.monotonic()
    pooled: dict[str, Outcome] = {}
    by_round: list[dict[str, dict]] = []
    load_before = os.getloadavg()
    with dask.config.set({"agents.kv.tick": args.tick, "agents.emulation.time-scale": args.time_scale}):
        if not args.no_warmup:  # the first engine in a process runs slower (kernels, allocator): not measured
            w = run_variant("prefix_caching", plan[:3], args)
            print(f"  warm-up (not measured): {w.calls} calls in {w.wall_s:.1f}s", flush=True)
        for r in range(size["rounds"]):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            by_round.append({})
            for v in order:
                o = run_variant(v, plan, args)
                s = o.summary()
                print(f"  round {r + 1} {v:16s} recomputed {s['recomputed_tokens']:7d}  hit {s['hit_rate']:.1%}  "
                      f"TCT mean {s['tct_mean_s']:.2f}s  wall {s['wall_s']:.1f}s"
                      + (f"  ERRORS {o.errors[:2]}" if o.errors else ""), flush=True)
                pooled[v] = _merge(pooled[v], o) if v in pooled else o
                by_round[-1][v] = s
    rows = [pooled[v].summary() for v in variants]
    # Every ratio is the median of paired per-round ratios (each round runs every variant on
    # fresh engines, in a rotated order), with its range: never a variant's best round.
    per_variant: dict[str, dict] = {}
    for v in variants:
        d: dict[str, Any] = {"hit_rate": pooled[v].summary()["hit_rate"],
                             "restore_stall_s": statistics.median(rd[v]["restore_stall_s"] for rd in by_round)}
        for base in ("prefix_caching", "lru_host"):
            if base not in variants or base == v:
                continue
            for name, key in (("recompute_reduction", "recomputed_tokens"), ("mean_tct_speedup", "tct_mean_s"),
                              ("p95_tct_speedup", "tct_p95_s")):
                xs = paired(by_round, base, v, key)
                d[f"{name}_vs_{base}"] = statistics.median(xs) if xs else None
                d[f"{name}_vs_{base}_spread"] = spread(xs)
        per_variant[v] = d
    # The bound: no policy recomputes less than the unbounded-memory floor, so no ratio of
    # recomputed tokens against a baseline can exceed the baseline's recomputed / floor.
    floor = recompute_floor(plan, args.system_tokens)
    for v in variants:
        per_variant[v]["recomputed_over_floor"] = statistics.median(
            rd[v]["recomputed_tokens"] / floor for rd in by_round)
    bound = {f"recompute_reduction_bound_vs_{base}": per_variant[base]["recomputed_over_floor"]
             for base in ("lru_host", "prefix_caching") if base in per_variant}
    full = per_variant.get("ours", {})
    keys = ("recompute_reduction_vs_lru_host", "mean_tct_speedup_vs_lru_host",
            "recompute_reduction_vs_prefix_caching", "mean_tct_speedup_vs_prefix_caching")
    summary = {**{k: full.get(k) for k in keys}, **{f"{k}_spread": full.get(f"{k}_spread") for k in keys},
               "restore_stall_s": full.get("restore_stall_s"), "recompute_floor_tokens": floor, **bound,
               "per_variant": per_variant,
               "goal": {"recompute_reduction_vs_lru_host": 1.5, "mean_tct_speedup_vs_lru_host": 1.3,
                        "recompute_reduction_vs_prefix_caching": 3.0, "mean_tct_speedup_vs_prefix_caching": 1.6},
               "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    print()
    print(format_table(rows))
    print()
    fmt = lambda d, k: "-" if d.get(k) is None else (  # noqa: E731
        f"{d[k]:.2f}x [{d[k + '_spread']['min']:.2f}, {d[k + '_spread']['max']:.2f}]")
    for v, d in per_variant.items():
        print(f"  {v:16s} vs lru_host: recompute {fmt(d, 'recompute_reduction_vs_lru_host'):20s} "
              f"mean TCT {fmt(d, 'mean_tct_speedup_vs_lru_host'):20s} | vs prefix caching: recompute "
              f"{fmt(d, 'recompute_reduction_vs_prefix_caching'):20s} mean TCT "
              f"{fmt(d, 'mean_tct_speedup_vs_prefix_caching'):20s} | restore stall {d['restore_stall_s']:.3f}s")
    print("  (median of paired per-round ratios [min, max])")
    print(f"  recompute floor (unbounded KV memory): {floor} tokens a round; no policy's recompute reduction "
          "can exceed " + ", ".join(f"{v:.2f}x {k.rsplit('_vs_', 1)[1]}" for k, v in bound.items())
          + "; recomputed / floor: " + ", ".join(f"{v} {d['recomputed_over_floor']:.2f}"
                                                for v, d in per_variant.items()))
    print(f"  load average before/after: {summary['load_average_before_after']} on {os.cpu_count()} cpus")
    print(f"  total wall {time.monotonic() - t_start:.0f}s")
    if args.json:
        payload = {"config": config, "summary": summary, "results": rows, "rounds": by_round,
                   "details": {v: {"kv_stats": pooled[v].kv, "manager": pooled[v].manager,
                                   "errors": pooled[v].errors} for v in variants}}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        print(f"  wrote {args.json}")
    return 1 if any(pooled[v].errors for v in variants) else 0


if __name__ == "__main__":
    sys.exit(main())
