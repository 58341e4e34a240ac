"""Chat, sampling options, structured outputs and tool calling, against a real vLLM engine (CPU
build, the built-in tiny dummy-weight model with its shipped tokenizer: ``coder`` as configured
by default, the engine in a process of its own), plus the byte-tokenizer engine's refusals, the
emulated engine's chat, the caller-side checks and the vLLM pieces ``vllm_compat`` wraps."""

from __future__ import annotations

import json
import os

import dask
import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from dask_agents.model_settings import builtin_model_path
from tests.conftest import wait_for

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "enum": ["a.py", "b.py"]}},
                       "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite",
        "parameters": {"type": "object", "properties": {"verbose": {"type": "boolean"}},
                       "required": ["verbose"], "additionalProperties": False}}},
]
# (longer than one of the tiny model's 128-token KV blocks: a next turn can hit the prefix cache)
MESSAGES = [{"role": "system", "content": "You fix bugs in small Python repositories. " * 6},
            {"role": "user", "content": "The parser drops the last line. Find the bug."}]


def _hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(builtin_model_path("tiny-llama"))


@pytest.fixture(scope="module")
def client():
    byte = {**dask.config.get("agents.llm.models.coder"), "tokenizer": "byte", "process": False}
    with dask.config.set({"agents.llm.models.bytes": byte, "agents.control.policies.reallocate.enabled": False}):
        with LocalCluster(n_workers=1, threads_per_worker=4, processes=False, dashboard_address=":0") as cluster:
            with Client(cluster) as c:
                da.install(c, models=["coder"])
                yield c


@da.tool(kind="file_io")
def read_file(path: str) -> str:
    return {"a.py": "def parse(text):\n    return text.splitlines()[:-1]\n", "b.py": "x = 1\n"}[path]


@da.tool(kind="code_exec")
def run_tests(verbose: bool) -> str:
    return "1 failed, 3 passed" + (" (test_parse_last_line)" if verbose else "")


# -- chat on the real engine --------------------------------------------------------------------

def test_chat_renders_the_models_template_and_the_next_turn_hits_the_prefix_cache(client):
    coder = da.llm("coder")
    expected = _hf_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
    with da.session(client):
        first = coder.chat(MESSAGES, max_tokens=8).value(300)
        assert first.prompt_tokens == len(expected)  # the template's tokens, special tokens included
        assert first.message is not None and first.message.role == "assistant"
        assert first.message.content == first.text and first.message.tool_calls == []
        assert first.output_tokens == 8  # dummy weights: EOS is ignored by default (ignore-eos unset)
        turn2 = MESSAGES + [first.message, {"role": "user", "content": "Now write the test."}]
        second = coder.chat(turn2, max_tokens=4).value(120)
    assert second.prompt_tokens > first.prompt_tokens
    assert second.cached_tokens > 0  # the conversation's prefix stayed cached between turns


def test_stop_strings_and_stop_token_ids_end_the_output_there(client):
    coder = da.llm("coder")
    prompt = "def parse(text):\n    return"
    letters = "[a-h]{24}"  # (dummy weights mostly sample special tokens: a regex makes the text letters)
    with da.session(client):
        full = coder.generate(prompt, max_tokens=32, regex=letters).value(300)  # greedy: the same again
        ids = full.token_ids
        cut = coder.generate(prompt, max_tokens=32, regex=letters, stop_token_ids=[ids[5]]).value(120)
        stop = full.text[6]
        stopped = coder.generate(prompt, max_tokens=32, regex=letters, stop=[stop]).value(120)
    assert len(full.text) == 24 and full.finish_reason == "stop" and full.stop_reason is None
    assert cut.finish_reason == "stop" and cut.stop_reason == ids[5]
    assert cut.token_ids == ids[: ids.index(ids[5]) + 1]
    # the output ends before the stop string's first occurrence, which is not in the text
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == full.text[: full.text.index(stop)]


