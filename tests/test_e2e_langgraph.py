"""The LangGraph peer as deployed: EMULATED engines behind OpenAI-compatible HTTP servers, a
session router in front (benchmarks/e2e/variants/http_engine.py), and LangGraph agents calling
them over HTTP (benchmarks/e2e/variants/langgraph_peer.py). No fixed sleeps, no timing checks."""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

pytest.importorskip("langgraph")
httpx = pytest.importorskip("httpx")

from benchmarks.e2e.program import LLMCall, Setup, ToolCall  # noqa: E402
from benchmarks.e2e.variants.http_engine import SESSION_HEADER, HTTPEngines  # noqa: E402

SETUP = Setup(engine={"kv_blocks": 256, "max_batch": 8, "decode_s_per_step": 0.002}, replicas=2,
              models=(("coder", 2),), time_scale=1.0, max_model_len=8192)


@pytest.fixture(scope="module")
def engines() -> Iterator[HTTPEngines]:
    with HTTPEngines(SETUP, "session_sticky") as e:
        yield e


@pytest.fixture
def client(engines: HTTPEngines) -> Iterator[Any]:
    with httpx.Client(base_url=engines.url, timeout=60.0, trust_env=False) as c:
        yield c


def complete(client: Any, session: str, prompt: str, max_tokens: int) -> dict:
    r = client.post("/v1/completions", headers={SESSION_HEADER: session},
                    json={"model": "coder", "prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


def served(engines: HTTPEngines) -> list[int]:
    """Completions each backend has served (its server's counter), replica order."""
    return [s["server"]["requests"] for s in engines.stats()]


def test_completion_over_http(engines: HTTPEngines, client: Any) -> None:
    body = complete(client, "solo", "p" * 100, 7)
    assert body["object"] == "text_completion" and body["model"] == "coder"
    assert body["choices"][0]["index"] == 0 and isinstance(body["choices"][0]["text"], str)
    u = body["usage"]
    assert u["prompt_tokens"] == 100 and u["completion_tokens"] == 7 and u["total_tokens"] == 107
    assert u["prompt_tokens_details"]["cached_tokens"] == 0
    t = body["x_timing"]
    assert t["received"] <= t["finished"]
    assert {m["id"] for m in client.get("/v1/models").json()["data"]} == {"coder"}


def test_bad_requests_get_openai_errors(client: Any) -> None:
    missing = client.post("/v1/completions", json={"model": "coder", "max_tokens": 3})
    assert missing.status_code == 400 and "prompt" in missing.json()["error"]["message"]
    unknown = client.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 3})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    too_long = client.post("/v1/completions", json={"model": "coder", "prompt": "x" * 8190, "max_tokens": 8})
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]


def test_session_sticks_to_its_backend(engines: HTTPEngines, client: Any) -> None:
    before = served(engines)
    first = "sticky session's own prefix " + "s" * 72  # 100 tokens: 6 full blocks of 16
    complete(client, "sticky", first, 4)
    body = complete(client, "sticky", first + " and the next turn", 4)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 16
    delta = [a - b for a, b in zip(served(engines), before)]
    assert sorted(delta) == [0, 2]  # both calls on one backend, none on the other


def test_sessions_spread_over_backends(engines: HTTPEngines, client: Any) -> None:
    before = served(engines)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: complete(client, f"spread-{k}", f"session {k} " + "q" * 40, 8), range(16)))
    delta = [a - b for a, b in zip(served(engines), before)]
    assert sum(delta) == 16 and min(delta) > 0
    table = engines.router_stats()["coder"]
    assert table["in_flight"] == [0, 0] and table["sessions"] >= 16


# -- LangGraph over the servers ----------------------------------------------------------------

def worker(ctx: Any, name: str) -> tuple:
    """An agent: two LLM calls (the second extends the first) around one tool call."""
    prompt = f"{ctx.session}/{name}: " + "w" * 64
    a = ctx.llm(LLMCall(ctx.session, "worker", prompt, 5))
    seen = ctx.tool(ToolCall("file_io", 0.01, answer=f"file of {name}"))
    b = ctx.llm(LLMCall(ctx.session, "worker", prompt + seen, 3))
    return name, a.prompt_tokens, a.output_tokens, seen, b.prompt_tokens, b.output_tokens, b.cached_tokens


def program(rt: Any) -> list:
    """Two agents in parallel."""
    return rt.gather([rt.agent("worker", worker, "one"), rt.agent("worker", worker, "two")])


def engine_hosts() -> int:
    """EMULATED engine hosts alive in this process."""
    from dask_agents.worker_plugin.emulated import EmulatedEngineHost

    return sum(isinstance(o, EmulatedEngineHost) for o in gc.get_objects())


def test_langgraph_peer_runs_agents_over_http() -> None:
    from benchmarks.e2e.variants.langgraph_peer import LangGraphPeer

    hosts_before = engine_hosts()
    with LangGraphPeer(SETUP, threads=8) as peer:
        assert engine_hosts() == hosts_before  # no engine object in the driver process
        assert all(type(v).__name__ != "EmulatedEngineHost" for v in vars(peer).values())
        d = peer.describe()
        assert d["framework"].startswith("langgraph ") and "X-Session-Id, session_sticky" in d["router"]
        assert "2 OpenAI-compatible HTTP servers" in d["engines"] and d["setup"] == SETUP.describe()
        before = [s["server"]["requests"] for s in peer.engine_stats()]
        with peer.session("lg-1") as rt:
            values = program(rt)
        prefix = len("lg-1/one: ") + 64
        assert values == [
            ("one", prefix, 5, "file of one", prefix + len("file of one"), 3, values[0][6]),
            ("two", prefix, 5, "file of two", prefix + len("file of two"), 3, values[1][6]),
        ]
        assert all(v[6] >= 16 for v in values)  # the second call found the first's prefix: sticky
        assert rt.rec.calls == 2 and len(rt.rec.llm) == 4 and rt.rec.overhead_s >= 0
        after = peer.engine_stats()
        delta = [s["server"]["requests"] - b for s, b in zip(after, before)]
        assert sorted(delta) == [0, 4]  # one session, one backend, every call over HTTP
        assert all(s["emulated"] for s in after)
