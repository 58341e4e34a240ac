"""LLM calls: ``da.llm("coder").generate(prompt, max_tokens=...)`` returns an AgentFuture.

The call is a task of component ``llm.<model>`` routed by the scheduler plugin to a worker
hosting the model, preferring the worker that served the session before (its KV is there).
The result is an :class:`~dask_agents.models.LLMResult`.
"""

from __future__ import annotations

import re
import threading

from distributed import Client

import dask_agents.config as agents_config

from dask_agents import runtime
from dask_agents.calls import find_client, submit_call
from dask_agents.components import make_spec
from dask_agents.errors import UnknownModelError
from dask_agents.futures import AgentFuture
from dask_agents.hints import ComponentHints

_known: dict[int, set[str]] = {}  # id(client) -> models the scheduler reported hosted
_known_lock = threading.Lock()


def _check_model(client: Client, model: str, component: str) -> None:
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
            f"{where(component, 'generate', session_id())}: unknown model {model!r}: not in agents.llm.models ({', '.join(sorted(configured)) or 'none'}) "
            f"and no worker hosts it ({', '.join(sorted(hosted)) or 'none'})"
        )


def component_name(model: str) -> str:
    """The component name of a model's calls: ``llm.<model>``.

    Model names often hold '-' (which Dask's key_split treats as a separator): the component
    name keeps letters, digits, '_' and '.' so keys split back to it exactly."""
    return "llm." + re.sub(r"[^A-Za-z0-9_.]", "_", model)


class LLM:
    """A handle on one model of the cluster."""

    def __init__(self, model: str | None = None):
        self.model = model or agents_config.get("llm.default-model")
        component = component_name(self.model)
        self._spec = make_spec(runtime.run_llm, "llm", component, ComponentHints(model=self.model))

    def generate(self, prompt: str | list[int], *, max_tokens: int | None = None,
                 temperature: float = 0.0, seed: int | None = None) -> AgentFuture:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (text or token ids)."""
        _check_model(find_client(self._spec, "generate"), self.model, self._spec.name)
        kwargs = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
        return submit_call(self._spec, "generate", runtime.run_llm, self.model, (prompt,), kwargs,
                           extra={"llm_model": self.model})

    def __repr__(self) -> str:
        return f"<LLM {self.model}>"


def llm(model: str | None = None) -> LLM:
    """A handle on ``model`` (default ``agents.llm.default-model``)."""
    return LLM(model)
