"""The README's code runs as written: the Quickstart is copied out of README.md and run as a
program (a real LocalCluster, real vLLM CPU engines), so the test fails when the block stops
running or stops printing what the README says it prints."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

README = Path(__file__).resolve().parent.parent / "README.md"


def code_blocks(section: str, lang: str = "python") -> list[str]:
    """The ``lang`` fenced blocks of the README section headed ``section`` (to the next heading
    of the same or a higher level)."""
    text = README.read_text(encoding="utf-8")
    m = re.search(rf"^(#+) {re.escape(section)}\s*$", text, re.M)
    assert m, f"README has no section {section!r}"
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{len(m[1])}}} ", rest, re.M)
    body = rest[:end.start()] if end else rest
    return re.findall(rf"^```{lang}\n(.*?)^```", body, re.M | re.S)


def test_the_readme_blocks_are_found():
    (quickstart,) = code_blocks("Quickstart")
    assert "da.install(client" in quickstart and 'if __name__ == "__main__":' in quickstart


def test_the_quickstart_runs_as_written(tmp_path: Path):
    (quickstart,) = code_blocks("Quickstart")
    (tmp_path / "quickstart.py").write_text(quickstart)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=540)
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout
    # the patches: one answer per subtask, printed as a list of three strings
    lists = [ast.literal_eval(line) for line in out.splitlines() if line[:2] in ("['", '["') and line.endswith("]")]
    assert [len(x) for x in lists] == [3] and all(isinstance(t, str) for t in lists[0]), out[-2000:]
    # the call graph's short repr, as the comment beside print(graph) shows it
    assert re.search(r"<SessionGraph 'session-[^']+' completed: 10 calls \(finished 10\), \d+ edges>", out), out[-2000:]
    assert (tmp_path / "session.html").stat().st_size > 0
    assert re.search(r"^\[10 rows x \d+ columns\]$", out, re.M), out[-2000:]  # telemetry: one row per call
    # closed cleanly: no lost-task or leaked-resource warnings from the cluster's shutdown
    for noise in ("lose already computed task", "leaked semaphore", "Traceback"):
        assert noise not in run.stderr, run.stderr[-4000:]
    # at the default log level: dask-agents' one line per engine load, and at most 5 lines from
    # the libraries (vLLM and torch printed 24 on the CPU build before they were quieted)
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    loads = [x for x in lines if re.search(r" - dask_agents - INFO - engine coder loaded: ", x)]
    assert len(loads) == 2, run.stderr[-4000:]
    assert len(lines) - len(loads) <= 5, run.stderr[-4000:]


def run_block(tmp_path: Path, section: str) -> str:
    """Run the README section's one python block as a program (as the Quickstart is run); its stdout."""
    (block,) = code_blocks(section)
    (tmp_path / "block.py").write_text(block)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=540)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def test_the_chat_block_runs_as_written(tmp_path: Path):
    lines = run_block(tmp_path, "Chat, tools and sampling").strip().splitlines()
    # the required tool call was dispatched, the next turn reused the conversation's prefix
    assert lines[-2] == "['read_file'] assistant True", lines
    assert lines[-1] == "True", lines


def test_the_langchain_block_runs_as_written(tmp_path: Path):
    out = run_block(tmp_path, "LangChain and LangGraph")
    assert out.strip().splitlines()[-2:] == ["AIMessage 16", "['llm.coder']"], out[-2000:]


def test_the_streaming_block_runs_as_written(tmp_path: Path):
    out = run_block(tmp_path, "Streaming")
    assert out.strip().splitlines()[-1] == "True True", out[-2000:]


def test_the_openai_endpoint_block_runs_as_written(tmp_path: Path):
    out = run_block(tmp_path, "The OpenAI-compatible endpoint")
    assert out.strip().splitlines()[-1] == "chat.completion 8", out[-2000:]
