"""Bad input, everywhere: property-based fuzzing (hypothesis) of every input dask-agents accepts.

Hints, ``agents.*`` config values, stub and ``generate`` arguments, session labels, KV
directives and hints, control actions and trace files. Each input is either accepted (and
then satisfies the documented contract) or rejected with a *clear* error: a specific exception
type and a message naming what was wrong (the component, the config key, the argument, the
action field, the file and line). The cluster tests send fuzzed input through a running cluster's
real RPCs and check that the scheduler and workers still serve ordinary calls afterwards.

Example counts are small (``max_examples`` 25 or 60, no deadline; ``DASK_AGENTS_FUZZ_SCALE=10``
multiplies them for a deeper hunt): the file runs in well under a
minute on two cores, the real vLLM engine of the directive tests included.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import random
import re
import sys
import tempfile
import threading
import types
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import dask
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dask_agents as da
import dask_agents.config as agents_config
from dask_agents.calls import sanitize_annotation
from dask_agents.errors import ConfigError  # also da.ConfigError
from dask_agents.hints import ComponentHints, ToolHints
from dask_agents.llm import check_generate_args
from dask_agents.stubgen import generate_stub_source
from examples.router import trace as router_trace
from dask_agents.kv.offline import traces as kv_traces
from dask_agents.kv.runtime.engine_kv import KVDirectiveError
from dask_agents.scheduler_plugin.actions import (
    ActionError,
    Kill,
    Migrate,
    Provision,
    Reassign,
    Route,
    SetPriority,
)
from dask_agents.worker_plugin.host import KV_OPS
from dask_agents.worker_plugin.engines import Engines

# DASK_AGENTS_FUZZ_SCALE=10 runs ten times the examples (a deeper hunt, not for every test run)
_SCALE = max(1, int(os.environ.get("DASK_AGENTS_FUZZ_SCALE", "1")))
FUZZ = settings(max_examples=60 * _SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=25 * _SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- value strategies ---------------------------------------------------------------------------

SPECIAL_STRINGS = ["", " ", "2ms", "1s", "10 minutes", "64 MiB", "25 GB/s", "-1s", "soon", "0", "inf", "nan",
                   "coder", "builtin:tiny-llama", "<b>x</b>", "a\nb", "\x00", "é", "1e309"]
floats = st.floats(allow_nan=True, allow_infinity=True)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.integers(), floats,
    st.text(max_size=12), st.sampled_from(SPECIAL_STRINGS),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


def _named(message: str, *names: str) -> bool:
    """True if ``message`` mentions one of ``names`` (as written or with _/- swapped)."""
    return any(n in message or n.replace("_", "-") in message or n.replace("-", "_") in message for n in names)


# -- hints ------------------------------------------------------------------------------------

HINT_KEYS = sorted(set(ToolHints.model_fields) | {"modle", "priority", "gpu", "stateless"})
hint_values = st.one_of(
    junk,
    st.dictionaries(st.sampled_from(["GPU", "", " ", "memory"]), floats, max_size=2),  # resources
    st.fixed_dictionaries({}, optional={"max_batch": junk, "max_wait": junk, "other": junk}),  # batching
    st.sampled_from(["file_io", "code_exec", "web_api", "db_query", "custom", "teleport"]),  # kind
)


@FUZZ
@given(hints=st.dictionaries(st.sampled_from(HINT_KEYS), hint_values, max_size=4),
       tool=st.booleans())
@example(hints={"batching": {"max_wait": float("inf")}}, tool=True)  # a worker would wait forever
@example(hints={"resources": {"GPU": float("nan")}}, tool=False)  # never fits any worker
@example(hints={"resources": {"GPU": -1.0}}, tool=False)
@example(hints={"stateful": "yes", "min_replicas": True}, tool=False)
def test_fuzzed_hints_are_valid_or_a_hint_error_naming_component_and_key(hints, tool):
    """Every accepted hint set satisfies the documented invariants; every rejection is a
    HintError naming the component and a hint it was given."""
    def target(x=None):
        return x

    decorate = da.tool if tool else da.agent
    try:
        decorate(name="FuzzComponent", **hints)(target)
    except da.HintError as e:
        msg = str(e)
        assert "FuzzComponent" in msg and _named(msg, *hints), msg
        assert len(msg) < 2000, "a message must stay readable"
        return
    h = da.spec_of(target).hints
    assert isinstance(h, ToolHints if tool else ComponentHints)
    assert type(h.stateful) is bool and type(h.min_replicas) is int and h.min_replicas >= 0
    assert h.max_replicas is None or (type(h.max_replicas) is int and h.max_replicas >= max(1, h.min_replicas))
    assert h.model is None or (isinstance(h.model, str) and h.model)
    for name, amount in h.resources.items():  # what Dask's scheduler will compare with worker resources
        assert name.strip() and math.isfinite(amount) and amount > 0
    if h.batching is not None:
        assert type(h.batching.max_batch) is int and h.batching.max_batch >= 1
        assert math.isfinite(h.batching.max_wait) and 0 <= h.batching.max_wait <= 60


@FUZZ
@given(name=st.one_of(st.text(max_size=30), st.sampled_from(["ok_name", "a.b", "a\n", "1abc", "a-b", "Développeur"])))
def test_fuzzed_component_names(name):
    """A component name is an identifier-like label (it becomes the prefix of Dask keys) or a
    NotAComponentError that quotes it."""
    def target():
        return None

    try:
        da.agent(name=name)(target)
    except da.NotAComponentError as e:
        assert repr(name) in str(e)
        return
    spec = da.spec_of(target)
    assert spec.name == (name or "target")  # no name: the function's own
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", spec.name), spec.name


@FUZZ
@given(name=st.one_of(st.none(), junk), tenant=st.one_of(st.none(), junk))
@example(name="ok\n", tenant=None)
@example(name=None, tenant="<script>alert(1)</script>")
def test_fuzzed_session_labels(name, tenant):
    """Session names and tenants reach the scheduler, telemetry and the dashboard: short plain
    labels, or a ValueError naming the argument before anything is sent."""
    from distributed import Client

    client = mock.create_autospec(Client, instance=True)
    try:
        s = da.session(client, name=name, tenant=tenant)
    except ValueError as e:
        assert "name=" in str(e) or "tenant=" in str(e), str(e)
        return
    for label in (name, tenant):
        assert label is None or re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.:+@-]{0,127}", label)
    assert s.id.startswith(f"{name or 'session'}-")


# -- config -----------------------------------------------------------------------------------

def _leaves(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict) and node:
        for k, v in node.items():
            if k == "options":  # policy options are free-form keyword arguments of a class
                continue
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix


CONFIG_KEYS = sorted(set(_leaves(agents_config.DEFAULTS["agents"])) | {
    "llm.models.fuzz.engine", "llm.models.fuzz.max-model-len", "llm.models.fuzz.kv-policy",
    "llm.models.fuzz.kv-pin-fraction", "llm.models.fuzz.kv-host-bytes", "worker.modles",
})
TIME_KEYS = [k for k in CONFIG_KEYS if k.rsplit(".", 1)[-1] in {
    "session-retention", "batched-send-interval", "housekeeping-interval", "interval", "report-interval",
    "update-interval", "window", "engine-stats-interval", "timeseries-interval", "timeseries-window", "tick",
    "ttl-max", "prefetch-margin",
    "policy-timeout", "watchdog-interval", "stall-timeout", "load-timeout"}]


POSITIVE_TIME_KEYS = [k for k in TIME_KEYS if k.rsplit(".", 1)[-1] not in {"session-retention", "prefetch-margin"}]
BYTE_KEYS = [k for k in CONFIG_KEYS if k.endswith(".capacity") or k.endswith("-bytes")]
BANDWIDTH_KEYS = [k for k in CONFIG_KEYS if k.endswith(".bandwidth")]


def _raw_schema_validator() -> Any:
    """A plain jsonschema validator of ``agents-schema.yaml`` as written (no formats, no
    finite-number rule): an oracle independent of ``dask_agents.config``'s own checks."""
    import jsonschema
    import yaml

    with open(agents_config.SCHEMA_PATH) as f:
        raw = yaml.safe_load(f)
    return jsonschema.validators.validator_for(raw)(raw)


