"""vLLM's AsyncLLM as an engine host: the usual form on GPU workers (``engine: vllm-async``).

AsyncLLM runs its engine core in a child process (the GPU's own event loop, CUDA graphs,
tensor parallelism), so the Dask worker that hosts it must not be daemonic
(``distributed.worker.daemon: false``, or a worker without a nanny). It runs here on a
private asyncio loop in one thread; calls submit from any thread and get a
``concurrent.futures.Future`` like ``EngineHost``'s, so ``Engines`` treats both alike.

Per-session KV control (``kv/runtime/engine_kv.py``) needs the block pool in this process, which
AsyncLLM keeps in its engine core. Lower tiers come through vLLM's KV connector API instead:
``kv-connector: dask-agents`` (``kv/runtime/connector.py``: a host tier of ``kv-host-bytes``
that saves each session's blocks when its request finishes and loads them back at its next
request, with the directives ``inspect``, ``offload`` and ``invalidate`` run in the engine core
through ``collective_rpc``; the others are refused, each with its reason), or
``kv-connector: lmcache`` (vLLM's ``LMCacheConnectorV1``, workflow-blind: every directive is
refused). vLLM's prefix cache serves each session's follow-ups either way, and the scheduler
routes a session to the engine that holds its KV.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from dask_agents.model_settings import ModelSettings, byte_size
from dask_agents.worker_plugin.host import _LOAD_LOCK, engine_priority, gather_completions, stream_deltas, wait_loaded
from dask_agents.worker_plugin.sampling import completion_text
from dask_agents.worker_plugin.host import resolve as _resolve
from dask_agents.worker_plugin.token_times import TokenTimes
from dask_agents.worker_plugin.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)


class AsyncEngineHost:
    """One vLLM AsyncLLM and the thread whose event loop drives it (the ``EngineHost`` interface,
    without per-session KV control)."""

    def __init__(self, name: str, settings: ModelSettings):
        self.name = name
        self.settings = settings
        self.tokenizer = ByteTokenizer() if settings.tokenizer == "byte" else None
        self.max_model_len = settings.max_model_len
        self.token_times = TokenTimes()  # first-token times (the registry reads TTFT/TPOT)
        self.stream_sinks: dict[str, Any] = {}  # streaming calls' delta sinks (host.stream_deltas)
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.crashed: BaseException | None = None
        self.kv: Any = None  # no in-process block pool: KV directives are refused
        self.kv_manager: Any = None
        # per-session directives through our KV connector only (kv-connector: dask-agents)
        self.kv_control = settings.kv_connector == "dask-agents"
        self.kv_control_reason = None if self.kv_control else (
            "engine: vllm-async keeps its block pool in the engine core's process; per-session KV control "
            "needs kv-connector: dask-agents (lmcache tiers are workflow-blind)")
        self.geometry: Any = None
        self.vocab_size: int | None = None  # the model's, once loaded: token ids are checked against it
        self.steps = 0  # finished requests (AsyncLLM does not expose its step count)
        self.started_at: float | None = None
        self.load_seconds: float | None = None  # how long the load took, once loaded
        self._engine: Any = None
        self._loop = asyncio.new_event_loop()
        self._tasks: dict[str, asyncio.Task] = {}
        # every future handed out and not yet settled: whatever the loop never got to (a submit
        # racing close) is failed when the loop ends, so no caller waits forever
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"dask-agents-async-engine-{name}", daemon=True)
        # kv-connector: offloading: the session-state hints received since the last request, sent
        # with the next one (vLLM's kv_hints) to our cache policy in the core's host tier
        self._hints: collections.deque = collections.deque(maxlen=4096)

    def start(self) -> None:
        """Start loading the engine in the background (idempotent)."""
        if self.started_at is None:
            self.started_at = time.time()
            self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until the engine is ready; re-raise a load failure."""
        wait_loaded(self, timeout)

    def _engine_args(self) -> Any:
        from vllm import AsyncEngineArgs

        from dask_agents.worker_plugin.sampling import structured_outputs_config

        s = self.settings
        kv_transfer, extension = None, None
        if s.kv_connector == "dask-agents":
            from dask_agents.kv.runtime import connector

            kv_transfer = connector.transfer_config(self.name, byte_size(s.kv_host_bytes))
            extension = f"{connector.__name__}.{connector.ControlExtension.__name__}"
        elif s.kv_connector == "lmcache":
            from vllm.config import KVTransferConfig

            kv_transfer = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
        elif s.kv_connector == "offloading":
            from vllm.config import KVTransferConfig

            from dask_agents import config as agents_config
            from dask_agents.kv.runtime.offload_policy import extra_config

            policy = s.kv_policy or str(agents_config.get("kv.policy"))
            kv_transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                           kv_connector_extra_config=extra_config(byte_size(s.kv_host_bytes), policy))
        return AsyncEngineArgs(
            model=s.model_path(), load_format=s.load_format, skip_tokenizer_init=self.tokenizer is not None,
            dtype=s.dtype, max_model_len=s.max_model_len, enable_prefix_caching=s.enable_prefix_caching,
            kv_cache_memory_bytes=s.kv_bytes(), scheduling_policy=s.scheduling,
            structured_outputs_config=structured_outputs_config(s),
            tensor_parallel_size=s.tensor_parallel_size, kv_transfer_config=kv_transfer,
            enforce_eager=s.enforce_eager, disable_log_stats=True,
            **({"worker_extension_cls": extension} if extension else {}),
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            import multiprocessing

            if multiprocessing.current_process().daemon:
                raise RuntimeError(
                    f"engine {self.name!r} (engine: vllm-async) starts vLLM's engine core in a child process, "
                    "which a daemonic worker process cannot have: start the worker with the Dask config "
                    "`distributed.worker.daemon: false` (or without a nanny), or use `engine: vllm`")
            from dask_agents.worker_plugin.logs import engine_loaded, quiet_engines

            quiet_engines()  # before vLLM is imported (the engine core inherits the environment)
            from dask_agents.kv.runtime.vllm_compat import ENGINE_MARKER

            os.environ[ENGINE_MARKER] = "1"  # the engine core applies vllm_compat.vllm_plugin
            with _LOAD_LOCK:  # vLLM's and transformers' lazy imports race between loading threads
                from vllm.v1.engine.async_llm import AsyncLLM

                self._engine = AsyncLLM.from_engine_args(self._engine_args())
            from dask_agents.kv.runtime import vllm_compat

            self.vocab_size = vllm_compat.vocab_size(self._engine)
            if self.tokenizer is None:  # tokenizer: auto: the one the engine loaded, read by the worker too
                from dask_agents.worker_plugin.tokenizer import ModelTokenizer

                self.tokenizer = ModelTokenizer.load(self.settings.model_path())
            self.load_seconds = time.time() - (self.started_at or time.time())
            engine_loaded(self.name, self.settings.model, self.settings.kv_bytes(), self.load_seconds)
        except BaseException as e:  # reported to every caller by wait_loaded
            logger.exception("loading engine %s failed", self.name)
            self.load_error = e
            self.loaded.set()
            return
        self.loaded.set()
        try:
            self._loop.run_forever()
        finally:
            engine, self._engine = self._engine, None
            if engine is not None:
                try:
                    engine.shutdown()
                except Exception:
                    logger.exception("engine %s: shutdown failed", self.name)
            with self._lock:
                self._closed = True
                self._loop.close()
                pending, self._pending = self._pending, {}
            for fut in pending.values():
                _resolve(fut, exc=self._stopped_error())

    def sampling_params(self, max_tokens: int, temperature: float, seed: int | None,
                        priority: tuple = (), options: dict | None = None) -> Any:
        """vLLM sampling parameters for one call, with its priority beside them."""
        from dask_agents.worker_plugin.sampling import vllm_params

        params = vllm_params(self.settings, self.tokenizer, max_tokens, temperature, seed, options)
        return params, engine_priority(priority)

    def extract_tool_calls(self, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
        """A chat output's ``(content, tool calls)`` (``sampling.tool_calls``)."""
        from dask_agents.worker_plugin.sampling import tool_calls

        return tool_calls(self.settings, self.tokenizer, text, tools)

    def submit(self, request_id: str, token_ids: list[int], params: Any, session: str | None) -> Future:
        """Start a request; the returned future resolves to vLLM's final RequestOutput."""
        fut: Future = Future()
        sampling, priority = params

        hints = self._take_hints(session)

        def begin() -> None:
            self._tasks[request_id] = self._loop.create_task(self._generate(request_id, token_ids, sampling,
                                                                            priority, fut, session, hints))
        with self._lock:
            if self._closed or self.crashed is not None or self._engine is None:
                fut.set_exception(self._stopped_error())
                return fut
            self._pending[request_id] = fut
            self.token_times.start(request_id)
            try:
                self._loop.call_soon_threadsafe(begin)
            except RuntimeError:  # the loop has just closed
                self._pending.pop(request_id, None)
                fut.set_exception(self._stopped_error())
        return fut

    async def _generate(self, request_id: str, token_ids: list[int], sampling: Any, priority: int,
                        fut: Future, session: str | None = None, hints: Any = None) -> None:
        from dask_agents.kv.runtime.vllm_compat import token_prompt

        final, seen, streamed = None, {}, {}
        try:
            priority = priority if self.settings.scheduling == "priority" else 0
            async for out in self._engine.generate(token_prompt(token_ids), sampling,
                                                   request_id, priority=priority, session_id=session,
                                                   **({"kv_hints": hints} if hints is not None else {})):
                if final is None and out.outputs and out.outputs[0].token_ids:
                    self.token_times.token(request_id)
                final = gather_completions(seen, out)
                sink = self.stream_sinks.get(request_id) if self.stream_sinks else None
                if sink is not None:
                    stream_deltas(streamed, out.outputs, sink, lambda c: completion_text(self.tokenizer, c))
            self.steps += 1
            _resolve(fut, result=final)
        except asyncio.CancelledError:  # aborted by its caller, or the host is closing
            _resolve(fut, exc=self._stopped_error() if self._closed else RuntimeError(f"request {request_id} aborted"))
        except Exception as e:
            if getattr(self._engine, "errored", True):  # the core died (or is gone): restart it
                self.crashed = RuntimeError(f"{type(e).__name__}: {e}")  # no traceback: frames hold memory
            _resolve(fut, exc=self._stopped_error() if self.crashed is not None else e)
        finally:
            self._tasks.pop(request_id, None)
            self._pending.pop(request_id, None)

    def stats(self) -> dict[str, Any]:
        """None here: AsyncLLM's scheduler runs in the engine core's process."""
        return {}

    def kv_report(self) -> dict | None:
        """None: no per-session KV tiers in this process (the connector's host tier is in the core's)."""
        return None

    def kv_hint(self, session: str, state: str, node: str | None = None, wait_key: str | None = None,
                at: float | None = None) -> Future | None:
        """With ``kv-connector: offloading``, kept for the next request to carry to the host
        tier's cache policy (``kv/runtime/offload_policy.py``; a done future); else ignored
        (None): no KV manager runs beside AsyncLLM."""
        if self.settings.kv_connector != "offloading":
            return None
        self._hints.append((session, state, node, wait_key, time.time() if at is None else float(at)))
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _take_hints(self, session: str | None) -> Any:
        """The hints the next request carries (None without ``kv-connector: offloading``)."""
        if self.settings.kv_connector != "offloading":
            return None
        from dask_agents.kv.runtime.offload_policy import envelope

        states = []
        while self._hints:
            try:
                states.append(self._hints.popleft())
            except IndexError:  # (taken by another request's submit meanwhile)
                break
        return envelope(session, states)

    def kv_directive(self, op: str, session: str, timeout: float = 60.0, **args: Any) -> dict:
        """See :meth:`kv_connector_directive`."""
        return self.kv_connector_directive(op, session, timeout, **args)

    def kv_session_end(self, session: str) -> None:
        """See :meth:`kv_connector_forget`; with ``kv-connector: offloading``, the session's end
        goes to the host tier's cache policy with the next request (its chunks go first)."""
        if self.settings.kv_connector == "offloading":
            self.kv_hint(session, "finished")
            return
        self.kv_connector_forget(session)

    def kv_connector_directive(self, op: str, session: str, timeout: float = 60.0, **args: Any) -> dict:
        """One KV directive through the engine's KV connector (``kv-connector: dask-agents``),
        run in the engine core between steps; KVDirectiveError naming the engine and the reason
        when this engine has no such connector or the directive is not available through one."""
        from dask_agents.kv.runtime import connector
        from dask_agents.kv.runtime.engine_kv import KVDirectiveError

        if self.settings.kv_connector != "dask-agents":
            raise KVDirectiveError(f"the engine for {self.name!r} (AsyncEngineHost) has no per-session KV control: "
                                   f"{self.kv_control_reason}")
        if args:
            raise KVDirectiveError(f"KV directive {op!r} through the KV connector takes no arguments; "
                                   f"got {', '.join(map(repr, sorted(args)))}")
        connector.check(op)  # here, before a round trip to the engine core
        if self._engine is None or self._closed:
            raise KVDirectiveError(f"engine {self.name!r} is not running")
        rpc = self._engine.collective_rpc("dask_agents_kv", args=(self.name, op, session))
        try:
            results = asyncio.run_coroutine_threadsafe(rpc, self._loop).result(timeout)
        except Exception as e:
            cause = e.__cause__ or e
            if isinstance(cause, KVDirectiveError) or "KVDirectiveError" in str(e):
                raise KVDirectiveError(f"engine {self.name!r}: {e}") from None
            raise
        return results[0]

    def kv_connector_forget(self, session: str) -> None:
        """The session ended: invalidate its KV through the connector (``kv-connector:
        dask-agents``), asynchronously (nobody waits; a failure is logged)."""
        if self.settings.kv_connector != "dask-agents" or self._engine is None or self._closed:
            return

        def done(f: Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                logger.warning("engine %s: invalidating the KV of session %s failed: %s", self.name, session,
                               f.exception())
        try:
            rpc = self._engine.collective_rpc("dask_agents_kv", args=(self.name, "invalidate", session))
            asyncio.run_coroutine_threadsafe(rpc, self._loop).add_done_callback(done)
        except RuntimeError:  # the loop has just closed
            pass

    def _stopped_error(self) -> BaseException:
        from dask_agents.errors import EngineStoppedError

        if self.crashed is not None:
            return EngineStoppedError(f"engine {self.name!r} crashed: {self.crashed!r}", crashed=True)
        return EngineStoppedError(f"engine {self.name!r} is closed")

    def abort(self, request_id: str) -> None:
        """Stop a request its caller gave up on."""
        def cancel() -> None:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()  # AsyncLLM aborts a request whose generator is closed
        if not self._closed and self._loop.is_running():
            self._loop.call_soon_threadsafe(cancel)

    def _shutdown_and_stop(self) -> None:
        # on the loop, while it runs: AsyncLLM cancels its output handler itself (stopping the
        # loop under it first logs a failed handler)
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine %s: shutdown failed", self.name)
        self._loop.stop()

    def close(self) -> None:
        """Stop the engine (its core process too); requests in flight fail with a clear error."""
        self._closed = True
        if self._loop.is_running():
            def stop() -> None:
                for task in list(self._tasks.values()):
                    task.cancel()
                self._loop.call_soon(self._shutdown_and_stop)
            self._loop.call_soon_threadsafe(stop)
        if self._thread.is_alive():
            self._thread.join(timeout=60)
