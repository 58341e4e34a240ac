"""An LLM engine hosted by a worker: vLLM in-process, stepped by one thread, many callers.

Why in-process: vLLM's default engine core is a child process, which daemonic Dask workers
(under a Nanny) cannot start; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps it in this process.
Why one stepping thread: concurrent calls are added to the same engine and batched by its
scheduler (continuous batching) instead of each holding a thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dask_agents.model_settings import ModelSettings
from dask_agents.worker_plugin.host import (_LOAD_LOCK, _STEP_LOCK, engine_priority, gather_completions, resolve,
                                           stream_deltas, wait_loaded)
from dask_agents.worker_plugin.host_kv import SessionKVHost
from dask_agents.worker_plugin.token_times import TokenTimes
from dask_agents.worker_plugin.sampling import completion_text, structured_outputs_config, tool_calls
from dask_agents.worker_plugin.tokenizer import ByteTokenizer, ModelTokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    token_ids: list[int]
    params: Any
    session: str | None
    future: Future
    engine_id: str = ""  # vLLM's own id for the request (it appends a suffix)
    completions: dict = field(default_factory=dict)  # index -> latest CompletionOutput (n > 1)
    streamed: dict = field(default_factory=dict)  # index -> (ids, characters) streamed so far


def before_import(settings: ModelSettings) -> None:
    """What must hold before vLLM is first imported in this process (its engine runs here, its
    log level and KV events are read from the environment)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from dask_agents.worker_plugin.logs import quiet_engines

    quiet_engines()  # vLLM reads its log level when first imported
    if settings.enable_prefix_caching:  # per-session KV control tracks the device's blocks from them
        from dask_agents.kv.runtime import vllm_compat

        for k, v in vllm_compat.KV_EVENTS_ENV.items():
            os.environ.setdefault(k, v)


