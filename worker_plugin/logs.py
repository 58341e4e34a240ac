"""Quiet engine libraries on workers: vLLM's and torch's logs at ``agents.llm.log-level``.

vLLM logs every engine load at INFO (a 3 KB config dump among two dozen lines) and warns about
the settings it was given; torch's C++ core and its Python deprecations add more. On a Dask
worker all of it is forwarded to the terminal that started the cluster. This module sets the
level before an engine loads (vLLM reads ``VLLM_LOGGING_LEVEL`` when it is first imported; once
imported, its logger's level is set directly; torch's C++ log level is
``TORCH_CPP_LOG_LEVEL``, read when torch is first imported), drops the libraries' Python
deprecation warnings above INFO, and gives dask-agents' own ``dask_agents`` logger a handler,
so the one line an engine load prints (model, KV size, load time) is seen at the default level.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOGGER = "dask_agents"  # engine loads and other once-per-engine news
_filtered: list[str] = []  # the libraries' deprecation warnings are already filtered in this process


def level(name: str | None = None) -> str:
    """The configured level (``agents.llm.log-level``), checked."""
    if name is None:
        import dask_agents.config as c

        name = str(c.get("llm.log-level", "WARNING"))
    name = name.upper()
    if name not in LEVELS:
        raise ValueError(f"agents.llm.log-level must be one of {', '.join(LEVELS)}, got {name!r}")
    return name


def quiet_engines(name: str | None = None) -> str:
    """Apply the level to vLLM, torch and their Python warnings in this process; returns it."""
    lvl = level(name)
    os.environ["VLLM_LOGGING_LEVEL"] = lvl
    if "torch" not in sys.modules:  # (torch reads it once, at import)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "INFO" if lvl in ("DEBUG", "INFO") else lvl)
    # (also before vLLM is imported: its import logs a warning before its logging is set up)
    logging.getLogger("vllm").setLevel(lvl)
    if logging.getLevelName(lvl) > logging.INFO and not _filtered:
        _filtered.append(lvl)  # once per process: every engine load (and restart) comes here
        for module in (r"vllm(\..*)?", r"torch(\..*)?"):
            warnings.filterwarnings("ignore", category=FutureWarning, module=module)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
    own = logging.getLogger(LOGGER)
    if own.level == logging.NOTSET:
        own.setLevel(logging.INFO)
    if not own.handlers and not logging.getLogger().handlers:  # (a worker's root logger has none)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
        own.addHandler(handler)
    return lvl


def engine_loaded(name: str, model: str, kv_bytes: int, seconds: float, blocks: int | None = None,
                  block_size: int | None = None) -> None:
    """The one line an engine load prints."""
    from dask.utils import format_bytes

    geometry = f" ({blocks} blocks of {block_size} tokens)" if blocks and block_size else ""
    logging.getLogger(LOGGER).info("engine %s loaded: %s, KV %s%s, in %.1f s", name, model,
                                   format_bytes(kv_bytes), geometry, seconds)