RAW_SCHEMA = _raw_schema_validator()


def _finite_everywhere(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite_everywhere(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite_everywhere(v) for v in value)
    return True


@FUZZ
@given(key=st.sampled_from(CONFIG_KEYS), value=junk)
@example(key="control.interval", value="")
@example(key="dashboard.window", value="1e400 days")
@example(key="control.enabled", value="false")  # an env var's text is not a boolean
@example(key="kv.tiers.host.bandwidth", value=0)
@example(key="kv.tiers.host.bandwidth", value=0.5)  # whole bytes per second: 0
@example(key="llm.models.fuzz.kv-host-bytes", value="lots")
@example(key="llm.models.fuzz.max-model-len", value=2048.0)  # an integer to the schema and to pydantic
@example(key="control.policy-timeout", value=0)  # would quarantine every policy
@example(key="control.stall-timeout", value="0s")  # the watchdog would restart the loop forever
@example(key="kv.ttl-max", value=0)
@example(key="kv.theta-low", value=float("nan"))  # passes minimum/maximum comparisons
def test_fuzzed_config_values_are_valid_or_a_config_error_naming_the_key(key, value):
    """``validate()`` (run by ``da.install`` and the preload) accepts a value only if the code
    that reads it can use it, and otherwise raises ConfigError naming ``agents.<key>``.

    An accepted value is checked independently of the validator: the plain schema (jsonschema,
    no formats), Dask's own parsers for durations and byte sizes, and the readers themselves
    (``ModelSettings`` for model entries, ``Tiers.from_config`` for the KV tiers)."""
    from dask.utils import parse_bytes, parse_timedelta

    from dask_agents.kv.runtime.blocks import Tiers
    from dask_agents.model_settings import ModelSettings

    if key.startswith("llm.models.fuzz."):
        entry = {"model": "emulated-x", key.rsplit(".", 1)[1]: value}
        update = {"agents.llm.models": {**agents_config.get("llm.models"), "fuzz": entry}}
    else:
        update = {f"agents.{key}": value}
    with dask.config.set(update):
        try:
            agents_config.validate()
        except ConfigError as e:
            assert f"agents.{key}" in str(e), (key, value, str(e))
            assert len(str(e)) < 1000
            return
        assert key != "worker.modles", "unknown keys are errors"
        RAW_SCHEMA.validate({"agents": dask.config.get("agents")})
        assert _finite_everywhere(value)
        if key in TIME_KEYS:
            s = float(parse_timedelta(value, default="s"))
            assert math.isfinite(s) and (s > 0 if key in POSITIVE_TIME_KEYS else s >= 0), (key, value)
            assert agents_config.seconds(key) == s
        if key in BYTE_KEYS:
            assert isinstance(value, (str, int, float)) and not isinstance(value, bool)
            assert (parse_bytes(value) if isinstance(value, str) else value) >= 0
            assert isinstance(value, str) or value == int(value)  # whole bytes
        if key in BANDWIDTH_KEYS or key.startswith("kv.tiers."):
            tiers = Tiers.from_config()
            assert all(t.bandwidth > 0 and t.capacity >= 0 for t in tiers)
        if key.startswith("llm.models."):
            name = key.split(".")[2]
            # the worker's reader agrees with the schema
            settings = ModelSettings(**agents_config.get("llm.models")[name])
            if key.endswith("-bytes"):
                from dask_agents.model_settings import byte_size as _bytes

                assert _bytes(getattr(settings, key.rsplit(".", 1)[1].replace("-", "_"))) >= 0
        default = agents_config._default(key)
        if isinstance(default, bool):
            assert isinstance(value, bool)
        elif isinstance(default, (int, float)) and not isinstance(value, str):
            # counts, rates, weights, shares: numbers (an integer may be written 2048.0), never negative
            assert not isinstance(value, bool) and isinstance(value, (int, float)) and value >= 0


@FEW
@given(key=st.sampled_from(TIME_KEYS), value=junk)
@example(key="control.interval", value="")
@example(key="scheduler.session-retention", value="-5s")
@example(key="control.stall-timeout", value=0)
def test_seconds_names_the_key_of_a_bad_duration(key, value):
    """Code that reads a duration directly (the plugins' periodic callbacks) gets a finite
    number of seconds (> 0 for periods and timeouts) or a ConfigError naming the key, never a
    KeyError from dask's parser."""
    with dask.config.set({f"agents.{key}": value}):
        try:
            s = agents_config.seconds(key)
        except ConfigError as e:
            assert f"agents.{key}" in str(e)
            return
    assert math.isfinite(s) and (s > 0 if key in POSITIVE_TIME_KEYS else s >= 0)


@FEW
@given(interval=junk, max_workers=junk)
def test_fuzzed_cluster_link_settings(interval, max_workers):
    """``da.attach_cluster`` takes a positive poll interval and a worker cap, or says which
    argument is wrong (a zero or unparsable interval would otherwise fail inside Tornado)."""
    from dask_agents.scaling import ClusterLink

    class Manager:
        def scale(self, n: int) -> None:
            pass

    try:
        link = ClusterLink(None, Manager(), interval, max_workers)
    except ValueError as e:
        assert "attach_cluster(interval=...)" in str(e) or "attach_cluster(max_workers=...)" in str(e)
        return
    assert math.isfinite(link.interval) and link.interval > 0
    assert max_workers is None or (type(max_workers) is int and max_workers >= 0)


def test_install_refuses_a_bad_config_before_touching_the_cluster():
    """``da.install`` validates first: nothing is registered with a broken configuration."""
    from distributed import Client

    client = mock.create_autospec(Client, instance=True)
    client.asynchronous = False
    with dask.config.set({"agents.control.interval": "soon"}):
        with pytest.raises(ConfigError, match=r"agents\.control\.interval: 'soon' is not a duration"):
            da.install(client)
    with pytest.raises(TypeError, match="models"):
        da.install(client, models="coder")
    client.register_plugin.assert_not_called()


# -- stub and generate arguments ----------------------------------------------------------------

@st.composite
def signatures(draw) -> list[tuple[str, str, bool]]:
    """A valid Python parameter list: (name, kind, has_default), kinds in order."""
    n_pos = draw(st.integers(0, 2))
    n_reg = draw(st.integers(0, 3))
    varargs = draw(st.booleans())
    n_kw = draw(st.integers(0, 2))
    varkw = draw(st.booleans())
    # positional defaults must be trailing
    n_pos_def = draw(st.integers(0, n_pos + n_reg))
    params = [(f"p{i}", "posonly") for i in range(n_pos)] + [(f"r{i}", "regular") for i in range(n_reg)]
    out = [(n, k, i >= len(params) - n_pos_def) for i, (n, k) in enumerate(params)]
    if varargs:
        out.append(("args", "varargs", False))
    out += [(f"k{i}", "kwonly", draw(st.booleans())) for i in range(n_kw)]
    if varkw:
        out.append(("kw", "varkw", False))
    return out


def _source(params: list[tuple[str, str, bool]]) -> str:
    parts, posonly, star = [], False, False
    for name, kind, has_default in params:
        if kind != "posonly" and posonly:
            parts.append("/")
            posonly = False
        if kind == "posonly":
            posonly = True
        if kind == "kwonly" and not star:
            parts.append("*")
            star = True
        if kind == "varargs":
            parts.append(f"*{name}")
            star = True
        elif kind == "varkw":
            parts.append(f"**{name}")
        else:
            parts.append(f"{name}=D" if has_default else name)
    if posonly:
        parts.append("/")
    return (f"import dask_agents as da\nD = object()\n\n@da.tool(kind='custom')\n"
            f"def fuzzed({', '.join(parts)}):\n    return None\n")


@contextmanager
def _stub_pair(src: str):
    """(real function, generated stub function) for the component source ``src``."""
    name = f"fuzzsrc_{uuid.uuid4().hex}"
    mod = types.ModuleType(name)
    exec(compile(src, f"{name}.py", "exec"), mod.__dict__)
    sys.modules[name] = mod
    try:
        gen = types.ModuleType(f"stubs_{uuid.uuid4().hex}")
        exec(compile(generate_stub_source(src, name), "stubs.py", "exec", dont_inherit=True), gen.__dict__)
        yield mod.fuzzed, gen.fuzzed
    finally:
        sys.modules.pop(name, None)


def _bind(fn, args: tuple, kwargs: dict) -> dict | None:
    try:
        b = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None
    return dict(b.arguments)


@FUZZ
@given(params=signatures(), n_args=st.integers(0, 6),
       kw_names=st.lists(st.sampled_from(["p0", "p1", "r0", "r1", "r2", "k0", "k1", "args", "kw", "zz"]),
                         unique=True, max_size=4))
def test_fuzzed_stub_arguments_bind_like_the_component(params, n_args, kw_names):
    """A generated stub forwards exactly what a direct call would bind: for any call, the stub
    refuses it (TypeError) exactly when the component's signature does, and otherwise the
    arguments it submits bind to the same parameter values."""
    args = tuple(range(100, 100 + n_args))
    kwargs = {k: f"v-{k}" for k in kw_names}
    submitted: list[tuple[tuple, dict]] = []
    with _stub_pair(_source(params)) as (real, stub), \
            mock.patch.object(da.FunctionStub, "__call__", lambda self, *a, **k: submitted.append((a, k))):
        expected = _bind(real, args, kwargs)
        try:
            stub(*args, **kwargs)
        except TypeError:
            assert expected is None, f"the stub refused a call the component accepts: {args} {kwargs}"
            return
        assert len(submitted) == 1
        a, k = submitted[0]
        assert _bind(real, a, k) == expected, (params, args, kwargs, a, k)


source_lines = st.sampled_from([
    "import dask_agents as da", "from dask_agents import tool, agent", "@da.agent", "@da.tool(kind='web_api')",
    "@agent(model='coder')", "class A:", "    def go(self, x, *, y=1):", "        return x", "def f(a, /, b=2, **kw):",
    "    pass", "    def _da_self(self):", "def _DEFAULT():", "    @property", "    def p(self):", "x = (",
    "\tdef t(self): pass", "class _da_x:", "async def g(*a):", "@da.agent\nclass B(A):\n    pass",
    "def h(_da_args):", "    '''doc \\\"\"\" '''", "",
])


@FUZZ
@given(lines=st.lists(source_lines, max_size=10), junk_text=st.text(max_size=40))
def test_fuzzed_component_sources_give_a_stub_module_or_a_value_error(lines, junk_text):
    """stubgen never runs the source: any text gives compilable stub code or a ValueError
    naming the file (and line when there is one)."""
    for src in ("\n".join(lines) + "\n", junk_text):
        try:
            out = generate_stub_source(src, "fuzzmod", "fuzz.py")
        except ValueError as e:
            assert str(e).startswith("fuzz.py"), str(e)
            continue
        compile(out, "stubs.py", "exec", dont_inherit=True)


@FUZZ
@given(prompt=st.one_of(junk, st.lists(st.integers(-5, 10**6), max_size=4)), max_tokens=junk,
       temperature=junk, seed=junk)
@example(prompt=[np.int64(3)], max_tokens=np.int64(4), temperature=np.float32(0.5), seed=np.int64(7))
@example(prompt="hi", max_tokens=None, temperature=10**400, seed=None)  # too large for a float
def test_fuzzed_generate_arguments(prompt, max_tokens, temperature, seed):
    """``da.llm(m).generate`` checks its arguments before submitting: accepted ones come back
    as the plain types the engines take (numpy ints become ``int``); rejected ones raise
    TypeError/ValueError naming the model and argument."""
    try:
        out = check_generate_args("fuzz-model", prompt, max_tokens, temperature, seed)
    except (TypeError, ValueError) as e:
        msg = str(e)
        assert msg.startswith("da.llm('fuzz-model').generate:"), msg
        assert _named(msg, "prompt", "token ids", "max_tokens", "temperature", "seed"), msg
        return
    prompt_out, max_tokens_out, temperature_out, seed_out = out
    assert (isinstance(prompt_out, str) and prompt_out == prompt) or (
        isinstance(prompt_out, list) and prompt_out == list(prompt)
        and all(type(t) is int and t >= 0 for t in prompt_out))
    assert max_tokens_out is None if max_tokens is None else (
        type(max_tokens_out) is int and max_tokens_out == max_tokens >= 1)
    assert type(temperature_out) is float and math.isfinite(temperature_out) and temperature_out >= 0
    assert temperature_out == float(temperature)
    assert seed_out is None if seed is None else (type(seed_out) is int and seed_out == seed)


def test_stub_of_an_unknown_method_names_the_component():
    """A stub only exposes the component's public methods."""
    @da.agent
    class Fuzzed:
        def go(self):
            return 1

    with pytest.raises(AttributeError, match="component 'Fuzzed' has no public method 'gone'"):
        da.stub(Fuzzed).gone()
    with pytest.raises(da.NotAComponentError):
        da.stub(42)


annotation_fields = st.sampled_from(["call", "component", "method", "kind", "session", "tenant", "creator", "deps",
                                    "created", "stateful", "model", "tool_kind", "llm_model", "batching", "llm_prompt_len", "llm_max_tokens",
                                    "opened_on", "zz"])


@FUZZ
@given(ann=st.one_of(junk, st.dictionaries(annotation_fields, junk, max_size=8)))
def test_fuzzed_annotations_sanitize_to_the_types_the_plugins_read(ann):
    """``sanitize_annotation`` turns anything a client can put in ``dask.annotate(agents=...)``
    into fields of the expected types (hashable strings, a list of keys, a finite time...)."""
    out = sanitize_annotation(ann)
    if not isinstance(ann, dict):
        assert out is None
        return
    assert set(out) <= {"call", "component", "method", "kind", "session", "tenant", "creator", "model", "tool_kind",
                        "llm_model", "deps", "created", "stateful", "batching", "llm_prompt_len", "llm_max_tokens",
                        "timeout", "opened_on"}
    for k, v in out.items():
        if k == "deps":
            assert isinstance(v, list) and all(isinstance(d, str) for d in v)
        elif k == "created":
            assert v is None or (type(v) is float and math.isfinite(v))
        elif k == "stateful":
            assert type(v) is bool
        elif k == "batching":
            assert v is None or (type(v["max_batch"]) is int and v["max_batch"] >= 1 and math.isfinite(v["max_wait"]))
        elif k == "timeout":  # a call's own timeout, s
            assert v is None or (type(v) is float and math.isfinite(v) and v > 0)
        elif k in ("llm_prompt_len", "llm_max_tokens"):  # sizes for KV admission
            assert v is None or (type(v) is int and 0 <= v <= 2**31)
        else:
            assert v is None or (isinstance(v, str) and len(v) <= 256)
    hash(tuple((k, v) for k, v in out.items() if k not in ("deps", "batching")))


def test_our_own_annotations_survive_sanitizing_unchanged():
    """What ``submit_call`` builds passes through ``sanitize_annotation`` as it is."""
    ann = {"call": "Dev-1", "component": "Dev", "method": "run", "kind": "agent", "session": "s-1", "tenant": None,
           "creator": "driver", "deps": ["Tool-2"], "created": 1.5, "stateful": True, "model": "coder",
           "tool_kind": None, "llm_model": "coder", "batching": {"max_batch": 4, "max_wait": 0.01},
           "llm_prompt_len": 120, "llm_max_tokens": 16, "timeout": 30.0,
           "opened_on": "Scheduler-0f8e4d1c-5a3b-4c2d-9e8f-7a6b5c4d3e2f"}
    assert sanitize_annotation(ann) == ann


# -- control actions ---------------------------------------------------------------------------

action_fields = {
    SetPriority: {"key": junk, "priority": st.one_of(junk, st.tuples(floats, st.integers())), "reason": junk},
    Migrate: {"key": junk, "source": junk, "target": junk, "reason": junk},
    Route: {"component": junk, "workers": st.one_of(junk, st.tuples(st.text(max_size=8))), "reason": junk},
    Reassign: {"worker": junk, "source": junk, "target": junk, "reason": junk},
    Provision: {"n": junk, "component": junk, "reason": junk},
    Kill: {"worker": junk, "reason": junk},
}


@st.composite
def actions(draw) -> tuple[type, dict]:
    cls = draw(st.sampled_from(list(action_fields)))
    fields = {name: draw(strategy) for name, strategy in action_fields[cls].items() if draw(st.booleans())}
    return cls, fields


@FUZZ
@given(spec=actions())
def test_fuzzed_actions_are_well_formed_or_an_action_error_naming_the_field(spec):
    """What a policy builds is checked at construction: a malformed action raises ActionError
    naming the action and the field; an accepted one has the shape the enforcer relies on."""
    cls, fields = spec
    try:
        a = cls(**fields)
    except TypeError as e:  # a required field missing: Python's own message names it
        assert "missing" in str(e) and "argument" in str(e)
        return
    except ActionError as e:
        msg = str(e)
        assert msg.startswith(f"{cls.__name__}."), msg
        assert _named(msg.split(":")[0], *fields), msg
        return
    assert isinstance(a.reason, str)
    if cls is SetPriority:
        assert type(a.priority) is tuple and a.priority
        assert all(not isinstance(p, bool) and math.isfinite(p) for p in a.priority)
        sorted([a.priority, (0, 0, 0, 0, 0)])  # comparable with the scheduler's own priorities
    if cls is Route:
        assert type(a.workers) is tuple and all(isinstance(w, str) and w for w in a.workers)
    if cls is Provision:
        assert type(a.n) is int and a.n >= 1


# -- KV directives and hints (the worker side) --------------------------------------------------

EMU = {"model": "emulated-fuzz", "engine": "emulated", "tokenizer": "byte", "emulation": {"time_scale": 0.001}}


@pytest.fixture(scope="module")
def emulated_engines():
    """A worker's Engines hosting one EMULATED engine (with per-session KV control, as the real one)."""
    with dask.config.set({"agents.llm.models": {"emu": EMU}}):
        eng = Engines("tcp://fuzz:1", ["emu"])
        eng.start("emu").wait_loaded(30)
        yield eng
        eng.close()


hashable_junk = st.one_of(scalars, st.tuples(st.integers()))


@FUZZ
@given(model=st.one_of(st.sampled_from(["emu", "coder"]), hashable_junk),
       op=st.one_of(st.sampled_from(KV_OPS), hashable_junk), session=st.one_of(st.sampled_from(["s1"]), junk),
       args=st.dictionaries(st.sampled_from(["ttl_s", "tier", "blocks", "max_blocks", "zz"]), junk, max_size=2))
def test_fuzzed_kv_directives_on_a_worker_are_kv_directive_errors(emulated_engines, model, op, session, args):
    """``Engines.kv_directive`` (what the ``agents_kv`` RPC calls) rejects an unknown op, a
    missing session, a model not hosted here, an argument the directive does not take, a bad
    argument value and a session the engine never saw with a KVDirectiveError that names the
    culprit (never a bare TypeError from the engine thread)."""
    with pytest.raises(KVDirectiveError) as info:
        emulated_engines.kv_directive(model, op, session, timeout=5, **args)
    msg = str(info.value)
    assert any(w in msg for w in ("unknown KV directive", "needs a session id", "is not hosted",
                                  "no per-session KV control", "names a model", "unknown:", "no KV for session",
                                  "must be", "needs a positive", "tier")), msg


@FUZZ
@given(session=st.one_of(st.sampled_from(["s1", ""]), junk), state=st.one_of(
    st.sampled_from(["running", "paused", "finished"]), hashable_junk), node=junk, wait_key=junk,
    at=st.one_of(st.none(), floats))
def test_fuzzed_kv_hints_on_a_worker(emulated_engines, session, state, node, wait_key, at):
    """``Engines.kv_hint`` (what the scheduler's KV hint stream calls) accepts the three states
    for a session id and names the culprit otherwise."""
    try:
        out = emulated_engines.kv_hint(session, state, node, wait_key, at)
    except KVDirectiveError as e:
        assert any(w in str(e) for w in ("unknown session state", "needs a session id", "time must be a finite"))
        return
    assert state in ("running", "paused", "finished") and isinstance(session, str) and session
    assert out == []  # the emulated engine has no KV manager to inform


try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # pragma: no cover - the CPU build is part of the test extras
    HAVE_VLLM = False

REAL = {"model": "builtin:tiny-llama", "load-format": "dummy", "tokenizer": "byte", "dtype": "bfloat16",
        "max-model-len": 1024, "kv-cache-memory-bytes": "2 MiB", "kv-host-bytes": "1 MiB", "kv-pin-fraction": 0.5,
        "kv-policy": "none"}


@pytest.fixture(scope="module")
def real_engines():
    """A worker's Engines hosting the built-in tiny vLLM engine with per-session KV control."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    with dask.config.set({"agents.llm.models": {"tiny": REAL}}):
        eng = Engines("tcp://fuzz:2", ["tiny"])
        eng.start("tiny").wait_loaded(300)
        yield eng
        eng.close()


def _generate(eng: Engines, session: str, seed: int, n: int = 200) -> list[int]:
    """One greedy request of ``n`` prompt tokens in ``session`` on the engine; its output ids."""
    from tests.kv_helpers import generate, prompt_ids

    return generate(eng.start("tiny"), prompt_ids(seed, n), session, max_tokens=2)[0]


@FEW
@given(op=st.sampled_from(KV_OPS),
       args=st.dictionaries(st.sampled_from(["ttl_s", "tier", "blocks", "max_blocks", "zz"]),
                            st.one_of(scalars, st.sampled_from(["host", "disk", "gpu"])), max_size=2))
def test_fuzzed_kv_directive_arguments_on_a_real_engine(real_engines, op, args):
    """Directive arguments from the controller reach the engine's KV layer: every one either
    applies or fails with an exception of the caller's (KVDirectiveError, TypeError,
    ValueError), and the engine keeps serving."""
    sid = "fuzz-kv"
    if "fuzz-kv" not in getattr(real_engines, "_fuzz_sessions", set()):
        _generate(real_engines, sid, 1)
        real_engines._fuzz_sessions = {sid}
    try:
        out = real_engines.kv_directive("tiny", op, sid, timeout=30, **args)
    except (KVDirectiveError, TypeError, ValueError) as e:
        assert str(e)
    else:
        assert "result" in out
    if op == "invalidate":
        real_engines._fuzz_sessions = set()


def test_real_engine_still_serves_after_fuzzed_directives(real_engines):
    """After every fuzzed directive (pins with odd TTLs, offloads, prefetches), a request
    completes: nothing wedged the engine's admission."""
    out = _generate(real_engines, "after-fuzz", 7, n=700)  # needs most of the 16 blocks
    assert len(out) == 2


