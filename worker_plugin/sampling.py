"""An LLM call's options as an engine's parameters, and what a chat's output means.

The caller checked the options (``dask_agents/sampling.py``); here they become vLLM's
``SamplingParams`` (:func:`vllm_params`, for the hosts that run vLLM) and a chat's completion
becomes an assistant turn (:func:`tool_calls_from_constraint`, :func:`json_fallback`). The
engine refuses what it cannot do, with the reason: stop strings and structured outputs need the
model's own tokenizer inside the engine (``tokenizer: auto``), not the byte tokenizer.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

# Options that need the engine to see text (vLLM detokenizes to match stop strings; a grammar is
# compiled against the tokenizer's vocabulary).
TEXT_OPTIONS = ("stop", "structured")


def needs_tokenizer(options: dict | None) -> list[str]:
    """The options of a call that only an engine with the model's tokenizer can honour."""
    return [k for k in TEXT_OPTIONS if options and k in options] + (
        ["tool_choice"] if options and options.get("tool_constraint") else [])


def structured_outputs_config(settings: Any) -> Any:
    """The engine's structured-output settings: compact JSON unless ``compact-json: false``
    (vLLM reads whitespace rules from the engine's config, not from a request's, and only for a
    named backend: llguidance, whose JSON-schema coverage is the widest of vLLM's backends, with
    objects closed to properties their schema does not name, as xgrammar, vLLM's default, has
    them; otherwise vLLM's own choice, ``auto``)."""
    from vllm.config import StructuredOutputsConfig

    if not settings.compact_json:
        return StructuredOutputsConfig()
    return StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True, disable_additional_properties=True)


def vllm_params(settings: Any, tokenizer: Any, max_tokens: int, temperature: float, seed: int | None,
                options: dict | None) -> Any:
    """vLLM's ``SamplingParams`` for one call (ValueError for what this engine cannot do).

    ``options`` (``dask_agents.sampling.check_options``'s dict, plus ``tool_constraint`` for a
    chat whose ``tool_choice`` constrains the output and ``keep_special`` when a tool parser
    reads the text): stop strings, ``n``, ``top_p``/``top_k``/``min_p``, ``logprobs``, penalties,
    ``ignore_eos`` (else the model's), one structured-output constraint."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    opts = dict(options or ())
    in_engine = bool(getattr(tokenizer, "in_engine", False))
    refused = needs_tokenizer(opts)
    if refused and not in_engine:
        raise ValueError(f"{', '.join(refused)} need the model's own tokenizer in the engine; this engine runs "
                         "with the byte tokenizer (tokenizer: byte): set tokenizer: auto on a model that ships one")
    structured = opts.pop("structured", None)
    constraint = opts.pop("tool_constraint", None)
    if constraint is not None:
        from dask_agents.kv.runtime import vllm_compat

        structured = {"json": vllm_compat.tool_call_schema(constraint["tools"], constraint["choice"])}
    keep_special = bool(opts.pop("keep_special", False))
    ignore_eos = opts.pop("ignore_eos", None)
    if ignore_eos is None:  # a constrained output ends with its grammar: at EOS
        ignore_eos = settings.eos_ignored() and structured is None
    # (whitespace in JSON outputs is the engine's setting: compact-json, see structured_outputs_config)
    so = StructuredOutputsParams(**structured) if structured is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=ignore_eos,
                          detokenize=in_engine, skip_special_tokens=not keep_special, structured_outputs=so,
                          **opts)


def tool_calls_from_constraint(text: str, constraint: dict) -> list[dict] | None:
    """The tool calls of an output that ``tool_choice`` constrained (vLLM's formats: for
    ``"required"`` a JSON list of ``{"name", "parameters"}``, for a named tool its arguments
    object), as ``[{"id", "name", "arguments"}]``; None when the text is not that (cut short by
    ``max_tokens``: the caller keeps it as content)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if constraint["choice"] == "required":
        if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                  for c in value):
            return None
        return [_call(c["name"], c.get("parameters", {})) for c in value]
    if not isinstance(value, dict):
        return None
    return [_call(constraint["choice"], value)]


def json_fallback(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """A model without a tool parser: the reply is a tool call when it is exactly a JSON object
    ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``) naming a given tool, or a list
    of them; otherwise it is content. Returns ``(content, calls)``."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return text, []
    try:
        value = json.loads(stripped)
    except ValueError:
        return text, []
    items = value if isinstance(value, list) else [value]
    calls = []
    for c in items:
        if not isinstance(c, dict) or c.get("name") not in names:
            return text, []
        args = c.get("arguments", c.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return text, []
        if not isinstance(args, dict):
            return text, []
        calls.append(_call(c["name"], args))
    return None, calls


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "name": name,
            "arguments": arguments if isinstance(arguments, dict) else {"value": arguments}}


def tool_calls(settings: Any, tokenizer: Any, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """A chat output's ``(content, [{"id", "name", "arguments"}])``: with the model's
    ``tool-parser`` (vLLM's, on an engine with the model's tokenizer) or the JSON fallback."""
    names = {t["function"]["name"] for t in tools}
    hf = getattr(tokenizer, "hf", None)
    if settings.tool_parser and hf is not None:
        from dask_agents.kv.runtime import vllm_compat

        content, calls = vllm_compat.extract_tool_calls(settings.tool_parser, hf, text, tools)
        return content, [_call(c["name"], c["arguments"]) for c in calls]
    return json_fallback(text, names)


def completion_text(tokenizer: Any, completion: Any) -> str:
    """A completion's text (so far): the engine's own when it detokenized (a matched stop string
    is cut off), else decoded here from its token ids."""
    if getattr(tokenizer, "in_engine", False) and getattr(completion, "text", None) is not None:
        return completion.text
    return tokenizer.decode(list(completion.token_ids)) if tokenizer else ""
