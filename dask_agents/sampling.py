"""The options of an LLM call beyond its prompt, checked on the caller before anything is sent.

``generate`` and ``chat`` take vLLM's sampling options (``stop``, ``top_p``, ``top_k``,
``min_p``, ``n``, ``logprobs``, penalties, ``ignore_eos``) and one structured-output
constraint (``json_schema``, ``regex`` or ``choice``); ``chat`` also takes ``messages``,
``tools`` and ``tool_choice``. Each is validated here with an error naming the model, the
argument and the session (TypeError for a wrong type, :class:`~dask_agents.errors.InvalidRequestError`
for a bad value) and travels to the worker as a plain dict of the options that differ from the
defaults; the engine host turns them into its own parameters (``worker_plugin/sampling.py``).
"""

from __future__ import annotations

import json
import math
from numbers import Integral, Real
from typing import Any, Callable

from dask_agents.errors import InvalidRequestError, short_repr

MAX_N = 128  # completions per call (each holds its own KV and batch slot)
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")


def argument_error(model: str, method: str, session: str | None) -> Callable[[type, str, object], Exception]:
    """``bad(kind, what, value)``: the error of class ``kind`` for a bad argument of
    ``da.llm(model).method``, naming the value and the session."""
    in_session = f" (session {session})" if session else ""

    def bad(kind: type, what: str, value: object) -> Exception:
        return kind(f"da.llm({model!r}).{method}: {what}, got {short_repr(value)}{in_session}")

    return bad


def check_options(model: str, method: str, session: str | None, *, stop: Any = None, stop_token_ids: Any = None,
                  top_p: Any = None, top_k: Any = None, min_p: Any = None, n: Any = 1, logprobs: Any = None,
                  presence_penalty: Any = None, frequency_penalty: Any = None, repetition_penalty: Any = None,
                  ignore_eos: Any = None, json_schema: Any = None, regex: Any = None,
                  choice: Any = None) -> dict[str, Any]:
    """The call's options as a dict holding only those set (see the module docstring).

    ``stop``: a non-empty string or list of them; ``stop_token_ids``: ints >= 0; ``top_p`` in
    (0, 1]; ``top_k`` an int >= 0 (0: off); ``min_p`` in [0, 1]; ``n`` in [1, 128];
    ``logprobs`` an int in [0, 20] (the top alternatives per output token); presence and
    frequency penalties in [-2, 2]; ``repetition_penalty`` > 0; ``ignore_eos`` a bool (None: the
    model's ``ignore-eos``); ``json_schema`` a JSON schema (a dict, its JSON text, or a pydantic
    model class), ``regex`` a pattern, ``choice`` a list of strings: at most one of the three."""
    bad = argument_error(model, method, session)
    out: dict[str, Any] = {}

    def number(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, Real):
            raise bad(TypeError, f"{name} must be a number", value)
        v = float(value)
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            lo_s = f"({lo:g}" if lo_open else f"[{lo:g}"
            raise bad(InvalidRequestError, f"{name} must be in {lo_s}, {hi:g}]", value)
        out[name] = v

    def integer(name: str, value: Any, lo: int, hi: int | None = None) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise bad(TypeError, f"{name} must be an int", value)
        if value < lo or (hi is not None and value > hi):
            raise bad(InvalidRequestError, f"{name} must be in [{lo}, {hi}]" if hi is not None
                      else f"{name} must be >= {lo}", value)
        return int(value)

    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
            raise bad(TypeError, "stop must be a string or a list of strings", stop)
        if not all(stops):
            raise bad(InvalidRequestError, "stop strings must not be empty", stop)
        if stops:
            out["stop"] = list(stops)
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, (list, tuple)):
            raise bad(TypeError, "stop_token_ids must be a list of ints", stop_token_ids)
        ids = [integer("stop_token_ids", t, 0) for t in stop_token_ids]
        if ids:
            out["stop_token_ids"] = ids
    number("top_p", top_p, 0.0, 1.0, lo_open=True)
    number("min_p", min_p, 0.0, 1.0)
    number("presence_penalty", presence_penalty, -2.0, 2.0)
    number("frequency_penalty", frequency_penalty, -2.0, 2.0)
    number("repetition_penalty", repetition_penalty, 0.0, math.inf, lo_open=True)
    if repetition_penalty is not None and math.isinf(out.get("repetition_penalty", 0.0)):
        raise bad(InvalidRequestError, "repetition_penalty must be finite", repetition_penalty)
    k = integer("top_k", top_k, 0)
    if k:
        out["top_k"] = k
    count = integer("n", n, 1, MAX_N)
    if count is not None and count != 1:
        out["n"] = count
    lp = integer("logprobs", logprobs, 0, MAX_LOGPROBS)
    if lp is not None:
        out["logprobs"] = lp
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise bad(TypeError, "ignore_eos must be a bool or None", ignore_eos)
        out["ignore_eos"] = ignore_eos
    constraint = check_constraint(bad, json_schema=json_schema, regex=regex, choice=choice)
    if constraint:
        out["structured"] = constraint
    return out


