"""The per-step cost shape of a real vLLM CPU engine, fitted with the EMULATED engine's cost model.

The emulated engine (``worker_plugin/emulated.py``) charges each iteration

    decode_s_per_step + decode_s_per_seq * running + decode_s_per_ctx_token * context tokens read
    + prefill_s_per_token * prompt tokens computed in the iteration

with defaults for a 7-8B model on one 80 GB GPU (its docstring gives the arithmetic). Those
figures cannot be measured here (no GPU); what can be checked is the *shape*: that a real vLLM
engine's step time is this linear form of the same four quantities. This script times the
steps of a real in-process vLLM CPU engine (``builtin:tiny-llama``, dummy weights) in two
designed experiments, fits the form by least squares and reports the coefficients, R^2 and the
largest relative error of the fit:

- prefill: one fresh prompt of P tokens (max_tokens 1), P in 256..3072: the step that
  computes it;
- decode: N sequences with C-token contexts decoding together, N in 1..16, C in 128..2048: the
  median of 30 decode steps.

Numbers are this 2-core machine's (they jitter by +-30% when other processes run: the fit's
R^2 says how well the form holds, not how fast a GPU is). Reproduce::

    .venv/bin/python benchmarks/engine_shape.py --json benchmarks/results/engine-shape.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402

PREFILL = (256, 512, 1024, 2048, 3072)
BATCH = (1, 2, 4, 8, 16)
CONTEXT = (128, 1024, 2048)
QUICK_BATCH = (1, 4, 16)
QUICK_CONTEXT = (128, 2048)


def make_engine():
    """An in-process vLLM engine on the shipped tiny model (what the tests and ``make demo`` run)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import EngineArgs, LLMEngine

    from dask_agents.model_settings import ModelSettings

    s = ModelSettings(model="builtin:tiny-llama", load_format="dummy", tokenizer="byte", dtype="bfloat16",
                      max_model_len=4096, kv_cache_memory_bytes="96 MiB")
    args = EngineArgs(model=s.model_path(), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                      max_model_len=4096, enable_prefix_caching=False, enforce_eager=True,
                      kv_cache_memory_bytes=s.kv_bytes())
    return LLMEngine.from_engine_args(args)


_ids = iter(range(10**9))


def _request(engine, n_tokens: int, max_tokens: int) -> str:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rid = f"r{next(_ids)}"
    base = next(_ids)
    prompt = [3 + (base * 7 + i * 13) % 250 for i in range(n_tokens)]
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False))
    return rid


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def prefill_points(engine, reps: int) -> list[dict]:
    out = []
    for p in PREFILL:
        times = []
        for _ in range(reps):
            _request(engine, p, 1)
            t = time.perf_counter()
            engine.step()  # computes the whole prompt (p <= max_num_batched_tokens) and its token
            times.append(time.perf_counter() - t)
            _drain(engine)
        out.append({"prompt_tokens": p, "step_s": statistics.median(times)})
    return out


def decode_points(engine, batches: tuple, contexts: tuple, steps: int) -> list[dict]:
    out = []
    for c in contexts:
        for n in batches:
            for _ in range(n):
                _request(engine, c, steps + 8)
            while True:  # prefill them all first (possibly over several steps)
                engine.step()
                sched = engine.engine_core.engine_core.scheduler
                if not sched.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running):
                    break
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            _drain(engine)
            out.append({"batch": n, "context_tokens": c, "step_s": statistics.median(times)})
    return out


def fit(prefill: list[dict], decode: list[dict]) -> dict:
    """Least squares of the emulated form; R^2 and the largest relative error per experiment."""
    xd = np.array([[1.0, d["batch"], d["batch"] * d["context_tokens"]] for d in decode])
    yd = np.array([d["step_s"] for d in decode])
    (d0, d1, d2), *_ = np.linalg.lstsq(xd, yd, rcond=None)
    xp = np.array([[1.0, p["prompt_tokens"]] for p in prefill])
    yp = np.array([p["step_s"] for p in prefill])
    (p0, p1), *_ = np.linalg.lstsq(xp, yp, rcond=None)

    def quality(x: np.ndarray, y: np.ndarray, coef: tuple) -> dict:
        pred = x @ np.array(coef)
        ss_res = float(((y - pred) ** 2).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum()) or 1e-30
        return {"r2": 1 - ss_res / ss_tot, "max_rel_error": float(np.max(np.abs(pred - y) / y))}

    return {"decode_s_per_step": float(d0), "decode_s_per_seq": float(d1), "decode_s_per_ctx_token": float(d2),
            "prefill_s_per_token": float(p1), "prefill_fixed_s": float(p0),
            "decode_fit": quality(xd, yd, (d0, d1, d2)), "prefill_fit": quality(xp, yp, (p0, p1))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the points and the fit as JSON")
    ap.add_argument("--quick", action="store_true", help="fewer points (about a minute)")
    args = ap.parse_args(argv)
    t0 = time.time()
    engine = make_engine()
    load_s = time.time() - t0
    _request(engine, 64, 4)  # warm-up: first-step allocations
    _drain(engine)
    prefill = prefill_points(engine, 2 if args.quick else 3)
    decode = decode_points(engine, QUICK_BATCH if args.quick else BATCH, QUICK_CONTEXT if args.quick else CONTEXT,
                           15 if args.quick else 30)
    result = fit(prefill, decode)
    print(f"real vLLM CPU engine (builtin:tiny-llama), loaded in {load_s:.1f}s")
    print("prefill:", ", ".join(f"{p['prompt_tokens']} tok {p['step_s'] * 1e3:.1f} ms" for p in prefill))
    print("decode: ", ", ".join(f"N={d['batch']} C={d['context_tokens']} {d['step_s'] * 1e3:.2f} ms" for d in decode))
    print(f"fit: step = {result['decode_s_per_step'] * 1e3:.3f} ms + {result['decode_s_per_seq'] * 1e6:.1f} us x seqs"
          f" + {result['decode_s_per_ctx_token'] * 1e9:.2f} ns x context tokens;"
          f" prefill {result['prefill_s_per_token'] * 1e6:.2f} us/token"
          f" (decode R^2 {result['decode_fit']['r2']:.3f}, max error {result['decode_fit']['max_rel_error']:.0%};"
          f" prefill R^2 {result['prefill_fit']['r2']:.3f}, max error {result['prefill_fit']['max_rel_error']:.0%})")
    if args.json:
        doc = {"config": {"model": "builtin:tiny-llama (2 layers, dummy weights)", "engine": "vllm (CPU build)",
                          "quick": args.quick, "python": platform.python_version(), "cpus": os.cpu_count(),
                          "load_s": load_s},
               "prefill": prefill, "decode": decode, "fit": result, "wall_s": time.time() - t0}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
