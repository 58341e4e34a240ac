"""Is an engine slowed by agents running in its worker? A REAL vLLM CPU engine's tokens/s and
step time alone, with agent work in the same worker process, and with the same agent work in
another worker process.

    .venv/bin/python benchmarks/engine_isolation.py --json benchmarks/results/engine-isolation.json

A ``LocalCluster`` of 2 worker processes (8 threads each), ``da.install``-ed with the shipped
tiny model (``builtin:tiny-llama``, dummy weights, the ``fanout.py`` entry) on each: the engine
dask-agents' worker plugin hosts, stepping in its own thread of the worker process. The
measured engine is worker A's: a task on A submits ``--seqs`` requests of ``--prompt`` tokens
(distinct prompts: nothing is served from the prefix cache) with ``--out`` output tokens at
once straight to the engine and times the batch; tokens/s = decode tokens / wall, step time =
wall / engine steps (``host.stats()["steps"]``).

Agent load: ``--agents`` tasks, each looping over what an agent does between its LLM and tool
calls (parse a JSON tool result, scan it with a regex, render the next prompt: ``--work-ms``
of CPU) and then waiting ``--wait-ms`` (on a tool), until the batch ends. Conditions:

- ``alone``: no agent load;
- ``same-worker``: the load runs in worker A's threads (where dask-agents runs components
  next to their engine);
- ``other-worker``: the same load in worker B's threads (another process: no shared GIL).

Each round runs the three conditions in a rotated order on the same warm cluster. Reported:
per condition and round tokens/s and step time, and the paired ratios ``alone / same-worker``
of tokens/s (slowdown) and ``same-worker / alone`` of step time, median over rounds with the
[min, max] spread; the same for ``other-worker``. On a machine whose cores the engine's kernels
already fill, ``other-worker`` measures core contention, and ``same-worker / other-worker``
what sharing the process (the GIL) adds to it. ``--engine vllm-process`` runs the same host in a
process of its own beside the worker (``process: true``: per-session KV control there too);
``--engine vllm-async`` runs vLLM's AsyncLLM (the engine core in a child process of the worker,
vLLM's production layout).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dask  # noqa: E402
from distributed import Client, LocalCluster, get_worker  # noqa: E402

import dask_agents as da  # noqa: E402
from benchmarks import fanout_app as app  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # (the workers inherit it)
CONDITIONS = ("alone", "same-worker", "other-worker")
WORD = re.compile(r"[a-z]+")


def _host() -> Any:
    engines = get_worker().plugins["dask-agents"].engines
    return engines.start(app.MODEL)


def engine_batch(tag: str, seqs: int, prompt: int, out: int) -> dict:
    """``seqs`` requests at once to this worker's engine; wall, decode tokens and steps."""
    host = _host()
    params = host.sampling_params(out, 0.0, None)
    prompts = [host.tokenizer.encode(app.text(f"{tag}/{i}/{uuid.uuid4().hex}", prompt))[:prompt] for i in range(seqs)]
    steps0 = host.stats().get("steps", 0)
    t0 = time.perf_counter()
    futs = [host.submit(uuid.uuid4().hex, p, params, None) for p in prompts]
    outs = [f.result(600) for f in futs]
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "decode_tokens": tokens, "steps": host.stats().get("steps", 0) - steps0,
            "prompt_tokens": sum(len(p) for p in prompts)}


def agent_load(stop: str, work_ms: float, wait_ms: float, seed: int) -> dict:
    """What an agent does between calls, in a loop until ``stop`` exists: CPU work (a tool's
    JSON result parsed, scanned, the next prompt rendered) for about ``work_ms``, then a wait."""
    doc = json.dumps({"results": [{"title": app.text(f"t{seed}/{i}", 40), "body": app.text(f"b{seed}/{i}", 400)}
                                  for i in range(20)]})
    cycles = 0
    cpu = 0.0
    while not os.path.exists(stop):
        t = time.thread_time()
        while (time.thread_time() - t) * 1000 < work_ms:
            parsed = json.loads(doc)
            words = sum(len(WORD.findall(r["body"])) for r in parsed["results"])
            prompt = "\n".join(f"- {r['title']}: {r['body'][:80]}" for r in parsed["results"])
            doc = json.dumps({**parsed, "words": words, "last": prompt[:64]})
        cpu += time.thread_time() - t
        cycles += 1
        time.sleep(wait_ms / 1000)
    return {"cycles": cycles, "cpu_s": cpu}


