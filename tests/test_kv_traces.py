"""The three trace families and their loaders' validation (file and line of a bad record)."""

from __future__ import annotations

import json
import math
import statistics

from pathlib import Path

import pandas as pd
import pytest

import dask_agents.data
from dask_agents.client_api import COLUMNS
from dask_agents.kv.offline import traces
from dask_agents.kv.offline.traces import GenParams, Step, Trace, generate, load, load_mooncake, load_steps, load_telemetry, save

# -- (a) generated -------------------------------------------------------------------------------

def test_generated_sessions_follow_the_published_shape():
    t = generate(GenParams(sessions=300, seed=3))
    sessions = t.sessions()
    turns = [sum(1 for s in steps if s.node == "answer") for steps in sessions.values()]
    calls = [len(steps) for steps in sessions.values()]
    assert statistics.mean(turns) == pytest.approx(3.95, rel=0.15)
    assert statistics.mean(calls) / statistics.mean(turns) == pytest.approx(7.83, rel=0.1)
    hinted = [s for s in t.steps if s.tool]
    assert {s.tool for s in hinted} <= set(traces.PRIORS) and all(s.node != "answer" for s in hinted)
    s = t.summary()
    assert 0.80 < s["unlimited_cache_hit_rate"] < 0.89  # 86% cached on the dataset card
    assert s["peak_running_blocks"] <= s["peak_footprint_blocks"]
    assert generate(GenParams(sessions=5, seed=1)) == generate(GenParams(sessions=5, seed=1))
    assert all(s.tool is None for s in generate(GenParams(sessions=3, hints=False)).steps)


def test_generated_prompts_extend_each_other_until_compaction():
    t = generate(GenParams(sessions=20, seed=0, max_context=16384))
    system = 8192 // 512
    for steps in t.sessions().values():
        assert len({s.blocks[:system] for s in steps}) == 1  # the shared system prompt
        for a, b in zip(steps, steps[1:]):
            extends = b.blocks[:len(a.blocks)] == a.blocks
            compacted = len(b.blocks) <= (8192 + 4096) // 512 and b.blocks[:system] == a.blocks[:system]
            assert extends or compacted


def test_bad_generator_parameters():
    with pytest.raises(ValueError, match="cached_share"):
        GenParams(cached_share=1.0)
    with pytest.raises(ValueError, match="unknown tool kind 'shell'"):
        GenParams(kind_mix=(("shell", 1.0),))


# -- our file format -----------------------------------------------------------------------------

def test_save_and_load_round_trip(tmp_path):
    t = generate(GenParams(sessions=4, seed=2))
    path = save(t, tmp_path / "t.jsonl")
    back = load(path)
    assert back.steps == t.steps and back.block_size == t.block_size and back.family == "generated"


@pytest.mark.parametrize("line, body, what", [
    (2, '{"session": "a", "at": 0, "blocks": [1, "x"]}', "blocks must be a list of non-negative integers"),
    # (the simulator failed with a KeyError on such a prompt: a repeated block was pinned twice, unpinned once)
    (2, '{"session": "a", "at": 0, "blocks": [5, 6, 5]}', "blocks holds block 5 twice"),
    (2, '{"session": "a", "at": -1, "blocks": []}', "at must be a finite number >= 0"),
    (2, '{"at": 0, "blocks": []}', "missing field\\(s\\) session"),
    (2, '{"session": "a", "at": 0, "blocks": [], "tail_tokens": 9}', "tail_tokens 9 must be below the block size 4"),
    (2, '{"session": "a", "at": 0, "blocks": [],', "not valid JSON"),
    (2, '[1, 2]', "expected a JSON object"),
])
def test_malformed_steps_name_file_and_line(tmp_path, line, body, what):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"format": "dask-agents-kv-trace", "version": 1, "block_size": 4}\n' + body + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl: line {line}: {what}"):
        load_steps(p)


