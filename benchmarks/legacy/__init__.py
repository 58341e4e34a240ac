"""The previous end-to-end harness (the small regime: 3k-token prompts, 18-token outputs), kept
only for ``legacy/e2e_real.py`` (two real vLLM CPU engines) and ``whatif.py``'s recording until
they move onto :mod:`benchmarks.e2e`; the benchmark of record is ``python benchmarks/e2e.py``."""
