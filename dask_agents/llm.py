"""LLM calls: ``da.llm("coder").generate(prompt, max_tokens=...)`` returns an AgentFuture.

The call is a task of component ``llm.<model>`` routed by the scheduler plugin to a worker
hosting the model, preferring the worker that served the session before (its KV is there).
The result is an :class:`~dask_agents.models.LLMResult`.
"""

from __future__ import annotations

import threading
from typing import Any

from distributed import Client

import dask_agents.config as agents_config

from dask_agents import runtime
from dask_agents.annotation import component_name  # noqa: F401  (also this module's)
from dask_agents.calls import find_client, submit_call
from dask_agents.components import make_spec
from dask_agents.errors import InvalidRequestError, UnknownModelError, short_repr
from dask_agents.futures import AgentFuture
from dask_agents.hints import ComponentHints

_known: dict[int, set[str]] = {}  # id(client) -> models the scheduler reported hosted
_known_lock = threading.Lock()


def _check_model(client: Client, model: str, component: str, method: str = "generate") -> None:
    configured = agents_config.get("llm.models") or {}
    if model in configured or model in _known.get(id(client), ()) or client.asynchronous:
        return  # async clients: the worker checks (and fails the call clearly)
    from dask_agents.client_api import hosted_models
    from dask_agents.errors import NotInstalledError

    try:
        hosted = hosted_models(client)
    except NotInstalledError:
        hosted = {}
    with _known_lock:
        _known[id(client)] = set(hosted)
    if model not in hosted:
        from dask_agents.context import session_id
        from dask_agents.errors import where

        raise UnknownModelError(
            f"{where(component, method, session_id())}: unknown model {model!r}: not in agents.llm.models ({', '.join(sorted(configured)) or 'none'}) "
            f"and no worker hosts it ({', '.join(sorted(hosted)) or 'none'})"
        )


def check_generate_args(model: str, prompt: object, max_tokens: object, temperature: object,
                        seed: object) -> tuple[Any, int | None, float, int | None]:
    """Validate and normalise ``generate``'s arguments.

    ``prompt``: a non-empty string (valid Unicode: no lone surrogates) or sequence of token ids
    (ints >= 0) or a future of one; ``max_tokens``: None or an int >= 1; ``temperature``: a
    finite number >= 0; ``seed``: None or an int torch can take (``[-2**63, 2**64 - 1]``). Any
    :class:`numbers.Integral` / :class:`numbers.Real` is accepted (``numpy.int64``...) and
    returned as the plain Python type the worker requires: ``(prompt, max_tokens, temperature,
    seed)`` with token ids as a ``list[int]``, ``max_tokens``/``seed`` as ``int`` (or None) and
    ``temperature`` as ``float``. Raises TypeError (a wrong type) or
    :class:`~dask_agents.errors.InvalidRequestError` (a ValueError: a bad value) naming the model,
    the argument and the session. What depends on the model (token ids inside its vocabulary,
    the context length) is checked on the worker, before the request reaches the engine."""
    import math
    from numbers import Integral, Real

    from dask_agents.context import session_id

    sid = session_id()
    in_session = f" (session {sid})" if sid else ""

    def bad(kind: type[Exception], what: str, value: object) -> Exception:
        return kind(f"da.llm({model!r}).generate: {what}, got {short_repr(value)}{in_session}")

    from distributed import Future

    limit = agents_config.parse_size(agents_config.get("llm.max-prompt-bytes"))

    def too_long(size: int) -> Exception:
        from dask_agents.errors import PromptTooLongError

        from dask.utils import format_bytes

        return PromptTooLongError(f"da.llm({model!r}).generate: the prompt is {format_bytes(size)}, past "
                                  f"agents.llm.max-prompt-bytes ({format_bytes(limit)}): refused before it was "
                                  f"sent{in_session}")

    if isinstance(prompt, Future):
        pass  # a future's value becomes the prompt on the worker (a Dask dependency)
    elif isinstance(prompt, str):
        if not prompt:
            raise bad(InvalidRequestError, "prompt must not be empty", prompt)
        if len(prompt) > limit:  # characters are at least a byte each: too long without encoding it
            raise too_long(len(prompt))
        try:
            size = len(prompt.encode("utf-8"))
            if size > limit:
                raise too_long(size)
        except UnicodeEncodeError as e:  # lone surrogates: no tokenizer can encode them
            raise bad(InvalidRequestError, f"the prompt text cannot be encoded ({e.reason} at position {e.start})",
                      prompt[e.start:e.end]) from None
    elif isinstance(prompt, (list, tuple)):
        if not prompt:
            raise bad(InvalidRequestError, "prompt must not be empty", prompt)
        if isinstance(prompt[0], dict) or hasattr(prompt[0], "model_dump"):
            raise bad(TypeError, f"generate takes a text prompt or token ids; for chat messages use "
                      f"da.llm({model!r}).chat(messages)", prompt[0])
        if 4 * len(prompt) > limit:
            raise too_long(4 * len(prompt))
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, Integral):
                raise bad(TypeError, "token ids must be ints", t)
            if t < 0:
                raise bad(InvalidRequestError, "token ids must be >= 0", t)
        prompt = [int(t) for t in prompt]
    else:
        raise bad(TypeError, "prompt must be a string or a list of token ids", prompt)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, Integral)):
        raise bad(TypeError, "max_tokens must be an int", max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise bad(InvalidRequestError, "max_tokens must be >= 1", max_tokens)
    if isinstance(temperature, bool) or not isinstance(temperature, Real):
        raise bad(TypeError, "temperature must be a number", temperature)
    try:
        temp = float(temperature)
    except (OverflowError, ValueError):  # an int too large for a float
        temp = math.inf
    if not math.isfinite(temp) or temp < 0:
        raise bad(InvalidRequestError, "temperature must be finite and >= 0", temperature)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)):
        raise bad(TypeError, "seed must be an int", seed)
    if seed is not None and not -(2**63) <= seed <= 2**64 - 1:  # torch's range (a larger one crashes a step)
        raise bad(InvalidRequestError, "seed must be in [-2**63, 2**64 - 1]", seed)
    return (prompt, None if max_tokens is None else int(max_tokens), temp,
            None if seed is None else int(seed))