# -- trace files -------------------------------------------------------------------------------

_TMP = Path(tempfile.mkdtemp(prefix="dask-agents-fuzz-"))


def _write(name: str, data: bytes) -> Path:
    path = _TMP / uuid.uuid4().hex / name
    path.parent.mkdir()
    path.write_bytes(data)
    return path


def _check_trace_error(e: ValueError, path: Path, line: bool) -> None:
    msg = str(e)
    assert msg.startswith(path.name + ":"), msg
    if line:
        assert re.match(re.escape(path.name) + r": (line \d+: |trace )", msg) or "session" in msg, msg
    assert len(msg) < 2000, "a message must stay readable"


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=False), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=5,
)
step_records = st.fixed_dictionaries(
    {"session": st.one_of(st.sampled_from(["s1", "s2"]), json_values), "at": st.one_of(st.floats(0, 100), json_values),
     "blocks": st.one_of(st.lists(st.integers(0, 20), max_size=4), json_values)},
    optional={"tail_tokens": st.one_of(st.integers(-1, 20), json_values), "duration": st.floats(0, 5),
              "output_tokens": st.one_of(st.integers(0, 9), json_values), "tool": st.one_of(st.none(), json_values),
              "last": st.booleans(), "node": json_values})
mooncake_records = st.fixed_dictionaries(
    {"timestamp": st.one_of(st.integers(0, 10**6), json_values), "input_length": st.one_of(st.integers(0, 2000), json_values),
     "output_length": st.one_of(st.integers(0, 50), json_values),
     "hash_ids": st.one_of(st.lists(st.integers(0, 30), max_size=4), json_values)})
