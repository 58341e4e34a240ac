"""EMULATED engines behind OpenAI-compatible HTTP servers on loopback, and a session router in
front of them: how users deploy engines for a framework that does not manage them (LangGraph).

- :func:`serve_engine`: the body of one engine process: an aiohttp server on
  ``127.0.0.1:<free port>`` hosting ONE engine made by :func:`common.make_engine` (the engine
  class every variant uses). ``POST /v1/completions`` (OpenAI completions, plus ``x_timing``:
  when the engine received the request and when it finished, wall clock), ``GET /v1/models``,
  ``GET /health``, ``GET /stats`` (the host's ``stats()`` plus the server's own counters under
  ``"server"``). The engine is workflow-blind: no session reaches ``host.submit`` (like vLLM).
- :func:`serve_router`: the body of the router process: an aiohttp proxy sending each
  ``/v1/completions`` to one backend of the body's ``model``, by a :class:`SessionRouter` rule
  (``session_sticky`` on the ``X-Session-Id`` header, like vLLM production-stack's session router).
- :class:`HTTPEngines`: starts one spawned server process per replica and the router, stops them.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import signal
import socket
import sys
import time
import uuid
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from benchmarks.e2e.program import Setup
from benchmarks.e2e.variants.common import ROUTINGS, make_engine

SESSION_HEADER = "X-Session-Id"
REPO_ROOT = str(Path(__file__).resolve().parents[3])  # where `benchmarks` imports from
_dumps = partial(json.dumps, default=str)


def _bound_socket() -> socket.socket:
    """A listening-ready socket on a free loopback port (bound here so the port cannot race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def openai_error(status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None) -> web.Response:
    """An error response shaped like OpenAI's (``{"error": {message, type, param, code}}``)."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                             status=status)


def check_completion(body: Any) -> str | None:
    """Why a completions body is bad, or None: needs ``model`` (str), ``prompt`` (non-empty
    str), ``max_tokens`` (int >= 1), optional numeric ``temperature``."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    if not isinstance(body.get("model"), str):
        return "'model' must be a string"
    if not isinstance(body.get("prompt"), str) or not body["prompt"]:
        return "'prompt' must be a non-empty string (token-id prompts are not supported)"
    mt = body.get("max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        return "'max_tokens' must be an integer >= 1"
    if not isinstance(body.get("temperature", 0.0), (int, float)):
        return "'temperature' must be a number"
    return None


async def _serve_until_term(app: web.Application, port_queue: Any) -> None:
    """Serve ``app`` on a free loopback port, report the port, run until SIGTERM."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    runner = web.AppRunner(app, access_log=None)  # no per-request log line: it costs CPU
    await runner.setup()
    sock = _bound_socket()
    await web.SockSite(runner, sock, backlog=1024).start()
    port_queue.put(sock.getsockname()[1])
    await stop.wait()
    await runner.cleanup()


# -- the engine server ---------------------------------------------------------------------------

def completion_body(rid: str, model: str, host: Any, out: Any, received: float, finished: float) -> dict:
    """The OpenAI completions answer for the engine output ``out``, plus ``x_timing``."""
    done = out.outputs[0]
    prompt_tokens, completion_tokens = len(out.prompt_token_ids), len(done.token_ids)
    return {"id": rid, "object": "text_completion", "created": int(received), "model": model,
            "choices": [{"index": 0, "text": host.tokenizer.decode(done.token_ids), "logprobs": None,
                         "finish_reason": done.finish_reason or "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": int(out.num_cached_tokens or 0)}},
            "x_timing": {"received": received, "finished": finished}}


def engine_app(model: str, host: Any) -> web.Application:
    """The OpenAI-compatible app serving ``model`` from the started engine ``host``."""
    counters = {"requests": 0, "in_flight": 0, "errors": 0}

    def fail(status: int, message: str, code: str | None = None) -> web.Response:
        counters["errors"] += 1
        return openai_error(status, message, code=code)

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        problem = check_completion(body)
        if problem:
            return fail(400, problem)
        if body["model"] != model:
            return fail(404, f"The model `{body['model']}` does not exist.", "model_not_found")
        received = time.time()  # stamped where generate_on stamps it: before tokenizing
        ids, max_tokens = host.tokenizer.encode(body["prompt"]), body["max_tokens"]
        if len(ids) + max_tokens > host.max_model_len:
            return fail(400, f"This model's maximum context length is {host.max_model_len} tokens; the "
                             f"request has {len(ids)} prompt + {max_tokens} completion tokens.")
        counters["requests"] += 1
        counters["in_flight"] += 1
        rid = f"cmpl-{uuid.uuid4().hex}"
        try:
            params = host.sampling_params(max_tokens, float(body.get("temperature", 0.0)), body.get("seed"))
            out = await asyncio.wrap_future(host.submit(rid, ids, params, None))  # workflow-blind
        except ValueError as e:  # the engine refused it (e.g. too big for its KV)
            return fail(400, str(e))
        finally:
            counters["in_flight"] -= 1
        return web.json_response(completion_body(rid, model, host, out, received, time.time()))

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": model})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({**host.stats(), "server": dict(counters)}, dumps=_dumps)

    app = web.Application(client_max_size=64 * 2**20)  # long prompts: up to 64 MiB bodies
    app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models),
                    web.get("/health", health), web.get("/stats", stats)])
    return app


def serve_engine(model: str, setup: Setup, port_queue: Any) -> None:
    """Process body: one EMULATED engine for ``model`` behind an HTTP server, until SIGTERM."""
    host = make_engine(model, setup)
    try:
        asyncio.run(_serve_until_term(engine_app(model, host), port_queue))
    finally:
        host.close()


# -- the router ------------------------------------------------------------------------------------

class SessionRouter:
    """Which backend of one model serves a request (one asyncio thread: no lock).

    ``round_robin`` per request; ``least_loaded``: fewest requests in flight (ties: the one
    that was sent fewer requests, then the lowest index); ``session_sticky``: a session's first
    request goes to the least loaded backend, later ones follow it (its prefix is cached
    there); the mapping keeps the ``max_sessions`` most recently used sessions. Requests without
    a session are routed least loaded."""

    def __init__(self, replicas: list[int], rule: str, max_sessions: int = 100_000):
        if rule not in ROUTINGS:
            raise ValueError(f"unknown routing {rule!r} (known: {', '.join(ROUTINGS)})")
        self.replicas, self.rule, self.max_sessions = replicas, rule, max_sessions
        self.in_flight, self.sent = [0] * len(replicas), [0] * len(replicas)
        self.rr = -1
        self.sticky: OrderedDict[str, int] = OrderedDict()

    def _least_loaded(self) -> int:
        return min(range(len(self.replicas)), key=lambda j: (self.in_flight[j], self.sent[j], j))

    def pick(self, session: str | None) -> int:
        """The backend (position in ``replicas``) for one request; pair with :meth:`done`."""
        if self.rule == "round_robin":
            self.rr = i = (self.rr + 1) % len(self.replicas)
        elif self.rule == "session_sticky" and session is not None:
            i = self.sticky.get(session, -1)
            if i < 0:
                i = self._least_loaded()
            self.sticky[session] = i
            self.sticky.move_to_end(session)
            if len(self.sticky) > self.max_sessions:
                self.sticky.popitem(last=False)
        else:
            i = self._least_loaded()
        self.in_flight[i] += 1
        self.sent[i] += 1
        return i

    def done(self, i: int) -> None:
        self.in_flight[i] -= 1


def router_app(backends: list[tuple[str, str]], routing: str) -> web.Application:
    """The proxy app: ``backends`` are (model, base URL) in replica order."""
    groups: dict[str, list[int]] = {}
    for r, (m, _) in enumerate(backends):
        groups.setdefault(m, []).append(r)
    tables = {m: SessionRouter(g, routing) for m, g in groups.items()}

    async def start_client(app: web.Application) -> Any:
        # One pooled client for every request; no limit on connections, no timeout (an
        # engine's queue can hold a request for long).
        app["client"] = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None))
        yield
        await app["client"].close()

    async def completions(request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            model = json.loads(raw).get("model")
        except (ValueError, AttributeError):
            return openai_error(400, "the body must be a JSON object")
        table = tables.get(model) if isinstance(model, str) else None
        if table is None:
            return openai_error(404, f"The model `{model}` does not exist.", code="model_not_found")
        i = table.pick(request.headers.get(SESSION_HEADER))
        replica = table.replicas[i]
        try:
            async with request.app["client"].post(f"{backends[replica][1]}/v1/completions", data=raw,
                                                  headers={"Content-Type": "application/json"}) as resp:
                data = await resp.read()
                return web.Response(body=data, status=resp.status, content_type=resp.content_type,
                                    headers={"X-Backend": str(replica)})
        except ClientError as e:
            return openai_error(502, f"backend {replica} failed: {e!r}", kind="server_error")
        finally:
            table.done(i)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in tables]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({m: {"replicas": t.replicas, "in_flight": t.in_flight, "sent": t.sent,
                                      "sessions": len(t.sticky)} for m, t in tables.items()})

    app = web.Application(client_max_size=64 * 2**20)
    app.cleanup_ctx.append(start_client)
    app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models),
                    web.get("/health", health), web.get("/stats", stats)])
    return app


def serve_router(backends: list[tuple[str, str]], routing: str, port_queue: Any) -> None:
    """Process body: the router in front of ``backends`` ((model, URL), replica order)."""
    asyncio.run(_serve_until_term(router_app(backends, routing), port_queue))


# -- the processes ---------------------------------------------------------------------------------

class HTTPEngines:
    """One spawned HTTP server process per engine replica (``setup.replica_models()``) and a
    router process in front; a context manager. ``url``: the router's base URL;
    ``backend_urls``: the servers', replica order."""

    def __init__(self, setup: Setup, routing: str = "session_sticky", start_timeout: float = 120.0):
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r} (known: {', '.join(ROUTINGS)})")
        self.setup, self.routing, self.start_timeout = setup, routing, start_timeout
        self.procs: list[Any] = []
        self.backend_urls: list[str] = []
        self.url = ""

    def _spawn(self, name: str, target: Any, *args: Any) -> Any:
        ctx = mp.get_context("spawn")  # never fork: the parent holds threads and event loops
        queue = ctx.Queue()
        proc = ctx.Process(target=target, args=(*args, queue), name=name, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc, queue

    def _port(self, proc: Any, queue: Any, deadline: float) -> int:
        import queue as queue_mod

        while time.monotonic() < deadline:
            try:
                return queue.get(timeout=0.2)
            except queue_mod.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"{proc.name} exited with code {proc.exitcode} before serving")
        raise TimeoutError(f"{proc.name} did not start within {self.start_timeout}s")

    def _wait_healthy(self, urls: list[str], deadline: float) -> None:
        import httpx

        for url in urls:
            while True:
                try:
                    _get_json(f"{url}/health", 5.0)
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{url}/health did not answer within {self.start_timeout}s") from None
                    time.sleep(0.05)  # poll: the server is starting

    def __enter__(self) -> "HTTPEngines":
        if REPO_ROOT not in sys.path:  # spawned children get the parent's sys.path and cwd
            sys.path.insert(0, REPO_ROOT)
        deadline = time.monotonic() + self.start_timeout
        try:
            models = self.setup.replica_models()
            started = [self._spawn(f"e2e-engine-{r}-{m}", serve_engine, m, self.setup) for r, m in enumerate(models)]
            self.backend_urls = [f"http://127.0.0.1:{self._port(p, q, deadline)}" for p, q in started]
            p, q = self._spawn("e2e-router", serve_router, list(zip(models, self.backend_urls)), self.routing)
            self.url = f"http://127.0.0.1:{self._port(p, q, deadline)}"
            self._wait_healthy([*self.backend_urls, self.url], deadline)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.procs = []

    def stats(self) -> list[dict]:
        """Every backend's ``/stats`` (the engine's counters, plus ``"server"``), replica order."""
        return [_get_json(f"{u}/stats") for u in self.backend_urls]

    def router_stats(self) -> dict:
        """The router's per-model counters (requests sent and in flight per backend, sessions)."""
        return _get_json(f"{self.url}/stats")


def _get_json(url: str, timeout: float = 30.0) -> Any:
    """GET ``url`` (loopback: no proxy from the environment) and decode its JSON; raises on errors."""
    import httpx

    return httpx.get(url, timeout=timeout, trust_env=False).raise_for_status().json()
