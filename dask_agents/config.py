"""``agents.*`` configuration: defaults shipped in ``agents.yaml``, overridable the Dask way.

Values come from ``dask.config`` (yaml files, ``DASK_AGENTS__...`` environment variables,
``dask.config.set``); this module only registers the defaults.
"""

from __future__ import annotations

import math
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
    """Return the time-valued key ``agents.<key>`` in seconds.

    Raises :class:`~dask_agents.errors.ConfigError` naming the key when the value is not a
    finite, non-negative duration (``"2ms"``, ``"10 minutes"``, a number of seconds)."""
    value = get(key)
    return _seconds(f"agents.{key}", value)


def _seconds(name: str, value: Any) -> float:
    from dask.utils import parse_timedelta

    from dask_agents.errors import ConfigError

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{name}: expected a duration such as '2ms' or a number of seconds, got {_short(value)}")
    try:
        out = float(parse_timedelta(value, default="s"))
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, IndexError):
        raise ConfigError(f"{name}: {_short(value)} is not a duration (e.g. '100ms', '2s', '10 minutes')") from None
    if not math.isfinite(out) or out < 0:
        raise ConfigError(f"{name}: a duration must be finite and >= 0, got {_short(value)}")
    return out


# -- validation against agents-schema.yaml -----------------------------------------------------

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list, tuple), "null": (type(None),),
}
_schema_cache: dict[str, Any] = {}


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def schema() -> dict:
    """The ``agents.*`` JSON schema (``agents-schema.yaml``), loaded once per modification."""
    mtime = os.path.getmtime(SCHEMA_PATH)
    if _schema_cache.get("mtime") != mtime:
        with open(SCHEMA_PATH) as f:
            _schema_cache.update(mtime=mtime, schema=yaml.safe_load(f))
    return _schema_cache["schema"]


def _is(value: Any, type_name: str) -> bool:
    if isinstance(value, bool) and type_name in ("integer", "number"):
        return False  # True is an int to Python, not a number to a config file
    return isinstance(value, _TYPES.get(type_name, (object,)))


def _check(name: str, value: Any, node: dict) -> None:
    """Validate ``value`` (at dotted key ``name``) against the schema ``node``; raise ConfigError."""
    from dask.utils import parse_bytes

    from dask_agents.errors import ConfigError

    types = node.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if types and not any(_is(value, t) for t in types):
        raise ConfigError(f"{name}: expected {' or '.join(types)}, got {type(value).__name__} {_short(value)}")
    if "enum" in node and value not in node["enum"]:
        raise ConfigError(f"{name}: {_short(value)} is not one of {', '.join(map(str, node['enum']))}")
    key = name.rpartition(".")[2]
    if isinstance(value, str) and "string" in types and ("number" in types or "integer" in types):
        if "integer" in types:  # a byte size: "64 MiB"
            try:
                n = parse_bytes(value)
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{name}: {_short(value)} is not a byte size (e.g. '64 MiB')") from None
            if n < 0:
                raise ConfigError(f"{name}: a byte size must be >= 0, got {_short(value)}")
        elif key == "bandwidth":  # bytes per second: "25 GB/s"
            try:
                n = parse_bytes(value.strip().removesuffix("/s"))
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{name}: {_short(value)} is not a bandwidth (e.g. '25 GB/s')") from None
            if n <= 0:
                raise ConfigError(f"{name}: a bandwidth must be > 0, got {_short(value)}")
        else:
            _check_duration(name, key, value)
        return
    if _is(value, "number"):
        if not math.isfinite(value):
            raise ConfigError(f"{name}: must be finite, got {_short(value)}")
        if "minimum" in node and value < node["minimum"]:
            raise ConfigError(f"{name}: must be >= {node['minimum']}, got {_short(value)}")
        if "maximum" in node and value > node["maximum"]:
            raise ConfigError(f"{name}: must be <= {node['maximum']}, got {_short(value)}")
        if "exclusiveMinimum" in node and value <= node["exclusiveMinimum"]:
            raise ConfigError(f"{name}: must be > {node['exclusiveMinimum']}, got {_short(value)}")
        if "string" in types and "integer" in types and value < 0:  # a byte size given in bytes
            raise ConfigError(f"{name}: a byte size must be >= 0, got {_short(value)}")
        if "string" in types and "number" in types:
            if key == "bandwidth":  # bytes per second given as a number
                if value <= 0:
                    raise ConfigError(f"{name}: a bandwidth must be > 0, got {_short(value)}")
            else:  # a duration given in seconds
                _check_duration(name, key, value)
    if isinstance(value, (list, tuple)) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            _check(f"{name}[{i}]", item, node["items"])
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties", True)
        for req in node.get("required") or ():
            if req not in value and req.replace("-", "_") not in value:
                raise ConfigError(f"{name}: missing required key {req!r}")
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{name}: keys must be strings, got {_short(k)}")
            sub = props.get(k) or props.get(k.replace("_", "-"))
            if sub is None:
                if extra is False:
                    known = ", ".join(sorted(props)) or "none"
                    raise ConfigError(f"{name}.{k}: unknown key (known under {name}: {known})")
                if not isinstance(extra, dict):
                    continue
                sub = extra
            _check(f"{name}.{k}", v, sub)


def _check_duration(name: str, key: str, value: Any) -> None:
    from dask_agents.errors import ConfigError

    s = _seconds(name, value)
    if s <= 0 and (key.endswith("interval") or key == "tick"):
        raise ConfigError(f"{name}: a period must be > 0, got {_short(value)}")


def validate(config: dict | None = None) -> None:
    """Check ``agents.*`` against ``agents-schema.yaml`` (and durations, byte sizes and
    bandwidths by their meaning).

    ``config``: the value of the ``agents`` key (default: the current Dask configuration).
    Raises :class:`~dask_agents.errors.ConfigError` naming the first bad key, for example
    ``agents.control.interval: 'soon' is not a duration``."""
    from dask_agents.errors import ConfigError

    value = dask.config.get("agents", default={}) if config is None else config
    root = (schema().get("properties") or {}).get("agents") or {}
    if not isinstance(value, dict):
        raise ConfigError(f"agents: expected a mapping of settings, got {type(value).__name__} {_short(value)}")
    _check("agents", value, root)