def run_condition(client: Client, cond: str, a: str, b: str, args: argparse.Namespace, tag: str) -> dict:
    stop = os.path.join(args.tmp, f"stop-{uuid.uuid4().hex}")
    load = []
    if cond != "alone":
        where = a if cond == "same-worker" else b
        load = [client.submit(agent_load, stop, args.work_ms, args.wait_ms, i, workers=[where], pure=False)
                for i in range(args.agents)]
        # the load is running before the engine's batch starts
        deadline = time.time() + 60
        while sum(s == "processing" for s in client.run_on_scheduler(
                lambda dask_scheduler, keys=[f.key for f in load]: [getattr(dask_scheduler.tasks.get(k), "state", None)
                                                                 for k in keys])) \
                < len(load) and time.time() < deadline:
            time.sleep(0.05)
    try:
        r = client.submit(engine_batch, tag, args.seqs, args.prompt, args.out, workers=[a], pure=False).result()
    finally:
        open(stop, "w").close()
    loads = client.gather(load)
    r.update(condition=cond, tokens_per_s=r["decode_tokens"] / r["wall_s"],
             step_ms=1000 * r["wall_s"] / r["steps"] if r["steps"] else None,
             agent_cycles=sum(x["cycles"] for x in loads), agent_cpu_s=sum(x["cpu_s"] for x in loads))
    return r


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": xs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--out", type=int, default=128)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--work-ms", type=float, default=5.0)
    ap.add_argument("--wait-ms", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--engine", choices=("vllm", "vllm-process", "vllm-async"), default="vllm",
                    help="vllm: stepped in a thread of the worker process (default); vllm-process: the same host, "
                         "per-session KV control included, in a process of its own beside the worker "
                         "(process: true); vllm-async: vLLM's AsyncLLM, its engine core in a child process (its "
                         "step count is not visible here: tokens/s only)")
    args = ap.parse_args(argv)
    import tempfile

    args.tmp = tempfile.mkdtemp(prefix="engine-isolation-")
    t0 = time.time()
    rows: list[dict] = []
    entry = ({**app.ENTRY, "engine": "vllm", "process": True} if args.engine == "vllm-process"
             else {**app.ENTRY, "engine": args.engine})
    with dask.config.set({"agents.llm.models": {app.MODEL: entry},
                          # AsyncLLM starts its engine core as a child: the worker must not be a daemon
                          "distributed.worker.daemon": args.engine != "vllm-async"}), \
            LocalCluster(n_workers=2, threads_per_worker=args.threads, processes=True, dashboard_address=None) as lc, \
            Client(lc) as client:
        da.install(client, models=[app.MODEL])  # returns once the engines have loaded
        a, b = sorted(client.scheduler_info()["workers"])
        client.submit(engine_batch, "warm", args.seqs, args.prompt, args.out, workers=[a], pure=False).result()
        for rnd in range(args.rounds):
            order = CONDITIONS[rnd % 3:] + CONDITIONS[:rnd % 3]
            for cond in order:
                r = run_condition(client, cond, a, b, args, f"r{rnd}/{cond}")
                r["round"] = rnd
                rows.append(r)
                step = f"{r['step_ms']:6.2f} ms" if r["step_ms"] else "  n/a"
                print(f"  round {rnd} {cond:12s} {r['tokens_per_s']:7.1f} tok/s  step {step}  "
                      f"({r['decode_tokens']} tokens, {r['steps']} steps, {r['wall_s']:.2f} s; agent cycles "
                      f"{r['agent_cycles']}, agent CPU {r['agent_cpu_s']:.2f} s)", flush=True)
    by = {(r["round"], r["condition"]): r for r in rows}
    rounds = range(args.rounds)
    summary = {}
    for cond in ("same-worker", "other-worker"):
        summary[f"tokens_per_s_alone_over_{cond}"] = spread(
            [by[(i, "alone")]["tokens_per_s"] / by[(i, cond)]["tokens_per_s"] for i in rounds])
        if args.engine in ("vllm", "vllm-process"):
            summary[f"step_ms_{cond}_over_alone"] = spread(
                [by[(i, cond)]["step_ms"] / by[(i, "alone")]["step_ms"] for i in rounds])
    summary["tokens_per_s_other_over_same_worker"] = spread(
        [by[(i, "other-worker")]["tokens_per_s"] / by[(i, "same-worker")]["tokens_per_s"] for i in rounds])
    summary["goal_ratio"] = 1.10
    doc = {"config": {**{k: v for k, v in vars(args).items() if k != "tmp"}, "model_entry": entry,
                      "python": platform.python_version(), "cpus": os.cpu_count(),
                      "cluster": f"LocalCluster(n_workers=2, threads_per_worker={args.threads}, processes=True)"},
           "rows": rows, "summary": summary, "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    for k, v in summary.items():
        if isinstance(v, dict):
            print(f"{k}: {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]")
    print(f"wrote {args.json} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
