"""Data the package ships: the public traces its tools replay (``traces/``, each with its licence).

- ``traces/azure-llm-2023``: the Azure LLM inference trace 2023 (code and conversation services),
  Azure Public Dataset, (c) Microsoft, CC-BY 4.0 (``LICENSE`` and ``README.md`` beside it); read by
  ``examples/router``.
- ``traces/mooncake-synthetic``: Mooncake's synthetic trace, Apache-2.0 (``LICENSE`` beside it);
  read by ``dask-agents replay mooncake`` and ``benchmarks/kv_policies.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "DASK_AGENTS_TRACES"


def traces_dir() -> Path:
    """Where the traces are: ``$DASK_AGENTS_TRACES`` when set, else the copies in this package."""
    env = os.environ.get(ENV)
    return Path(env).expanduser() if env else Path(__file__).resolve().parent / "traces"
