"""Calls from the driver straight to a worker: the driver's half of two-level control.

A driver's call of a stateless agent or tool inside a ``da.session`` block crosses the
scheduler twice on Dask's path (update-graph, compute-task; task-finished, key-in-memory, then
``who_has``/``get_data`` for the value): 6 ms a call on an idle 2-core machine, 10-12 ms under
load, where one RPC to a worker and its answer take under 1 ms (measured: issue 26's notes).
So when the scheduler has told this client where the call belongs, the call goes there in
one RPC (``agents_direct``, ``worker_plugin/direct.py``) and its value comes back in the
answer. The scheduler tells a session's owner, on its own stream (``agents-direct``):

- when a session opens, this client's **token** (a keyed hash of the client's id under the
  scheduler's secret, which the workers know: a worker runs direct calls only of a client the
  scheduler gave one), where each model's engines are and which model each component's LLM
  calls use (``called_model``); a session's calls may go direct from its first one (the
  token came with an earlier session) on;
- when a session is bound to an engine of a model (admission), that **binding**.

A call goes to the worker of its session's engine of the model its component uses, or to the
only engine of that model. A session's first call of a model with several engines has no route
yet: with ``agents.client.bind-first-calls`` (on by default) this client binds the session
itself, to the engine its own calls in flight load least (then the one with fewest of its
sessions), as the scheduler's ``balance-by: calls`` would, and the call goes straight there; the
worker admits the session to its engine under admission's lease (nothing of the model short)
and the scheduler binds it from the records (else admission binds it where its first LLM call
arrives, and tells this client). That spares a request's first calls (often a fan-out) the
scheduler's round trip both ways: 10-12 ms each under load against 2-5 for a direct hop
(``benchmarks/README.md``, finance). Off, the call takes the scheduler path, which binds the
session; with ``agents.client.route-first-calls`` (off by default) it waits on the client for one instead
(**route request**, ``agents-route`` on the client's stream, after the session's open): the
scheduler binds the session as that call's own arrival would, and answers where, so a
request's first calls (often a fan-out) go straight too; an answer of None, or none within
:data:`ROUTE_WAIT_S`, sends them down the scheduler path.
Anything else (stateful, batched, resource-bound or timed calls; calls with futures as
arguments; LLM calls; asynchronous clients) takes the scheduler path, as does a call the
worker refuses (no free thread, not ready, draining). Nothing about the future changes: it is an
``AgentFuture`` of the same key; when the answer comes its key is made known to the scheduler
(``update-data`` on this client's stream, as ``scatter`` does: the value stays in the worker's
memory and later work may depend on it) and given the call as its task (so a value lost with
its worker is computed again, as a task's would be), and the worker's records of the call reach the
scheduler plugin with its reports, so session graphs and telemetry see it. A call whose worker
is lost before it answers is sent again down the scheduler path under the same key (Dask would
run a task again after the same loss); one cancelled before its answer is dropped there.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dask_agents.models import NOT_ADMITTED

DIRECT_OP = "agents-direct"
"""scheduler -> client: routes for the client's sessions (``scheduler_plugin/direct.py``)."""

ROUTE_OP = "agents-route"
"""client -> scheduler: where a session's calls of a model go (``scheduler_plugin/plugin.py``)."""

ROUTE_WAIT_S = 1.0
"""How long calls waiting for a route request's answer wait before they take the scheduler path
(an answer lost with a dropped connection must not leave them waiting)."""

LASTING, REST_S = ("not ready", "no token"), 10.0
"""A worker that answers it cannot take direct calls for one of these reasons is not sent any
for this many seconds (a full thread pool, by contrast, passes)."""

SENT, FINISHED, ERRED, CANCELLED, SCHEDULER = "sent", "finished", "erred", "cancelled", "scheduler"
_STATUS = {SENT: "pending", FINISHED: "finished", ERRED: "error", CANCELLED: "cancelled"}


@dataclass(eq=False)
class DirectCall:
    """One call sent straight to ``worker``; ``resubmit`` sends it down the scheduler path."""

    key: str
    worker: str
    session: str
    client: Any
    resubmit: Any
    ann: dict = field(default_factory=dict)  # its annotation (an erred one's task carries it)
    model: str | None = None  # the model its component's LLM calls use (its route's)
    pin: Any = None  # once answered: sends the call as its key's task (:func:`_settle`)
    state: str = SENT
    value: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def status(self) -> str:
        return _STATUS[self.state]