def test_inconsistent_sessions_are_rejected(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"format": "dask-agents-kv-trace", "block_size": 4}\n'
                 '{"session": "a", "at": 0, "blocks": [1], "duration": 5}\n'
                 '{"session": "a", "at": 1, "blocks": [1]}\n')
    with pytest.raises(ValueError, match="t.jsonl: .*arrives at 1.0 before its previous step ends at 5.0"):
        load_steps(p)
    with pytest.raises(ValueError, match="after the session's last step"):
        Trace("x", "file", 4, (Step("a", 0, (), last=True), Step("a", 1, ())))


# -- (c) Mooncake ----------------------------------------------------------------------------------

def mooncake_rows():
    return [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 2000, "input_length": 1600, "output_length": 20, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 9000, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
    ]


def write_mooncake(path, rows):
    path.mkdir(parents=True, exist_ok=True)
    f = path / traces.MOONCAKE_FILE
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_mooncake_sessions_are_prefix_trees(tmp_path):
    write_mooncake(tmp_path / traces.MOONCAKE_SUBDIR, mooncake_rows())
    t = load_mooncake(tmp_path, decode_s_per_token=0.01)  # a directory holding mooncake-synthetic
    s = t.sessions()
    assert sorted(s) == ["m0", "m7"]
    a = s["m0"]
    assert [x.at for x in a] == [0.0, 2.0, 9.0] and [x.last for x in a] == [False, False, True]
    assert a[0].blocks == (0, 1) and a[0].tail_tokens == 1100 - 1024  # the partial block is not cached
    assert a[1].blocks == (0, 1, 2) and a[2].blocks == (0, 1) and a[2].tail_tokens == 0
    assert [x.node for x in a] == ["llm#0", "llm#1", "llm#2"] and a[0].duration == pytest.approx(0.1)
    assert s["m7"][0].last and s["m7"][0].tool is None
    assert load_mooncake(tmp_path, limit=2).sessions().keys() == {"m0", "m7"}


def test_mooncake_sessions_below_a_shared_system_prompt(tmp_path):
    """Every request begins with one system-prompt block (id 99): grouped by first block they
    would be one session; rooted below the high-fan-out prefix they are one per conversation."""
    rows = []
    for c in range(4):  # 4 conversations of 2 turns, each under the system prompt
        base = 1000 * (c + 1)
        rows.append({"timestamp": 10 * c, "input_length": 1024, "output_length": 1, "hash_ids": [99, base]})
        rows.append({"timestamp": 10 * c + 5, "input_length": 1536, "output_length": 1,
                     "hash_ids": [99, base, base + 1]})
    f = write_mooncake(tmp_path / traces.MOONCAKE_SUBDIR, rows)
    s = load_mooncake(f, root_fanout=4).sessions()
    assert sorted(s) == ["m1000", "m2000", "m3000", "m4000"]
    assert all(len(v) == 2 and v[0].blocks == (99, k) for k, v in zip((1000, 2000, 3000, 4000), map(s.get, sorted(s))))
    assert list(load_mooncake(f, root_fanout=5).sessions()) == ["m99"]  # below the threshold: one tree
    with pytest.raises(ValueError, match="root_fanout must be an integer >= 2"):
        load_mooncake(f, root_fanout=1)


def test_replay_limit_counts_requests_of_a_mooncake_file(tmp_path):
    """``--limit`` on a Mooncake file (as on ``mooncake``) keeps its first N requests, not sessions."""
    from dask_agents.kv.offline.replay import load_trace

    f = write_mooncake(tmp_path / traces.MOONCAKE_SUBDIR, mooncake_rows())
    assert len(load_trace(str(f), limit=3)) == 3 and len(load_trace(str(tmp_path), limit=1)) == 1
    assert len(load_trace(str(f))) == 4


