"""The end-to-end benchmark of agentic workflows (``python benchmarks/e2e.py``; docs in
``benchmarks/README.md``).

Layout: :mod:`.program` (the interfaces: workflow programs, runtimes, setups, variants),
:mod:`.profile` (the EMULATED engine profiles), :mod:`.ideal` (each request's ideal latency from
the same cost model), ``workflows/`` (one module per workflow), ``variants/`` (one module per
framework or baseline), :mod:`.stats` (metrics and paired ratios), :mod:`.runner` (plans, fresh
interleaved runs, jobs and merge), :mod:`.report` (summary, tables, plots), :mod:`.cli`.
"""
