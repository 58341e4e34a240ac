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


def get(key: str, default: Any = None) -> Any:
    """Return ``agents.<key>`` from dask config (``default`` when unset)."""
    return dask.config.get(f"agents.{key}", default=default)


def seconds(key: str) -> float:
    """Return the time-valued key ``agents.<key>`` in seconds."""
    from dask.utils import parse_timedelta

    return float(parse_timedelta(get(key), default="s"))