class LLM:
    """A handle on one model of the cluster."""

    def __init__(self, model: str | None = None):
        self.model = model or agents_config.get("llm.default-model")
        if not isinstance(self.model, str) or not self.model.strip():
            raise TypeError(f"da.llm() needs a model name (a non-empty string), got {self.model!r}")
        component = component_name(self.model)
        self._spec = make_spec(runtime.run_llm, "llm", component, ComponentHints(model=self.model))

    def generate(self, prompt: str | list[int], *, max_tokens: int | None = None,
                 temperature: float = 0.0, seed: int | None = None, stop: str | list[str] | None = None,
                 stop_token_ids: list[int] | None = None, top_p: float | None = None, top_k: int | None = None,
                 min_p: float | None = None, n: int = 1, logprobs: int | None = None,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 repetition_penalty: float | None = None, ignore_eos: bool | None = None,
                 json_schema: Any = None, regex: str | None = None, choice: list[str] | None = None,
                 stream: bool = False) -> AgentFuture:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (text or token ids).

        Sampling follows vLLM's ``SamplingParams`` (``stop`` strings, ``top_p``, ``top_k``,
        ``min_p``, ``n`` completions, ``logprobs``, penalties, ``ignore_eos``: None takes the
        model's ``ignore-eos``); at most one structured-output constraint: ``json_schema`` (a
        dict, JSON text or pydantic model class), ``regex`` or ``choice``. The result is an
        :class:`~dask_agents.models.LLMResult` (``choices`` holds all ``n``). With
        ``stream=True`` the output also arrives as it is generated: ``fut.stream()`` (or
        ``fut.astream()``) iterates :class:`~dask_agents.streaming.Delta` objects.

        Arguments are checked here, before anything is submitted: a bad one raises TypeError or
        :class:`~dask_agents.errors.InvalidRequestError` naming the model and the argument; what
        depends on the model (token ids in its vocabulary, its context, stop strings and
        constraints on an engine without the model's tokenizer) fails the future with
        InvalidRequestError (PromptTooLongError) naming the call, before it reaches the engine."""
        from dask_agents.context import session_id
        from dask_agents.sampling import check_options

        prompt, max_tokens, temperature, seed = check_generate_args(self.model, prompt, max_tokens, temperature, seed)
        options = check_options(self.model, "generate", session_id(), stop=stop, stop_token_ids=stop_token_ids,
                                top_p=top_p, top_k=top_k, min_p=min_p, n=n, logprobs=logprobs,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
                                json_schema=json_schema, regex=regex, choice=choice)
        # its size, for KV admission: token ids, or the text's UTF-8 bytes (the scheduler learns
        # the working sets from reports; a first estimate only has to be of the right order)
        size = len(prompt) if isinstance(prompt, list) else len(prompt.encode("utf-8")) if isinstance(prompt, str) else 0
        return self._submit("generate", (prompt,), max_tokens, temperature, seed, options, None, size, stream)

    def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
             tool_choice: str | dict[str, Any] | None = None, max_tokens: int | None = None,
             temperature: float = 0.0, seed: int | None = None, stop: str | list[str] | None = None,
             stop_token_ids: list[int] | None = None, top_p: float | None = None, top_k: int | None = None,
             min_p: float | None = None, n: int = 1, logprobs: int | None = None,
             presence_penalty: float | None = None, frequency_penalty: float | None = None,
             repetition_penalty: float | None = None, ignore_eos: bool | None = None,
             json_schema: Any = None, regex: str | None = None, choice: list[str] | None = None,
             stream: bool = False) -> AgentFuture:
        """Answer a conversation: ``messages`` (OpenAI's shape: ``{"role": "system" | "user" |
        "assistant" | "tool", "content": ...}``, an assistant turn's ``tool_calls``, a tool
        result's ``tool_call_id``) rendered with the model's chat template on the worker.

        ``tools`` (OpenAI function tools) are given to the template; ``tool_choice`` is
        ``"auto"`` (the default), ``"none"``, ``"required"`` (at least one call, the output
        constrained to vLLM's tool-call JSON) or a tool's name (that tool, its arguments
        constrained to its ``parameters`` schema). The result's ``message`` is the assistant
        turn: ``content`` and parsed ``tool_calls`` (the model's ``tool-parser``, vLLM's, when it
        has one, else the JSON fallback: the reply is a tool call when it is exactly
        ``{"name": ..., "arguments": {...}}`` or a list of them). Append it to ``messages`` as
        it is for the next turn. Sampling options and ``stream`` as for :meth:`generate`."""
        from dask_agents.context import session_id
        from dask_agents.sampling import check_messages, check_options, check_tools

        sid = session_id()
        msgs = check_messages(self.model, sid, messages)
        tool_list, choice_of_tool = check_tools(self.model, sid, tools, tool_choice)
        _, max_tokens, temperature, seed = check_generate_args(self.model, "-", max_tokens, temperature, seed)
        options = check_options(self.model, "chat", sid, stop=stop, stop_token_ids=stop_token_ids, top_p=top_p,
                                top_k=top_k, min_p=min_p, n=n, logprobs=logprobs, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                                ignore_eos=ignore_eos, json_schema=json_schema, regex=regex, choice=choice)
        if tool_list and choice_of_tool not in ("auto", "none") and "structured" in options:
            from dask_agents.sampling import argument_error

            raise argument_error(self.model, "chat", sid)(
                InvalidRequestError, f"tool_choice={choice_of_tool!r} constrains the output itself: "
                "give no json_schema, regex or choice with it", choice_of_tool)
        conversation = {"messages": msgs, "tools": tool_list, "tool_choice": choice_of_tool}
        size = sum(len((m.get("content") or "").encode("utf-8")) for m in msgs)
        return self._submit("chat", (None,), max_tokens, temperature, seed, options, conversation, size, stream)

    def _submit(self, method: str, args: tuple, max_tokens: int | None, temperature: float, seed: int | None,
                options: dict, conversation: dict | None, size: int, stream: bool = False) -> AgentFuture:
        client = find_client(self._spec, method)
        _check_model(client, self.model, self._spec.name, method)
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
        if options:
            kwargs["options"] = options
        if conversation is not None:
            kwargs["chat"] = conversation
        extra: dict[str, Any] = {"llm_model": self.model, "llm_prompt_len": size,
                                 "llm_max_tokens": (max_tokens or 0) * int(options.get("n", 1))}  # n outputs' KV
        if not isinstance(stream, bool):
            raise TypeError(f"da.llm({self.model!r}).{method}: stream must be a bool, got {stream!r}")
        if stream:  # subscribed before the call is sent, on the same ordered stream (streaming.py)
            from dask_agents import streaming

            kwargs["stream"] = extra["stream"] = streaming.subscribe(client)
        fut = submit_call(self._spec, method, runtime.run_llm, self.model, args, kwargs, extra=extra)
        if stream:
            fut._agents_stream = True
            streaming.watch(fut)
        return fut

    def __repr__(self) -> str:
        return f"<LLM {self.model}>"


def llm(model: str | None = None) -> LLM:
    """A handle on ``model`` (default ``agents.llm.default-model``)."""
    return LLM(model)
