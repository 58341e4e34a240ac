"""Stateful instances on one worker: one call at a time, submission order, nothing left waiting."""

from __future__ import annotations

import threading

from tests.conftest import wait_for
from dask_agents.errors import InstanceLostError
from dask_agents.worker_plugin.instances import Instances


class Counter:
    pass


def start_call(inst: Instances, session: str, key: str, log: list, release: threading.Event) -> threading.Thread:
    def body() -> None:
        with inst.turn("c", session, key, Counter):
            log.append(("enter", key))
            release.wait(30)
            log.append(("exit", key))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def waiting(inst: Instances, session: str) -> int:
    return len(inst._slot("c", session).cond._waiters)  # threads blocked in turn()


def test_an_earlier_call_arriving_late_waits_for_the_running_one():
    inst, log = Instances(), []
    go_b, go_a = threading.Event(), threading.Event()
    inst.ticket("c", "s", "B", created=2.0)
    tb = start_call(inst, "s", "B", log, go_b)
    wait_for(lambda: log == [("enter", "B")])
    inst.ticket("c", "s", "A", created=1.0)  # submitted first, arrived second: sorts ahead of B
    ta = start_call(inst, "s", "A", log, go_a)
    wait_for(lambda: waiting(inst, "s") == 1)  # A waits: B is using the instance
    go_b.set()
    go_a.set()
    tb.join(10)
    ta.join(10)
    assert log == [("enter", "B"), ("exit", "B"), ("enter", "A"), ("exit", "A")]


def test_a_cancelled_running_call_keeps_its_turn_until_its_code_returns():
    inst, log = Instances(), []
    go_x, go_y = threading.Event(), threading.Event()
    inst.ticket("c", "s", "X", created=1.0)
    inst.ticket("c", "s", "Y", created=2.0)
    tx = start_call(inst, "s", "X", log, go_x)
    wait_for(lambda: log == [("enter", "X")])
    inst.done("c", "s", "X")  # the worker says X left (cancelled) while its thread still runs
    ty = start_call(inst, "s", "Y", log, go_y)
    wait_for(lambda: waiting(inst, "s") == 1)
    go_x.set()
    go_y.set()
    tx.join(10)
    ty.join(10)
    assert log == [("enter", "X"), ("exit", "X"), ("enter", "Y"), ("exit", "Y")]


def test_ending_the_session_wakes_calls_queued_behind_a_call_that_never_came():
    inst, log = Instances(), []
    inst.ticket("c", "s2", "P", created=1.0)  # P never runs here
    inst.ticket("c", "s2", "Q", created=2.0)
    errors: list[BaseException] = []

    def body() -> None:
        try:
            with inst.turn("c", "s2", "Q", Counter):
                log.append(("enter", "Q"))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    tq = threading.Thread(target=body, daemon=True)
    tq.start()
    wait_for(lambda: waiting(inst, "s2") == 1)
    inst.end_session("s2")
    tq.join(10)
    # woken, and failed: its instance went with the session (never a fresh, empty one)
    assert not tq.is_alive() and log == []
    assert len(errors) == 1 and isinstance(errors[0], InstanceLostError) and "s2" in str(errors[0])
