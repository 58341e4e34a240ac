"""LangChain's chat-model interface on dask-agents: ``ChatDaskAgents(model="coder")``.

Existing LangChain/LangGraph agent code keeps its graph and nodes; each model call becomes a
dask-agents LLM call (``da.llm(model).chat``) in the current session, so its KV, priority and
placement follow the session like any other call. Needs ``langchain-core`` (the ``langchain``
extra)::

    from dask_agents.langchain import ChatDaskAgents

    llm = ChatDaskAgents(model="coder", max_tokens=256).bind_tools([read_file, run_tests])
    with da.session(client):
        reply = llm.invoke([("user", "The parser drops the last line.")])
        reply.tool_calls   # [{"name": "read_file", "args": {...}, "id": ...}]

``bind_tools`` takes what LangChain takes (functions, pydantic models, ``@tool`` objects, OpenAI
dicts) and a ``tool_choice`` (``"auto"``, ``"required"``/``"any"``, ``"none"`` or a tool's name).
"""

from __future__ import annotations

from typing import Any, Sequence

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, convert_to_openai_messages
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool

from dask_agents.llm import llm as _llm

# ChatDaskAgents' fields passed to chat() as they are (None: the call's default)
_SAMPLING = ("max_tokens", "temperature", "seed", "top_p", "top_k", "presence_penalty", "frequency_penalty")


class ChatDaskAgents(BaseChatModel):
    """A LangChain chat model whose calls are dask-agents LLM calls in the current session
    (``da.session`` on the driver, or the session of the component making them)."""

    model: str = "coder"
    max_tokens: int | None = None
    temperature: float = 0.0
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    timeout: float | None = None  # seconds to wait for a call's result (None: no limit)

    @property
    def _llm_type(self) -> str:
        return "dask-agents"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, **{k: getattr(self, k) for k in _SAMPLING}}

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | None = None, **kwargs: Any) -> Any:
        """This model with ``tools`` given to every call (LangChain's ``bind_tools``);
        ``tool_choice`` ``"any"`` means ``"required"``, as in LangChain's OpenAI models."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice == "any":
            tool_choice = "required"
        return self.bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        conversation = convert_to_openai_messages(messages)
        options = {k: getattr(self, k) for k in _SAMPLING if getattr(self, k) is not None}
        options.update(kwargs)
        if stop:
            options["stop"] = stop
        result = _llm(self.model).chat(conversation, **options).value(self.timeout)
        turn = result.message
        message = AIMessage(
            content=turn.content or "",
            tool_calls=[{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"}
                        for c in turn.tool_calls],
            response_metadata={"model_name": self.model, "finish_reason": result.finish_reason,
                               "worker": result.worker},
            usage_metadata={"input_tokens": result.prompt_tokens, "output_tokens": result.output_tokens,
                            "total_tokens": result.prompt_tokens + result.output_tokens,
                            "input_token_details": {"cache_read": result.cached_tokens}},
        )
        return ChatResult(generations=[ChatGeneration(message=message)])