class Routes:
    """What the scheduler told this client about where its sessions' calls belong."""

    def __init__(self) -> None:
        self.token: str | None = None  # this client's token (from the scheduler)
        self.sessions: set[str] = set()  # sessions the scheduler routes for (their bindings are kept)
        self.opened: set[str] = set()  # sessions this client opened taking routes (may ask for a route)
        self.bound: dict[tuple[str, str], str] = {}  # (session, model) -> worker of its engine
        # bindings this client made itself (:meth:`bind`) that neither the scheduler nor a
        # worker's admission confirmed yet: a worker that cannot admit the session refuses them
        self.provisional: set[tuple[str, str]] = set()
        self.models: dict[str, tuple[str, ...]] = {}  # model -> workers of its engines
        self.components: dict[str, str] = {}  # component -> the model its LLM calls use
        # worker -> until when it is not sent direct calls (it answered it cannot take them:
        # its fast path is off, or it has no secret yet), so each call does not pay a refusal
        self.resting: dict[str, float] = {}
        self.made: dict[str, list[str]] = {}  # session -> keys of the calls sent straight, to name at its end
        self.pending: dict[str, DirectCall] = {}  # key -> a call sent and not answered yet
        # (session, model) -> calls waiting for the answer to its route request (client's loop only)
        self.awaiting: dict[tuple[str, str], list[tuple[DirectCall, dict]]] = {}
        self.lock = threading.Lock()

    def update(self, token: Any = None, session: Any = None, bound: Any = None, models: Any = None,
               components: Any = None, routed: Any = None, **kw: Any) -> None:
        """What the scheduler said on :data:`DIRECT_OP` (on the client's loop); ``routed``, the
        answer to a route request, is a binding (or none)."""
        if isinstance(routed, (list, tuple)) and len(routed) == 3 and routed[2] is not None:
            bound = [*(bound or ()), routed]
        if isinstance(models, dict):
            self.models = {m: tuple(w) for m, w in models.items() if isinstance(w, (list, tuple))}
        if isinstance(components, dict):
            self.components.update({c: m for c, m in components.items() if isinstance(m, str)})
        if isinstance(token, str):
            self.token = token
        if isinstance(session, str):
            self.sessions.add(session)
        for row in bound or ():
            if isinstance(row, (list, tuple)) and len(row) == 3:
                sid, model, worker = row
                if sid in self.sessions:
                    self.provisional.discard((sid, model))  # the scheduler's word
                    if worker is None:
                        self.bound.pop((sid, model), None)
                    else:
                        self.bound[(sid, model)] = worker

    def forget(self, sid: str) -> None:
        """``sid`` ended: its routes go (they would only grow)."""
        self.sessions.discard(sid)
        self.opened.discard(sid)
        for sk in [sk for sk in self.bound if sk[0] == sid]:
            del self.bound[sk]
            self.provisional.discard(sk)

    def target(self, sid: str, component: str, model: str | None) -> tuple[str, str, str] | None:
        """(worker, token, model) for a call of ``component`` in ``sid`` (``model``: its
        ``model=`` hint), or None: the scheduler path."""
        token = self.token
        if token is None:
            return None
        model = model or self.components.get(component)
        if model is None:
            return None
        worker = self.bound.get((sid, model))
        if worker is None:
            workers = self.models.get(model, ())
            worker = workers[0] if len(workers) == 1 else self.bind(sid, model, workers)
        if worker is None or (worker in self.resting and self.resting[worker] > time.monotonic()):
            return None
        return worker, token, model

    def bind(self, sid: str, model: str, workers: tuple[str, ...]) -> str | None:
        """Bind ``sid`` (a session this client opened) to the engine of ``model`` its own calls
        in flight load least, then the one with fewest of its sessions bound (None: not this
        client's session, bind-first-calls off, or every engine resting)."""
        from dask_agents import config as agents_config

        if sid not in self.opened or not agents_config.get("client.bind-first-calls"):
            return None
        now = time.monotonic()
        live = [w for w in workers if self.resting.get(w, 0.0) <= now]
        if not live:
            return None
        with self.lock:
            calls = {w: 0 for w in live}
            for c in self.pending.values():
                if c.worker in calls:
                    calls[c.worker] += 1
            sessions = {w: 0 for w in live}
            for (_, m), w in self.bound.items():
                if m == model and w in sessions:
                    sessions[w] += 1
            worker = min(live, key=lambda w: (calls[w], sessions[w]))
            self.bound[(sid, model)] = worker  # the session's next calls follow, the scheduler's word wins
            self.provisional.add((sid, model))
        return worker

    def confirmed(self, call: "DirectCall", admitted: bool) -> None:
        """The worker of ``call`` ran it (``admitted``: its engine took the session) or refused
        it because it could not admit the session (something of the model is short): a binding
        this client made is confirmed, or goes (the scheduler path binds the session)."""
        sk = (call.session, call.model)
        if sk not in self.provisional:  # (most answers: no lock taken on the client's loop)
            return
        with self.lock:
            if sk not in self.provisional:
                return
            self.provisional.discard(sk)
            if not admitted and self.bound.get(sk) == call.worker:
                del self.bound[sk]

    def unrouted(self, sid: str, component: str, model: str | None) -> tuple[None, str, str] | None:
        """(None, token, model) when a call of ``component`` in ``sid`` (a session this client
        opened) lacks only the session's binding (its model has several engines, not all
        resting): it may wait for a route request's answer; else None."""
        from dask_agents import config as agents_config

        token = self.token
        model = model or self.components.get(component)
        if (token is None or model is None or sid not in self.opened or (sid, model) in self.bound
                or not agents_config.get("client.route-first-calls")):
            return None
        now = time.monotonic()
        workers = [w for w in self.models.get(model, ()) if self.resting.get(w, 0.0) <= now]
        return (None, token, model) if len(workers) > 1 else None


