"""The yardstick's real-engine check: Open-SWE on two REAL vLLM CPU engines.

    .venv/bin/python benchmarks/e2e_real.py --json PATH [--quick]

The yardstick (``benchmarks/e2e/``: its runner, variants, statistics and report) with every
LLM call on a real in-process vLLM engine: the shipped tiny model (``builtin:tiny-llama``: 2
layers, dummy weights, byte tokenizer, 128-token blocks of 128 KiB), one engine per worker
process (peers: per actor or server), 2 replicas. The Open-SWE requests are the realistic
workflow's draws shrunk to fit the model's 4,096 positions (every length x ``TOKENS``, every tool
latency x ``TOOLS``: ``benchmarks/e2e/workflows/swe.py``'s ``scaled``), and each engine's KV is
kept small (12 MiB = 96 blocks = 12k tokens) so that pressure exists: a session's developers
hold 5-10k tokens together. Every variant gets the same engine entry and the same host tier
(24 MiB per engine); the baselines' is workflow-blind (``kv-policy: lru``: what vLLM's native
CPU offloading or LMCache give anyone), dask-agents runs its configured policy on it.

Method as the yardstick's: the choose phase picks plain Dask's best static configuration,
the capacity and the cap on sweep seeds; every reported number is a fresh point, variants
interleaved per seed; the ideal bound uses the cost shape fitted on this engine
(``benchmarks/results/engine-shape.json``, R^2 0.93-0.95: a bound within about 20%).
Latency here is the real time of a tiny model on a shared 2-core machine (scheduler, workers,
engines and the load generator on two cores): the ratios say how the frameworks drive the same
real engines, not how fast a GPU is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.e2e import cli, report, runner  # noqa: E402
from benchmarks.e2e.program import Setup  # noqa: E402
from benchmarks.e2e.workflows.swe import SWE  # noqa: E402

MAX_MODEL_LEN = 4096
LABEL = "REAL vLLM CPU engines"
TOKENS = 0.05  # the realistic draws' lengths, shrunk: the longest prompt of a session ~2-3.5k
TOOLS = 0.05  # tool latencies: a 15 s test suite runs 0.75 s
# The tiny model's cost shape on this machine's CPU engine (benchmarks/results/engine-shape.json,
# "fit"), in the emulated engine's terms: what the ideal bound computes with.
REAL_SHAPE = {"decode_s_per_step": 0.00118, "decode_s_per_seq": 6.45e-05, "decode_s_per_ctx_token": 8.44e-08,
              "prefill_s_per_token": 1.335e-05, "prefill_s_per_token_pos": 0.0, "block_size": 128, "kv_blocks": 96}

FULL = {"time_scale": 1.0, "requests": 40, "scenarios": ["stationary"], "factors": [0.8, 1.2], "seeds": [0, 1, 2],
        "variants": ["dask", "dask-capped", "dask-agents"], "probe_rps": 1.0,
        "static_sweep": [{"threads": t, "llm_slots": None, "routing": r} for t in (16, 32)
                         for r in ("none", "session_sticky")],
        "capacity_ladder": [0.125, 0.25, 0.5, 1.0, 1.5, 2.0], "caps": [1, 2, 4], "ttls": [], "peer_routings": [],
        "deadline_s": 300.0, "replicas": 2, "kv": "12 MiB", "host": "24 MiB"}
QUICK = {**FULL, "requests": 16, "factors": [1.0], "seeds": [0], "variants": ["dask", "dask-agents"],
         "static_sweep": [{"threads": 16, "llm_slots": None, "routing": "session_sticky"}],
         "capacity_ladder": [0.25, 0.5]}


def real_entry(kv: str, host: str) -> dict:
    """The ``coder`` entry of every engine: a real vLLM CPU engine on the shipped tiny model,
    vLLM's prefix cache and a workflow-blind LRU host tier (dask-agents replaces the policy)."""
    return {"model": "builtin:tiny-llama", "engine": "vllm", "load-format": "dummy", "tokenizer": "byte",
            "dtype": "bfloat16", "max-model-len": MAX_MODEL_LEN, "enable-prefix-caching": True,
            "enforce-eager": True, "kv-cache-memory-bytes": kv, "kv-host-bytes": host, "kv-policy": "lru"}


def make_setup(preset: dict) -> Setup:
    return Setup(engine=dict(REAL_SHAPE), replicas=preset["replicas"], models=(("coder", preset["replicas"]),),
                 time_scale=preset["time_scale"], max_model_len=MAX_MODEL_LEN, tool_threads=16,
                 entry=real_entry(preset["kv"], preset["host"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", required=True)
    ap.add_argument("--quick", action="store_true", help="one seed, one load, 16 requests (a smoke run)")
    a = ap.parse_args(argv)
    preset = dict(QUICK if a.quick else FULL)
    wf = SWE(tokens=TOKENS, tools=TOOLS, max_len=MAX_MODEL_LEN)
    setup = make_setup(preset)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.time()
    log(f"e2e_real: REAL vLLM CPU engines (builtin:tiny-llama) x {setup.replicas}, {wf.name}, time scale 1 "
        f"(real seconds; tools x {TOOLS:g}); {setup.describe()}")
    res = runner.choose(wf, setup, preset, lambda ch: cli.factory_for(setup, ch), log)
    chosen = res["chosen"]
    log(f"chose {chosen}")
    plan = {"scenarios": preset["scenarios"], "factors": preset["factors"], "seeds": preset["seeds"],
            "variants": preset["variants"], "capacity_rps": chosen["capacity_rps"], "requests": preset["requests"],
            "deadline_s": preset["deadline_s"]}
    units = runner.measure(wf, setup, plan, cli.factory_for(setup, chosen), None, log)
    summary = report.summarize(units, **cli.kv_context(units, preset["requests"], {wf.name: setup.describe()},
                                                      {wf.name: wf}))
    print(report.table(summary, LABEL))
    config: dict[str, Any] = {**cli.config(preset, "quick" if a.quick else "full"),
                              "engine": "REAL vLLM (CPU build), builtin:tiny-llama, dummy weights",
                              "workflow": f"{wf.name}: Open-SWE lengths x {TOKENS:g}, tool latencies x {TOOLS:g}",
                              "ideal": "the fitted cost shape of this engine (engine-shape.json)"}
    config.pop("emulated", None)
    out = {"config": config, "choices": {wf.name: chosen}, "sweeps": {wf.name: res["sweeps"]}, "units": units,
           "setups": {wf.name: setup.describe()}, "summary": summary, "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    out["plots"] = report.plot(summary, os.path.splitext(a.json)[0], LABEL)
    with open(a.json, "w") as f:
        json.dump(cli.jsonable(out), f, indent=1)
    log(f"wrote {a.json} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
