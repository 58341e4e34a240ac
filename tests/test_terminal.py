"""What a user sees in the terminal: vLLM's and torch's logs at ``agents.llm.log-level``, one
line per engine load, and ``make demo`` printing its table and little else."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from dask_agents.worker_plugin import logs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_log_level_is_checked_and_reaches_vllm(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", vllm_logger.level)
    with pytest.raises(ValueError, match="agents.llm.log-level must be one of"):
        logs.quiet_engines("LOUD")
    assert logs.quiet_engines("error") == "ERROR"
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and vllm_logger.level == logging.ERROR
    import dask

    with dask.config.set({"agents.llm.log-level": "warning"}):
        assert logs.level() == "WARNING"


def test_an_engine_load_prints_one_line(caplog):
    with caplog.at_level(logging.INFO, logger=logs.LOGGER):
        logs.engine_loaded("coder", "builtin:tiny-llama", 64 * 2**20, 1.25, 512, 128)
    (rec,) = [r for r in caplog.records if r.name == logs.LOGGER]
    assert rec.getMessage() == ("engine coder loaded: builtin:tiny-llama, KV 64.00 MiB (512 blocks of 128 tokens), "
                                "in 1.2 s")


def test_make_demo_prints_its_table_and_at_most_25_lines():
    """``make demo``'s command (the SWE workflow, 8 requests, 2 workers with a real vLLM CPU
    engine each): the table, the summary and the /agents address, no library logs."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "examples.swe", "--requests", "8"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (out.stdout + out.stderr).splitlines()
    assert len(lines) <= 25, "\n".join(lines)
    text = "\n".join(lines)
    assert "/agents" in text and "concurrent requests" in text and "issue7" in text
    assert "INFO" not in text.replace("dask_agents - INFO", ""), text  # only our one line per engine load
    assert sum("engine coder loaded" in line for line in lines) == 2
