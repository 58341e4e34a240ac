"""The built wheel, installed into a fresh virtual environment, as a user gets it.

The source folders stay where the design puts them (``scheduler_plugin/``, ``worker_plugin/``,
``kv/`` beside ``dask_agents/``), but the wheel installs them under one namespace
(setup.cfg's ``package_dir``): ``top_level.txt`` must hold only ``dask_agents``, every source
module and data file must be in the wheel, and the preload must work from the installed wheel
with the repository out of reach.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parent.parent
# source folder -> where its files land in the wheel
FOLDERS = {"dask_agents": "dask_agents", "scheduler_plugin": "dask_agents/scheduler_plugin",
           "worker_plugin": "dask_agents/worker_plugin", "kv": "dask_agents/kv"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the files git tracks (a build writes build/ and *.egg-info beside
    # its sources: not into the checkout); --no-build-isolation: this venv's setuptools builds
    # it (no index needed).
    src = tmp_path_factory.mktemp("src")
    for rel in source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, timeout=300, cwd=out)
    (whl,) = out.glob("dask_agents-*.whl")
    return whl


def source_files() -> list[str]:
    """The checkout's files (tracked, and new ones git does not ignore), relative to it."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         check=True, capture_output=True, timeout=60).stdout.decode().split("\0")
    return [rel for rel in out if rel and (REPO / rel).is_file()]


def test_the_wheel_installs_one_top_level_package_with_every_module_and_data_file(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (top,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top).decode().split() == ["dask_agents"]
        (eps,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = configparser.ConfigParser()
        entry_points.read_string(z.read(eps).decode())
    assert entry_points["dask_cli"]["agents"] == "dask_agents.cli:main"  # `dask agents ...`
    assert entry_points["console_scripts"]["dask-agents"] == "dask_agents.cli:main"
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"dask_agents"}
    missing = []
    for rel in source_files():
        folder, _, inner = rel.partition("/")
        if folder in FOLDERS and inner and f"{FOLDERS[folder]}/{inner}" not in names:
            missing.append(rel)
    assert missing == [], f"source files not in the wheel: {missing}"
    assert any(n.endswith("dask_agents/data/traces/azure-llm-2023/LICENSE") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)


PROGRAM = textwrap.dedent("""
    import importlib.util, json, sys

    import dask_agents as da
    from distributed import Client, LocalCluster

    # the source folders' names are not importable: only dask_agents was installed
    stray = [m for m in ("scheduler_plugin", "worker_plugin", "kv") if importlib.util.find_spec(m)]
    import dask_agents.scheduler_plugin.plugin as sp
    import dask_agents.worker_plugin.plugin as wp
    import dask_agents.kv.runtime.policies as kp
    from dask_agents.kv.offline.traces import mooncake_path

    @da.tool
    def add(a, b):
        return a + b

    if __name__ == "__main__":
        with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0",
                          scheduler_kwargs={"preload": ["dask_agents.preload"]},
                          preload=["dask_agents.preload"]) as cluster, Client(cluster) as client:
            plugins = client.run(lambda dask_worker: sorted(dask_worker.plugins))
            with da.session(client, name="wheel") as s:
                total = da.stub(add)(2, 3).result(timeout=60)
            print(json.dumps({
                "files": [da.__file__, sp.__file__, wp.__file__, kp.__file__, str(mooncake_path())],
                "stray": stray, "installed": da.installed(client), "worker_plugins": list(plugins.values()),
                "total": total, "rows": len(da.telemetry(client, s)),
            }))
""")


def test_the_preload_works_from_the_wheel_in_a_fresh_venv(wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # The dependencies come from this environment's site-packages (appended after the fresh
    # venv's own, so the wheel's dask_agents is found first; this environment's editable
    # install is a .pth there, which Python reads only in site directories, not here).
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300)
    (tmp_path / "prog.py").write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DASK_AGENTS_TRACES")}
    env["DASK_AGENTS__WORKER__MODELS"] = "[]"  # no engine: this checks the install, not vLLM
    run = subprocess.run([str(py), "prog.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(f.startswith(str(site)) for f in out["files"]), out["files"]
    assert out["stray"] == []
    assert out["installed"] is True and all("dask-agents" in p for p in out["worker_plugins"]), out
    assert out["total"] == 5 and out["rows"] == 1
    help_out = subprocess.run([str(py), "-m", "dask_agents", "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
    assert help_out.returncode == 0, help_out.stderr
    for command in ("replay", "report", "stubgen", "whatif"):
        assert command in help_out.stdout
