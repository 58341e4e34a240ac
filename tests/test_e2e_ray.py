"""The Ray peer of the end-to-end benchmark (benchmarks/e2e/variants/ray_peer.py) runs a small
workflow program: values, LLM accounting, session-sticky prefix caching, engine counters."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, NamedTuple

import pytest

pytest.importorskip("ray")

from benchmarks.e2e.program import LLMCall, LLMOut, Setup, ToolCall  # noqa: E402
from benchmarks.e2e.variants.ray_peer import RayPeer  # noqa: E402

SETUP = Setup(engine={"kv_blocks": 256, "max_batch": 8, "decode_s_per_step": 0.002}, replicas=2,
              models=(("coder", 2),), time_scale=1.0, max_model_len=8192, tool_threads=4)
BLOCK = 16  # the emulated engine's block size (tokens)


def coder(ctx, k: int) -> tuple[str, LLMOut, LLMOut]:
    """An agent: a call, a longer call extending its prompt (a prefix-cache hit when it lands on
    the same replica), then a tool call."""
    first = f"session {ctx.session} agent {k}: " + "plan the change " * 12
    a = ctx.llm(LLMCall(ctx.session, "coder", first, 4))
    second = first + f" patch {a.output_tokens} " + "apply the diff " * 4  # > 2 blocks more
    assert len(second) - len(first) > 2 * BLOCK
    b = ctx.llm(LLMCall(ctx.session, "coder", second, 6))
    answer = ctx.tool(ToolCall("file_io", 0.01, answer=f"docs {k}"))
    return answer, a, b


class Outcome(NamedTuple):
    value: list
    overhead_s: float
    llm_calls: int


def program(rt) -> Outcome:
    """A request: two coder agents in parallel."""
    values = rt.gather([rt.agent("coder", coder, k) for k in range(2)])
    return Outcome(values, rt.rec.overhead_s, len(rt.rec.llm))


def run(peer: RayPeer, session: str) -> tuple[Outcome, list[LLMOut]]:
    with peer.session(session) as rt:
        out = program(rt)
        return out, list(rt.rec.llm)


@pytest.fixture(scope="module")
def peer() -> Iterator[RayPeer]:
    with RayPeer(SETUP) as p:  # one ray.init for the module
        yield p


def totals(stats: list[dict]) -> dict[str, int]:
    return {k: sum(s[k] for s in stats) for k in ("queries", "hits", "decode_tokens")}


def test_session_runs_program(peer: RayPeer) -> None:
    before = totals(peer.engine_stats())
    out, llm = run(peer, "s-one")
    after = peer.engine_stats()

    assert [v[0] for v in out.value] == ["docs 0", "docs 1"]
    assert out.llm_calls == len(llm) == 4  # what the program asked: 2 agents x 2 calls
    for _, a, b in out.value:
        assert (a.output_tokens, b.output_tokens) == (4, 6)
        assert b.prompt_tokens > a.prompt_tokens + 2 * BLOCK
        assert b.cached_tokens > 0  # session_sticky: the second call found the first's prefix
    assert out.overhead_s >= 0

    # the engines saw exactly these calls (counters are per token: prompt, cached, generated)
    assert len(after) == SETUP.replicas
    grew = {k: v - before[k] for k, v in totals(after).items()}
    assert grew == {"queries": sum(x.prompt_tokens for x in llm), "hits": sum(x.cached_tokens for x in llm),
                    "decode_tokens": sum(x.output_tokens for x in llm)}


def test_concurrent_sessions(peer: RayPeer) -> None:
    with ThreadPoolExecutor(3) as ex:
        results = list(ex.map(lambda s: run(peer, s), ["c-0", "c-1", "c-2"]))
    for out, llm in results:
        assert [v[0] for v in out.value] == ["docs 0", "docs 1"]
        assert out.llm_calls == len(llm) == 4
        assert all(b.cached_tokens > 0 for _, _, b in out.value)
        assert out.overhead_s >= 0
    assert peer.routers["coder"].sticky == {}  # every session forgot its replica when it ended


def test_describe(peer: RayPeer) -> None:
    d = peer.describe()
    assert d["framework"].startswith("ray ")
    assert d["engines"] == "2 async actors (num_cpus=0), one EMULATED engine each"
    assert d["agents"] == "driver threads calling actors (ray.get)"
    assert d["routing"] == "session_sticky"
    assert d["setup"] == SETUP.describe()
