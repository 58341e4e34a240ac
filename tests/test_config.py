"""agents.* configuration: shipped defaults, schema, environment overrides, model registry."""

from __future__ import annotations

import os
import subprocess
import sys

import jsonschema
import pytest
import yaml

import dask_agents.config as agents_config
from dask_agents.errors import ConfigError
from dask_agents.model_settings import ModelSettings
from dask_agents.worker_plugin.engines import registry


def test_defaults_validate_against_schema():
    with open(agents_config.SCHEMA_PATH) as f:
        schema = yaml.safe_load(f)
    jsonschema.validate(agents_config.DEFAULTS, schema)
    bad = {"agents": {"worker": {"modles": []}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_every_default_key_is_in_the_schema():
    with open(agents_config.SCHEMA_PATH) as f:
        schema = yaml.safe_load(f)

    def walk(d, s, path):
        if "properties" not in s and not isinstance(s.get("additionalProperties"), dict):
            return  # a free-form object (policy options)
        for k, v in d.items():
            props = s.get("properties", {})
            assert k in props or isinstance(s.get("additionalProperties"), dict), path + k
            sub = props.get(k) or s["additionalProperties"]
            if isinstance(v, dict):
                walk(v, sub, path + k + ".")
            else:
                assert sub.get("description") or sub.get("type"), path + k

    walk(agents_config.DEFAULTS, schema, "")


def test_environment_overrides_apply():
    code = (
        "import dask_agents.config as c; "
        "print(c.get('worker.models'), c.seconds('scheduler.session-retention'))"
    )
    env = dict(os.environ, DASK_AGENTS__WORKER__MODELS='["coder", "other"]',
               DASK_AGENTS__SCHEDULER__SESSION_RETENTION="5s")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['coder',", "'other']", "5.0"]


def test_shipped_model_registry_is_valid():
    models = registry()
    assert "coder" in models
    coder = models["coder"]
    assert os.path.exists(os.path.join(coder.model_path(), "config.json"))
    assert coder.kv_bytes() == 64 * 2**20 and coder.tokenizer == "auto" and coder.tool_parser == "hermes"
    # the model's own tokenizer ships with it (vLLM loads it: stop strings, constraints, chat template)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert os.path.exists(os.path.join(coder.model_path(), name))
    assert coder.eos_ignored()  # dummy weights: calls run to max_tokens


def test_bad_model_settings_are_rejected():
    with pytest.raises(Exception, match="max-model-len|max_model_len"):
        ModelSettings(**{"model": "builtin:tiny-llama", "max-model-len": 2})
    long = ModelSettings(**{"model": "builtin:tiny-llama", "max-model-len": 4097})  # (a registry entry still loads)
    assert "max-model-len 4097 is longer than builtin:tiny-llama's context" in long.context_error()
    assert ModelSettings(**{"model": "builtin:tiny-llama", "max-model-len": 4096}).context_error() is None
    assert ModelSettings(**{"model": "builtin:tiny-llama", "max-model-len": 4097, "engine": "emulated"}).context_error() is None
    with pytest.raises(Exception, match="unknown builtin"):
        ModelSettings(model="builtin:nope").model_path()
    import dask

    with dask.config.set({"agents.llm.models": {"broken": {"model": "x", "typo-key": 1}}}):
        with pytest.raises(ValueError, match="broken"):
            registry()


def test_byte_tokenizer_round_trips():
    from dask_agents.worker_plugin.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    text = "naïve café ✓"
    ids = tok.encode(text)
    assert max(ids) < 259 and min(ids) >= 3
    assert tok.decode(ids) == text
    assert tok.decode([0, 1, 2] + ids + [700]) == text


# -- agents-schema.yaml, checked with jsonschema (dask_agents.config.validate) ----------------------

def _model_entry_schema() -> dict:
    return agents_config.schema()["properties"]["agents"]["properties"]["llm"]["properties"]["models"][
        "additionalProperties"]


def _literals(annotation) -> set | None:
    """The values of a ``Literal[...]`` (``| None`` adds None); None when not a Literal."""
    import types
    import typing

    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        parts = [_literals(a) if a is not type(None) else {None} for a in typing.get_args(annotation)]
        if all(p is not None for p in parts) and any(p != {None} for p in parts):
            return set().union(*parts)
    return None


def test_model_entries_have_one_schema_generated_from_model_settings():
    """``agents.llm.models`` entries are checked at install by the schema and on the worker by
    ModelSettings: the schema is ModelSettings' own (pydantic's JSON schema), so no hand-kept
    copy can drift; agents-schema.yaml holds only the marker it replaces."""
    import yaml

    from dask_agents.model_settings import json_schema

    raw = yaml.safe_load(open(agents_config.SCHEMA_PATH))
    models = raw["properties"]["agents"]["properties"]["llm"]["properties"]["models"]
    assert models["additionalProperties"] == {"$generated": "model-settings"}
    entry = _model_entry_schema()
    assert entry == json_schema()
    aliases = {f.alias or name for name, f in ModelSettings.model_fields.items()}
    assert set(entry["properties"]) == aliases and entry["required"] == ["model"]
    assert entry["additionalProperties"] is False and ModelSettings.model_config["extra"] == "forbid"
    for key in ("kv-host-bytes", "kv-disk-bytes", "kv-cache-memory-bytes"):  # checked as byte sizes
        assert entry["properties"][key]["format"] == "bytes"


@pytest.mark.parametrize("key, value", [
    ("max-model-len", 2048.0), ("max-model-len", 2048), ("max-model-len", 2048.5), ("max-model-len", True),
    ("max-model-len", 15), ("max-model-len", "2048"), ("tensor-parallel-size", 0), ("tensor-parallel-size", 2.0),
    ("min-replicas", 0), ("max-replicas", None), ("max-replicas", 0), ("kv-pin-fraction", 1),
    ("kv-pin-fraction", float("nan")), ("kv-pin-fraction", 1.5), ("engine", "vllm-async"), ("engine", "vLLM"),
    ("kv-connector", "lmcache"), ("kv-connector", "offloading"), ("kv-connector", None), ("kv-connector", "mooncake"),
    ("kv-policy", "wa_lru"),
    ("kv-policy", None), ("kv-policy", "fifo"), ("scheduling", "fcfs"), ("enforce-eager", False),
    ("enforce-eager", "no"), ("kv-host-bytes", "2 GiB"), ("kv-host-bytes", 0), ("kv-host-bytes", -1),
    ("kv-host-bytes", 5.0), ("kv-disk-path", None), ("emulation", {"prefill-s-per-token": 1e-4}),
    ("emulation", {1: 2}), ("max-model-len", 2.0**63), ("kv-cache-memory-bytes", 2.0**63),
    ("kv-cache-memory-bytes", 2**63), ("kv-cache-memory-bytes", ""),
])
def test_model_entries_the_schema_accepts_are_model_settings(key, value):
    """What ``validate()`` accepts in an ``llm.models`` entry, ModelSettings accepts too (the
    schema may be stricter: it refuses strings for numbers, and byte sizes it cannot parse)."""
    entry = {"model": "builtin:tiny-llama", key: value}
    try:
        agents_config.validate({"llm": {"models": {"m": entry}}})
    except ConfigError as e:
        assert f"agents.llm.models.m.{key}" in str(e) or "agents.llm.models.m" in str(e), str(e)
        return
    settings = ModelSettings(**entry)  # raises if the two disagree
    if key == "max-model-len":
        assert settings.max_model_len == int(value)


def test_integral_floats_pass_both_checks():
    """``max-model-len: 2048.0`` (a yaml or env value) is an integer for both checks."""
    entry = {"model": "builtin:tiny-llama", "max-model-len": 2048.0, "tensor-parallel-size": 1.0}
    agents_config.validate({"llm": {"models": {"m": entry}}})
    assert ModelSettings(**entry).max_model_len == 2048


POSITIVE = ["client.batched-send-interval", "scheduler.batched-send-interval", "scheduler.housekeeping-interval",
            "control.interval", "control.policy-timeout", "control.watchdog-interval", "control.stall-timeout",
            "worker.report-interval", "worker.batched-send-interval", "dashboard.update-interval",
            "dashboard.window", "dashboard.engine-stats-interval", "dashboard.timeseries-interval",
            "dashboard.timeseries-window", "kv.tick", "kv.ttl-max", "llm.load-timeout",
            "scheduler.session-idle-timeout", "scheduler.admission.interval", "worker.fast-path.max-wait",
            "worker.switch-interval"]
NON_NEGATIVE = ["scheduler.session-retention", "kv.prefetch-margin", "scheduler.session-grace",
                "scheduler.instance-linger", "scheduler.admission.max-wait", "control.pass-budget",
                "scheduler.drain-timeout", "scheduler.call-timeout", "llm.stream-interval"]


@pytest.mark.parametrize("key", POSITIVE)
@pytest.mark.parametrize("zero", [0, 0.0, "0s", "0ms"])
def test_periods_and_timeouts_must_be_positive(key, zero):
    """A zero period spins, a zero timeout fires at once (``policy-timeout: 0`` quarantines
    every policy, ``stall-timeout: 0s`` restarts the loop forever): refused by validate() and
    by seconds(), naming the key."""
    import dask

    with dask.config.set({f"agents.{key}": zero}):
        with pytest.raises(ConfigError, match=rf"^agents\.{key}: .*> 0"):
            agents_config.validate()
        with pytest.raises(ConfigError, match=rf"^agents\.{key}: "):
            agents_config.seconds(key)
    with dask.config.set({f"agents.{key}": "5ms"}):
        agents_config.validate()
        assert agents_config.seconds(key) == 0.005


@pytest.mark.parametrize("key", NON_NEGATIVE)
def test_zero_is_a_valid_retention_or_margin(key):
    import dask

    with dask.config.set({f"agents.{key}": 0}):
        agents_config.validate()
        assert agents_config.seconds(key) == 0.0
    with dask.config.set({f"agents.{key}": "-1s"}):
        with pytest.raises(ConfigError, match=rf"^agents\.{key}: "):
            agents_config.validate()


def test_every_duration_in_the_schema_has_a_decided_bound():
    """Each ``[string, number]``/``[string, integer]`` field names its format; the periods and
    timeouts above are exactly the positive durations."""
    found: dict[str, str | None] = {}

    def walk(node, path):
        if isinstance(node, dict):
            t = node.get("type")
            if isinstance(t, list) and "string" in t and ({"number", "integer"} & set(t)):
                found[path] = node.get("format")
            for k, v in (node.get("properties") or {}).items():
                walk(v, f"{path}.{k}" if path else k)
            if isinstance(node.get("additionalProperties"), dict):
                walk(node["additionalProperties"], f"{path}.*")

    walk(agents_config.schema()["properties"]["agents"], "")
    assert None not in found.values(), found
    assert {k for k, f in found.items() if f == "positive-duration"} == set(POSITIVE)
    assert {k for k, f in found.items() if f == "duration"} == set(NON_NEGATIVE)
    assert {f for f in found.values()} == {"positive-duration", "duration", "bytes", "bandwidth"}


@pytest.mark.parametrize("config, message", [
    ({"control": {"interval": "soon"}}, "agents.control.interval: 'soon' is not a duration"),
    ({"worker": {"modles": []}}, "agents.worker.modles: unknown key (known under agents.worker: "),
    ({"worker": {"models": ["a", 3]}}, "agents.worker.models[1]: 3 is not of type 'string'"),
    ({"kv": {"tiers": {"host": {"capacity": "lots"}}}}, "agents.kv.tiers.host.capacity: 'lots' is not a byte size"),
    ({"kv": {"tiers": {"host": {"capacity": -1}}}}, "agents.kv.tiers.host.capacity: a byte size must be >= 0"),
    ({"kv": {"tiers": {"disk": {"bandwidth": "0 GB/s"}}}}, "agents.kv.tiers.disk.bandwidth: a bandwidth must be"),
    ({"kv": {"theta-low": float("nan")}}, "agents.kv.theta-low: nan is not of type 'number' (numbers must be finite)"),
    ({"kv": {"theta-low": 2}}, "agents.kv.theta-low: 2 is greater than the maximum of 1"),
    ({"control": {"enabled": "false"}}, "agents.control.enabled: 'false' is not of type 'boolean'"),
    ({"llm": {"models": {"m": {"engine": "vllm"}}}}, "agents.llm.models.m: 'model' is a required property"),
    ({"llm": {"models": {"m": {"model": "x", "engine": "tgi"}}}}, "agents.llm.models.m.engine: 'tgi' is not one of"),
    ({"control": {"max-calls-per-tick": ["x" * 500]}}, "agents.control.max-calls-per-tick: ['xxxxx"),
    ("nope", "agents: 'nope' is not of type 'object'"),
])
def test_validate_names_the_key_and_the_problem(config, message):
    with pytest.raises(ConfigError) as info:
        agents_config.validate(config)
    assert str(info.value).startswith(message), str(info.value)
    assert len(str(info.value)) < 500


def test_underscore_keys_are_the_dashed_keys():
    """Dask treats ``some_key`` and ``some-key`` as one key (``DASK_AGENTS__...`` variables give
    underscores); so do validate() and ModelSettings."""
    entry = {"model": "builtin:tiny-llama", "max_model_len": 4096, "kv_host_bytes": "1 GiB"}
    agents_config.validate({"control": {"policy_timeout": "1s"}, "llm": {"models": {"m": entry}}})
    assert ModelSettings(**entry).max_model_len == 4096
    with pytest.raises(ConfigError, match=r"^agents\.control\.policy-timeout: "):
        agents_config.validate({"control": {"policy_timeout": 0}})


def test_short_repr_is_bounded_and_survives_a_broken_repr():
    from dask_agents.errors import short_repr

    class Broken:
        def __repr__(self):
            raise RuntimeError("no")

    assert short_repr("x" * 1000) == repr("x" * 1000)[:77] + "..."
    assert len(short_repr(list(range(1000)))) == 80
    assert short_repr(Broken()) == "<Broken>"
    assert short_repr(3) == "3"