def check_constraint(bad: Callable[[type, str, object], Exception], *, json_schema: Any = None, regex: Any = None,
                     choice: Any = None) -> dict[str, Any] | None:
    """The one structured-output constraint of a call as ``{"json": schema}``, ``{"regex": p}``
    or ``{"choice": [...]}`` (vLLM's ``StructuredOutputsParams`` fields), or None."""
    given = [name for name, v in (("json_schema", json_schema), ("regex", regex), ("choice", choice)) if v is not None]
    if len(given) > 1:
        raise bad(InvalidRequestError, "give at most one of json_schema, regex and choice", given)
    if json_schema is not None:
        schema = json_schema
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
            schema = schema.model_json_schema()
        elif isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise bad(InvalidRequestError, f"json_schema is not valid JSON ({e})", json_schema) from None
        if not isinstance(schema, dict):
            raise bad(TypeError, "json_schema must be a JSON schema (a dict, its JSON text or a pydantic model class)",
                      json_schema)
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise bad(InvalidRequestError, f"json_schema is not JSON-serializable ({e})", json_schema) from None
        return {"json": schema}
    if regex is not None:
        if not isinstance(regex, str):
            raise bad(TypeError, "regex must be a string", regex)
        if not regex:
            raise bad(InvalidRequestError, "regex must not be empty", regex)
        import re

        try:
            re.compile(regex)
        except re.error as e:
            raise bad(InvalidRequestError, f"regex does not compile ({e})", regex) from None
        return {"regex": regex}
    if choice is not None:
        if not isinstance(choice, (list, tuple)) or not all(isinstance(c, str) for c in choice):
            raise bad(TypeError, "choice must be a list of strings", choice)
        if not choice or not all(choice):
            raise bad(InvalidRequestError, "choice must be a non-empty list of non-empty strings", choice)
        return {"choice": list(choice)}
    return None


def check_messages(model: str, session: str | None, messages: Any) -> list[dict[str, Any]]:
    """Chat messages as plain dicts (OpenAI's shape: ``role``, ``content``, and for an assistant
    turn ``tool_calls``, for a tool result ``tool_call_id``). Accepts dicts, pydantic models
    (an ``LLMResult.message``) and content as a string or a list of text parts."""
    bad = argument_error(model, "chat", session)
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise bad(TypeError, "messages must be a list of {'role': ..., 'content': ...} dicts "
                  "(for a plain prompt use generate)", messages)
    if not messages:
        raise bad(InvalidRequestError, "messages must not be empty", messages)
    out = []
    for i, m in enumerate(messages):
        if hasattr(m, "model_dump"):
            m = m.model_dump(exclude_none=True)
        if not isinstance(m, dict):
            raise bad(TypeError, f"message {i} must be a dict with 'role' and 'content'", m)
        role = m.get("role")
        if role not in ROLES:
            raise bad(InvalidRequestError, f"message {i}: role must be one of {', '.join(ROLES)}", role)
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only here
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(InvalidRequestError, f"message {i}: content parts must be "
                              "{'type': 'text', 'text': ...} (text models only)", part)
                texts.append(part["text"])
            content = "".join(texts)
        calls = m.get("tool_calls") or None
        if content is None and not (role == "assistant" and calls):
            raise bad(InvalidRequestError, f"message {i}: content is required (a string)", m)
        if content is not None and not isinstance(content, str):
            raise bad(TypeError, f"message {i}: content must be a string", content)
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls is not None:
            if role != "assistant":
                raise bad(InvalidRequestError, f"message {i}: only assistant messages have tool_calls", m)
            msg["tool_calls"] = [_check_call(bad, i, c) for c in calls]
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad(TypeError, f"message {i}: {key} must be a string", m[key])
                msg[key] = m[key]
        out.append(msg)
    return out


