"""agents.* configuration: shipped defaults, schema, environment overrides, model registry."""

from __future__ import annotations

import os
import subprocess
import sys

import jsonschema
import pytest
import yaml

import dask_agents.config as agents_config
from worker_plugin.engine import ModelSettings, registry


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
    assert coder.kv_bytes() == 64 * 2**20 and coder.tokenizer == "byte"


def test_bad_model_settings_are_rejected():
    with pytest.raises(Exception, match="max-model-len|max_model_len"):
        ModelSettings(**{"model": "builtin:tiny-llama", "max-model-len": 2})
    with pytest.raises(Exception, match="unknown builtin"):
        ModelSettings(model="builtin:nope").model_path()
    import dask

    with dask.config.set({"agents.llm.models": {"broken": {"model": "x", "typo-key": 1}}}):
        with pytest.raises(ValueError, match="broken"):
            registry()


def test_byte_tokenizer_round_trips():
    from worker_plugin.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    text = "naïve café ✓"
    ids = tok.encode(text)
    assert max(ids) < 259 and min(ids) >= 3
    assert tok.decode(ids) == text
    assert tok.decode([0, 1, 2] + ids + [700]) == text
