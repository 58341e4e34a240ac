"""LLM engines hosted by a worker: vLLM in-process, stepped by one thread, many callers.

Why in-process: vLLM's default engine core is a child process, which daemonic Dask workers
(under a Nanny) cannot start; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps it in this process.
Why one stepping thread: concurrent calls are added to the same engine and batched by its
scheduler (continuous batching) instead of each holding a thread.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


from dask_agents.model_settings import ModelSettings
from dask_agents.worker_plugin.host_kv import SessionKVHost
from dask_agents.worker_plugin.token_times import TokenTimes
from dask_agents.worker_plugin.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)
# vLLM keeps process-global state that every in-process engine of this process shares: the
# parallel groups (built at load, destroyed by the last shutdown) and the forward context (set
# by each forward pass, a load's warm-up included). Two engines loading, stepping or shutting
# down at once in one process (in-process workers, or two models) race on it: measured here, two
# engines stepping concurrently returned each other's tokens. Loads (and vLLM's lazy imports,
# also for AsyncLLM, whose core runs elsewhere) hold _LOAD_LOCK; forward passes and shutdowns
# hold _STEP_LOCK; an in-process load holds both, in that order.
_LOAD_LOCK = threading.Lock()
_STEP_LOCK = threading.Lock()
# A crashed engine is restarted at most this often per model: one that dies on every load or
# step then fails its calls with a clear error instead of reloading forever.
RESTARTS_MAX = 3
RESTART_WINDOW_S = 300.0


def wait_loaded(host: Any, timeout: float | None = None) -> None:
    """Block until ``host`` (a real or emulated engine host) is loaded; re-raise its load failure."""
    if not host.loaded.wait(timeout):
        raise TimeoutError(f"engine for model {host.name!r} did not load within {timeout}s")
    if host.load_error is not None:
        from dask_agents.errors import INSTALL_HINT, EngineLoadError

        e = host.load_error
        missing = isinstance(e, ImportError) and (getattr(e, "name", None) or "").split(".")[0] in ("vllm", "torch")
        raise EngineLoadError(f"engine for model {host.name!r} failed to load: {type(e).__name__}: {e}"
                              + (f"; {INSTALL_HINT}" if missing else "")) from None


# Seeds torch's generators take (vLLM seeds one per request inside the step: a larger one crashes it).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1



@dataclass
class _Request:
    request_id: str
    token_ids: list[int]
    params: Any
    session: str | None
    future: Future
    engine_id: str = ""  # vLLM's own id for the request (it appends a suffix)


class EngineHost(SessionKVHost):
    """One vLLM engine and the thread that steps it."""

    def __init__(self, name: str, settings: ModelSettings):
        self.name = name
        self.settings = settings
        self.tokenizer = ByteTokenizer() if settings.tokenizer == "byte" else None
        self.token_times = TokenTimes()  # first-token times (the registry reads TTFT/TPOT)
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
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from dask_agents.worker_plugin.logs import quiet_engines

        quiet_engines()  # before vLLM is imported: it reads its log level then
        from dask_agents.kv.runtime import vllm_compat

        s = self.settings
        events = None
        if s.enable_prefix_caching:  # per-session KV control tracks the device's blocks from them
            for k, v in vllm_compat.KV_EVENTS_ENV.items():
                os.environ.setdefault(k, v)
            events = vllm_compat.kv_events_config()
        from vllm import EngineArgs, LLMEngine

        args = EngineArgs(
            model=s.model_path(),
            load_format=s.load_format,
            skip_tokenizer_init=self.tokenizer is not None,
            dtype=s.dtype,
            max_model_len=s.max_model_len,
            enable_prefix_caching=s.enable_prefix_caching,
            enforce_eager=s.enforce_eager,
            kv_cache_memory_bytes=s.kv_bytes(),
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
        name = self.settings.kv_policy_name()
        if self.kv is None or name == "none":
            return None
        from dask_agents.kv.runtime.manager import KVManager

        try:
            return KVManager(self.kv, name)
        except Exception as e:  # optional too: KV directives still work without a policy
            logger.warning("engine %s: KV policy %r is off: %s: %s", self.name, name, type(e).__name__, e)
            return None

    def sampling_params(self, max_tokens: int, temperature: float, seed: int | None,
                        priority: tuple = ()) -> Any:
        """vLLM sampling parameters for one call (EOS ignored: agents ask for a token budget).

        The call's priority travels beside them (vLLM takes it in ``add_request``)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                ignore_eos=True, detokenize=False)
        return params, engine_priority(priority)

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
                _resolve(req.future, exc=RuntimeError(f"request {request_id} aborted"))

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
            _resolve(req.future, exc=exc)
        self._pending.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _resolve(item.future, exc=exc)
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
        from vllm.inputs import TokensPrompt

        if not req.future.set_running_or_notify_cancel():
            return  # its caller gave up before the engine saw it; from here on it cannot cancel
        params, priority = req.params
        try:
            req.engine_id = self._engine.add_request(
                req.request_id, TokensPrompt(prompt_token_ids=req.token_ids), params,
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
            _resolve(req.future, exc=EngineStepError(
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
            self.geometry = self._geometry()
            self.kv = self._session_kv()
            self.kv_manager = self._make_manager()
            from dask_agents.worker_plugin.logs import engine_loaded

            cache = self._engine.vllm_config.cache_config
            self.load_seconds = time.time() - (self.started_at or time.time())
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
                    if out.outputs and out.outputs[0].token_ids:  # (the last step's too: 1 token)
                        req = self._pending.get(out.request_id)
                        if req is not None:
                            self.token_times.token(req.request_id)
                    if out.finished:
                        req = self._pending.pop(out.request_id, None)
                        if req is not None:
                            self._finished(req)
                            self._count(out)
                            _resolve(req.future, result=out)
        self._run_calls()  # directives queued before close still get an answer

    def close(self) -> None:
        """Stop the stepping thread; in-flight requests fail with a clear error."""
        self._closed = True
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if not self._thread.is_alive():  # a thread still inside a step keeps its engine
            self._engine = None


KV_OPS = ("inspect", "retain", "release", "offload", "prefetch", "invalidate")
# the keyword arguments each directive takes (EngineKV's signatures): anything else is refused
# before it reaches an engine, where it would raise a bare TypeError on the stepping thread
KV_OP_ARGS = {"inspect": (), "retain": ("ttl_s",), "release": (), "offload": ("tier", "blocks"),
              "prefetch": ("max_blocks",), "invalidate": ()}


def _resolve(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Settle ``fut`` unless it already is (cancelled by its caller, or failed by a drain)."""
    if fut.done():
        return
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except Exception:  # InvalidStateError: settled concurrently
        pass


def engine_priority(priority: tuple) -> int:
    """The control plane's priority tuple as the int vLLM takes (smaller runs first).

    Only the workflow part matters inside an engine: fair-share starvation, then progress
    (``(user, -starved, -progress, -kv_resident, arrival)``; vLLM breaks ties by arrival)."""
    if len(priority) != 5:
        return 0
    user, starved, progress = (int(x) for x in priority[:3])
    return (user * 2 + starved) * 1_000_000 + max(progress, -999_999)


def task_priority(key: str) -> tuple:
    """The current priority of the running task ``key`` on this worker (``()`` if unknown)."""
    from distributed import get_worker

    from dask_agents.worker_plugin.dask_compat import task_priority as compat_priority

    try:
        return compat_priority(get_worker(), key)
    except ValueError:  # not on a worker (tests calling the engine directly)
        return ()


def make_host(name: str, settings: ModelSettings) -> Any:
    """An engine host for ``settings``: vLLM, or the emulated engine."""
    if settings.engine == "vllm-async":
        from dask_agents.worker_plugin.async_engine import AsyncEngineHost

        return AsyncEngineHost(name, settings)
    if settings.engine == "emulated":
        from dask_agents.worker_plugin.emulated import EmulatedEngineHost

        return EmulatedEngineHost(name, settings)
    return EngineHost(name, settings)


def registry() -> dict[str, ModelSettings]:
    """The model registry from ``agents.llm.models`` config, validated."""
    import dask_agents.config as agents_config

    out = {}
    for name, raw in (agents_config.get("llm.models") or {}).items():
        try:
            out[name] = ModelSettings(**raw)
        except Exception as e:
            raise ValueError(f"invalid settings for model {name!r} in agents.llm.models: {e}") from None
    return out


class Engines:
    """The engines of one worker, by model name; started eagerly for hosted models, lazily otherwise."""

    def __init__(self, worker_address: str, hosted: list[str]):
        self.worker_address = worker_address
        self._lock = threading.Lock()
        self._hosts: dict[str, Any] = {}  # EngineHost or EmulatedEngineHost
        self._inflight: dict[str, Any] = {}  # LLM call key -> the host serving it now (agenerate)
        self._given_up: dict[str, None] = {}  # calls aborted because the scheduler released them
        self.hosted = list(hosted)
        # set by the plugin: tell the scheduler what this worker serves now (``announced()``),
        # after a model started lazily, an engine was given up, or came back
        self.on_announce: Any = None
        self.restarts: dict[str, int] = {}  # model -> engines restarted after a crash
        self._restart_times: dict[str, list[float]] = {}  # model -> monotonic times of recent restarts
        # model -> why its engine was given up (restarted too often): hosted, but not announced,
        # so the scheduler places nothing here for it until it is back (restarted or reloaded)
        self.failed: dict[str, str] = {}

    def announced(self) -> list[str]:
        """The models this worker serves: hosted ones whose engine was not given up."""
        return [m for m in self.hosted if m not in self.failed]

    def _announce(self) -> None:
        if self.on_announce is not None:
            self.on_announce()

    def start(self, name: str) -> EngineHost:
        """The engine for ``name``, starting it if needed, and restarting it if it crashed."""
        host = self._hosts.get(name)
        if host is not None and getattr(host, "crashed", None) is None:
            return host
        with self._lock:
            host = self._hosts.get(name)
            if host is not None and getattr(host, "crashed", None) is not None:
                host = self._restart(name, host)
            elif host is None:
                models = registry()
                if name not in models:
                    from dask_agents.errors import UnknownModelError

                    raise UnknownModelError(
                        f"model {name!r} is not in agents.llm.models on worker {self.worker_address} "
                        f"(known: {', '.join(sorted(models)) or 'none'})"
                    )
                host = make_host(name, models[name])
                host.start()
                self._hosts[name] = host
                if name not in self.hosted:
                    self.hosted.append(name)
                    self._announce()
        return host

    def _restart(self, name: str, old: Any) -> Any:
        """A fresh engine for ``name`` after ``old`` crashed (under ``self._lock``); refuses with
        EngineStoppedError after ``RESTARTS_MAX`` restarts within ``RESTART_WINDOW_S``: an engine
        that dies on every load or step must fail its calls, not reload forever."""
        import gc

        from dask_agents.errors import EngineStoppedError

        now = time.monotonic()
        recent = [t for t in self._restart_times.get(name, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= RESTARTS_MAX:
            reason = (f"engine {name!r} on worker {self.worker_address} crashed again ({old.crashed}) after "
                      f"{len(recent)} restarts within {RESTART_WINDOW_S:.0f} s: not restarting it")
            if name not in self.failed:  # given up: stop announcing it (the scheduler places elsewhere)
                logger.error("%s; no longer announcing it to the scheduler", reason)
                self.failed[name] = reason
                self._announce()
            raise EngineStoppedError(reason, crashed=False)
        logger.warning("engine %s on %s crashed (%s): restarting it", name, self.worker_address, old.crashed)
        old.close()  # its thread (or AsyncLLM's core process) and memory go before the new one loads
        gc.collect()
        self._restart_times[name] = recent + [now]
        self.restarts[name] = self.restarts.get(name, 0) + 1
        settings = registry().get(name, old.settings)  # a corrected configuration is picked up
        host = make_host(name, settings)
        host.start()
        self._hosts[name] = host
        if self.failed.pop(name, None) is not None:  # given up before, back now: announce it again
            self._announce()
        return host

    def _prepare(self, header: tuple, model: str, prompt: str | list[int], max_tokens: int | None,
                 temperature: float, seed: int | None) -> tuple[Any, list[int], Any]:
        """Validate one call; returns (engine host, token ids, params). The host may still be loading."""
        import dask_agents.config as agents_config

        from dask_agents.errors import EngineStoppedError, InvalidRequestError, short_repr, where

        component, method, sid, key = header[:4]
        if max_tokens is None:
            max_tokens = int(agents_config.get("llm.default-max-tokens"))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f"{where(component, method, sid)}: max_tokens must be a positive int, "
                                      f"got {short_repr(max_tokens)} (call {key})")
        try:
            host = self.start(model)
        except EngineStoppedError as e:  # given up here: say which call it stopped
            raise EngineStoppedError(f"{where(component, method, sid)}: call {key}: {e}", crashed=e.crashed) from e
        return host, prompt, (max_tokens, temperature, seed)

    def _check_inputs(self, header: tuple, model: str, host: Any, prompt: Any, sampling: tuple) -> list[int]:
        """The call's token ids, checked against the loaded model before anything reaches the
        engine: a value that passes vLLM's own checks can still crash an engine step (a token id
        outside the vocabulary: vLLM checks ids only through the tokenizer our engines skip; a
        seed torch cannot take), which fails every call in flight. Raises InvalidRequestError
        (PromptTooLongError for the context) naming the call, its session and the bad value."""
        from numbers import Integral, Real

        from dask_agents.errors import InvalidRequestError, PromptTooLongError, short_repr, where

        component, method, sid, key = header[:4]
        max_tokens, temperature, seed = sampling

        def bad(what: str, value: object) -> InvalidRequestError:
            return InvalidRequestError(
                f"{where(component, method, sid)}: {what}, got {short_repr(value)} (call {key})")

        if isinstance(prompt, str):
            if host.tokenizer is None:
                raise TypeError(f"{where(component, method, sid)}: model {model!r} takes token ids here")
            try:
                ids = host.tokenizer.encode(prompt)
            except UnicodeError as e:  # lone surrogates ('\ud800'...): not text any tokenizer takes
                start, end = getattr(e, "start", 0), getattr(e, "end", 0)
                raise bad(f"the prompt text cannot be encoded ({getattr(e, 'reason', e)} at position {start})",
                          prompt[start:end]) from None
        elif isinstance(prompt, (list, tuple)):
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, Integral):
                    raise bad("token ids must be ints", t)
            ids = [int(t) for t in prompt]
        else:
            raise bad("the prompt must be a string or a list of token ids", prompt)
        if not ids:
            raise bad("empty prompt", prompt)
        vocab = getattr(host, "vocab_size", None)
        for i, t in enumerate(ids):
            if t < 0 or (vocab is not None and t >= vocab):
                where_in = f"model {model!r}'s vocabulary of {vocab} ids (0..{vocab - 1})" if vocab else "0 or more"
                raise bad(f"token id at position {i} is outside {where_in}", t)
        try:
            temp = float(temperature) if isinstance(temperature, Real) and not isinstance(temperature, bool) else None
        except OverflowError:  # an int too large for a float
            temp = math.inf
        if temp is None or not math.isfinite(temp) or temp < 0:
            raise bad("temperature must be a finite number >= 0", temperature)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)
                                 or not SEED_MIN <= seed <= SEED_MAX):
            raise bad(f"seed must be None or an int in [{SEED_MIN}, {SEED_MAX}]", seed)
        if len(ids) + max_tokens > host.max_model_len:
            raise PromptTooLongError(
                f"{where(component, method, sid)}: prompt of {len(ids)} tokens + max_tokens={max_tokens} "
                f"exceeds model {model!r}'s context of {host.max_model_len} tokens (call {key})"
            )
        return ids

    def _submit(self, header: tuple, model: str, host: Any, prompt: str | list[int], sampling: tuple) -> tuple:
        """Tokenize and check against the loaded engine, then queue; returns (future, ids)."""
        from dask_agents.errors import InvalidRequestError, where

        component, method, sid, key = header[:4]
        max_tokens, temperature, seed = sampling
        ids = self._check_inputs(header, model, host, prompt, sampling)
        try:  # the engine's own parameter checks (vLLM's ranges) fail this call, named, and only it
            params = host.sampling_params(max_tokens, float(temperature), seed, task_priority(key))
        except Exception as e:  # vLLM's VLLMValidationError is no ValueError
            raise InvalidRequestError(f"{where(component, method, sid)}: model {model!r} refuses the sampling "
                                      f"parameters (max_tokens={max_tokens}, temperature={temperature}, "
                                      f"seed={seed}): {e} (call {key})") from None
        return host.submit(key, ids, params, sid), ids

    def _result(self, header: tuple, model: str, host: Any, ids: list[int], out: Any, load_wait: float = 0.0) -> Any:
        from dask_agents.models import LLMResult
        from dask_agents.worker_plugin.plugin import get_plugin

        comp = out.outputs[0]
        toks = list(comp.token_ids)
        cached = int(out.num_cached_tokens or 0)
        kv_bytes = host.geometry.bytes_for(len(ids) + len(toks)) if host.geometry else None
        emulated = bool(getattr(out, "emulated", False))
        times = host.token_times.pop(header[3], len(toks))
        if load_wait > 0:  # it waited for its engine to load: queueing, not service (see the worker plugin)
            times["engine_load_s"] = load_wait
        get_plugin().record_metrics(header[3], prompt_tokens=len(ids), cached_tokens=cached,
                                    output_tokens=len(toks), model=model, kv_bytes=kv_bytes,
                                    emulated=emulated, **times)
        return LLMResult(
            model=model, text=host.tokenizer.decode(toks) if host.tokenizer else "",
            token_ids=toks, prompt_tokens=len(ids), cached_tokens=cached, output_tokens=len(toks),
            worker=self.worker_address, finish_reason=comp.finish_reason, emulated=emulated,
        )

    def generate(self, header: tuple, model: str, prompt: str | list[int], max_tokens: int | None = None,
                 temperature: float = 0.0, seed: int | None = None) -> Any:
        """Run one generation for a call (``header`` from the runtime) and return an LLMResult.

        Blocking; a task thread secedes while the engine works (see :meth:`agenerate`)."""
        from dask_agents.worker_plugin.dask_compat import secede_if_in_task

        host, prompt, sampling = self._prepare(header, model, prompt, max_tokens, temperature, seed)
        attempts = self._attempts()
        load_wait = 0.0
        for attempt in range(attempts):
            if not host.loaded.is_set():
                secede_if_in_task()
                t0 = time.time()
                host.loaded.wait()
                load_wait += time.time() - t0
            host.wait_loaded()
            fut, ids = self._submit(header, model, host, prompt, sampling)
            secede_if_in_task()  # the engine works for us; free the worker slot meanwhile
            try:
                return self._result(header, model, host, ids, fut.result(), load_wait)
            except Exception as e:
                host = self._retry_or_raise(e, attempt, attempts, header, model)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _attempts(self) -> int:
        """Attempts per call: one, plus ``agents.llm.engine-restarts`` retries on restarted engines."""
        import dask_agents.config as agents_config

        return 1 + max(0, int(agents_config.get("llm.engine-restarts", 1)))

    def _retry_or_raise(self, exc: Exception, attempt: int, attempts: int, header: tuple, model: str) -> Any:
        """After a failed wait: the restarted engine to retry on when the engine crashed and
        retries are left; otherwise raise an error that names the call."""
        from dask_agents.errors import EngineStepError, EngineStoppedError, InvalidRequestError, where

        component, method, sid, key = header[:4]
        if isinstance(exc, InvalidRequestError):  # the engine refused it: name the call
            raise InvalidRequestError(f"{where(component, method, sid)}: {exc} (call {key})") from exc
        if not isinstance(exc, EngineStoppedError):
            raise exc
        if isinstance(exc, EngineStepError):  # this call is the likely cause: never retried
            raise EngineStepError(f"{where(component, method, sid)}: call {key} failed on worker "
                                  f"{self.worker_address}: {exc}") from exc
        cause: BaseException = exc
        if exc.crashed and attempt + 1 < attempts:
            logger.warning("%s: %s; retrying call %s on a restarted engine", where(component, method, sid), exc, key)
            try:
                return self.start(model)
            except EngineStoppedError as refused:  # restarted too often: give up on this call
                cause = refused
        raise EngineStoppedError(
            f"{where(component, method, sid)}: call {key} lost its engine on worker {self.worker_address} "
            f"after {attempt + 1} attempt(s): {cause}", crashed=exc.crashed) from exc

    async def agenerate(self, header: tuple, model: str, prompt: str | list[int], max_tokens: int | None = None,
                        temperature: float = 0.0, seed: int | None = None) -> Any:
        """:meth:`generate` for a task that runs on the worker's event loop: the call leaves
        the worker's slots at once (it is long-running while the engine works) and waits on
        the engine's future without a thread, so any number of calls wait for one engine."""
        import asyncio

        from dask_agents.worker_plugin.dask_compat import secede_async_task

        host, prompt, sampling = self._prepare(header, model, prompt, max_tokens, temperature, seed)
        secede_async_task(header[3])
        attempts = self._attempts()
        load_wait = 0.0
        for attempt in range(attempts):
            if not host.loaded.is_set():
                t0 = time.time()
                await asyncio.to_thread(host.loaded.wait)
                load_wait += time.time() - t0
            host.wait_loaded()
            fut, ids = self._submit(header, model, host, prompt, sampling)
            self._inflight[header[3]] = host
            try:
                out = await asyncio.wrap_future(fut)
            except asyncio.CancelledError:  # the task was cancelled (worker closing): stop the request too
                if hasattr(host, "abort"):
                    host.abort(header[3])
                raise
            except Exception as e:
                if header[3] in self._given_up:  # aborted: nobody wants its result any more
                    raise
                host = self._retry_or_raise(e, attempt, attempts, header, model)
                continue
            finally:
                self._inflight.pop(header[3], None)
            return self._result(header, model, host, ids, out, load_wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def abort_call(self, key: str) -> bool:
        """The scheduler released LLM call ``key`` while it ran (its creator failed, its session
        was given up): stop its request in the engine, which frees its batch slot and KV blocks
        (Dask lets a released coroutine task run on to its end). True if a request was stopped."""
        host = self._inflight.get(key)
        if host is None or not hasattr(host, "abort"):
            return False
        self._given_up[key] = None
        while len(self._given_up) > 10_000:
            self._given_up.pop(next(iter(self._given_up)))
        host.abort(key)
        return True

    def stop(self, name: str) -> bool:
        """Close the engine for ``name`` and stop hosting it; True if it was hosted. A model
        started again after this loads afresh (a reload: an engine given up comes back so)."""
        with self._lock:
            host = self._hosts.pop(name, None)
            was = name in self.hosted
            if was:
                self.hosted.remove(name)
            self.failed.pop(name, None)
        if host is not None:
            host.close()  # drained first by the controller: nothing should be in flight
        if was:  # whoever asked (the controller, or anyone calling agents_swap_model), the scheduler hears it
            self._announce()
        return was or host is not None

    def swap(self, remove: str | None, add: str | None, timeout: float | None = None) -> list[str]:
        """Stop hosting ``remove`` and start (and wait for) ``add``; returns the hosted models."""
        if remove:
            self.stop(remove)
        if add:
            self.start(add).wait_loaded(timeout)
        return self.announced()

    def kv_directive(self, model: str, op: str, session: str, timeout: float = 60.0, **args: Any) -> dict:
        """Apply one KV directive (``KV_OPS``) for ``session`` on this worker's engine for
        ``model``, between engine steps; returns ``{"result": ..., "residency": {...}}``."""
        import dataclasses

        from dask_agents.kv.runtime.engine_kv import KVDirectiveError

        if op not in KV_OPS:
            raise KVDirectiveError(f"unknown KV directive {op!r} (known: {', '.join(KV_OPS)})")
        if not isinstance(session, str) or not session:
            raise KVDirectiveError(f"a KV directive needs a session id, got {session!r}")
        if not isinstance(model, str):
            raise KVDirectiveError(f"a KV directive names a model, got {model!r}")
        unknown = sorted(map(repr, set(args) - set(KV_OP_ARGS[op])))
        if unknown:
            raise KVDirectiveError(f"KV directive {op!r} takes {', '.join(KV_OP_ARGS[op]) or 'no arguments'}; "
                                   f"unknown: {', '.join(unknown)}")
        host = self._hosts.get(model)
        if host is None or model not in self.hosted:
            raise KVDirectiveError(f"model {model!r} is not hosted on worker {self.worker_address}")
        if hasattr(host, "kv_connector_directive"):  # engine: vllm-async with kv-connector: dask-agents
            return host.kv_connector_directive(op, session, timeout, **args)
        if not hasattr(host, "kv_call"):
            raise KVDirectiveError(f"the engine for {model!r} ({type(host).__name__}) has no per-session KV control")

        def apply(kv: Any) -> dict:
            result = getattr(kv, op)(session, **args)
            out: dict = {"result": dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result}
            if op != "invalidate":
                out["residency"] = dataclasses.asdict(kv.inspect(session))
            return out

        return host.kv_call(apply).result(timeout)

    def kv_hint(self, session: str, state: str, node: str | None = None, wait_key: str | None = None,
                at: float | None = None) -> list[str]:
        """Forward a session's workflow state to the KV manager of every engine here that saw the
        session (non-blocking; see ``EngineHost.kv_hint``); returns those models' names.

        ``state``: "running" (the session's next step starts), "paused" (the step labelled
        ``node`` ended; the session waits on ``wait_key``, a tool kind or a dependency key) or
        "finished". ``at``: Unix time of the change (default now). Raises KVDirectiveError for
        an unknown state or an empty session id."""
        from dask_agents.kv.runtime.engine_kv import KVDirectiveError
        from dask_agents.kv.runtime.manager import STATES

        if state not in STATES:
            raise KVDirectiveError(f"unknown session state {state!r} (known: {', '.join(STATES)})")
        if not isinstance(session, str) or not session:
            raise KVDirectiveError(f"a KV hint needs a session id, got {session!r}")
        if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at)):
            raise KVDirectiveError(f"a KV hint's time must be a finite Unix time or None, got {at!r}")
        out = []
        for name, host in list(self._hosts.items()):
            ready = hasattr(host, "kv_hint") and host.loaded.is_set() and host.load_error is None
            if ready and host.kv_hint(session, state, node, wait_key, at) is not None:
                out.append(name)
        return out

    def end_session(self, session: str) -> None:
        """Invalidate ``session``'s KV on every engine here (asynchronously: nobody waits)."""
        for host in list(self._hosts.values()):
            if not host.loaded.is_set() or host.load_error is not None:
                continue
            if hasattr(host, "kv_connector_forget"):
                host.kv_connector_forget(session)
            elif hasattr(host, "kv_call"):
                host.kv_call(lambda kv: kv.invalidate(session))

    def wait_hosted(self, timeout: float) -> dict[str, dict]:
        """Wait (blocking, at most ``timeout`` seconds in all) for the engines of the hosted
        models to load: model -> ``{"load_s": seconds or None, "error": None or why it did not}``."""
        deadline = time.monotonic() + timeout
        out: dict[str, dict] = {}
        for m in self.hosted:
            host = self._hosts.get(m)
            if host is None:
                out[m] = {"load_s": None, "error": f"engine for model {m!r} was not started on this worker"}
                continue
            try:
                wait_loaded(host, max(0.0, deadline - time.monotonic()))
            except Exception as e:  # its load failed, or it is still loading
                out[m] = {"load_s": None, "error": str(e)}
            else:
                out[m] = {"load_s": host.load_seconds, "error": None}
        return out

    def loaded_models(self) -> list[str]:
        """Models whose engine finished loading (not those given up)."""
        return [n for n, h in self._hosts.items()
                if h.loaded.is_set() and h.load_error is None and n not in self.failed]

    def close(self) -> None:
        """Close every engine."""
        for host in list(self._hosts.values()):
            host.close()
        self._hosts.clear()