def _check_call(bad: Callable, i: int, c: Any) -> dict[str, Any]:
    """An assistant turn's tool call in OpenAI's shape (``{"id", "type": "function",
    "function": {"name", "arguments": JSON text}}``); accepts dask-agents' ToolCall too."""
    if hasattr(c, "model_dump"):
        c = c.model_dump()
    if not isinstance(c, dict):
        raise bad(TypeError, f"message {i}: a tool call must be a dict", c)
    f = c.get("function", c)
    name, args = f.get("name"), f.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise bad(InvalidRequestError, f"message {i}: a tool call needs a function name", c)
    if not isinstance(args, str):
        try:
            args = json.dumps(args)
        except (TypeError, ValueError):
            raise bad(InvalidRequestError, f"message {i}: tool call arguments must be JSON", args) from None
    return {"id": str(c.get("id") or f"call_{i}"), "type": "function", "function": {"name": name, "arguments": args}}


def check_tools(model: str, session: str | None, tools: Any, tool_choice: Any) -> tuple[list[dict] | None, Any]:
    """``tools`` as OpenAI function tools (``{"type": "function", "function": {"name",
    "description", "parameters"}}``; ``{"name", "parameters", ...}`` is wrapped) and the
    ``tool_choice``: ``"auto"`` (the default with tools), ``"none"``, ``"required"``, or one
    tool's name (or ``{"type": "function", "function": {"name": ...}}``), returned as the name."""
    bad = argument_error(model, "chat", session)
    if tools is None:
        if tool_choice not in (None, "auto", "none"):
            raise bad(InvalidRequestError, "tool_choice needs tools", tool_choice)
        return None, None
    if not isinstance(tools, (list, tuple)) or not tools:
        raise bad(TypeError, "tools must be a non-empty list of function tools", tools)
    out, names = [], set()
    for t in tools:
        if hasattr(t, "model_dump"):
            t = t.model_dump(exclude_none=True)
        if not isinstance(t, dict):
            raise bad(TypeError, "a tool must be a dict", t)
        f = t.get("function") if t.get("type", "function") == "function" and "function" in t else t
        if t.get("type", "function") != "function" or not isinstance(f, dict):
            raise bad(InvalidRequestError, "only function tools are supported", t)
        name, params = f.get("name"), f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not name:
            raise bad(InvalidRequestError, "a tool needs a name", t)
        if name in names:
            raise bad(InvalidRequestError, "tool names must be unique", name)
        if not isinstance(params, dict):
            raise bad(TypeError, f"tool {name!r}: parameters must be a JSON schema (a dict)", params)
        names.add(name)
        fn = {"name": name, "parameters": params}
        if f.get("description") is not None:
            fn["description"] = str(f["description"])
        out.append({"type": "function", "function": fn})
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name")
        if not isinstance(choice, str):
            raise bad(InvalidRequestError, "tool_choice must name a function", tool_choice)
    if not isinstance(choice, str):
        raise bad(TypeError, "tool_choice must be 'auto', 'none', 'required' or a tool's name", tool_choice)
    if choice not in TOOL_CHOICES and choice not in names:
        raise bad(InvalidRequestError, f"tool_choice names no tool given (tools: {', '.join(sorted(names))})", choice)
    return out, choice