def test_n_completions_and_logprobs(client):
    coder = da.llm("coder")
    with da.session(client):
        r = coder.generate("Write a haiku about parsers.", max_tokens=6, n=3, temperature=1.0, seed=7,
                           logprobs=2).value(300)
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in r.choices) and r.output_tokens == 18
    assert len({tuple(c.token_ids) for c in r.choices}) > 1  # sampled: the completions differ
    assert r.text == r.choices[0].text and r.token_ids == r.choices[0].token_ids
    for c in r.choices:  # per output token: the sampled token and the top 2, log probabilities <= 0
        assert len(c.logprobs) == 6
        for tok, step in zip(c.token_ids, c.logprobs):
            assert tok in step and 2 <= len(step) <= 3 and all(v <= 0 for v in step.values())


def test_structured_outputs_constrain_the_text(client):
    coder = da.llm("coder")
    schema = {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["fix", "wontfix"]},
                                               "severity": {"type": "integer", "enum": [1, 2, 3]}},
              "required": ["verdict", "severity"], "additionalProperties": False}
    with da.session(client):
        by_regex = coder.generate("Answer yes or no:", max_tokens=16, regex="(yes|no)").value(300)
        by_choice = coder.chat(MESSAGES, max_tokens=16, choice=["alpha", "beta"]).value(120)
        by_schema = coder.generate("Triage:", max_tokens=64, json_schema=schema).value(120)
    assert by_regex.text in ("yes", "no") and by_regex.finish_reason == "stop"
    assert by_choice.text in ("alpha", "beta")
    value = json.loads(by_schema.text)
    assert value["verdict"] in ("fix", "wontfix") and value["severity"] in (1, 2, 3) and set(value) == set(schema["properties"])


def test_tool_choice_required_and_named_give_tool_calls_an_agent_loop_dispatches(client):
    coder = da.llm("coder")
    tools = {"read_file": da.stub(read_file), "run_tests": da.stub(run_tests)}
    with da.session(client):
        r = coder.chat(MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=96).value(300)
        assert r.finish_reason == "stop" and r.message.content is None and r.message.tool_calls
        messages = MESSAGES + [r.message]
        for call in r.message.tool_calls:  # dispatch each call to its @da.tool, answer with its result
            assert call.name in tools and call.id
            out = tools[call.name](**call.arguments).value(60)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
        named = coder.chat(messages, tools=TOOLS, tool_choice="read_file", max_tokens=32).value(120)
    (call,) = named.message.tool_calls
    assert call.name == "read_file" and call.arguments["path"] in ("a.py", "b.py")
    assert named.cached_tokens > 0  # the loop's growing transcript reuses its prefix
    assert named.prompt_tokens > r.prompt_tokens


def test_tool_choice_auto_parses_with_the_models_tool_parser_in_the_engines_process(client):
    text = 'Reading it. <tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'

    def parse(dask_worker):
        host = dask_worker.plugins["dask-agents"].engines._hosts["coder"]
        return type(host).__name__, host.extract_tool_calls(text, TOOLS), host.extract_tool_calls("no call", TOOLS)

    (kind, (content, calls), (plain, none)) = client.run(parse).popitem()[1]
    assert kind == "ProcessEngineHost"  # vLLM's hermes parser ran in the engine's process
    assert content == "Reading it. " and [(c["name"], c["arguments"]) for c in calls] == [("read_file", {"path": "a.py"})]
    assert plain == "no call" and none == []
    with da.session(client):  # auto on the dummy model: whatever it wrote, a well-formed turn
        r = da.llm("coder").chat(MESSAGES, tools=TOOLS, max_tokens=8).value(300)
    assert r.message.tool_calls == [] and r.message.content == r.text


def test_a_byte_tokenizer_engine_refuses_text_constraints_naming_the_call(client):
    byte = da.llm("bytes")
    with da.session(client) as s:
        assert byte.generate("hi", max_tokens=2).value(300).output_tokens == 2
        for kwargs in ({"stop": ["\n"]}, {"regex": "a+"}):
            fut = byte.generate("hi", max_tokens=2, **kwargs)
            with pytest.raises(da.InvalidRequestError, match="tokenizer: byte") as info:
                fut.value(120)
            assert fut.key in str(info.value) and s.id in str(info.value) and "llm.bytes.generate" in str(info.value)
        # a chat renders with the built-in template in Python: same tokens as the model's template
        r = byte.chat(MESSAGES, max_tokens=2).value(120)
    text = _hf_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert r.prompt_tokens == len(text.encode("utf-8"))


