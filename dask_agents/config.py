"""``agents.*`` configuration: defaults shipped in ``agents.yaml``, overridable the Dask way.

Values come from ``dask.config`` (yaml files, ``DASK_AGENTS__...`` environment variables,
``dask.config.set``); this module registers the defaults and checks values against the JSON
schema ``agents-schema.yaml`` with :mod:`jsonschema`. Durations, byte sizes and bandwidths are
schema ``format`` s (``duration``, ``positive-duration``, ``bytes``, ``bandwidth``) checked with
Dask's own parsers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import dask.config
import jsonschema
import jsonschema.exceptions
import jsonschema.validators
import yaml

from dask_agents.errors import ConfigError, short_repr

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
    finite, non-negative duration (``"2ms"``, ``"10 minutes"``, a number of seconds), or is 0
    where the schema says ``format: positive-duration`` (periods and timeouts)."""
    value = get(key)
    positive = _subschema(key).get("format") == "positive-duration"
    try:
        return parse_duration(value, positive=positive)
    except ValueError as e:
        raise ConfigError(f"agents.{key}: {e}") from None


# -- the value formats of agents-schema.yaml ---------------------------------------------------

_PARSE_ERRORS = (ValueError, KeyError, TypeError, AttributeError, OverflowError, IndexError)


def parse_duration(value: Any, *, positive: bool = False) -> float:
    """Seconds from a duration: a time string (``"100ms"``, ``"10 minutes"``) or a number of seconds.

    Raises ValueError (quoting the value) unless the result is finite and >= 0 (> 0 with
    ``positive``)."""
    from dask.utils import parse_timedelta

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"expected a duration such as '2ms' or a number of seconds, got {short_repr(value)}")
    try:
        out = float(parse_timedelta(value, default="s"))
    except _PARSE_ERRORS:
        raise ValueError(f"{short_repr(value)} is not a duration (e.g. '100ms', '2s', '10 minutes')") from None
    if not math.isfinite(out) or out < 0:
        raise ValueError(f"a duration must be finite and >= 0, got {short_repr(value)}")
    if positive and out <= 0:
        raise ValueError(f"a period or timeout must be > 0, got {short_repr(value)}")
    return out


def parse_size(value: Any) -> int:
    """Bytes from a byte size: ``"64 MiB"`` or a number of bytes; ValueError unless >= 0."""
    from dask.utils import parse_bytes

    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or (
            isinstance(value, str) and not value.strip()):  # dask reads "" as 1 byte
        raise ValueError(f"{short_repr(value)} is not a byte size (e.g. '64 MiB')")
    try:
        n = parse_bytes(value) if isinstance(value, str) else int(value)
    except _PARSE_ERRORS:
        raise ValueError(f"{short_repr(value)} is not a byte size (e.g. '64 MiB')") from None
    if n < 0:
        raise ValueError(f"a byte size must be >= 0, got {short_repr(value)}")
    return n


def parse_bandwidth(value: Any) -> float:
    """Bytes per second from ``"25 GB/s"``, ``"25GB"`` or a number (read as
    ``dask_agents.kv.runtime.blocks.Tiers`` reads it); ValueError unless > 0."""
    text = value.strip().removesuffix("/s") if isinstance(value, str) else value
    try:
        n = parse_size(text)
    except ValueError:
        raise ValueError(f"{short_repr(value)} is not a bandwidth (e.g. '25 GB/s')") from None
    if n <= 0:  # whole bytes: 0.5 is 0 bytes per second
        raise ValueError(f"a bandwidth must be at least 1 byte/s, got {short_repr(value)}")
    return float(n)


def _format(parse: Callable[[Any], Any]) -> Callable[[Any], bool]:
    """A jsonschema format check from a parser: only strings and numbers are checked (the
    ``type`` keyword speaks for other values); the parser's ValueError is the error's cause."""

    def check(instance: Any) -> bool:
        if isinstance(instance, bool) or not isinstance(instance, (str, int, float)):
            return True
        parse(instance)
        return True

    return check


FORMAT_CHECKER = jsonschema.FormatChecker(formats=())
"""Checks the formats ``agents-schema.yaml`` uses (and no others)."""
for _name, _parse in {
    "duration": parse_duration,
    "positive-duration": lambda v: parse_duration(v, positive=True),
    "bytes": parse_size,
    "bandwidth": parse_bandwidth,
}.items():
    FORMAT_CHECKER.checks(_name, raises=ValueError)(_format(_parse))


# -- validation against agents-schema.yaml -----------------------------------------------------

_schema_cache: dict[str, Any] = {}
_EXACT_FLOAT_INT = 2**53


def schema() -> dict:
    """The ``agents.*`` JSON schema (``agents-schema.yaml``), loaded once per modification."""
    _load()
    return _schema_cache["schema"]