def routes_of(client: Any) -> Routes | None:
    """The client's routes, once ``da.install`` set them up on it (None before)."""
    return getattr(client, "_agents_routes", None)


def install_routes(client: Any) -> Routes:
    """Give ``client`` its routes and the stream handler that fills them (idempotent)."""
    from dask_agents.worker_plugin import dask_compat

    routes = routes_of(client)
    if routes is None:
        routes = client._agents_routes = Routes()

        def on_direct(**msg: Any) -> None:
            routes.update(**msg)
            routed = msg.get("routed")
            if isinstance(routed, (list, tuple)) and len(routed) == 3:
                _routed(client, routes, (routed[0], routed[1]), routed[2])
            for row in msg.get("bound") or ():  # a binding made meanwhile by other means
                if isinstance(row, (list, tuple)) and len(row) == 3 and row[2] is not None:
                    _routed(client, routes, (row[0], row[1]), row[2])

        dask_compat.add_client_stream_handler(client, DIRECT_OP, on_direct)
        dask_compat.on_graph_dependencies(client, lambda: bool(routes.pending),
                                          lambda keys: escape_keys(client, keys))
    return routes


def eligible(client: Any, spec: Any, ann: dict, deps: list, sid: str | None) -> bool:
    """Whether a driver's call may go straight to a worker (see the module docstring)."""
    from dask_agents import config as agents_config

    hints = spec.hints
    return (sid is not None and not deps and spec.kind in ("agent", "tool") and not client.asynchronous
            and not hints.stateful and hints.batching is None and not hints.resources and hints.timeout is None
            and hints.max_replicas is None and not ann.get("stream") and bool(agents_config.get("client.direct-calls")))


def pack(runner: Any, target: Any, header: tuple, args: tuple, kwargs: dict) -> Any | None:
    """A direct call's payload, pickled in the caller's thread (not on the client's loop): a
    future of a call still running that it carries is waited for here (:func:`escape`), where
    the wait can end. None if something in it does not pickle: the caller takes the scheduler
    path, which names the argument."""
    from distributed.protocol import Serialized, serialize

    try:
        return Serialized(*serialize((runner, header, target, args, kwargs), on_error="raise"))
    except Exception as e:
        from dask_agents.errors import escape_error_in

        escaped = escape_error_in(e)
        if escaped is not None:
            raise escaped from None
        return None


def send(client: Any, routes: Routes, where: tuple[str | None, str, str], header: tuple, payload: Any, ann: dict,
         resubmit: Any, pin: Any = None) -> DirectCall:
    """Send the call (``payload`` from :func:`pack`) to ``where`` = (worker, token, model) on the
    client's loop; returns at once. A worker of None (:meth:`Routes.unrouted`): the call waits
    for its session's route first."""
    worker, token, model = where
    call = DirectCall(key=header[3], worker=worker or "", session=header[2], client=client, resubmit=resubmit,
                      ann=ann, pin=pin, model=model)
    with routes.lock:
        routes.pending[call.key] = call
        routes.made.setdefault(call.session, []).append(call.key)
        bind = (call.session, model) in routes.provisional  # the worker must admit the session, or refuse
    msg = {"key": call.key, "ann": ann, "client": client.id, "token": token, "model": model,
           "payload": payload, "bind": bind}
    if worker is None:
        client.loop.add_callback(_await_route, client, routes, call, msg, (call.session, model))
    else:
        client.loop.add_callback(_go, client, routes, call, msg)
    return call