# -- the caller's checks (nothing is submitted) ----------------------------------------------------

@pytest.mark.parametrize("kwargs, kind, match", [
    ({"stop": ""}, da.InvalidRequestError, "stop strings must not be empty"),
    ({"stop": 3}, TypeError, "stop must be a string"),
    ({"top_p": 0}, da.InvalidRequestError, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, da.InvalidRequestError, "top_k must be >= 0"),
    ({"n": 0}, da.InvalidRequestError, r"n must be in \[1, 128\]"),
    ({"n": 2.0}, TypeError, "n must be an int"),
    ({"logprobs": 21}, da.InvalidRequestError, r"logprobs must be in \[0, 20\]"),
    ({"presence_penalty": 3}, da.InvalidRequestError, "presence_penalty"),
    ({"ignore_eos": "yes"}, TypeError, "ignore_eos must be a bool"),
    ({"regex": "(", }, da.InvalidRequestError, "regex does not compile"),
    ({"json_schema": "{nope"}, da.InvalidRequestError, "json_schema is not valid JSON"),
    ({"json_schema": {"type": "object"}, "regex": "a"}, da.InvalidRequestError, "at most one of"),
    ({"choice": []}, da.InvalidRequestError, "choice must be a non-empty list"),
])
def test_bad_options_are_refused_before_anything_is_sent(kwargs, kind, match):
    with pytest.raises(kind, match=match) as info:
        da.llm("coder").generate("hi", **kwargs)
    assert "da.llm('coder').generate" in str(info.value)


@pytest.mark.parametrize("messages, tools, tool_choice, kind, match", [
    ("hello", None, None, TypeError, "messages must be a list"),
    ([], None, None, da.InvalidRequestError, "must not be empty"),
    ([{"role": "robot", "content": "x"}], None, None, da.InvalidRequestError, "role must be one of"),
    ([{"role": "user"}], None, None, da.InvalidRequestError, "content is required"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], None, None, da.InvalidRequestError, "text models"),
    ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}], None, None,
     da.InvalidRequestError, "only assistant messages have tool_calls"),
    (MESSAGES, None, "required", da.InvalidRequestError, "tool_choice needs tools"),
    (MESSAGES, [{"type": "retrieval"}], None, da.InvalidRequestError, "only function tools"),
    (MESSAGES, TOOLS + TOOLS[:1], None, da.InvalidRequestError, "unique"),
    (MESSAGES, TOOLS, "delete_repo", da.InvalidRequestError, "names no tool given"),
])
def test_bad_conversations_are_refused_before_anything_is_sent(messages, tools, tool_choice, kind, match):
    with pytest.raises(kind, match=match):
        da.llm("coder").chat(messages, tools=tools, tool_choice=tool_choice)


def test_chat_messages_given_to_generate_say_to_use_chat():
    with pytest.raises(TypeError, match=r"use da.llm\('coder'\).chat\(messages\)"):
        da.llm("coder").generate(MESSAGES)


def test_a_required_tool_choice_takes_no_other_constraint():
    with pytest.raises(da.InvalidRequestError, match="constrains the output itself"):
        da.llm("coder").chat(MESSAGES, tools=TOOLS, tool_choice="required", regex="a")


