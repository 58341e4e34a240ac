"""The ``dask-agents`` command line: a :mod:`click` group; each tool is a subcommand.

    dask-agents stubgen agents.py -o stubs/     # write stubs/agents.py (see stubgen.py)
    dask-agents replay mooncake --tiers 4GiB     # KV policies vs the offline optimum (kv/offline/replay.py)
    dask-agents report telemetry.parquet -o report/   # PNG plots (dask_agents/report.py)
    dask-agents whatif telemetry.parquet --gpus 4      # another allocation, predicted (whatif.py)
    dask-agents serve --scheduler tcp://h:8786       # an OpenAI-compatible endpoint (openai_server.py)

The same group is ``dask agents ...`` (Dask's ``dask_cli`` entry point, as ``dask cuda`` is) and
``python -m dask_agents ...``.
"""

from __future__ import annotations

import click

from dask_agents.report import report_command


@click.group(name="agents", context_settings={"help_option_names": ["-h", "--help"]})  # (subcommands too)
@click.version_option(package_name="dask-agents", prog_name="dask-agents")
def main() -> None:
    """dask-agents: workflow-aware serving of agentic applications on Dask."""


@main.command("stubgen")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False),
              help="Directory to write the stub modules into (created if missing).")
@click.option("--package-root", type=click.Path(exists=True, file_okay=False), default=None,
              help="Directory the source import paths are relative to (default: the directory above "
                   "the file's outermost package, or the file's stem outside a package).")
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
@click.option("--without-session-ends", is_flag=True,
              help="Replay with no session's end known (on derived traces the end is hindsight).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the rows as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of hit rate vs accelerator memory here.")
def replay_command(trace: str, policies: tuple[str, ...], tiers: tuple[str, ...], limit: int | None,
                   no_offline: bool, without_session_ends: bool, json_path: str | None,
                   plot_path: str | None) -> None:
    """Replay TRACE under KV policies, side by side with the offline optimum.

    TRACE is a file (a saved kv trace, a Mooncake JSON-lines file, or a da.telemetry frame as
    CSV/JSON/parquet), a directory holding the Mooncake trace, 'mooncake' (the shipped trace),
    or 'generated[:key=value,...]' (generated agent sessions; keys of dask_agents.kv.offline.traces.GenParams).
    """
    from dask_agents.kv.runtime.blocks import CostModel, Tiers
    from dask_agents.kv.offline.replay import ONLINE, format_table, load_trace, plot, ratios, replay, resolve_tiers, write_json

    try:
        t = load_trace(trace, limit)
        if without_session_ends:
            t = t.without_session_ends()
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


@main.command("whatif")
@click.argument("telemetry", type=click.Path(exists=True, dir_okay=False))
@click.option("--gpus", type=click.IntRange(min=1), default=None,
              help="Engine replicas in all, split over the models by their recorded LLM work (default: as recorded).")
@click.option("--replicas", "replicas", multiple=True, help="MODEL=N engine replicas of one model (repeatable).")
@click.option("--load-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Session arrivals this many times faster than recorded.")
@click.option("--max-batch", type=click.IntRange(min=1), default=256, show_default=True,
              help="Concurrent sequences per engine.")
@click.option("--kv-blocks", type=click.IntRange(min=1), default=1 << 20, show_default=True,
              help="KV capacity per engine, in blocks of --block-size tokens.")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON here.")
def whatif_command(telemetry: str, gpus: int | None, replicas: tuple[str, ...], load_scale: float, max_batch: int,
                   kv_blocks: int, block_size: int, json_path: str | None) -> None:
    """Predict latency and throughput of a recorded workload on another allocation.

    TELEMETRY is a da.telemetry(client) calls table (parquet or csv; see
    dask_agents.report.save_telemetry). The engines' costs are calibrated on the recorded LLM
    calls, the recording is replayed on its own allocation to show the prediction error, then
    on the one asked for. Predictions come from an EMULATED engine (dask_agents/whatif.py).
    """
    import json

    from dask_agents import whatif as w

    try:
        scripts = w.load(telemetry)
        fits = w.calibrate(scripts)
        kw = {"max_batch": max_batch, "kv_blocks": kv_blocks, "block_size": block_size}
        check = w.validate(scripts, fits, **kw)
        asked = w.parse_replicas(replicas, gpus, scripts)
        pred = w.predict(scripts, fits, asked, load_scale=load_scale, **kw).summary()
    except w.WhatIfError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"telemetry: {telemetry}: {len(scripts)} sessions, "
               f"{sum(len(s.calls) for s in scripts)} calls; recorded replicas {check['replicas']}")
    for m, f in fits.items():
        click.echo(f"calibration {m}: decode {f.decode_s_per_step * 1e3:.3f} ms/step + {f.decode_s_per_seq * 1e3:.4f} "
                   f"ms/seq, prefill {f.prefill_s_per_token * 1e6:.2f} us/token ({f.calls} calls, R^2 {f.r2:.2f})")

    def row(name: str, d: dict) -> str:
        return (f"{name:28s} {d['mean_s']:8.2f} {d['p95_s']:8.2f} {d['throughput_per_s']:10.3f} "
                f"{d['llm_mean_s']:8.3f} {d['hit_rate'] if d['hit_rate'] is not None else float('nan'):6.1%}")
    click.echo(f"{'':28s} {'mean s':>8s} {'P95 s':>8s} {'sessions/s':>10s} {'LLM s':>8s} {'hit':>6s}")
    click.echo(row("recorded", check["measured"]))
    click.echo(row("predicted, same allocation", check["predicted"]))
    click.echo("prediction error on the recording: " + ", ".join(f"{k} {v:+.0%}" for k, v in check["errors"].items()))
    click.echo(row(f"predicted {asked} x{load_scale:g}", pred))
    click.echo("(predictions: EMULATED engine calibrated on the recording)")
    untrusted = w.warnings_for(fits, check)
    for why in untrusted:
        click.secho(f"WARNING: do not trust these predictions: {why}", fg="red", bold=True, err=True)
    if untrusted:
        click.secho(f"WARNING: to fix it, {w.RECORDING_HINT}", fg="red", err=True)
    if json_path:
        def strict(x: object) -> object:  # NaN (no sample) is null: the file stays valid JSON
            if isinstance(x, dict):
                return {k: strict(v) for k, v in x.items()}
            if isinstance(x, float) and x != x:
                return None
            return x
        doc = {"telemetry": telemetry, "emulated": True, "trusted": not untrusted, "warnings": untrusted,
               "calibration": {m: vars(f) for m, f in fits.items()},
               "validation": check, "whatif": {"replicas": asked, "load_scale": load_scale, **kw, "predicted": pred}}
        with open(json_path, "w") as fh:
            json.dump(strict(doc), fh, indent=2, allow_nan=False)
        click.echo(f"wrote {json_path}")


@main.command("serve")
@click.option("--scheduler", required=True, help="Address of the cluster's scheduler (dask-agents installed there).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--idle-timeout", default=300.0, show_default=True, type=float,
              help="Seconds a session named by the X-Dask-Agents-Session header stays open without a request.")
def serve_command(scheduler: str, host: str, port: int, idle_timeout: float) -> None:
    """Serve the cluster's models on an OpenAI-compatible endpoint (/v1/chat/completions,
    /v1/completions, /v1/models; streaming by server-sent events)."""
    from distributed import Client

    from dask_agents.openai_server import serve

    with Client(scheduler) as client:
        serve(client, host=host, port=port, idle_timeout=idle_timeout)