class EngineHost(SessionKVHost):
    """One vLLM engine and the thread that steps it."""

    def __init__(self, name: str, settings: ModelSettings):
        self.name = name
        self.settings = settings
        self.tokenizer = ByteTokenizer() if settings.tokenizer == "byte" else None
        self.token_times = TokenTimes()  # first-token times (the registry reads TTFT/TPOT)
        self.stream_sinks: dict[str, Any] = {}  # streaming calls' delta sinks (host.stream_deltas)
        self.max_model_len = settings.max_model_len
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self._inbox: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._calls: queue.SimpleQueue[tuple[Any, Future]] = queue.SimpleQueue()
        self.kv: Any = None  # dask_agents.kv.runtime.engine_kv.EngineKV once loaded (per-session KV control)
        self.kv_manager: Any = None  # dask_agents.kv.runtime.manager.KVManager once loaded, unless kv-policy is "none"
        self._manager_failures = 0
        self._pending: dict[str, _Request] = {}
        self._engine: Any = None
        self._thread = threading.Thread(target=self._run, name=f"dask-agents-engine-{name}", daemon=True)
        self._closed = False
        self.crashed: BaseException | None = None  # why the engine died (restart it), None while healthy
        self.steps = 0
        self.counters = dict.fromkeys(("queries", "hits", "prefill_tokens", "decode_tokens"), 0)
        self.started_at: float | None = None
        self.load_seconds: float | None = None  # how long the load took, once loaded
        self.load_began: float | None = None  # when the load began, if before start() (a process host's child)
        self.geometry: Any = None  # kv.KVGeometry once loaded (None for models without a local config)
        self.vocab_size: int | None = None  # the model's, once loaded: token ids are checked against it
        # Per-session KV control is optional: when kv/runtime/vllm_compat.py rejects this vLLM or the
        # model's KV layout, the engine serves with plain prefix caching and says why here.
        self.kv_control = False
        self.kv_control_reason: str | None = "the engine has not loaded yet"
        # vLLM ids of requests admitted and not yet scheduled by vLLM: when a step fails, the
        # ones it scheduled first are the likely cause (see _fail_new_requests); None: the
        # scheduler could not be read, every request in flight is retried as for any crash
        self._unscheduled: set[str] | None = set()

    def start(self) -> None:
        """Start loading the engine in the background (idempotent)."""
        if not self._thread.is_alive() and self.started_at is None:
            self.started_at = time.time()
            self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until the engine is ready; re-raise a load failure."""
        wait_loaded(self, timeout)

    def _load(self) -> Any:
        from dask_agents.kv.runtime import vllm_compat

        s = self.settings
        before_import(s)
        events = vllm_compat.kv_events_config() if s.enable_prefix_caching else None
        from vllm import EngineArgs, LLMEngine

        vllm_compat.avoid_cpu_amx_attention()
        args = EngineArgs(
            model=s.model_path(),
            load_format=s.load_format,
            skip_tokenizer_init=self.tokenizer is not None,
            dtype=s.dtype,
            max_model_len=s.max_model_len,
            enable_prefix_caching=s.enable_prefix_caching,
            enforce_eager=s.enforce_eager,
            kv_cache_memory_bytes=s.kv_bytes(), structured_outputs_config=structured_outputs_config(s),
            scheduling_policy=s.scheduling,
            kv_events_config=events,
        )
        return LLMEngine.from_engine_args(args)

    def _geometry(self) -> Any:
        from dask_agents.kv import KVGeometry

        path = self.settings.model_path()
        if not os.path.isdir(path):
            return None
        block = self._engine.vllm_config.cache_config.block_size
        dtype = self.settings.dtype if self.settings.dtype != "auto" else "auto"
        return KVGeometry.from_model_dir(path, dtype, block)

    def _session_kv(self) -> Any:
        """Per-session KV control for the loaded engine (``dask_agents.kv.runtime.engine_kv.EngineKV``), or None.

        Optional, so it never stops the model from loading: when ``dask_agents.kv.runtime.vllm_compat`` rejects the
        vLLM version, the model's KV layout or its cache groups (or the tiers cannot be set up),
        the engine serves with vLLM's plain prefix caching, one warning says why, and
        ``kv_control``/``kv_control_reason`` report it (the engine report carries them)."""
        if not self.settings.enable_prefix_caching:
            # nothing is cached, so there is nothing to keep per session (a choice: no warning)
            self.kv_control_reason = "prefix caching is off (enable-prefix-caching: false)"
            return None
        from dask_agents.kv.runtime import vllm_compat
        from dask_agents.kv.runtime.engine_kv import EngineKV

        try:
            kv = EngineKV(vllm_compat.engine_parts(self._engine), self.settings.kv_tiers(self.name))
        except Exception as e:
            self.kv_control_reason = f"{type(e).__name__}: {e}"
            logger.warning("engine %s: per-session KV control is off, serving with vLLM's prefix caching "
                           "alone: %s", self.name, self.kv_control_reason)
            return None
        self.kv_control, self.kv_control_reason = True, None
        return kv

    def _make_manager(self) -> Any:
        import dask_agents.config as agents_config

        # unset on the model: the configured policy ("none": no manager)
        name = self.settings.kv_policy or str(agents_config.get("kv.policy") or "none")
        if self.kv is None or name == "none":
            return None
        from dask_agents.kv.runtime.manager import KVManager

        try:
            return KVManager(self.kv, name)
        except Exception as e:  # optional too: KV directives still work without a policy
            logger.warning("engine %s: KV policy %r is off: %s: %s", self.name, name, type(e).__name__, e)
            return None

    def sampling_params(self, max_tokens: int, temperature: float, seed: int | None,
                        priority: tuple = (), options: dict | None = None) -> Any:
        """vLLM sampling parameters for one call (``worker_plugin/sampling.py``).

        The call's priority travels beside them (vLLM takes it in ``add_request``)."""
        from dask_agents.worker_plugin.sampling import vllm_params

        params = vllm_params(self.settings, self.tokenizer, max_tokens, temperature, seed, options)
        return params, engine_priority(priority)

    def extract_tool_calls(self, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
        """A chat output's ``(content, tool calls)`` (``tool_calls``' shared rule)."""
        return tool_calls(self.settings, self.tokenizer, text, tools)

    def submit(self, request_id: str, token_ids: list[int], params: Any, session: str | None) -> Future:
        """Queue a request; the returned future resolves to vLLM's final RequestOutput."""
        fut: Future = Future()
        if self._closed:  # crashed (the caller retries on a restart) or closed
            fut.set_exception(self._stopped_error())
            return fut
        self.token_times.start(request_id)
        self._inbox.put(_Request(request_id, token_ids, params, session, fut))
        self._fail_if_gone()
        return fut

    def abort(self, request_id: str) -> None:
        """Stop a request its caller gave up on (frees its decode steps and KV blocks)."""
        def drop(_kv: Any = None) -> None:
            req = self._pending.pop(request_id, None)
            if req is not None:
                self._engine.abort_request([req.engine_id])
                self._finished(req)
                resolve(req.future, exc=RuntimeError(f"request {request_id} aborted"))

        if not self._closed:
            self._calls.put((drop, Future()))
            self._inbox.put(None)

    def _stopped(self) -> bool:
        return self._closed  # crashed (the caller retries on a restart) or closed

    def _gone(self) -> bool:
        return self.started_at is not None and not self._thread.is_alive()

    def _fail_if_gone(self) -> None:
        # Queued after the stepping thread ended (closed, failed to load, died): nobody would answer.
        if self._gone():
            self._drain(self._stopped_error())

    def _drain(self, exc: BaseException) -> None:
        """Fail everything queued or in flight (the stepping thread is ending or gone)."""
        for req in list(self._pending.values()):
            resolve(req.future, exc=exc)
        self._pending.clear()
        for item in self._take_inbox():
            resolve(item.future, exc=exc)
        self._fail_calls(exc)

    def _count(self, out: Any) -> None:
        """Token counters of a finished request (the engine thread's; ``stats`` reads them)."""
        prompt = len(out.prompt_token_ids or ())
        cached = int(out.num_cached_tokens or 0)
        c = self.counters
        c["queries"] += prompt
        c["hits"] += cached
        c["prefill_tokens"] += prompt - cached
        c["decode_tokens"] += sum(len(o.token_ids) for o in out.outputs)

    def stats(self) -> dict[str, Any]:
        """Token counters of finished requests (``queries``: prompt tokens, ``hits``: of them
        served from the prefix cache, ``prefill_tokens``: computed, ``decode_tokens``), and
        with per-session KV control also running and waiting requests, batch slots and KV blocks
        (used = referenced; free includes cached, evictable blocks), read as counts from another
        thread (the parts are not known without KV control)."""
        out: dict[str, Any] = {"steps": self.steps, **self.counters}
        kv = self.kv
        if kv is None:
            return out
        from dask_agents.kv.runtime import vllm_compat

        parts = kv.parts
        capacity = parts.num_blocks - 1  # the null block holds nothing
        free = min(capacity, vllm_compat.free_blocks(parts))
        empty = min(free, vllm_compat.empty_free_blocks(parts))
        # used: holding KV (referenced or cached); pinned: referenced (running requests and
        # retained sessions); cached: free but holding KV (evictable), as the emulated engine
        out.update(running=vllm_compat.running_requests(parts), waiting=vllm_compat.waiting_requests(parts),
                   max_batch=vllm_compat.max_running_requests(parts), block_size=parts.block_size,
                   capacity_blocks=capacity, free_blocks=free, used_blocks=capacity - empty,
                   pinned_blocks=capacity - free, cached_blocks=free - empty, retained_blocks=kv.pinned_blocks())
        return out

    def kv_report(self) -> dict | None:
        """Per-tier KV bytes (as of the engine thread's last snapshot), tier capacities and
        cumulative traffic, for telemetry; None before load or without KV control."""
        kv = self.kv
        if kv is None:
            return None
        parts, tiers, st = kv.parts, kv.tiers, kv.stats
        manager = self.kv_manager
        return {"kv_policy": manager.policy.name if manager is not None else "none",
                "kv_actions": self._manager_actions(),
                "kv_bytes": dict(kv.snapshot),
                "kv_capacity_bytes": {"device": parts.num_blocks * kv.bytes_per_block,
                                      "host": tiers.host_bytes, "disk": tiers.disk_bytes},
                "kv_traffic_bytes": {"offloaded": st.offloaded_bytes, "spilled": st.spilled_bytes,
                                     "restored": st.restored_bytes}}

    def _kv_or_raise(self) -> Any:
        if self.load_error is not None:
            raise RuntimeError(f"engine {self.name!r} failed to load: {self.load_error}")
        if self.kv is None:
            from dask_agents.kv.runtime.engine_kv import KVDirectiveError

            raise KVDirectiveError(f"engine {self.name!r} has no per-session KV control ({self.kv_control_reason})")
        return self.kv

    def _admit(self, req: _Request) -> None:
        from dask_agents.kv.runtime.vllm_compat import token_prompt

        if not req.future.set_running_or_notify_cancel():
            return  # its caller gave up before the engine saw it; from here on it cannot cancel
        params, priority = req.params
        try:
            req.engine_id = self._engine.add_request(
                req.request_id, token_prompt(req.token_ids), params,
                priority=priority if self.settings.scheduling == "priority" else 0, session_id=req.session)
            self._pending[req.request_id] = req
        except Exception as e:  # vLLM's own input checks refused it: fail this call only
            from dask_agents.errors import InvalidRequestError

            req.future.set_exception(InvalidRequestError(
                f"engine {self.name!r} refused request {req.request_id}: {type(e).__name__}: {e}"))
            return
        if self._unscheduled is not None:
            self._unscheduled.add(req.engine_id)
        self._kv_track("admit", req.session, req.engine_id)

    def _finished(self, req: _Request) -> None:
        if self._unscheduled is not None:
            self._unscheduled.discard(req.engine_id)
        self._kv_track("finish", req.session, req.engine_id)

    def _take(self, item: _Request | None) -> None:
        if item is not None:
            self._admit(item)

    def _stopped_error(self) -> BaseException:
        from dask_agents.errors import EngineStoppedError

        if self.crashed is not None:
            return EngineStoppedError(f"engine {self.name!r} crashed: {self.crashed!r}", crashed=True)
        return EngineStoppedError(f"engine {self.name!r} is closed")

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the engine died: fail what waits (callers retry on a restart)
            logger.exception("engine %s: stepping thread failed", self.name)
            # Kept without its traceback: its frames hold the engine (model runner, KV tensors),
            # which must be freed before a restarted engine allocates its own.
            self.crashed = RuntimeError(f"{type(e).__name__}: {e}")
            self._closed = True
            del e
        # Before the waiting calls hear of it: a caller that restarts the engine finds it gone.
        self._shutdown_engine()
        self._drain(self._stopped_error())

    def _shutdown_engine(self) -> None:
        """Shut the engine down through vLLM's own teardown, on this thread, before a successor
        may load (a restart joins this thread first). Its memory goes now; and vLLM's
        collection-time finalizer is spent: run later, under a restarted engine, it would destroy
        the process's distributed groups the successor uses ("pipeline model parallel group is
        not initialized"). See ``dask_agents.kv.runtime.vllm_compat.shutdown_engine``."""
        from dask_agents.kv.runtime import vllm_compat

        engine, self._engine = self._engine, None
        self.kv = self.kv_manager = None
        if engine is None:
            return
        try:
            with _STEP_LOCK:  # process-global state: not while another in-process engine loads or steps
                vllm_compat.shutdown_engine(engine)
        except Exception:
            logger.exception("engine %s: shutdown failed", self.name)

    def _note_scheduled(self) -> None:
        """Before a step: forget the requests vLLM has scheduled already (they are not new)."""
        if not self._unscheduled:
            return
        from dask_agents.kv.runtime import vllm_compat

        try:
            self._unscheduled -= vllm_compat.scheduled(self._engine, self._unscheduled)
        except Exception as e:  # another vLLM: a failing step retries every request, as before
            logger.warning("engine %s: cannot read vLLM's scheduler (%s: %s); a failing step will retry "
                           "every request in flight", self.name, type(e).__name__, e)
            self._unscheduled = None

    def _fail_new_requests(self, exc: BaseException) -> None:
        """A step failed: fail the requests it scheduled for the first time with EngineStepError.
        One of them is the likely cause (a request that passed every check yet breaks the model):
        retried, it would crash the restarted engine too and take the others' retries with it.
        The requests scheduled before are failed as crashed by ``_run``, and retried."""
        from dask_agents.errors import EngineStepError
        from dask_agents.kv.runtime import vllm_compat

        if not self._unscheduled:
            return
        try:
            new = vllm_compat.scheduled(self._engine, self._unscheduled)
        except Exception:  # the scheduler is unreadable: nobody is blamed, everyone is retried
            logger.debug("engine %s: cannot tell which requests the failing step scheduled first", self.name,
                         exc_info=True)
            return
        cause = f"{type(exc).__name__}: {exc}"
        for req in [r for r in self._pending.values() if r.engine_id in new]:
            del self._pending[req.request_id]
            logger.warning("engine %s: the step that first scheduled request %s failed (%s): failing it, not "
                           "retrying it", self.name, req.request_id, cause)
            resolve(req.future, exc=EngineStepError(
                f"engine {self.name!r} crashed ({cause}) in the step that first scheduled request "
                f"{req.request_id}: it is the likely cause, so it is not retried (requests scheduled before "
                "are retried on a restarted engine)"))

    def _serve(self) -> None:
        from dask_agents.kv.runtime import vllm_compat

        try:
            with _LOAD_LOCK, _STEP_LOCK:
                self._engine = self._load()
                try:  # our shutdown, not vLLM's finalizer, tears it down (see _shutdown_engine)
                    vllm_compat.adopt_engine(self._engine)
                except Exception as e:
                    logger.warning("engine %s: cannot take over vLLM's engine teardown: %s", self.name, e)
            self.vocab_size = vllm_compat.vocab_size(self._engine)
            if self.tokenizer is None:  # tokenizer: auto: the one the engine loaded, read by the worker too
                self.tokenizer = ModelTokenizer.load(self.settings.model_path())
            self.geometry = self._geometry()
            self.kv = self._session_kv()
            self.kv_manager = self._make_manager()
            from dask_agents.worker_plugin.logs import engine_loaded

            cache = self._engine.vllm_config.cache_config
            self.load_seconds = time.time() - (self.load_began or self.started_at or time.time())
            engine_loaded(self.name, self.settings.model, self.settings.kv_bytes(), self.load_seconds,
                          cache.num_gpu_blocks, cache.block_size)
        except BaseException as e:  # reported to every caller by wait_loaded
            logger.exception("loading engine %s failed", self.name)
            self.load_error = e
            self.loaded.set()
            self._run_calls()  # directives queued meanwhile fail with the load error
            return
        self.loaded.set()
        while not self._closed:
            self._run_calls()
            self._kv_poll()
            if not self._engine.has_unfinished_requests():
                try:  # idle: sleep until a request (or close) arrives
                    self._take(self._inbox.get(timeout=self._idle_wait()))
                except queue.Empty:
                    continue
            while True:  # admit everything that is waiting: it joins the next step's batch
                try:
                    self._take(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if self._closed:
                break
            if self._engine.has_unfinished_requests():
                # A failing step leaves vLLM's scheduler and block pool in an unknown state:
                # the engine is dead. The requests it scheduled first fail (EngineStepError);
                # the error propagates to _run, which fails every other waiting call with a
                # crashed EngineStoppedError; Engines restarts the engine and those calls retry.
                self._note_scheduled()
                try:
                    with _STEP_LOCK:  # one forward pass at a time in this process (see _STEP_LOCK)
                        outputs = self._engine.step()
                except BaseException as e:
                    self._fail_new_requests(e)
                    raise
                self.steps += 1
                for out in outputs:
                    req = self._pending.get(out.request_id)
                    if req is not None:
                        gather_completions(req.completions, out)
                        if out.outputs and out.outputs[0].token_ids:  # (the last step's too: 1 token)
                            self.token_times.token(req.request_id)
                        sink = self.stream_sinks.get(req.request_id) if self.stream_sinks else None
                        if sink is not None:
                            stream_deltas(req.streamed, out.outputs, sink, lambda c: completion_text(self.tokenizer, c))
                    if out.finished:
                        req = self._pending.pop(out.request_id, None)
                        if req is not None:
                            self._finished(req)
                            self._count(out)
                            resolve(req.future, result=out)
        self._run_calls()  # directives queued before close still get an answer

    def close(self) -> None:
        """Stop the stepping thread; in-flight requests fail with a clear error."""
        self._closed = True
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if not self._thread.is_alive():  # a thread still inside a step keeps its engine
            self._engine = None
