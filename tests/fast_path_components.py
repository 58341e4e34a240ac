"""Components for tests/test_fast_path.py (importable by worker processes)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from distributed import get_client, get_worker

import dask_agents as da


@da.tool(kind="file_io")
def where(x: int) -> tuple[int, int, str]:
    """``x`` back, with the thread and the worker it ran in."""
    return x, threading.get_ident(), get_worker().address


@da.tool
def boom(x: int) -> int:
    raise ValueError(f"boom {x}")


@da.tool
def add(a: int, b: int) -> int:
    return a + b


@da.tool
def total(xs: list) -> int:
    return sum(xs)


@da.tool
def mark(path: str) -> str:
    with open(path, "w") as f:
        f.write("ran")
    return path


@da.tool
def slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@dataclass
class Box:
    """A future inside an object Dask does not look into: pickled with it, not a dependency."""

    fut: Any


class Escaping:
    """An argument whose pickling raises what a running call's future raises where it cannot wait."""

    def __reduce__(self):
        raise da.CallEscapeError("the future of add (key add-0) was sent from nowhere")


@da.tool
def unbox(box: Box) -> int:
    """Reads the future it was handed inside an object: a plain Dask future by then, unbound
    (Dask binds only the futures it sees as dependencies), so bound here as a Dask user would."""
    box.fut.bind_client(get_client())
    return box.fut.result() + 100


@da.agent(stateful=True)
class Tally:
    """Stateful: its calls always take the scheduler path."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n


@da.tool
def via_tally(k: int) -> int:
    """A tool that makes a scheduler-path call (running on the fast path itself)."""
    return da.stub(Tally).add(k).value()


@da.tool
def via_where(x: int) -> tuple:
    """A tool that makes a tool call itself (both nested; the inner made by a fast-path call)."""
    value, thread, worker = da.stub(where)(x).value()
    return value, thread == threading.get_ident(), threading.get_ident()


@da.agent(stateful=True)
class Gate:
    """A scheduler-path call that waits for a file (stateful: never on the fast path)."""

    def wait(self, path: str) -> str:
        while not os.path.exists(path):
            time.sleep(0.01)
        return path


@da.agent
def waits_on_gate(path: str) -> str:
    """Waits on a scheduler-path call: its thread parks in the wait."""
    return da.stub(Gate).wait(path).value()


def plain_double(x: int) -> int:
    """Plain Dask work (not a component)."""
    return 2 * x


@da.agent
class Caller:
    """Calls made inside a component, each the way a user would write it."""

    def inline(self, x: int) -> dict:
        value, thread, worker = da.stub(where)(x).value()
        return {"value": value, "same_thread": thread == threading.get_ident(),
                "same_worker": worker == get_worker().address}

    def nested(self, x: int) -> dict:
        value, inner_same, thread = da.stub(via_where)(x).value()
        return {"value": value, "inner_same_thread": inner_same, "same_thread": thread == threading.get_ident()}

    def tally_twice(self, k: int) -> list:
        return [da.stub(via_tally)(k).value(), da.stub(via_tally)(k).value()]

    def fail(self, x: int) -> str:
        try:
            da.stub(boom)(x).value()
        except da.CallFailedError as e:
            return f"{type(e.original).__name__}|{e}"
        return "no error"

    def chain(self, x: int) -> int:
        a = da.stub(add)(x, 1)
        b = da.stub(add)(a, 10)  # a dependency on a call still deferred
        return b.value()

    def chain_after(self, x: int) -> int:
        a = da.stub(add)(x, 1)
        a.value()
        return da.stub(total)([a, a, 3]).value()  # a finished local future inside a list

    def fan_out(self, n: int) -> dict:
        futs = [da.stub(where)(i) for i in range(n)]
        values = [f.value() for f in futs]
        return {"values": [v[0] for v in values],
                "same_thread": [v[1] == threading.get_ident() for v in values]}

    def hidden(self, x: int) -> int:
        """A call's future hidden in an argument of a sibling made before either was waited for:
        waiting for the first sends the sibling, whose pickling carries the first's future."""
        a = da.stub(add)(x, 1)
        b = da.stub(unbox)(Box(a))
        return a.value() + b.value()

    def plain_submit(self, x: int, deferred: bool) -> int:
        f = da.stub(add)(x, 1)
        if not deferred:
            f.value()
        return get_client().submit(plain_double, f).result()

    def with_timeout(self, seconds: float) -> str:
        try:
            da.stub(slow)(seconds).value(timeout=0.05)
        except da.CallTimeoutError as e:
            return f"timeout|{e}"
        return "no timeout"

    def cancelled(self, path: str) -> dict:
        f = da.stub(mark)(path)
        f.cancel()
        try:
            f.value()
        except Exception as e:  # Dask's FutureCancelledError, as on the scheduler path
            error = type(e).__name__
        else:
            error = None
        return {"status": f.status, "done": f.available(), "error": error, "ran": os.path.exists(path)}

    def forgotten_but_kept(self, path: str) -> str:
        """A call it never waits for, whose future it keeps: it runs anyway."""
        self._kept = da.stub(mark)(path)
        return "left"

    def fire_and_forgotten(self, path: str) -> str:
        """A call handed to fire_and_forget and dropped: it runs anyway, as on the scheduler path."""
        from distributed import fire_and_forget

        fire_and_forget(da.stub(mark)(path))
        return "left"

    def status(self, x: int) -> list:
        f = da.stub(add)(x, 1)
        before = (f.status, f.available())
        f.value()
        return [before, (f.status, f.available())]

    def after_cancel(self, started: str, out: str, path: str) -> str:
        """Runs on after its session was ended with cancel=True (a thread cannot be stopped),
        then makes a call: it must not run here as if nothing happened."""
        worker = get_worker()
        key = worker.get_current_task()
        with open(started, "w") as f:
            f.write(key)
        deadline = time.time() + 60
        while worker.state.tasks.get(key) is not None and worker.state.tasks[key].state == "executing":
            if time.time() > deadline:
                break
            time.sleep(0.01)
        try:
            da.stub(mark)(path).value()
            outcome = "ran"
        except Exception as e:
            outcome = f"{type(e).__name__}|{e}"
        with open(out, "w") as f:
            f.write(outcome)
        return outcome


