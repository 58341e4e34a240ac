"""LLM engines hosted by a worker: vLLM in-process, stepped by one thread, many callers.

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
from dataclasses import dataclass
from typing import Any, Literal

from dask.utils import parse_bytes
from pydantic import BaseModel, ConfigDict, Field

from worker_plugin.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)
# vLLM initialises process-global state (parallel groups) while building an engine: two
# engines built at once in one process (in-process workers, or two models) race on it.
_LOAD_LOCK = threading.Lock()
BUILTIN = {"tiny-llama": os.path.join(os.path.dirname(__file__), "models", "tiny-llama")}


class ModelSettings(BaseModel):
    """One entry of ``agents.llm.models`` (keys as in the yaml, dashes allowed)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)
    model: str
    # "vllm": a real engine. "emulated": worker_plugin/emulated.py, a cost model of an engine
    # (batch capacity, per-token prefill/decode cost, KV memory with prefix reuse) for
    # experiments at scale on CPUs; its numbers are always labeled emulated.
    engine: Literal["vllm", "emulated"] = "vllm"
    emulation: dict[str, Any] = Field(default_factory=dict)
    load_format: str = Field("auto", alias="load-format")
    tokenizer: str = "auto"
    dtype: str = "auto"
    max_model_len: int = Field(2048, alias="max-model-len", ge=16)
    kv_cache_memory_bytes: int | str = Field("256 MiB", alias="kv-cache-memory-bytes")
    enable_prefix_caching: bool = Field(True, alias="enable-prefix-caching")
    # "priority": the engine admits calls in the control plane's priority order (progress
    # first), FIFO among equals; "fcfs": arrival order.
    scheduling: Literal["priority", "fcfs"] = "priority"
    # Bounds for reallocation (how many engine workers may serve this model).
    min_replicas: int = Field(1, alias="min-replicas", ge=0)
    max_replicas: int | None = Field(None, alias="max-replicas", ge=1)

    def model_path(self) -> str:
        """A local path for ``builtin:NAME`` models, the name itself otherwise."""
        if self.model.startswith("builtin:"):
            name = self.model.split(":", 1)[1]
            if name not in BUILTIN:
                raise ValueError(f"unknown builtin model {name!r} (have: {', '.join(BUILTIN)})")
            return BUILTIN[name]
        return self.model

    def kv_bytes(self) -> int:
        """KV cache budget in bytes."""
        v = self.kv_cache_memory_bytes
        return int(v) if isinstance(v, int) else int(parse_bytes(v))


@dataclass
class _Request:
    request_id: str
    token_ids: list[int]
    params: Any
    session: str | None
    future: Future