@pytest.mark.parametrize("row, what", [
    ({"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1]},
     "hash_ids has 2 ids but input_length 1100 needs 3 blocks of 512 tokens"),
    ({"timestamp": "1", "input_length": 10, "output_length": 1, "hash_ids": [0]}, "timestamp must be an integer >= 0"),
    ({"timestamp": 1, "input_length": 10, "hash_ids": [0]}, "missing field\\(s\\) output_length"),
    ({"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [-3]}, "hash_ids must be a list"),
])
def test_malformed_mooncake_lines(tmp_path, row, what):
    f = write_mooncake(tmp_path, mooncake_rows()[:2] + [row])
    with pytest.raises(ValueError, match=f"synthetic_trace.jsonl: line 3: {what}"):
        load_mooncake(f)


def test_mooncake_is_found_through_the_environment(tmp_path, monkeypatch):
    write_mooncake(tmp_path / traces.MOONCAKE_SUBDIR, mooncake_rows())
    monkeypatch.setenv(traces.ENV, str(tmp_path))
    assert traces.mooncake_path() == tmp_path / traces.MOONCAKE_SUBDIR / traces.MOONCAKE_FILE
    assert len(load_mooncake()) == 4
    monkeypatch.setenv(traces.ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="DASK_AGENTS_TRACES"):
        traces.mooncake_path()


def test_the_real_mooncake_trace():
    path = traces.mooncake_path()  # the copy the package ships, found without ../shared or the env
    assert path.is_relative_to(Path(dask_agents.data.__file__).parent)
    t = load_mooncake(path)
    assert len(t) == 3993 and len(t.sessions()) == 2211 and t.block_size == 512
    assert 0.6 < t.summary()["unlimited_cache_hit_rate"] < 0.7


# -- (b) telemetry ---------------------------------------------------------------------------------

def telemetry_frame():
    """A da.telemetry-shaped frame: two sessions, LLM calls with tool calls between them."""
    rows = []

    def call(session, component, kind, started, finished, prompt=None, cached=None, out=None, creator="driver"):
        r = dict.fromkeys(COLUMNS)
        r.update(key=f"{component}-{len(rows)}", session=session, component=component, kind=kind, creator=creator,
                 state="finished", started=started, finished=finished, prompt_tokens=prompt, cached_tokens=cached,
                 output_tokens=out)
        rows.append(r)

    call("s1", "llm.coder", "llm", 100.0, 101.0, 1500, 1024, 20)
    call("s1", "code_exec_tool", "tool", 101.1, 103.0)
    call("s1", "llm.coder", "llm", 103.2, 104.0, 2100, 1536, 30)
    call("s1", "llm.coder", "llm", 110.0, 111.0, 700, 512, 5)  # shorter: shares only what was cached
    call("s2", "llm.coder", "llm", 100.5, 101.5, 1200, 1024, 10)
    call("s2", "run_linter", "tool", 101.6, 102.0)
    call("s2", "llm.coder", "llm", 102.5, 103.0, 1300, 1024, 10)
    call(None, "llm.coder", "llm", 99.0, 99.5, 100, 0, 1)  # outside any session: ignored
    return pd.DataFrame(rows, columns=COLUMNS)


def test_telemetry_becomes_block_chains():
    t = load_telemetry(telemetry_frame(), block_size=512)
    s = t.sessions()
    a, b = s["s1"], s["s2"]
    assert [x.at for x in a] == pytest.approx([0.0, 3.2, 10.0]) and a[0].duration == pytest.approx(1.0)
    assert a[0].blocks == b[0].blocks[:2]  # both sessions' first 1024 cached tokens: a shared prefix
    assert a[1].blocks[:2] == a[0].blocks and len(a[1].blocks) == 4  # grew: extends its predecessor
    assert a[2].blocks == a[1].blocks[:1]  # shorter: only the cached 512 tokens are shared
    assert a[0].tool == "code_exec" and b[0].tool is None and a[-1].last and b[-1].last
    assert a[0].node == "llm.coder" and a[0].tail_tokens == 1500 - 1024


def test_telemetry_with_parallel_llm_calls_becomes_branches():
    """Quickstart-shaped: a planner call, two developers' calls at once, then the tester's. The
    recording failed ("arrives ... before its previous step ends"); now the overlapping call is a
    branch session that shares the plan's prefix, and the whole frame replays."""
    rows = []

    def call(component, kind, started, finished, prompt=None, cached=None, out=None):
        r = dict.fromkeys(COLUMNS)
        r.update(key=f"{component}-{len(rows)}", session="q", component=component, kind=kind, creator="driver",
                 state="finished", started=started, finished=finished, prompt_tokens=prompt, cached_tokens=cached,
                 output_tokens=out)
        rows.append(r)

    call("llm.coder", "llm", 0.0, 1.0, 1100, 0, 16)  # planner
    call("llm.coder", "llm", 1.2, 2.0, 1700, 1024, 24)  # developer 0
    call("llm.coder", "llm", 1.21, 2.5, 1650, 1024, 24)  # developer 1, concurrently
    call("code_exec_tool", "tool", 2.6, 2.9)
    call("llm.coder", "llm", 3.0, 3.4, 2300, 1536, 8)  # tester, after both
    t = load_telemetry(pd.DataFrame(rows, columns=COLUMNS), block_size=512)
    s = t.sessions()
    assert sorted(s) == ["q", "q#1"]
    main, branch = s["q"], s["q#1"]
    assert [x.at for x in main] == pytest.approx([0.0, 1.2, 3.0]) and [x.at for x in branch] == pytest.approx([1.21])
    assert branch[0].last and main[-1].last and not main[1].last
    assert main[1].blocks[:2] == branch[0].blocks[:2] == main[0].blocks[:2]  # both extend the plan
    assert main[1].blocks[2] != branch[0].blocks[2]  # a sibling's prompt is not a prefix of the other's
    assert main[2].blocks[:3] == branch[0].blocks[:3]  # the tester follows the last developer to finish
    assert main[1].tool == "code_exec" and main[1].duration == pytest.approx(0.8)  # the tool in its pause
    from dask_agents.kv.runtime.blocks import CostModel, Tier, Tiers
    from dask_agents.kv.offline.replay import replay
    from dask_agents.kv.runtime.sizing import KVGeometry

    cost = CostModel(KVGeometry(1, 1, 1, 1, block_size=512), prefill_tokens_per_s=1000.0)
    out = replay(t, ("lru", "ours"), [Tiers(Tier("accelerator", 16 * cost.bytes_per_block))], cost)
    assert {r.policy for r in out} >= {"lru", "ours"} and all(r.ratio >= 1 - 1e-12 for r in out)


def test_telemetry_files_and_their_errors(tmp_path):
    frame = telemetry_frame()
    csv = tmp_path / "tel.csv"
    frame.to_csv(csv, index=False)
    assert load(csv).steps == load_telemetry(frame).steps
    frame.to_json(tmp_path / "tel.json", orient="records")
    assert load(tmp_path / "tel.json").steps == load_telemetry(frame).steps
    bad = frame.copy()
    bad.loc[2, "prompt_tokens"] = -5
    bad.to_csv(csv, index=False)
    with pytest.raises(ValueError, match="tel.csv: line 4: prompt_tokens must be an integer >= 0, got -5"):
        load_telemetry(csv)
    bad = frame.copy()
    bad.loc[0, "finished"] = 50.0
    with pytest.raises(ValueError, match="telemetry: row 0: finished 50.0 is before started 100.0"):
        load_telemetry(bad)
    with pytest.raises(ValueError, match="missing column\\(s\\) prompt_tokens"):
        load_telemetry(frame.drop(columns=["prompt_tokens"]))
    with pytest.raises(ValueError, match="unknown telemetry format '.txt'"):
        (tmp_path / "x.txt").write_text("x")
        load_telemetry(tmp_path / "x.txt")
    assert math.isclose(load_telemetry(frame, time_scale=0.5).steps[0].duration, 2.0)


def test_prefix_closed_says_whether_every_block_keeps_its_parent():
    from tests.kv_helpers import step, trace

    assert generate(GenParams(sessions=3, seed=1)).prefix_closed()
    closed = [step("a", 0, [1, 2, 3]), step("b", 1, [1, 2, 4]), step("a", 2, [1, 2, 3, 5], last=True)]
    assert trace(*closed).prefix_closed()
    # one late prompt where block 2 follows 9 (not 1): the whole trace is not, from its start
    assert not trace(*closed, step("c", 3, [9, 2], last=True)).prefix_closed()
    assert not trace(step("a", 0, [2, 3]), step("b", 1, [1, 2], last=True)).prefix_closed()  # 2 first, then after 1
