"""``agents.*`` configuration: defaults shipped in ``agents.yaml``, overridable the Dask way.

Values come from ``dask.config`` (yaml files, ``DASK_AGENTS__...`` environment variables,
``dask.config.set``); this module only registers the defaults.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

_HERE = os.path.dirname(__file__)
DEFAULTS_PATH = os.path.join(_HERE, "agents.yaml")
SCHEMA_PATH = os.path.join(_HERE, "agents-schema.yaml")

with open(DEFAULTS_PATH) as _f:
    DEFAULTS: dict[str, Any] = yaml.safe_load(_f)

dask.config.update_defaults(DEFAULTS)


_MISSING = object()


def _default(key: str) -> Any:
    node: Any = DEFAULTS["agents"]
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def get(key: str, default: Any = None) -> Any:
    """Return ``agents.<key>`` from dask config.

    Falls back to the shipped default when the key is absent (code that resets
    ``dask.config.config``, such as Dask's test utilities, drops registered defaults),
    then to ``default``.
    """
    value = dask.config.get(f"agents.{key}", default=_MISSING)
    if value is _MISSING:
        value = _default(key)
    return default if value is _MISSING else value


def seconds(key: str) -> float:
    """Return the time-valued key ``agents.<key>`` in seconds."""
    from dask.utils import parse_timedelta

    return float(parse_timedelta(get(key), default="s"))