def test_messages_and_tools_are_normalised_to_openais_shape():
    from dask_agents.models import ChatMessage, ToolCall
    from dask_agents.sampling import check_messages, check_tools

    turn = ChatMessage(content=None, tool_calls=[ToolCall(id="c1", name="read_file", arguments={"path": "a.py"})])
    msgs = check_messages("m", None, [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}, turn])
    assert msgs[0] == {"role": "user", "content": "ab"}
    assert msgs[1]["tool_calls"] == [{"id": "c1", "type": "function",
                                      "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]
    tools, choice = check_tools("m", None, [{"name": "f", "parameters": {"type": "object"}}],
                                {"type": "function", "function": {"name": "f"}})
    assert tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert choice == "f"


# -- the pieces without an engine ---------------------------------------------------------------------

def test_the_built_in_chat_template_and_its_python_rendering_agree():
    from dask_agents.sampling import check_messages
    from dask_agents.worker_plugin.tokenizer import ByteTokenizer, ModelTokenizer

    tok = ModelTokenizer.load(builtin_model_path("tiny-llama"))
    msgs = check_messages("m", None, MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "def parse(): ..."}])
    for tools in (None, TOOLS):
        assert ByteTokenizer().render_chat(msgs, tools) == tok.render_chat(msgs, tools)
    # plain text has the byte tokenizer's ids under the model's tokenizer
    text = "naïve parser: ok\n\tdone"
    assert tok.encode(text) == ByteTokenizer().encode(text) and tok.decode(tok.encode(text)) == text


def test_json_fallback_and_constrained_outputs_parse_as_tool_calls():
    from dask_agents.worker_plugin.sampling import json_fallback, tool_calls_from_constraint

    content, calls = json_fallback('{"name": "f", "arguments": {"x": 1}}', {"f"})
    assert content is None and [(c["name"], c["arguments"]) for c in calls] == [("f", {"x": 1})]
    content, calls = json_fallback('[{"name": "f", "parameters": {}}, {"name": "g", "arguments": "{\\"y\\": 2}"}]',
                                   {"f", "g"})
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", {}), ("g", {"y": 2})]
    for text in ('{"name": "h", "arguments": {}}', "plain", '{"name": "f", "arguments": 3}', "{broken"):
        assert json_fallback(text, {"f"}) == (text, [])
    assert [c["name"] for c in tool_calls_from_constraint('[{"name": "f", "parameters": {}}]',
                                                          {"choice": "required"})] == ["f"]
    assert tool_calls_from_constraint('{"x": 1}', {"choice": "f"})[0]["arguments"] == {"x": 1}
    assert tool_calls_from_constraint('[{"name": "f", "para', {"choice": "required"}) is None  # cut short


def test_vllm_tool_call_schema_and_parser_are_where_vllm_compat_expects_them():
    from dask_agents.kv.runtime import vllm_compat

    schema = vllm_compat.tool_call_schema(TOOLS, "required")
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]]
    assert names == [["read_file"], ["run_tests"]]
    assert vllm_compat.tool_call_schema(TOOLS, "read_file") == TOOLS[0]["function"]["parameters"]
    content, calls = vllm_compat.extract_tool_calls(
        "hermes", _hf_tokenizer(), '<tool_call>{"name": "run_tests", "arguments": {"verbose": true}}</tool_call>',
        TOOLS)
    assert content is None and calls == [{"name": "run_tests", "arguments": {"verbose": True}}]
    with pytest.raises(KeyError):
        vllm_compat.extract_tool_calls("no-such-parser", _hf_tokenizer(), "x", TOOLS)