def _await_route(client: Any, routes: Routes, call: DirectCall, msg: dict, sk: tuple[str, str]) -> None:
    """On the client's loop: ``call`` goes where its session is bound, or waits for the answer
    to the session's route request (the first waiting call of ``sk`` sends it)."""
    worker = routes.bound.get(sk)
    if worker is not None:
        _routed_one(client, routes, call, msg, worker)
        return
    waiting = routes.awaiting.get(sk)
    if waiting is not None:
        waiting.append((call, msg))
        return
    waiting = routes.awaiting[sk] = [(call, msg)]
    try:
        # on the client's stream, after the session's open (sent from the caller's thread before)
        client._send_to_scheduler({"op": ROUTE_OP, "session": sk[0], "model": sk[1]})  # noqa: SLF001
    except Exception:  # a closing client: the scheduler path says what is wrong
        _routed(client, routes, sk, None)
        return
    client.loop.call_later(ROUTE_WAIT_S, _routed, client, routes, sk, None, waiting)


def _routed(client: Any, routes: Routes, sk: tuple, worker: str | None, only: list | None = None) -> None:
    """On the client's loop: ``sk``'s route is ``worker`` (None: none, or no answer in time:
    ``only`` the calls of that request, not of a later one): the calls waiting for it go there,
    or down the scheduler path."""
    if only is not None and routes.awaiting.get(sk) is not only:
        return
    for call, msg in routes.awaiting.pop(sk, ()):
        _routed_one(client, routes, call, msg, worker)


def _routed_one(client: Any, routes: Routes, call: DirectCall, msg: dict, worker: str | None) -> None:
    if call.state != SENT:  # cancelled while it waited: never sent anywhere
        with routes.lock:
            routes.pending.pop(call.key, None)
        return
    if worker is None or (worker in routes.resting and routes.resting[worker] > time.monotonic()):
        _settle(client, routes, call, {"status": "unrouted"})  # the scheduler path, same key
        return
    call.worker = worker
    client.loop.add_callback(_go, client, routes, call, msg)


async def _go(client: Any, routes: Routes, call: DirectCall, msg: dict) -> None:
    try:
        answer = await client.rpc(call.worker).agents_direct(**msg)
    except Exception as e:  # the worker went away (or closes): Dask would run the call again elsewhere
        answer = {"status": "lost", "why": f"{type(e).__name__}: {e}"}
    _settle(client, routes, call, answer if isinstance(answer, dict) else {"status": "lost", "why": repr(answer)})


def _settle(client: Any, routes: Routes, call: DirectCall, answer: dict) -> None:
    """On the client's loop: the worker answered (or is lost)."""
    from dask_agents.worker_plugin import dask_compat

    with routes.lock:
        routes.pending.pop(call.key, None)
    status = answer.get("status")
    if status in ("OK", "error") or answer.get("why") == NOT_ADMITTED:
        routes.confirmed(call, status != "busy")
    if call.state == SENT and client.refcount.get(call.key, 0) <= 0:
        call.state = CANCELLED  # its future was dropped unwaited: Dask would have released the task
    if call.state == CANCELLED:  # dropped while it ran: nobody registers it, so the worker forgets it
        if status == "OK":
            client.loop.add_callback(_forget, client, call, routes.token)
        return
    if status == "OK":
        call.value = answer.get("value")
        # the key made known first, on this client's stream: anything this client sends later
        # (a call depending on it, its release) comes after
        dask_compat.register_key(client, call.key, call.worker, answer.get("nbytes") or 0)
        # ... then the call itself as the key's task (Dask keeps the value and takes the task:
        # ``update_graph`` gives a key known without one its run_spec), so that a value lost
        # with its worker is computed again, as Dask does for a task's, for whatever was given
        # its future: otherwise it is scattered data, and work depending on it fails with
        # "lost dependencies". Its annotation names no call: the call's record is its worker's.
        if call.pin is not None:
            try:
                call.pin()
            except Exception:  # a closing client: nothing can depend on it any more
                pass
        call.state = FINISHED
        dask_compat.finish_future(client, call.key, type(call.value))
    elif status == "error":
        call.error = answer.get("exception") or RuntimeError(f"call {call.key} failed on {call.worker}")
        call.state = ERRED
        dask_compat.fail_future(client, call.key, call.error)
        _erred_task(call)  # so that later work may depend on it and fail with its error
    else:  # refused (no free thread, not ready) or lost: the scheduler path, same key
        if answer.get("why") in LASTING:
            routes.resting[call.worker] = time.monotonic() + REST_S
        call.state = SCHEDULER
        try:
            call.resubmit(status == "lost")
        except BaseException as e:  # its future must not wait forever for a call never sent
            call.error, call.state = e, ERRED
            dask_compat.fail_future(client, call.key, e)
    call.done.set()


