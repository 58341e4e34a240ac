"""An OpenAI-compatible endpoint on a dask-agents cluster: any OpenAI-SDK agent runs on its engines.

    dask-agents serve --scheduler tcp://host:8786 --port 8000     # loopback by default
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")

``/v1/chat/completions`` (tools, ``tool_choice``, ``response_format``, ``stream`` by server-sent
events), ``/v1/completions`` and ``/v1/models``. Each request is a dask-agents LLM call; the header
``X-Dask-Agents-Session`` maps requests to one dask-agents session (its KV stays on one engine
between them, its calls are ordered and placed by its progress), kept open until
``idle_timeout`` seconds pass without a request (or the server stops); without it each request is
a session of its own. Needs ``fastapi`` and ``uvicorn`` (the ``server`` extra).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Iterator

# at module level: FastAPI reads the handlers' annotations by name (a local import hides Request)
from fastapi import Request

SESSION_HEADER = "x-dask-agents-session"


class _Sessions:
    """Sessions named by the header: opened on first use, ended after ``idle`` seconds unused."""

    def __init__(self, client: Any, idle: float):
        self.client, self.idle = client, idle
        self.open: dict[str, tuple[Any, float]] = {}  # header value -> (SessionContext, last use)
        self.lock = threading.Lock()

    def get(self, name: str, tenant: str | None) -> Any:
        from dask_agents import client_api, context

        now = time.monotonic()
        with self.lock:
            expired = [(k, c) for k, (c, t) in self.open.items() if now - t > self.idle and k != name]
            for k, _ in expired:
                del self.open[k]
            entry = self.open.get(name)
            ctx = entry[0] if entry is not None else None
            if ctx is None:
                ctx = context.SessionContext(f"{name}-{uuid.uuid4().hex[:8]}", tenant, self.client)
            self.open[name] = (ctx, now)
        for _k, c in expired:
            client_api.end_session(self.client, c.id)
        if entry is None:
            client_api.open_session(self.client, ctx.id, tenant)
        return ctx

    def close(self) -> None:
        from dask_agents import client_api

        with self.lock:
            ctxs = [c for c, _ in self.open.values()]
            self.open.clear()
        for c in ctxs:
            client_api.end_session(self.client, c.id)


def create_app(client: Any, idle_timeout: float = 300.0) -> Any:
    """The FastAPI application serving ``client``'s cluster."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    from dask_agents import client_api, context
    from dask_agents.errors import InvalidRequestError, PromptTooLongError, UnknownModelError
    from dask_agents.llm import llm

    sessions = _Sessions(client, idle_timeout)

    @asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        yield
        sessions.close()  # the header's sessions end with the server

    app = FastAPI(title="dask-agents", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.sessions = sessions

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=status)

    def run(request: Request, body: dict, call: Any) -> Any:
        """Make the call in the request's session: the header's (kept open), else one of its own."""
        name = request.headers.get(SESSION_HEADER)
        if name:
            ctx, own = sessions.get(name, request.headers.get("x-dask-agents-tenant")), None
        else:
            ctx = context.SessionContext(f"openai-{uuid.uuid4().hex[:16]}", None, client)
            client_api.open_session(client, ctx.id, None)
            own = ctx.id
        token = context.current_session.set(ctx)
        try:
            return call(), own
        except BaseException:  # refused before it was sent: its own session ends here
            if own is not None:
                client_api.end_session(client, own)
            raise
        finally:
            context.current_session.reset(token)

    def sampling(body: dict) -> dict:
        out: dict[str, Any] = {"max_tokens": body.get("max_completion_tokens", body.get("max_tokens")),
                               "temperature": body.get("temperature", 1.0)}
        for key in ("top_p", "top_k", "min_p", "n", "seed", "stop", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "ignore_eos", "stop_token_ids"):
            if body.get(key) is not None:
                out[key] = body[key]
        if body.get("logprobs") or body.get("top_logprobs"):  # refused, not dropped: none would come back
            raise InvalidRequestError("logprobs are not served by this endpoint yet: "
                                      "use da.llm(model).generate(..., logprobs=k) for them")
        rf = body.get("response_format") or {}
        if rf.get("type") == "json_schema":
            out["json_schema"] = (rf.get("json_schema") or {}).get("schema", {})
        elif rf.get("type") == "json_object":
            out["json_schema"] = {"type": "object"}
        for key in ("regex", "choice", "json_schema"):  # vLLM's own extras (guided_* by other names)
            if body.get(key) is not None:
                out[key] = body[key]
        return out

    def usage(r: Any) -> dict:
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.output_tokens,
                "total_tokens": r.prompt_tokens + r.output_tokens,
                "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}

    def handle(request: Request, body: dict, chat: bool) -> Any:
        model = body.get("model")
        if not isinstance(model, str):
            return error(400, "'model' is required")
        stream = bool(body.get("stream", False))
        try:
            kwargs = sampling(body)
            if chat:
                fut, own = run(request, body, lambda: llm(model).chat(
                    body.get("messages"), tools=body.get("tools"), tool_choice=body.get("tool_choice"),
                    stream=stream, **kwargs))
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                fut, own = run(request, body, lambda: llm(model).generate(prompt, stream=stream, **kwargs))
        except UnknownModelError as e:
            return error(404, str(e), "not_found_error")
        except (TypeError, ValueError, InvalidRequestError) as e:
            return error(400, str(e))
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{fut.key}", int(time.time())

        def end() -> None:
            if own is not None:
                client_api.end_session(client, own)

        if stream:
            return StreamingResponse(_events(fut, rid, created, model, chat, end), media_type="text/event-stream")
        try:
            r = fut.value()
        except PromptTooLongError as e:
            return error(400, str(e))
        except InvalidRequestError as e:
            return error(400, str(e))
        except Exception as e:  # the call failed: its da.* error names it
            return error(500, f"{type(e).__name__}: {e}", "server_error")
        finally:
            end()
        choices = [_choice(c, chat) for c in (r.choices or [])]
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": choices, "usage": usage(r)}

    @app.get("/v1/models")
    def models() -> dict:
        names = sorted(client_api.hosted_models(client))
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "dask-agents"}
                                           for m in names]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await request.json()
        return await _in_thread(handle, request, body, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        return await _in_thread(handle, request, body, False)

    return app


async def _in_thread(fn: Any, *args: Any) -> Any:
    import anyio

    return await anyio.to_thread.run_sync(lambda: fn(*args))


def _choice(c: Any, chat: bool) -> dict:
    finish = c.finish_reason
    if not chat:
        return {"index": c.index, "text": c.text, "finish_reason": finish, "logprobs": None}
    m = c.message
    calls = [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": json.dumps(t.arguments)}}
             for t in (m.tool_calls if m is not None else [])]
    message: dict[str, Any] = {"role": "assistant", "content": m.content if m is not None else c.text}
    if calls:
        message["tool_calls"] = calls
        finish = "tool_calls"
    return {"index": c.index, "message": message, "finish_reason": finish, "logprobs": None}


def _events(fut: Any, rid: str, created: int, model: str, chat: bool, end: Any) -> Iterator[str]:
    """Server-sent events of a streaming call, then its final chunk and ``[DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    try:
        first = True
        for d in fut.stream():
            if d.restarted:
                continue
            if chat:
                delta: dict[str, Any] = {"content": d.text}
                if first:
                    delta["role"] = "assistant"
                choice = {"index": d.index, "delta": delta, "finish_reason": None}
            else:
                choice = {"index": d.index, "text": d.text, "finish_reason": None}
            first = False
            yield f"data: {json.dumps({'id': rid, 'object': kind, 'created': created, 'model': model, 'choices': [choice]})}\n\n"
        r = fut.value()
        last = [{"index": c.index, **({"delta": {}} if chat else {"text": ""}), "finish_reason": c.finish_reason}
                for c in r.choices]
        yield f"data: {json.dumps({'id': rid, 'object': kind, 'created': created, 'model': model, 'choices': last})}\n\n"
    except Exception as e:  # the call failed mid-stream: say so, then end the stream
        yield f"data: {json.dumps({'error': {'message': f'{type(e).__name__}: {e}', 'type': 'server_error'}})}\n\n"
    finally:
        end()
    yield "data: [DONE]\n\n"


def serve(client: Any, host: str = "127.0.0.1", port: int = 8000, idle_timeout: float = 300.0) -> Any:
    """Run the endpoint with uvicorn until stopped (blocking); loopback unless ``host`` says."""
    import uvicorn

    uvicorn.run(create_app(client, idle_timeout), host=host, port=port, log_level="warning")


def start(client: Any, host: str = "127.0.0.1", port: int = 0, idle_timeout: float = 300.0) -> tuple[Any, int]:
    """Start the endpoint in a background thread; returns ``(server, port)`` (``server.should_exit =
    True`` stops it). ``port`` 0: a free one."""
    import socket

    import uvicorn

    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(client, idle_timeout), host=host, port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name="dask-agents-openai", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # polls the server's own flag
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the OpenAI-compatible endpoint did not start on {host}:{port}")
        time.sleep(0.01)
    return server, port