@da.tool
def logged_wait(log: str, release: str) -> str:
    """Appends its key and worker to ``log``, then waits for ``release`` to exist."""
    key = get_worker().get_current_task() or ""
    from dask_agents import context

    with open(log, "a") as f:
        f.write(f"{context.call_id()} {get_worker().address}\n")
    while not os.path.exists(release):
        time.sleep(0.01)
    return key


@da.agent
def calls_logged_wait(log: str, release: str) -> str:
    """A component whose one tool call runs on the fast path, in its thread."""
    da.stub(logged_wait)(log, release).value()
    return get_worker().address


@da.agent
def llm_under_lease(model: str, prompt: list) -> dict:
    """Two LLM calls of its session: the first on the scheduler path (it admits the session to
    this worker's engine), the second once this worker holds the lease on the session."""
    local = get_worker().plugins["dask-agents"].local
    sid = da.current_session()
    first = da.llm(model).generate(prompt, max_tokens=8).value()
    deadline = time.time() + 30
    while not local.leased(model, sid) and time.time() < deadline:
        time.sleep(0.01)
    leased = local.leased(model, sid)
    host = get_worker().plugins["dask-agents"].engines._hosts[model]
    seen, params = [], host.sampling_params

    def spy(*args, **kwargs):  # the priority the engine is given
        out = params(*args, **kwargs)
        seen.append(tuple(out.priority))
        return out

    host.sampling_params = spy
    try:
        second = da.llm(model).generate(prompt + list(first.token_ids) + [7] * 8, max_tokens=8).value()
    finally:
        host.sampling_params = params
    from dask_agents.worker_plugin.dask_compat import task_priority

    return {"leased": leased, "workers": [first.worker, second.worker], "here": get_worker().address,
            "cached": second.cached_tokens, "output": [first.output_tokens, second.output_tokens],
            "priority": seen, "caller_priority": task_priority(get_worker(), get_worker().get_current_task())}
