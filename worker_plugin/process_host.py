"""An engine in its own process beside the worker (``process: true`` on a model entry): vLLM's
production layout for the engines dask-agents steps itself (``engine: vllm`` or ``emulated``).

Why: an engine stepped in a thread of the worker shares the worker's GIL with every component,
tool and Dask's own event loop there. Measured (``benchmarks/engine_isolation.py``): the real
CPU engine's tokens/s fell 2.9x with agent work in its worker, 1.07x with the same work in
another worker. vLLM runs its engine core in a process of its own for this reason
(``engine: vllm-async``), but then the block pool is out of reach and per-session KV control is
reduced to what a KV connector can do. Here the whole host, per-session KV control and the KV
manager included, runs in a child process; the worker keeps a thin proxy with the same
interface (:class:`~dask_agents.worker_plugin.host.EngineHostAPI`), so the registry, the runtime
and KV directives treat it like any host.

The child is started with :mod:`subprocess` (not :mod:`multiprocessing`: Dask's nanny makes
worker processes daemonic, and daemonic processes may not have children of their own) and talks
over two inherited pipes with :class:`multiprocessing.connection.Connection` framing (pickle,
between this worker and the child it started: nothing from outside reaches them; errors travel
as their class's name and text and are rebuilt from names we know, :func:`_rebuild`). Requests
and calls go down; outputs, first-token times and replies come up, read by one thread of the
proxy that settles the callers' futures. If the child dies, every caller waiting gets
:class:`~dask_agents.errors.EngineStoppedError` and ``crashed`` is set, so the registry restarts
the engine as it does an in-process one. The child exits when its pipe closes (the worker went
away), so it never outlives its worker.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from dask_agents.model_settings import ModelSettings
from dask_agents.worker_plugin.host import plain_output, resolve, wait_loaded
from dask_agents.worker_plugin.token_times import TokenTimes
from dask_agents.worker_plugin.tokenizer import ByteTokenizer, ModelTokenizer

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 900.0  # a real model may take minutes to load; the child says when it failed
CALLS = ("stats", "kv_report", "kv_directive", "kv_hint", "kv_session_end", "extract_tool_calls")
"""The host's methods the proxy forwards as calls (each answered by a reply)."""


@dataclass(frozen=True)
class Params:
    """A call's sampling parameters as the proxy holds them; the child turns them into the
    engine's own (vLLM's ``SamplingParams`` need not be built, or imported, in the worker)."""

    max_tokens: int
    temperature: float
    seed: int | None
    priority: tuple = ()
    options: dict | None = None


