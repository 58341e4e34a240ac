"""Client handle on the global control loop: start, stop, run one pass, read its stats."""

from __future__ import annotations

from typing import Any

from distributed import Client

from dask_agents.client_api import _call
from dask_agents.errors import NotAllowedError


class Control:
    """``da.control(client)``: the scheduler plugin's control loop, from the client."""

    def __init__(self, client: Client):
        self.client = client

    def _op(self, op: str) -> Any:
        def check(reply: dict) -> dict:
            if "error" in reply:
                if reply.get("refused"):
                    raise NotAllowedError(reply["error"])
                raise RuntimeError(reply["error"])
            return reply

        return _call(self.client, "agents_control", check, action=op)

    def start(self) -> Any:
        """Start the periodic loop (``agents.control.interval``)."""
        return self._op("start")

    def stop(self) -> Any:
        """Stop the loop; decisions already applied stand."""
        return self._op("stop")

    def run_once(self) -> Any:
        """Run one pass now; returns its summary (``pass``) and the loop's stats."""
        return self._op("run_once")

    def stats(self) -> Any:
        """Tick times (last, p50, p99, max); actions by kind: ``applied`` (moves only once Dask
        confirmed them), ``requested`` and ``refused`` moves, ``rejected`` (with
        ``rejected_reasons`` and recent ``rejections``); policy errors and the policies backing
        off (``failing_policies``); recent decisions; ``faults``."""
        return self._op("stats")


def control(client: Client) -> Control:
    """A handle on the control loop of ``client``'s scheduler."""
    return Control(client)