async def _forget(client: Any, call: DirectCall, token: str | None) -> None:
    try:
        await client.rpc(call.worker).agents_direct_forget(key=call.key, client=client.id, token=token)
    except Exception:  # the worker is gone, and its memory with it
        pass


def cancel(call: DirectCall) -> bool:
    """The caller cancelled a call still running on its worker: its future is cancelled now and
    its answer dropped when it comes (True); False if it had answered."""
    from dask_agents.worker_plugin import dask_compat

    if call.state != SENT:
        return False
    call.state = CANCELLED
    client = call.client
    client.loop.add_callback(dask_compat.cancel_future, client, call.key, "cancelled")
    call.done.set()
    return True


def cancel_session(client: Any, sid: str) -> None:
    """The driver gave up on ``sid``: its calls still running on their workers are cancelled
    here (the scheduler cancels those it has records of); its routes go."""
    routes = routes_of(client)
    if routes is None:
        return
    with routes.lock:
        calls = [c for c in routes.pending.values() if c.session == sid]
    for c in calls:
        cancel(c)


def session_ended(client: Any, sid: str) -> list[str]:
    """The driver left ``sid``: the keys of the calls it sent straight to workers (its end
    names them: the session completes after their records) and its routes go."""
    routes = routes_of(client)
    if routes is None:
        return []
    with routes.lock:
        made = routes.made.pop(sid, [])
    client.loop.add_callback(routes.forget, sid)
    return made


def wait(call: DirectCall, timeout: float | None) -> bool:
    """Wait for the worker's answer; False if ``timeout`` passed first."""
    return call.done.wait(timeout)


def escape(call: DirectCall) -> None:
    """``call``'s future is about to be sent to the cluster (an argument of other work, or
    pickled): its key must exist there first. Waits for the answer (the call is running: what
    depends on it could not start before anyway): a finished call's key was named to the
    scheduler, an erred one's is a task raising its error (:func:`_erred_task`), ahead of
    anything sent after. The client's lock is let go meanwhile (a graph may be serialized under
    it, and the answer's handling takes it); on the client's own loop, where the answer is
    handled, waiting could never end: a clear error instead."""
    if call.done.is_set():
        return
    from dask_agents.errors import escape_error
    from dask_agents.worker_plugin import dask_compat

    if dask_compat.on_event_loop(call.client):
        a = call.ann
        raise escape_error(a.get("component", "?"), a.get("method"), call.session, call.key, "its client's event loop")
    with dask_compat.lock_released(getattr(call.client, "_refcount_lock", None)):
        call.done.wait()


def _erred_task(call: DirectCall) -> None:
    """On the client's loop: an erred direct call's key becomes a task raising its error, so
    what depends on it fails with that error, as on the scheduler path (one task per erred
    call: the error path only)."""
    import dask

    from dask_agents.annotation import ANNOTATION
    from dask_agents.runtime import reraise
    from dask_agents.worker_plugin import dask_compat

    try:
        # annotated (its worker logs no traceback for it) but not as a call: the call's record is
        # its worker's, which may still be on its way
        with dask.annotate(**{ANNOTATION: {**call.ann, "call": None}}):
            dask_compat.submit_key(call.client, reraise, call.error, key=call.key)
    except Exception:  # a closing client: nothing can depend on it any more
        pass


def escape_keys(client: Any, keys: Any) -> None:
    """Before a graph goes out: the direct calls still running among its dependencies
    ``keys`` are waited for (their keys exist once they answered)."""
    routes = routes_of(client)
    if routes is None:
        return
    for k in keys:
        call = routes.pending.get(k)
        if call is not None:
            escape(call)