def _load() -> None:
    """(Re)load the schema when its file changed: check it, and build its validator (the draft
    its ``$schema`` names, finite numbers, exact integers, :data:`FORMAT_CHECKER`)."""
    mtime = os.path.getmtime(SCHEMA_PATH)
    if _schema_cache.get("mtime") == mtime:
        return
    with open(SCHEMA_PATH) as f:
        loaded = yaml.safe_load(f)
    _generate(loaded)
    base = jsonschema.validators.validator_for(loaded, default=jsonschema.Draft202012Validator)
    base.check_schema(loaded)
    # A JSON number is finite: YAML's .inf/.nan (or such a float from Python) are not numbers
    # here. An integer may be written 2048.0 (as JSON Schema and pydantic read it) while the
    # float is exact (|x| <= 2**53): pydantic refuses larger floats for its int fields.
    checker = base.TYPE_CHECKER.redefine_many({
        "number": lambda tc, v: base.TYPE_CHECKER.is_type(v, "number") and (isinstance(v, int) or math.isfinite(v)),
        "integer": lambda tc, v: base.TYPE_CHECKER.is_type(v, "integer") and (
            isinstance(v, int) or abs(v) <= _EXACT_FLOAT_INT),
    })
    cls = jsonschema.validators.extend(base, type_checker=checker)
    _schema_cache.update(mtime=mtime, schema=loaded, validator=cls(loaded, format_checker=FORMAT_CHECKER),
                         nodes={})


def _generate(node: Any) -> None:
    """Put the generated schemas in place of their ``{$generated: NAME}`` markers (in place)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, dict) and set(v) == {"$generated"}:
                node[k] = _GENERATED[v["$generated"]]()
            else:
                _generate(v)
    elif isinstance(node, list):
        for v in node:
            _generate(v)


def _model_settings_schema() -> dict:
    from dask_agents.model_settings import json_schema

    return json_schema()


# name -> the function building the schema a {$generated: name} marker stands for
_GENERATED = {"model-settings": _model_settings_schema}


def _subschema(key: str) -> dict:
    """The schema of ``agents.<key>`` (``{}`` where the schema does not describe it)."""
    _load()
    nodes = _schema_cache["nodes"]
    if key not in nodes:
        node: Any = (_schema_cache["schema"].get("properties") or {}).get("agents") or {}
        for part in key.split("."):
            props = node.get("properties") or {}
            extra = node.get("additionalProperties")
            if part in props or part.replace("_", "-") in props:
                node = props.get(part) or props[part.replace("_", "-")]
            elif isinstance(extra, dict):
                node = extra
            else:
                node = {}
                break
        nodes[key] = node
    return nodes[key]


def _canonical(value: Any, node: Any) -> Any:
    """``value`` with ``some_key`` renamed to the schema's ``some-key`` (Dask treats the two
    as one key, and ``DASK_AGENTS__...`` variables give underscores) and tuples as lists."""
    if not isinstance(node, dict):
        node = {}
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        out = {}
        for k, v in value.items():
            if isinstance(k, str) and k not in props and k.replace("_", "-") in props:
                k = k.replace("_", "-")
            out[k] = _canonical(v, props.get(k, extra))
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v, node.get("items")) for v in value]
    return value


def _dotted(path: Iterable[Any]) -> str:
    """``agents.x.y[0]`` from a jsonschema path."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(error: jsonschema.exceptions.ValidationError) -> str:
    """``agents.x.y: <what is wrong>`` for one jsonschema error, its value cut short."""
    where = _dotted(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        props = error.schema.get("properties") or {}
        unknown = sorted((k for k in error.instance if k not in props), key=str)
        known = ", ".join(sorted(props)) or "none"
        return f"{_dotted([*error.absolute_path, unknown[0]])}: unknown key (known under {where}: {known})"
    if error.validator == "format" and error.cause is not None:
        return f"{where}: {error.cause}"
    text = error.message
    try:
        full = repr(error.instance)
    except Exception:
        full = None
    if full and len(full) > 80 and text.startswith(full):  # jsonschema quotes the whole value
        text = short_repr(error.instance) + text[len(full):]
    if error.validator == "type" and isinstance(error.instance, float):
        if not math.isfinite(error.instance):
            text += " (numbers must be finite)"
        elif error.instance.is_integer():
            text += " (a float this large is not an exact integer: write it as an int)"
    if len(text) > 400:
        text = text[:397] + "..."
    return f"{where}: {text}"


def validate(config: dict | None = None) -> None:
    """Check ``agents.*`` against ``agents-schema.yaml`` with jsonschema (durations, byte sizes
    and bandwidths through their ``format``).

    ``config``: the value of the ``agents`` key (default: the current Dask configuration).
    Raises :class:`~dask_agents.errors.ConfigError` naming the first bad key, for example
    ``agents.control.interval: 'soon' is not a duration (e.g. '100ms', '2s', '10 minutes')``."""
    value = dask.config.get("agents", default={}) if config is None else config
    _load()
    instance = _canonical({"agents": value}, _schema_cache["schema"])
    errors = list(_schema_cache["validator"].iter_errors(instance))
    if not errors:
        return
    try:
        error = jsonschema.exceptions.best_match(errors)
    except TypeError:  # sibling paths that do not compare (a dict with int and str keys)
        error = min(errors, key=lambda e: len(e.path))
    raise ConfigError(_message(error))
