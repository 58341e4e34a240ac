"""A scheduler SIGKILLed and restarted (``--preload``, same port) under a driver that keeps its
client (issue 27), on real ``dask scheduler`` / ``dask worker`` processes.

Dask's workers close when their scheduler connection breaks (``Worker.handle_scheduler``), so
no stateful instance outlives a scheduler: a deployment (SLURM, Kubernetes, the test here)
starts new ones. What the driver must see: its in-flight call fails with ``da.CallLostError``
naming the call and the restart; a later stateful call of a session opened before the restart
fails with ``da.InstanceLostError`` naming the session; it never runs on a fresh instance
(a silently different answer). Stateless calls of that session, and new sessions, work.
"""

from __future__ import annotations

import os
import signal
import socket

import pytest
from distributed import Client

import dask_agents as da
from tests import fault_components as fc
from tests.test_faults import markers
from tests.test_preload import DASK, PRELOAD, Proc, _env, agents_ping
from tests.test_preload import wait_for as pwait

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as sock:  # a port the restarted scheduler can take again
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_session_outliving_its_scheduler_never_runs_on_a_fresh_instance(tmp_path):
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = _env()
    sched_args = [DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard",
                  "--preload", PRELOAD]
    worker_args = [DASK, "worker", address, "--host", "127.0.0.1", "--nthreads", "4", "--no-dashboard",
                   "--preload", PRELOAD]
    procs: list[Proc] = []
    d = str(tmp_path)
    counter = da.stub(fc.Counter)

    def ready(client: Client, sched: Proc) -> None:
        pwait(lambda: client.scheduler_info()["workers"], "a worker", procs=(sched,))
        pwait(lambda: agents_ping(client)["workers"], "the worker's hello", procs=(sched,))

    try:
        sched = Proc(sched_args, str(tmp_path / "scheduler1.log"), env)
        procs.append(sched)
        worker = Proc(worker_args, str(tmp_path / "worker1.log"), env)
        procs.append(worker)
        # the client's timeout is also how long it tries to reconnect
        with Client(address, timeout="60s") as client:
            ready(client, sched)
            first = client.scheduler_info()["id"]
            with da.session(client, name="before") as s:
                assert counter.bump(d).value(timeout=60)[0] == 1
                pending = counter.bump(d, hold=True)  # in flight when the scheduler dies
                pwait(lambda: len(markers(d, "bump")) == 2, "the held call to start", procs=(sched,))
                os.killpg(sched.popen.pid, signal.SIGKILL)
                sched.popen.wait(10)
                sched.kill()
                procs.remove(sched)
                sched = Proc(sched_args, str(tmp_path / "scheduler2.log"), env)
                procs.append(sched)

                with pytest.raises(da.CallLostError) as ei:
                    pending.value(timeout=90)
                text = str(ei.value)
                assert pending.key in text and s.id in text and "restarted" in text, text
                assert client.scheduler_info()["id"] != first

                # Dask's old worker closes (its held call ends with the release); a deployment
                # starts a new one
                open(os.path.join(d, "release"), "w").close()
                worker.kill()
                procs.remove(worker)
                worker = Proc(worker_args, str(tmp_path / "worker2.log"), env)
                procs.append(worker)
                ready(client, sched)

                with pytest.raises(da.InstanceLostError) as ei:
                    counter.bump(d).value(timeout=60)  # a fresh instance would answer 1
                text = str(ei.value)
                assert s.id in text and first in text and "Counter" in text, text
                # the same again for the next call: the session's instances are gone for good
                with pytest.raises(da.InstanceLostError):
                    counter.bump(d).value(timeout=60)
                # stateless work of that session needs no instance: it goes on
                assert da.stub(fc.echo)(5).value(timeout=60) == 5

            with da.session(client, name="after"):  # a new session starts from scratch, rightly
                assert [counter.bump(d).value(timeout=60)[0] for _ in range(2)] == [1, 2]
    finally:
        for p in reversed(procs):
            p.kill()