garbage_lines = st.one_of(st.binary(max_size=30), st.just(b"["), st.just(b"\xff\xfe\n"), st.just(b"[" * 5000))


def _lines(records: list, junk_lines: list[bytes], rng: random.Random) -> bytes:
    lines = [json.dumps(r).encode() for r in records]
    for g in junk_lines:
        lines.insert(rng.randrange(len(lines) + 1), g.replace(b"\n", b" "))
    return b"\n".join(lines) + b"\n"


@FUZZ
@given(header=st.one_of(st.just({"format": kv_traces.FORMAT, "block_size": 4}), json_values),
       records=st.lists(step_records, max_size=5), junk_lines=st.lists(garbage_lines, max_size=2),
       seed=st.integers(0, 100))
def test_fuzzed_step_trace_files(header, records, junk_lines, seed):
    """Our own trace format: a Trace, or a ValueError naming the file and the line."""
    path = _write("fuzz.jsonl", _lines([header, *records], junk_lines, random.Random(seed)))
    try:
        t = kv_traces.load_steps(path)
    except ValueError as e:
        _check_trace_error(e, path, line=True)
    else:
        assert len(t) >= 1
    try:  # the dispatcher: a file that is not ours is read as a telemetry export
        kv_traces.load(path)
    except ValueError as e:
        _check_trace_error(e, path, line=False)


