"""The command line as Dask users reach it: ``dask-agents``, ``dask agents`` (Dask's
``dask_cli`` entry point, as ``dask cuda``) and ``python -m dask_agents``; ``--version``."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest

import dask_agents
from dask_agents.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_version_and_python_m():
    assert _run("-m", "dask_agents", "--version").strip() == f"dask-agents, version {dask_agents.__version__}"
    assert "replay" in _run("-m", "dask_agents", "--help")


def test_dash_h_is_help_for_the_group_and_its_commands():
    from click.testing import CliRunner

    runner = CliRunner()
    for args in (["-h"], ["replay", "-h"], ["stubgen", "-h"]):
        out = runner.invoke(main, args)
        assert out.exit_code == 0 and "Usage:" in out.output, (args, out.output)
    assert "Show this message and exit" in runner.invoke(main, ["-h"]).output


def test_dask_agents_is_a_dask_cli_subcommand():
    eps = [ep for ep in metadata.entry_points(group="dask_cli") if ep.name == "agents"]
    if not eps:
        pytest.fail("the dask_cli entry point 'agents' is not installed (pip install -e . registers it)")
    assert eps[0].load() is main and main.name == "agents"
    text = _run("-m", "dask", "agents", "--help")
    assert set(main.commands) == {"replay", "report", "serve", "stubgen", "whatif"}
    for command in main.commands:  # every command is listed
        assert f"  {command} " in text, command


@pytest.mark.parametrize("module", ["examples.swe", "examples.finance", "examples.router", "examples.hpc.slurm"])
def test_the_examples_help_names_the_command_that_runs_them(module):
    text = _run("-m", module, "--help")
    assert text.startswith(f"usage: python -m {module} "), text[:200]
    assert "__main__.py" not in text
