"""The ``dask-agents`` command line: a :mod:`click` group; each tool is a subcommand.

    dask-agents stubgen agents.py -o stubs/     # write stubs/agents.py (see stubgen.py)
"""

from __future__ import annotations

import click


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