@FUZZ
@given(records=st.lists(mooncake_records, max_size=5), junk_lines=st.lists(garbage_lines, max_size=2),
       seed=st.integers(0, 100))
def test_fuzzed_mooncake_files(records, junk_lines, seed):
    """A Mooncake-style file: a Trace, or a ValueError naming the file and the line."""
    path = _write("synthetic_trace.jsonl", _lines(records, junk_lines, random.Random(seed)))
    try:
        t = kv_traces.load_mooncake(path)
    except ValueError as e:
        _check_trace_error(e, path, line=True)
        return
    assert len(t) >= 1


TELEMETRY_HEADER = "session,component,kind,state,started,finished,prompt_tokens,output_tokens,cached_tokens,creator"
telemetry_cells = st.one_of(st.sampled_from(["s1", "llm.coder", "llm", "tool", "finished", "1.5", "2", "-1", "",
                                             "nan", "1e30", "99999999999999999999", "driver", '"', "x,y"]),
                            st.text(max_size=5))


@FUZZ
@given(rows=st.lists(st.lists(telemetry_cells, min_size=0, max_size=11), max_size=5),
       raw=st.binary(max_size=60), suffix=st.sampled_from([".csv", ".json", ".jsonl"]))
def test_fuzzed_telemetry_files(rows, raw, suffix):
    """A telemetry export (CSV/JSON): a Trace, or a ValueError naming the file; never a
    pandas, JSON, decoding or recursion error of another kind."""
    body = (TELEMETRY_HEADER + "\n" + "\n".join(",".join(r) for r in rows) + "\n").encode()
    for data in (body, raw, body + raw):
        path = _write(f"tel{suffix}", data)
        try:
            t = kv_traces.load(path)
        except ValueError as e:
            _check_trace_error(e, path, line=False)
            continue
        assert len(t) >= 1