class ProcessEngineHost:
    """The worker's side of an engine in its own process (see the module docstring)."""

    def __init__(self, name: str, settings: ModelSettings):
        self.name = name
        self.settings = settings
        inner_emulated = settings.engine == "emulated"
        byte = settings.tokenizer == "byte" or (inner_emulated and settings.tokenizer == "auto")
        # as the inner host's: the byte tokenizer, or the model's own (loaded when the engine is)
        self.tokenizer: ByteTokenizer | ModelTokenizer | None = ByteTokenizer() if byte else None
        self.max_model_len = settings.max_model_len
        self.token_times = TokenTimes()
        self.stream_sinks: dict[str, Any] = {}  # streaming calls' delta sinks: the child sends deltas
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.load_seconds: float | None = None
        self.started_at: float | None = None
        self.crashed: BaseException | None = None
        self.vocab_size: int | None = None
        self.geometry: Any = None
        self.steps = 0
        # until the child says: directives are refused with this reason
        self.kv_control = False
        self.kv_control_reason: str | None = "the engine's process has not loaded yet"
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None
        self._down: Connection | None = None  # proxy -> child
        self._send_lock = threading.Lock()
        self._pending: dict[str, Future] = {}  # request id -> its caller's future
        self._replies: dict[int, Future] = {}  # call id -> its caller's future
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the two maps against the reader thread
        self._closing = False
        self._reader: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the child process (idempotent); it loads the engine and says when it is ready."""
        if self.started_at is not None:
            return
        self.started_at = time.time()
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        settings = self.settings.model_dump(by_alias=True)
        settings["process"] = False
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "dask_agents.worker_plugin.process_host", str(down_r), str(up_w)],
                pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL, close_fds=True)
        except Exception as e:
            for fd in (down_r, down_w, up_r, up_w):
                os.close(fd)
            self.load_error = e
            self.loaded.set()
            return
        os.close(down_r)
        os.close(up_w)
        self.pid = self._proc.pid
        self._down = Connection(down_w, readable=False)
        up = Connection(up_r, writable=False)
        self._reader = threading.Thread(target=self._read, args=(up,), name=f"dask-agents-engine-proc-{self.name}",
                                        daemon=True)
        self._reader.start()  # first: a child that dies at once is seen (EOF) and reported as a load error
        import dask

        try:  # the worker's agents.* configuration goes with it (the KV policy, the emulation's time scale)
            self._send(("init", self.name, settings, dask.config.get("agents", default={})))
        except Exception as e:  # it died before reading: the reader reports the exit too
            logger.error("engine %s: its process (pid %s) did not take its settings: %s", self.name, self.pid, e)

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until the child loaded the engine; re-raise its load failure."""
        wait_loaded(self, LOAD_TIMEOUT_S if timeout is None else timeout)

    def close(self) -> None:
        """Stop the engine and its process; callers still waiting get EngineStoppedError."""
        self._closing = True
        try:
            self._send(("close",))
        except Exception:  # already gone
            pass
        if self._down is not None:
            try:
                self._down.close()
            except OSError:
                pass
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._fail_all(self._stopped_error())

    # -- the engine's interface -------------------------------------------------------------------
    def sampling_params(self, max_tokens: int, temperature: float, seed: int | None, priority: tuple = (),
                        options: dict | None = None) -> Params:
        """The call's parameters (the child builds the engine's own from them)."""
        return Params(max_tokens, temperature, seed, tuple(priority), options)

    def extract_tool_calls(self, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
        """A chat output's ``(content, tool calls)``, parsed in the child (vLLM's tool parsers are
        there: the worker does not import vLLM for them)."""
        content, calls = self._call("extract_tool_calls", text, tools, timeout=30.0)
        return content, calls

    def submit(self, request_id: str, token_ids: list[int], params: Any, session: str | None) -> Future:
        """Queue one request in the child; the future resolves to the engine's output."""
        fut: Future = Future()
        if self.crashed is not None or self._closing or self._down is None:
            fut.set_exception(self._stopped_error())
            return fut
        with self._lock:
            self._pending[request_id] = fut
        self.token_times.start(request_id)
        try:
            # a streaming call: the child sends its deltas ("delta" messages) to this host's sink
            self._send(("submit", request_id, list(token_ids), params, session, request_id in self.stream_sinks))
        except Exception as e:  # the pipe broke: the reader fails everyone as it sees EOF
            with self._lock:
                self._pending.pop(request_id, None)
            if isinstance(e, OSError) and self.crashed is None and not self._closing:
                # the child is gone: say so now, not when the reader gets to the EOF, so the
                # registry's retry restarts the engine instead of handing this host back
                self.crashed = e
            resolve(fut, exc=self._stopped_error(e))
        return fut

    def abort(self, request_id: str) -> None:
        """Stop a request its caller gave up on."""
        try:
            self._send(("abort", request_id))
        except Exception:  # gone: nothing runs there any more
            pass

    def stats(self) -> dict[str, Any]:
        """The engine's counters, from the child (empty while it loads or after it died)."""
        if not self.loaded.is_set() or self.crashed is not None or self.load_error is not None:
            return {}
        try:
            st = self._call("stats", timeout=10.0)
        except Exception:  # a busy or dying child: the next report has them
            return {}
        self.steps = int(st.get("steps", self.steps) or 0)
        return st

    def kv_report(self) -> dict | None:
        """Per-session KV tiers, traffic and policy actions (the child's host's)."""
        if not self.kv_control:
            return None
        try:
            return self._call("kv_report", timeout=10.0)
        except Exception:
            return None

    def kv_directive(self, op: str, session: str, timeout: float = 60.0, **args: Any) -> dict:
        """Apply one KV directive in the child, beside the engine's block pool."""
        if not self.kv_control:
            from dask_agents.kv.runtime.engine_kv import KVDirectiveError

            raise KVDirectiveError(f"engine {self.name!r} has no per-session KV control ({self.kv_control_reason})")
        # the child waits up to ``timeout`` for the stepping thread; the proxy a little longer
        return self._call("kv_directive", op, session, timeout=timeout + 5.0, directive_timeout=timeout, **args)

    def kv_hint(self, session: str, state: str, node: str | None = None, wait_key: str | None = None,
                at: float | None = None) -> Future | None:
        """Tell the child's KV manager a session's workflow state (non-blocking)."""
        if not self.kv_control or self.crashed is not None:
            return None
        try:
            return self._call_async("kv_hint", session, state, node=node, wait_key=wait_key, at=at)
        except Exception:
            return None

    def kv_session_end(self, session: str) -> None:
        """The session ended: the child drops its KV."""
        try:
            self._call_async("kv_session_end", session)
        except Exception:  # gone: its KV went with it
            pass

    # -- the pipe -----------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        if self._down is None:
            raise RuntimeError("the engine's process is not running")
        with self._send_lock:
            self._down.send(msg)

    def _call_async(self, method: str, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        cid = next(self._ids)
        with self._lock:
            self._replies[cid] = fut
        try:
            self._send(("call", cid, method, args, kwargs))
        except Exception as e:
            with self._lock:
                self._replies.pop(cid, None)
            resolve(fut, exc=self._stopped_error(e))
        return fut

    def _call(self, method: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
        return self._call_async(method, *args, **kwargs).result(timeout)

    def _read(self, up: Connection) -> None:
        """The reader thread: settle what the child reports, until its pipe closes."""
        why: BaseException | None = None
        try:
            while True:
                msg = up.recv()
                kind = msg[0]
                if kind == "done":
                    _k, rid, out = msg
                    with self._lock:
                        fut = self._pending.pop(rid, None)
                    if fut is not None:
                        resolve(fut, out)
                elif kind == "failed":
                    _k, rid, error = msg
                    with self._lock:
                        fut = self._pending.pop(rid, None)
                    if fut is not None:
                        resolve(fut, exc=_rebuild(error))
                elif kind == "token":
                    self.token_times.token(msg[1], msg[2])
                elif kind == "delta":
                    sink = self.stream_sinks.get(msg[1])
                    if sink is not None:
                        sink(*msg[2:])
                elif kind == "reply":
                    _k, cid, ok, value = msg
                    with self._lock:
                        fut = self._replies.pop(cid, None)
                    if fut is not None:
                        resolve(fut, value) if ok else resolve(fut, exc=_rebuild(value))
                elif kind == "loaded":
                    info = msg[1]
                    if self.tokenizer is None:  # tokenizer: auto: the worker encodes with the model's own
                        try:
                            self.tokenizer = ModelTokenizer.load(self.settings.model_path())
                        except Exception as e:  # the engine loaded, but the worker cannot encode for it
                            self.load_error = e
                            self.loaded.set()
                            continue
                    self.vocab_size, self.geometry = info["vocab_size"], info["geometry"]
                    self.kv_control, self.kv_control_reason = info["kv_control"], info["kv_control_reason"]
                    self.load_seconds = time.time() - (self.started_at or time.time())
                    self.loaded.set()
                elif kind == "load_error":
                    self.load_error = _rebuild(msg[1])
                    self.loaded.set()
                elif kind == "crashed":
                    why = _rebuild(msg[1])
        except (EOFError, OSError) as e:
            why = why or e
        except Exception as e:  # an unpicklable message: the channel can no longer be trusted
            logger.exception("engine %s: its process sent what could not be read", self.name)
            why = e
        finally:
            up.close()
        if not self._closing and self.load_error is None:  # (a failed load ends the child: not a crash)
            code = self._proc.poll() if self._proc is not None else None
            self.crashed = why if isinstance(why, BaseException) and not isinstance(why, EOFError) else \
                RuntimeError(f"the engine's process exited (code {code})")
            logger.error("engine %s: its process (pid %s) is gone: %s", self.name, self.pid, self.crashed)
            if not self.loaded.is_set():
                self.load_error = self.crashed
                self.loaded.set()
        self._fail_all(self._stopped_error())

    def _stopped_error(self, cause: BaseException | None = None) -> BaseException:
        from dask_agents.errors import EngineStoppedError

        cause = cause or self.crashed
        if cause is not None and not self._closing:
            return EngineStoppedError(f"engine {self.name!r} in its own process (pid {self.pid}) stopped: {cause!r}",
                                      crashed=True)
        return EngineStoppedError(f"engine {self.name!r} was stopped")

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            replies, self._replies = self._replies, {}
        for fut in [*pending.values(), *replies.values()]:
            resolve(fut, exc=exc)


# -- the child ----------------------------------------------------------------------------------------

class _Child:
    """The engine host in the child process and the loop that serves the proxy."""

    def __init__(self, down: Connection, up: Connection):
        self.down, self.up = down, up
        self.lock = threading.Lock()  # the up pipe is written by the loop and by futures' callbacks
        self.host: Any = None

    def send(self, msg: tuple) -> None:
        """Send one message up. One that does not pickle (an engine's exotic error or output)
        is replaced by a failure naming why: its caller must hear something."""
        try:
            with self.lock:
                self.up.send(msg)  # pickled whole before any byte is written
        except (BrokenPipeError, EOFError, OSError):
            pass  # the worker went away: the loop ends at its next read
        except Exception as e:
            kind, why = msg[0], _portable(RuntimeError(f"the engine's answer could not be sent from its process: {e}"))
            if kind in ("done", "failed"):
                fallback: tuple = ("failed", msg[1], why)
            elif kind == "reply":
                fallback = ("reply", msg[1], False, why)
            else:
                return
            with self.lock:
                self.up.send(fallback)

    def serve(self) -> None:
        msg = self.down.recv()
        _k, name, raw, agents = msg
        began = time.time()
        try:
            import dask

            # the worker's agents.* configuration (the KV policy, the emulation's time scale...)
            dask.config.update(dask.config.config, {"agents": agents}, priority="new")
            settings = ModelSettings(**raw)
            _import_engine(settings)
            self.host = _inner_host(name, settings)
            self.host.load_began = began  # (its load time, logged, counts the import)
            self._watch_tokens()
            self.host.start()
            self.host.wait_loaded(LOAD_TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 (reported to the worker, which raises it to callers)
            self.send(("load_error", _portable(e)))
            return
        h = self.host
        self.send(("loaded", {"vocab_size": h.vocab_size, "geometry": h.geometry, "kv_control": h.kv_control,
                              "kv_control_reason": h.kv_control_reason}))
        threading.Thread(target=self._watch_crash, name="dask-agents-engine-crash", daemon=True).start()
        while True:
            try:
                msg = self.down.recv()
            except (EOFError, OSError):
                break  # the worker went away: so does its engine
            kind = msg[0]
            if kind == "close":
                break
            if kind == "submit":
                self._submit(*msg[1:])
            elif kind == "abort":
                h.abort(msg[1])
            elif kind == "call":
                self._call(*msg[1:])
        try:
            h.close()
        except Exception:  # exiting anyway
            pass

    def _watch_tokens(self) -> None:
        """Forward each request's first-token time (TTFT) as the host stamps it."""
        times, send = self.host.token_times, self.send
        stamp = times.token

        def token(request_id: str, at: float | None = None) -> bool:
            at = time.time() if at is None else at
            first = stamp(request_id, at)
            if first:
                send(("token", request_id, at))
            return first

        times.token = token

    def _watch_crash(self) -> None:
        """The engine's own crash (its stepping thread died): tell the worker, then exit."""
        while self.host.crashed is None:
            time.sleep(0.5)
        self.send(("crashed", _portable(self.host.crashed)))
        os._exit(3)

    def _submit(self, rid: str, token_ids: list[int], p: Params, session: str | None, stream: bool = False) -> None:
        h = self.host
        if stream:  # each step's new output goes to the worker's sink, ahead of the result
            send = self.send
            h.stream_sinks[rid] = lambda index, text, ids: send(("delta", rid, index, text, ids))
        try:
            params = h.sampling_params(p.max_tokens, p.temperature, p.seed, p.priority, p.options)
            fut = h.submit(rid, token_ids, params, session)
        except BaseException as e:  # noqa: BLE001
            h.stream_sinks.pop(rid, None)
            self.send(("failed", rid, _portable(e)))
            return

        def done(f: Future) -> None:
            h.stream_sinks.pop(rid, None)
            exc = f.exception()
            self.send(("failed", rid, _portable(exc)) if exc is not None else ("done", rid, plain_output(f.result())))

        fut.add_done_callback(done)

    def _call(self, cid: int, method: str, args: tuple, kwargs: dict) -> None:
        if method not in CALLS:
            self.send(("reply", cid, False, _portable(ValueError(f"not a host call: {method!r}"))))
            return
        if method == "kv_directive":
            kwargs = dict(kwargs)
            kwargs["timeout"] = kwargs.pop("directive_timeout", 60.0)
            # a directive waits for the stepping thread: not on this loop, which feeds that thread
            threading.Thread(target=self._reply, args=(cid, method, args, kwargs), daemon=True).start()
            return
        self._reply(cid, method, args, kwargs)

    def _reply(self, cid: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            value = getattr(self.host, method)(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001
            self.send(("reply", cid, False, _portable(e)))
            return
        if isinstance(value, Future):  # kv_hint: answer when it is done
            value.add_done_callback(lambda f: self.send(("reply", cid, True, None) if f.exception() is None
                                                        else ("reply", cid, False, _portable(f.exception()))))
            return
        self.send(("reply", cid, True, value))


def _import_engine(settings: ModelSettings) -> None:
    """Import the engine's library with Python's cyclic collector off, then freeze the heap.

    Why: importing vLLM (with torch and transformers) makes a large heap of long-lived objects
    (modules, classes, functions), none of them garbage, and the automatic collections the
    allocations trigger walk it again and again; vLLM's load then calls
    ``gc.collect()`` five times, each walking all of them. Measured on the built-in model, one
    engine alone on this machine: 8.0-8.7 s from the child's start to a loaded engine, 6.0-6.2 s
    with the collector off for the import and the import's heap frozen (``gc.freeze``, which
    vLLM does itself once loaded). This process hosts one engine, so what the import made lives
    as long as it does: nothing is kept that would otherwise be freed. (``main`` turned the
    collector off when the process started.)"""
    import gc
    import importlib

    try:
        if settings.engine == "vllm":
            from dask_agents.worker_plugin.vllm_host import before_import

            before_import(settings)
            importlib.import_module("vllm.v1.engine.llm_engine")  # (the host's loader uses it)
    finally:
        gc.enable()
        gc.freeze()


def _inner_host(name: str, settings: ModelSettings) -> Any:
    """The host that runs in the child: the engine stepped in this process (``process: true``
    is for ``engine: vllm`` and ``emulated``)."""
    if settings.engine == "emulated":
        from dask_agents.worker_plugin.emulated import EmulatedEngineHost

        return EmulatedEngineHost(name, settings)
    from dask_agents.worker_plugin.vllm_host import EngineHost

    return EngineHost(name, settings)


def _portable(e: BaseException) -> tuple:
    """``e`` as it crosses the pipe: its class's module and name, its text and whether it marks a
    crash (not the exception object: the proxy rebuilds it from names it knows, so nothing
    arbitrary is unpickled and an exception whose class cannot be rebuilt still arrives)."""
    return (type(e).__module__, type(e).__qualname__, str(e), bool(getattr(e, "crashed", False)),
            getattr(e, "name", None) if isinstance(e, ImportError) else None)


def _rebuild(error: tuple) -> BaseException:
    """The exception the child sent (:func:`_portable`): the same class for ours (``dask_agents.*``)
    and Python's built-in ones, else a RuntimeError naming it."""
    import builtins
    import importlib

    module, name, text, crashed, import_name = error
    cls: Any = None
    if module == "builtins":
        cls = getattr(builtins, name, None)
    elif module.startswith("dask_agents."):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            cls = None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        try:
            from dask_agents.errors import EngineStoppedError

            if issubclass(cls, EngineStoppedError):
                return cls(text, crashed=crashed)
            if issubclass(cls, ImportError):  # its module's name says what to install
                return cls(text, name=import_name)
            return cls(text)
        except Exception:  # a constructor that wants more: the text still arrives
            pass
    return RuntimeError(f"{module}.{name}: {text}")


def main(argv: list[str]) -> None:
    """The child's entry point: ``python -m dask_agents.worker_plugin.process_host DOWN_FD UP_FD``."""
    import gc
    import signal

    # Ctrl-C in the terminal reaches the whole process group: the engine is its worker's to stop
    # (it exits when its pipe closes), not the terminal's; dying on it printed tracebacks and
    # failed the calls in flight before the driver could end its sessions.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.disable()  # until the engine's library is imported (_import_engine)
    down = Connection(int(argv[0]), writable=False)
    up = Connection(int(argv[1]), readable=False)
    try:
        _Child(down, up).serve()
    finally:
        os._exit(0)  # no interpreter teardown waiting on the engine's threads


if __name__ == "__main__":
    main(sys.argv[1:])