def test_the_shipped_tokenizer_is_what_the_generator_writes(tmp_path):
    """``scripts/make_tiny_tokenizer.py`` is the source of the shipped files: rebuilding gives them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_tokenizer", os.path.join(
        os.path.dirname(__file__), "..", "scripts", "make_tiny_tokenizer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.build().save(str(tmp_path / "tokenizer.json"))
    shipped = json.load(open(os.path.join(builtin_model_path("tiny-llama"), "tokenizer.json")))
    assert json.load(open(tmp_path / "tokenizer.json")) == shipped
    config = json.load(open(os.path.join(builtin_model_path("tiny-llama"), "tokenizer_config.json")))
    assert config["chat_template"] == mod.CHAT_TEMPLATE


def test_the_emulated_engine_chats_and_refuses_n():
    import uuid

    from dask_agents.model_settings import ModelSettings
    from dask_agents.worker_plugin.emulated import EmulatedEngineHost

    host = EmulatedEngineHost("emu", ModelSettings(model="emulated-llama", engine="emulated",
                                                   emulation={"time_scale": 0.001}))
    host.start()
    try:
        with pytest.raises(ValueError, match="one completion per call"):
            host.sampling_params(4, 0.0, None, (), {"n": 2})
        params = host.sampling_params(4, 0.0, None, (), {"stop": ["x"], "top_p": 0.5})
        ids = host.tokenizer.encode(host.tokenizer.render_chat(MESSAGES, None))
        out = host.submit(uuid.uuid4().hex, ids, params, None).result(30)
        assert len(out.outputs[0].token_ids) == 4
        assert host.extract_tool_calls('{"name": "read_file", "arguments": {"path": "a.py"}}', TOOLS)[1][0]["name"] \
            == "read_file"
    finally:
        host.close()


# -- LangChain / LangGraph on dask-agents -------------------------------------------------------------

def test_langchain_chat_model_calls_are_dask_agents_calls_in_the_session(client):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from dask_agents.langchain import ChatDaskAgents

    llm = ChatDaskAgents(model="coder", max_tokens=6)
    with da.session(client) as s:
        reply = llm.invoke([SystemMessage(MESSAGES[0]["content"]), HumanMessage(MESSAGES[1]["content"])])
        bound = llm.bind_tools(TOOLS, tool_choice="any")  # LangChain's "any": at least one call
        called = bound.invoke([SystemMessage(MESSAGES[0]["content"]), HumanMessage(MESSAGES[1]["content"])],
                              max_tokens=96)
    assert isinstance(reply, AIMessage) and reply.usage_metadata["output_tokens"] == 6
    assert called.tool_calls and all(c["name"] in ("read_file", "run_tests") for c in called.tool_calls)
    graph = da.session_graph(client, s.id)
    assert [n.component for n in graph.nodes] == ["llm.coder", "llm.coder"]


def test_the_langgraph_example_runs_its_react_loop_on_the_cluster(client):
    from langchain_core.messages import AIMessage, ToolMessage

    from examples.langgraph import react

    out = react.run(client)
    kinds = [type(m).__name__ for m in out["state"]["messages"]]
    # system, user, the model's tool calls, one answer per call, the model's final turn
    assert kinds[:3] == ["SystemMessage", "HumanMessage", "AIMessage"] and kinds[-1] == "AIMessage"
    calls = out["state"]["messages"][2].tool_calls
    answers = [m for m in out["state"]["messages"] if isinstance(m, ToolMessage)]
    assert calls and len(answers) == len(calls)
    assert isinstance(out["state"]["messages"][-1], AIMessage) and not out["state"]["messages"][-1].tool_calls
    graph = da.session_graph(client, out["session"])
    comps = sorted(n.component for n in graph.nodes)
    assert comps.count("llm.coder") == 2 and len(comps) == 2 + len(calls)  # two turns, one call per tool use


# -- streaming ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["coder", "bytes"])  # the engine in its own process / in the worker
def test_a_streamed_call_sends_its_output_as_it_is_generated(client, model):
    with dask.config.set({"agents.llm.stream-interval": 0}):  # every engine step: several deltas
        with da.session(client):
            fut = da.llm(model).generate("def parse(text):", max_tokens=24, stream=True)
            deltas = list(fut.stream(timeout=300))
            result = fut.value(10)
    assert len(deltas) > 1 and not any(d.restarted for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert "".join(d.text for d in deltas) == result.text


def test_a_streamed_chat_iterates_asynchronously_and_the_telemetry_has_its_ttft(client):
    import asyncio

    async def collect(fut):
        return [d async for d in fut.astream()]

    with da.session(client) as s:
        fut = da.llm("coder").chat(MESSAGES, max_tokens=12, stream=True)
        deltas = asyncio.run(collect(fut))
        result = fut.value(10)
    assert "".join(d.text for d in deltas) == result.message.content == result.text
    df = wait_for(lambda: (d := da.telemetry(client, s.id))["ttft_s"].notna().all() and (d,))[0]
    assert (df["ttft_s"] > 0).all() and (df["ttft_s"] <= df["service_s"]).all()


def test_streaming_errors_are_the_calls_own(client):
    with da.session(client) as s:
        plain = da.llm("coder").generate("hi", max_tokens=2)
        with pytest.raises(da.InvalidRequestError, match="not made with stream=True"):
            next(plain.stream())
        too_long = da.llm("coder").generate("x" * 5000, max_tokens=4, stream=True)
        with pytest.raises(da.PromptTooLongError, match=s.id):
            list(too_long.stream(timeout=120))
    # nothing of the streams is left on the worker (the failed one sent no end: its sink went too)
    left = client.run(lambda dask_worker: (len(dask_worker.plugins["dask-agents"].engines._sinks),
                                           sum(len(h.stream_sinks) for h in
                                               dask_worker.plugins["dask-agents"].engines._hosts.values())))
    assert list(left.values()) == [(0, 0)]
    with pytest.raises(TypeError, match="stream must be a bool"):
        da.llm("coder").generate("hi", stream="yes")


def test_a_streamed_futures_finalizer_run_while_the_streams_lock_is_held_does_not_wedge(monkeypatch):
    """The garbage collector runs finalizers at any allocation, in whatever thread makes it: a
    dropped streaming future's (``drop``) may run inside ``queue_for``, which allocates while it
    holds the streams' lock (a plain lock wedged that thread for good, a client's loop included)."""
    import threading

    from dask_agents import streaming

    streams = streaming._Streams()
    streams.queue_for("dropped")
    real = streaming.queue.SimpleQueue

    def allocating() -> object:  # the allocation at which a collection pass ran the finalizer
        streams.drop("dropped")
        return real()

    monkeypatch.setattr(streaming.queue, "SimpleQueue", allocating)
    t = threading.Thread(target=streams.queue_for, args=("new",), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive() and set(streams.queues) == {"new"}


# -- the OpenAI-compatible endpoint, with the openai package as the client ---------------------------

@pytest.fixture(scope="module")
def openai_client(client):
    import openai

    from dask_agents.openai_server import start

    server, port = start(client)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=300)
    server.should_exit = True


def test_the_openai_sdk_lists_models_and_completes(openai_client):
    assert "coder" in [m.id for m in openai_client.models.list().data]
    r = openai_client.chat.completions.create(model="coder", messages=MESSAGES, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    c = openai_client.completions.create(model="coder", prompt="def parse(text):", max_tokens=4)
    assert c.object == "text_completion" and c.usage.completion_tokens == 4


def test_the_openai_sdk_calls_tools_streams_and_keeps_a_session(openai_client, client):
    r = openai_client.chat.completions.create(model="coder", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              max_tokens=96, temperature=0)  # (OpenAI's default is 1)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    assert all(c.function.name in ("read_file", "run_tests") and isinstance(json.loads(c.function.arguments), dict)
               for c in calls)
    chunks = list(openai_client.chat.completions.create(model="coder", messages=MESSAGES, max_tokens=12, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason == "length" and isinstance(text, str)
    # one session across requests: the second reuses the first's prefix on the same engine
    head = {"X-Dask-Agents-Session": "agent-7"}
    first = openai_client.chat.completions.create(model="coder", messages=MESSAGES, max_tokens=4, extra_headers=head)
    again = openai_client.chat.completions.create(
        model="coder", messages=MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                                            {"role": "user", "content": "And the test?"}],
        max_tokens=4, extra_headers=head)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert first.id.split("-", 1)[1] != again.id.split("-", 1)[1]


def test_the_openai_sdk_gets_openai_errors(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError, match="gpt-huge"):
        openai_client.chat.completions.create(model="gpt-huge", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        openai_client.chat.completions.create(model="coder", messages=MESSAGES, top_p=0)
    with pytest.raises(openai.BadRequestError, match="logprobs are not served"):
        openai_client.chat.completions.create(model="coder", messages=MESSAGES, logprobs=True, top_logprobs=2)
