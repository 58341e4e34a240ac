"""The ``dask-agents`` command line: a :mod:`click` group; each tool is a subcommand.

    dask-agents stubgen agents.py -o stubs/     # write stubs/agents.py (see stubgen.py)
    dask-agents replay mooncake --tiers 4GiB     # KV policies vs the offline optimum (kv/replay.py)
    dask-agents report telemetry.parquet -o report/   # PNG plots (dask_agents/report.py)
"""

from __future__ import annotations

import click

from dask_agents.report import report_command


@click.group()
def main() -> None:
    """dask-agents: workflow-aware serving of agentic applications on Dask."""


@main.command("stubgen")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False),
              help="Directory to write the stub modules into (created if missing).")
@click.option("--package-root", type=click.Path(exists=True, file_okay=False), default=None,
              help="Directory the source import paths are relative to (default: each file's stem).")
def stubgen_command(files: tuple[str, ...], out: str, package_root: str | None) -> None:
    """Write an importable stub module for each component file in FILES.

    The files are parsed, never imported. Each stub keeps the import path, names and call
    syntax of its components; calls submit to Dask and return AgentFutures.
    """
    from dask_agents.stubgen import write_stubs

    try:
        written = write_stubs(list(files), out, package_root)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e
    for path in written:
        click.echo(f"wrote {path}")


@main.command("replay")
@click.argument("trace")
@click.option("--policy", "policies", multiple=True,
              help="Policy to replay: lru, wa_lru, nalar or ours (repeatable; default: all four).")
@click.option("--tiers", "tiers", multiple=True,
              help="Tier sizes, e.g. 'accelerator=16GiB,host=64GiB' or 'accelerator=25%' (a share of the "
                   "trace's peak footprint); repeatable, one replay each (default: agents.kv.tiers).")
@click.option("--limit", type=int, default=None, help="Replay only the first N sessions (Mooncake: requests).")
@click.option("--no-offline", is_flag=True, help="Leave out the offline cost-aware schedule.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the rows as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of hit rate vs accelerator memory here.")
def replay_command(trace: str, policies: tuple[str, ...], tiers: tuple[str, ...], limit: int | None,
                   no_offline: bool, json_path: str | None, plot_path: str | None) -> None:
    """Replay TRACE under KV policies, side by side with the offline optimum.

    TRACE is a file (a saved kv trace, a Mooncake JSON-lines file, or a da.telemetry frame as
    CSV/JSON/parquet), a directory holding the Mooncake trace, 'mooncake' (the shipped trace),
    or 'generated[:key=value,...]' (generated agent sessions; keys of kv.traces.GenParams).
    """
    from kv.blocks import CostModel, Tiers
    from kv.replay import ONLINE, format_table, load_trace, plot, ratios, replay, resolve_tiers, write_json

    try:
        t = load_trace(trace, limit)
        cost = CostModel.from_config()
        base = Tiers.from_config()
        configs = [resolve_tiers(spec, t, cost, base) for spec in tiers] or [base]
        rows = replay(t, policies or ONLINE, configs, cost, offline=not no_offline)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(format_table(rows))
    summary = ratios(rows, policies or ONLINE)
    if json_path:
        click.echo(f"wrote {write_json(json_path, {'trace': t.summary(), 'rows': rows, 'summary': summary})}")
    if plot_path:
        click.echo(f"wrote {plot(rows, plot_path)}")


main.add_command(report_command)  # defined beside the plotting code it drives