class EngineHost:
    """One vLLM engine and the thread that steps it."""

    def __init__(self, name: str, settings: ModelSettings):
        self.name = name
        self.settings = settings
        self.tokenizer = ByteTokenizer() if settings.tokenizer == "byte" else None
        self.max_model_len = settings.max_model_len
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self._inbox: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._pending: dict[str, _Request] = {}
        self._engine: Any = None
        self._thread = threading.Thread(target=self._run, name=f"dask-agents-engine-{name}", daemon=True)
        self._closed = False
        self.steps = 0
        self.started_at: float | None = None
        self.geometry: Any = None  # kv.KVGeometry once loaded (None for models without a local config)

    def start(self) -> None:
        """Start loading the engine in the background (idempotent)."""
        if not self._thread.is_alive() and self.started_at is None:
            self.started_at = time.time()
            self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until the engine is ready; re-raise a load failure."""
        if not self.loaded.wait(timeout):
            raise TimeoutError(f"engine for model {self.name!r} did not load within {timeout}s")
        if self.load_error is not None:
            raise RuntimeError(f"engine for model {self.name!r} failed to load: {self.load_error}")

    def _load(self) -> Any:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import EngineArgs, LLMEngine

        s = self.settings
        args = EngineArgs(
            model=s.model_path(),
            load_format=s.load_format,
            skip_tokenizer_init=self.tokenizer is not None,
            dtype=s.dtype,
            max_model_len=s.max_model_len,
            enable_prefix_caching=s.enable_prefix_caching,
            enforce_eager=True,
            kv_cache_memory_bytes=s.kv_bytes(),
            scheduling_policy=s.scheduling,
        )
        return LLMEngine.from_engine_args(args)

    def _geometry(self) -> Any:
        from kv import KVGeometry

        path = self.settings.model_path()
        if not os.path.isdir(path):
            return None
        block = self._engine.vllm_config.cache_config.block_size
        dtype = self.settings.dtype if self.settings.dtype != "auto" else "auto"
        return KVGeometry.from_model_dir(path, dtype, block)

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
        if self._closed:
            fut.set_exception(RuntimeError(f"engine {self.name!r} is closed"))
            return fut
        self._inbox.put(_Request(request_id, token_ids, params, session, fut))
        return fut

    def _admit(self, req: _Request) -> None:
        from vllm.inputs import TokensPrompt

        params, priority = req.params
        try:
            self._engine.add_request(req.request_id, TokensPrompt(prompt_token_ids=req.token_ids), params,
                                     priority=priority if self.settings.scheduling == "priority" else 0)
            self._pending[req.request_id] = req
        except Exception as e:  # bad request: fail this call only
            req.future.set_exception(e)

    def _take(self, item: _Request | None) -> None:
        if item is not None:
            self._admit(item)

    def _run(self) -> None:
        try:
            with _LOAD_LOCK:
                self._engine = self._load()
            self.geometry = self._geometry()
        except BaseException as e:  # reported to every caller by wait_loaded
            logger.exception("loading engine %s failed", self.name)
            self.load_error = e
            self.loaded.set()
            return
        self.loaded.set()
        while not self._closed:
            if not self._engine.has_unfinished_requests():
                try:  # idle: sleep until a request (or close) arrives
                    self._take(self._inbox.get(timeout=0.5))
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
                try:
                    outputs = self._engine.step()
                except Exception as e:  # an engine failure fails what is in flight, not the worker
                    logger.exception("engine %s step failed", self.name)
                    for req in self._pending.values():
                        req.future.set_exception(e)
                    self._pending.clear()
                    continue
                self.steps += 1
                for out in outputs:
                    if out.finished:
                        req = self._pending.pop(out.request_id, None)
                        if req is not None:
                            req.future.set_result(out)
        for req in self._pending.values():
            req.future.set_exception(RuntimeError(f"engine {self.name!r} closed"))

    def close(self) -> None:
        """Stop the stepping thread; in-flight requests fail with a clear error."""
        self._closed = True
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._engine = None


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

    from worker_plugin.dask_compat import task_priority as compat_priority

    try:
        return compat_priority(get_worker(), key)
    except ValueError:  # not on a worker (tests calling the engine directly)
        return ()


def make_host(name: str, settings: ModelSettings) -> Any:
    """An engine host for ``settings``: vLLM, or the emulated engine."""
    if settings.engine == "emulated":
        from worker_plugin.emulated import EmulatedEngineHost

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
        self.hosted = list(hosted)
        self.on_new_model: Any = None  # set by the plugin: announce a lazily started model

    def start(self, name: str) -> EngineHost:
        """The engine for ``name``, starting it if needed."""
        host = self._hosts.get(name)
        if host is not None:
            return host
        with self._lock:
            host = self._hosts.get(name)
            if host is None:
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
                    if self.on_new_model is not None:
                        self.on_new_model(name)
        return host

    def generate(self, header: tuple, model: str, prompt: str | list[int], max_tokens: int | None = None,
                 temperature: float = 0.0, seed: int | None = None) -> Any:
        """Run one generation for a call (``header`` from the runtime) and return an LLMResult."""
        import dask_agents.config as agents_config

        from dask_agents.errors import PromptTooLongError, where
        from dask_agents.models import LLMResult
        from worker_plugin.dask_compat import secede_if_in_task
        from worker_plugin.plugin import get_plugin

        component, method, sid, key = header[:4]
        if max_tokens is None:
            max_tokens = int(agents_config.get("llm.default-max-tokens"))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{where(component, method, sid)}: max_tokens must be a positive int, got {max_tokens!r}")
        host = self.start(model)
        if not host.loaded.is_set():
            secede_if_in_task()
        host.wait_loaded()
        if isinstance(prompt, str):
            if host.tokenizer is None:
                raise TypeError(f"{where(component, method, sid)}: model {model!r} takes token ids here")
            ids = host.tokenizer.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError(f"{where(component, method, sid)}: empty prompt")
        if len(ids) + max_tokens > host.max_model_len:
            raise PromptTooLongError(
                f"{where(component, method, sid)}: prompt of {len(ids)} tokens + max_tokens={max_tokens} "
                f"exceeds model {model!r}'s context of {host.max_model_len} tokens (call {key})"
            )
        priority = task_priority(key)
        fut = host.submit(key, ids, host.sampling_params(max_tokens, temperature, seed, priority), sid)
        secede_if_in_task()  # the engine works for us; free the worker slot meanwhile
        out = fut.result()
        comp = out.outputs[0]
        toks = list(comp.token_ids)
        cached = int(out.num_cached_tokens or 0)
        kv_bytes = host.geometry.bytes_for(len(ids) + len(toks)) if host.geometry else None
        emulated = bool(getattr(out, "emulated", False))
        get_plugin().record_metrics(key, prompt_tokens=len(ids), cached_tokens=cached,
                                    output_tokens=len(toks), model=model, kv_bytes=kv_bytes,
                                    emulated=emulated)
        return LLMResult(
            model=model, text=host.tokenizer.decode(toks) if host.tokenizer else "",
            token_ids=toks, prompt_tokens=len(ids), cached_tokens=cached, output_tokens=len(toks),
            worker=self.worker_address, finish_reason=comp.finish_reason, emulated=emulated,
        )

    def stop(self, name: str) -> bool:
        """Close the engine for ``name`` and stop hosting it; True if it was hosted."""
        with self._lock:
            host = self._hosts.pop(name, None)
            was = name in self.hosted
            if was:
                self.hosted.remove(name)
        if host is not None:
            host.close()  # drained first by the controller: nothing should be in flight
        return was or host is not None

    def swap(self, remove: str | None, add: str | None, timeout: float | None = None) -> list[str]:
        """Stop hosting ``remove`` and start (and wait for) ``add``; returns the hosted models."""
        if remove:
            self.stop(remove)
        if add:
            self.start(add).wait_loaded(timeout)
        return list(self.hosted)

    def loaded_models(self) -> list[str]:
        """Models whose engine finished loading."""
        return [n for n, h in self._hosts.items() if h.loaded.is_set() and h.load_error is None]

    def close(self) -> None:
        """Close every engine."""
        for host in list(self._hosts.values()):
            host.close()
        self._hosts.clear()
