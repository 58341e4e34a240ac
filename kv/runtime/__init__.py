"""The KV code an engine worker runs: per-session state and its look for policies (``view``),
the agent execution graph (``aeg``), tool latency priors, tiers and costs (``blocks``,
``sizing``), the policies, the engine adapter (``engine_kv``, with vLLM's internals fenced in
``vllm_compat``) and the manager that enforces what policies suggest. Nothing here imports
:mod:`dask_agents.kv.offline` (a test checks a worker never loads it)."""
