"""``python -m dask_agents``: the ``dask-agents`` command line (also ``dask agents``)."""

from dask_agents.cli import main

if __name__ == "__main__":
    main(prog_name="dask-agents")