def test_deeply_nested_json_is_a_value_error_naming_the_line():
    """A line of 100,000 ``[`` is a clear error (Python's JSON parser would recurse out)."""
    path = _write("deep.jsonl", json.dumps({"format": kv_traces.FORMAT, "block_size": 4}).encode() + b"\n"
                  + b"[" * 100_000 + b"\n")
    with pytest.raises(ValueError, match=r"deep.jsonl: line 2: JSON nested too deeply"):
        kv_traces.load_steps(path)


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
azure_cells = st.one_of(
    st.sampled_from(["2023-11-16 18:00:10.0000000", "2023-11-16T18:00:11+02:00", "2023-11-16 18:00:12", "9999-12-31T23:59:59-23:00",
                     "yesterday", "12", "-4", "1.5", "", '"', '"a,b"', "0" * 30, "²", "\x00"]),
    st.text(max_size=6))


@FUZZ
@given(rows=st.lists(st.lists(azure_cells, min_size=1, max_size=4), max_size=5), raw=st.binary(max_size=60),
       bom=st.booleans())
def test_fuzzed_router_trace_csv(rows, raw, bom):
    """The Router example's Azure trace loader: arrivals, or a ValueError that starts with
    ``<file>: line N:`` (NUL bytes, bad UTF-8, unterminated quotes and mixed time zones
    included)."""
    body = ("\ufeff" if bom else "") + AZURE_HEADER + "\n" + "\n".join(",".join(r) for r in rows) + "\n"
    for data in (body.encode(), raw, body.encode() + raw):
        path = _write("AzureLLMInferenceTrace_code.csv", data)
        try:
            arrivals = router_trace.read_csv(path, "code")
        except ValueError as e:
            assert re.match(r"AzureLLMInferenceTrace_code\.csv: line \d+: ", str(e)), str(e)
            continue
        assert arrivals and min(a.at for a in arrivals) == 0.0
        assert all(a.context_tokens >= 0 and a.generated_tokens >= 0 for a in arrivals)


# -- through a running cluster: fuzzed annotations, RPCs, directives and actions -----------------

from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster, inc

from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for

RPC_JUNK = [None, True, False, 0, -1, 2**63 - 1, float("nan"), float("inf"), "", "x", "<b>x</b>", "llm.coder",
            "s-1", "\x00", "finished", "calls", "kv", "sessions", "paused", "tcp://127.0.0.1:1", "inspect", "retain"]


def _rpc_junk(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value: scalars, lists and dicts (what a confused or hostile
    authenticated peer could send)."""
    r = rng.random()
    if depth < 2 and r < 0.15:
        return [_rpc_junk(rng, depth + 1) for _ in range(rng.randrange(3))]
    if depth < 2 and r < 0.3:
        return {rng.choice(["key", "session", "x", "", "ttl_s"]): _rpc_junk(rng, depth + 1) for _ in range(rng.randrange(3))}
    return rng.choice(RPC_JUNK)


def _junk_annotation(rng: random.Random) -> dict:
    fields = ["call", "component", "method", "kind", "session", "tenant", "creator", "deps", "created", "stateful",
              "model", "tool_kind", "llm_model", "batching"]
    return {f: _rpc_junk(rng) for f in fields if rng.random() < 0.6}


def _junk_action(rng: random.Random) -> Any:
    """A random action (valid shape, nonsense content) or something that is not an action."""
    pick = rng.randrange(7)
    s = lambda: rng.choice(["", "x", "tcp://127.0.0.1:1", "llm.coder", "emu"])
    try:
        if pick == 0:
            return SetPriority(s() or "k", (rng.randrange(-5, 5), rng.random()))
        if pick == 1:
            return Migrate(s() or "k", s() or "w", s() or "v")
        if pick == 2:
            return Route(s() or "c", tuple(x for x in (s(), s()) if x))
        if pick == 3:
            return Reassign(s() or "w", s() or "a", s() or "b")
        if pick == 4:
            return Provision(rng.randrange(1, 10**6), s() or None)
        if pick == 5:
            return Kill("tcp://127.0.0.1:1")
    except ActionError:
        pass
    return _rpc_junk(rng)


@da.tool(kind="custom")
def fuzz_echo(x: Any) -> Any:
    """A plain tool for the cluster checks."""
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=120,
             config={"agents.llm.models": {"emu": EMU}, "agents.control.enabled": False})
async def test_fuzzed_input_through_the_real_rpcs_never_crashes_or_wedges_the_cluster(c: Client, s: Scheduler, a: Worker):
    """Annotations, scheduler RPCs, worker RPCs, KV hint messages and control actions, all
    fuzzed, through a running cluster with the plugins installed: each is answered or refused
    (the caller gets an exception), the scheduler and the worker stay up and connected, and
    afterwards ordinary tool, LLM and telemetry calls still work."""
    await da.install(c, models=["emu"])
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: a.address in plugin.ready_workers, timeout=30)
    rng = random.Random(20261130)
    refused = 0

    # 1. annotations with odd but well-typed content (what sanitize_annotation lets through):
    #    unknown components and sessions, missing and dangling dependencies, odd labels
    futs = []
    for i in range(40):
        with dask.annotate(agents=sanitize_annotation(_junk_annotation(rng))):
            futs.append(c.submit(inc, i, key=f"fuzz-ann-{i}", pure=False))
    assert await c.gather(futs) == [i + 1 for i in range(40)]

    # 2. the scheduler plugin's RPC handlers (the client API), with junk arguments
    handlers = {"agents_session_graph": ["session", "settle"],
                "agents_telemetry": ["session", "table"], "agents_progress": ["sessions"],
                "agents_scale_requests": ["interval"], "agents_worker_hello": ["worker", "models", "pid"],
                "agents_control": ["action"], "agents_workflow_graph": [], "agents_models": [], "agents_ping": []}
    for _ in range(150):
        op = rng.choice(sorted(handlers))
        kwargs = {k: _rpc_junk(rng) for k in handlers[op] if rng.random() < 0.8}
        if op == "agents_control" and kwargs.get("action") in ("start", "stop"):
            continue
        if op == "agents_worker_hello" and not isinstance(kwargs.get("worker"), str):
            continue  # a non-string worker address: see test_raw_junk_from_a_client_never_costs_a_worker
        if rng.random() < 0.1:
            kwargs["unexpected"] = 1
        try:
            await asyncio.wait_for(getattr(c.scheduler, op)(**kwargs), 10)
        except TimeoutError:
            pytest.fail(f"{op}({kwargs}) wedged the scheduler")
        except Exception:
            refused += 1

    # 3. the worker plugin's RPC handlers: KV directives, session ends, model swaps, info
    worker_ops = {"agents_kv": ["model", "op", "session", "args"], "agents_end_session": ["session"],
                  "agents_swap_model": ["remove", "add"], "agents_worker_info": []}
    async with c.rpc(a.address) as w:
        for _ in range(80):
            op = rng.choice(sorted(worker_ops))
            kwargs = {k: _rpc_junk(rng) for k in worker_ops[op] if rng.random() < 0.8}
            if op != "agents_worker_info" and rng.random() < 0.8:  # past the caller check: the arguments' own
                kwargs["secret"] = plugin.roster.secret
            if op == "agents_swap_model" and ("emu" in kwargs.values()):
                continue
            try:
                await asyncio.wait_for(getattr(w, op)(**kwargs), 10)
            except TimeoutError:
                pytest.fail(f"{op}({kwargs}) wedged the worker")
            except Exception:
                refused += 1

    # 4. KV hints on the scheduler -> worker stream (ordered with compute-task messages)
    for _ in range(40):
        msg = {k: _rpc_junk(rng) for k in ("session", "state", "node", "wait_key", "at") if rng.random() < 0.8}
        s.worker_send(a.address, {"op": "agents-kv-hint", **msg})

    # 5. control actions (and things that are not actions) through the enforcement layer
    enforcer = plugin.control.enforcer
    before = sum(enforcer.rejected.values())
    applied = enforcer.apply([_junk_action(rng) for _ in range(60)], "fuzz")
    assert applied + sum(enforcer.rejected.values()) - before == 60
    assert plugin.pending_add == 0  # no cluster manager attached: nothing was provisioned

    # 6. stub arguments that cannot travel: refused at the call, naming the argument
    async with da.session(c, name="bad-args"):
        with pytest.raises(TypeError, match=r"fuzz_echo \(session bad-args-\w+\): argument #0 \(lock\) cannot be sent"):
            da.stub(fuzz_echo)(threading.Lock())
        with pytest.raises(TypeError, match=r"argument 'x' \(generator\) cannot be sent"):
            da.stub(fuzz_echo)(x=(i for i in range(3)))

    # the cluster is intact and serves ordinary work
    assert refused > 0, "the fuzzed calls should include refusals"
    assert s.status.name == "running" and a.status.name == "running"
    assert a.address in s.workers and a.address in plugin.ready_workers
    assert await c.submit(inc, 41, pure=False) == 42
    async with da.session(c, name="after-fuzz") as sess:
        assert await da.stub(fuzz_echo)("still here") == "still here"
        r = await da.llm("emu").generate("You are a careful engineer. Fix it.", max_tokens=4)
    assert r.emulated and r.output_tokens == 4
    graph = await async_wait_for(lambda: _completed(c, sess.id), timeout=30)
    assert {n.component for n in graph.nodes} == {"fuzz_echo", "llm.emu"}
    assert (await c.scheduler.agents_ping())["ok"]
    rows = await c.scheduler.agents_telemetry(session=sess.id)
    assert len(rows) == 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config={"agents.control.enabled": False})
async def test_raw_junk_from_a_client_never_costs_a_worker(c: Client, s: Scheduler, a: Worker):
    """Raw junk in the ``agents`` annotation (any client can send it with ``dask.annotate``)
    and in a worker hello: the tasks still run, the worker stays connected, the API answers."""
    await da.install(c)
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: a.address in plugin.ready_workers, timeout=30)
    with pytest.raises(Exception):
        await c.scheduler.agents_worker_hello(worker=1.5, models=["x"])
    assert list((await c.scheduler.agents_ping())["workers"]) == [a.address]
    rng = random.Random(20261130)
    futs = []
    for i in range(40):
        with dask.annotate(agents=_junk_annotation(rng)):
            futs.append(c.submit(inc, i, key=f"fuzz-raw-{i}", pure=False))
    assert await asyncio.wait_for(c.gather(futs), 30) == [i + 1 for i in range(40)]
    # the worker's timing reports of these calls reach the scheduler (none left to send)
    wplugin = a.plugins[NAME]
    await async_wait_for(lambda: not wplugin._reports and not any(
        isinstance(k, str) and k.startswith("fuzz-raw-") for k in wplugin._started), timeout=30)
    assert a.status.name == "running" and a.address in s.workers


async def _completed(c: Client, sid: str) -> Any:
    g = await da.session_graph(c, sid)
    return g if g is not None and g.state == "completed" else None
