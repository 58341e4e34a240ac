"""The engines of one worker, by model name: started eagerly for the models it hosts, lazily
for others, restarted after a crash (a bounded number of times), and called by the runtime's
LLM calls (generation, KV directives and hints) with the errors that name the call."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from dask_agents.model_settings import ModelSettings
from dask_agents.worker_plugin.host import (KV_OP_ARGS, KV_OPS, SEED_MAX, SEED_MIN, EngineHostAPI, task_priority,
                                           wait_loaded)
from dask_agents.worker_plugin.vllm_host import EngineHost

logger = logging.getLogger(__name__)
# A crashed engine is restarted at most this often per model: one that dies on every load or
# step then fails its calls with a clear error instead of reloading forever.
RESTARTS_MAX = 3
RESTART_WINDOW_S = 300.0


def make_host(name: str, settings: ModelSettings) -> EngineHostAPI:
    """The engine host for ``settings.engine``: vLLM in the worker, vLLM's AsyncLLM, or the emulated engine;
    with ``process: true``, vLLM or the emulated engine in a process of its own beside the worker."""
    if settings.process and settings.engine != "vllm-async":  # (AsyncLLM's core is in a child already)
        from dask_agents.worker_plugin.process_host import ProcessEngineHost

        return ProcessEngineHost(name, settings)
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
        self._hosts: dict[str, EngineHostAPI] = {}  # model -> its engine host
        self._inflight: dict[str, Any] = {}  # LLM call key -> the host serving it now (agenerate)
        self._given_up: dict[str, None] = {}  # calls aborted because the scheduler released them
        self.hosted = list(hosted)
        # set by the plugin: tell the scheduler what this worker serves now (``announced()``),
        # after a model started lazily, an engine was given up, or came back
        self.on_announce: Any = None
        # set by the plugin: attach a call's metrics (tokens, times) to its finish report
        self.on_metrics: Any = None
        # set by the plugin: on_stream(topic, msg) sends a streaming call's delta to its caller
        # (thread-safe: hosts call it from their stepping threads)
        self.on_stream: Any = None
        self._sinks: dict[str, DeltaSink] = {}  # streaming call key -> its sink (across retries)
        self.stream_barrier: Any = None  # set by the plugin: awaited after a streaming call's end
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

    def start(self, name: str) -> EngineHostAPI:
        """The engine for ``name``, starting it if needed, and restarting it if it crashed."""
        host = self._hosts.get(name)
        if host is not None and host.crashed is None:
            return host
        with self._lock:
            host = self._hosts.get(name)
            if host is not None and host.crashed is not None:
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

    def _prepare(self, header: tuple, model: str, prompt: str | list[int] | None, max_tokens: int | None,
                 temperature: float, seed: int | None, options: dict | None = None,
                 chat: dict | None = None) -> tuple[Any, Any, tuple]:
        """Validate one call; returns (engine host, prompt, sampling): ``sampling`` is
        ``(max_tokens, temperature, seed, options, chat)``. The host may still be loading."""
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
        return host, prompt, (max_tokens, temperature, seed, options, chat)

    def _check_inputs(self, header: tuple, model: str, host: Any, prompt: Any, sampling: tuple) -> list[int]:
        """The call's token ids, checked against the loaded model before anything reaches the
        engine: a value that passes vLLM's own checks can still crash an engine step (a token id
        outside the vocabulary: vLLM checks ids only through the tokenizer our engines skip; a
        seed torch cannot take), which fails every call in flight. Raises InvalidRequestError
        (PromptTooLongError for the context) naming the call, its session and the bad value."""
        from numbers import Integral, Real

        from dask_agents.errors import InvalidRequestError, PromptTooLongError, short_repr, where

        component, method, sid, key = header[:4]
        max_tokens, temperature, seed, _options, chat = sampling

        def bad(what: str, value: object) -> InvalidRequestError:
            return InvalidRequestError(
                f"{where(component, method, sid)}: {what}, got {short_repr(value)} (call {key})")

        if chat is not None:  # the model's chat template, then its tokenizer
            if host.tokenizer is None:
                raise TypeError(f"{where(component, method, sid)}: model {model!r} has no tokenizer here "
                                "(chat needs one: tokenizer: auto or byte)")
            try:
                prompt = host.tokenizer.render_chat(chat["messages"], chat.get("tools"))
            except Exception as e:  # no template, or the template refused the conversation
                raise InvalidRequestError(f"{where(component, method, sid)}: model {model!r} cannot render the "
                                          f"conversation: {type(e).__name__}: {e} (call {key})") from None
            encode_chat = getattr(host.tokenizer, "encode_chat", host.tokenizer.encode)
            ids = encode_chat(prompt)
        elif isinstance(prompt, str):
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
        vocab = host.vocab_size
        # Ids the host's own tokenizer made are in range when its vocabulary fits the model's;
        # others are checked by min/max first (C speed: a Python loop over a 56k-token prompt
        # held the GIL ~4 ms a call).
        own = isinstance(prompt, str) and vocab is not None and getattr(host.tokenizer, "vocab_size", vocab + 1) <= vocab
        if not own and (min(ids) < 0 or (vocab is not None and max(ids) >= vocab)):
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
        from dask_agents.errors import InvalidRequestError, short_repr, where

        component, method, sid, key = header[:4]
        max_tokens, temperature, seed, options, chat = sampling
        received = time.time()  # the engine host has the request: tokenizing and checks are its work
        ids = self._check_inputs(header, model, host, prompt, sampling)
        priority = task_priority(key)
        if not priority:  # on the fast path (not a task here): its caller's, the session's progress then
            from dask_agents import context

            creator = context.call_id()
            priority = task_priority(creator) if creator is not None else ()
        engine_options = _engine_options(options, chat)
        try:  # the engine's own parameter checks (vLLM's ranges) fail this call, named, and only it
            params = host.sampling_params(max_tokens, float(temperature), seed, priority, engine_options)
        except Exception as e:  # vLLM's VLLMValidationError is no ValueError
            shown = ", ".join(f"{k}={short_repr(v, 40)}" for k, v in (options or {}).items())
            raise InvalidRequestError(f"{where(component, method, sid)}: model {model!r} refuses the sampling "
                                      f"parameters (max_tokens={max_tokens}, temperature={temperature}, "
                                      f"seed={seed}{', ' + shown if shown else ''}): {e} (call {key})") from None
        fut = host.submit(key, ids, params, sid)
        host.token_times.restamp(key, received)
        return fut, ids

    def _result(self, header: tuple, model: str, host: Any, ids: list[int], out: Any, load_wait: float = 0.0,
                ready_at: float | None = None, chat: dict | None = None) -> Any:
        from dask_agents.models import LLMResult

        choices = [self._completion(host, c, i, chat) for i, c in enumerate(out.outputs)]
        comp = out.outputs[0]
        toks = list(comp.token_ids)
        out_tokens = sum(len(c.token_ids) for c in out.outputs)
        cached = int(out.num_cached_tokens or 0)
        kv_bytes = host.geometry.bytes_for(len(ids) + out_tokens) if host.geometry else None
        emulated = bool(getattr(out, "emulated", False))
        arrival = host.token_times.submitted_at(header[3])
        finished = time.time()
        times = host.token_times.pop(header[3], out_tokens, finished)
        if load_wait > 0:  # it waited for its engine to load: queueing, not service (see the worker plugin)
            times["engine_load_s"] = load_wait
            times["engine_ready_at"] = ready_at  # when its engine was there (the worker plugin's start)
        if self.on_metrics is not None:
            self.on_metrics(header[3], prompt_tokens=len(ids), cached_tokens=cached, output_tokens=out_tokens,
                            model=model, kv_bytes=kv_bytes, emulated=emulated, **times)
        first = choices[0]
        return LLMResult(
            model=model, text=first.text, token_ids=toks, prompt_tokens=len(ids), cached_tokens=cached,
            output_tokens=out_tokens, worker=self.worker_address, finish_reason=first.finish_reason,
            emulated=emulated, arrival_time=arrival, finished_time=finished, stop_reason=first.stop_reason,
            logprobs=first.logprobs, message=first.message, choices=choices,
        )

    @staticmethod
    def _completion(host: Any, comp: Any, index: int, chat: dict | None) -> Any:
        """One completion of an engine output as a :class:`~dask_agents.models.Completion`:
        its text (the engine's own when it detokenized, stop strings cut), logprobs, and for a
        chat the assistant turn with its tool calls (see :func:`_assistant_turn`)."""
        from dask_agents.models import Completion

        from dask_agents.worker_plugin.sampling import completion_text

        toks = list(comp.token_ids)
        text = completion_text(host.tokenizer, comp)
        logprobs = None
        if getattr(comp, "logprobs", None) is not None:
            logprobs = [{int(t): float(getattr(lp, "logprob", lp)) for t, lp in step.items()} for step in comp.logprobs]
        stop = getattr(comp, "stop_reason", None)
        return Completion(index=index, text=text, token_ids=toks, finish_reason=comp.finish_reason,
                          stop_reason=stop if isinstance(stop, (str, int)) else None, logprobs=logprobs,
                          message=_assistant_turn(host, text, chat) if chat is not None else None)

    def generate(self, header: tuple, model: str, prompt: str | list[int] | None, max_tokens: int | None = None,
                 temperature: float = 0.0, seed: int | None = None, options: dict | None = None,
                 chat: dict | None = None, stream: str | None = None) -> Any:
        """Run one generation for a call (``header`` from the runtime) and return an LLMResult:
        of ``prompt``, or of the conversation ``chat`` (``{"messages", "tools", "tool_choice"}``)
        through the model's chat template; ``options`` are the checked sampling options;
        ``stream``: the caller's stream topic (its output goes there as it is generated).

        Blocking; a task thread secedes while the engine works (see :meth:`agenerate`)."""
        from dask_agents.worker_plugin.dask_compat import secede_if_in_task

        host, prompt, sampling = self._prepare(header, model, prompt, max_tokens, temperature, seed, options, chat)
        attempts = self._attempts()
        load_wait, ready_at = 0.0, None
        for attempt in range(attempts):
            if not host.loaded.is_set():
                secede_if_in_task()
                t0 = time.time()
                host.loaded.wait()
                ready_at = time.time()
                load_wait += ready_at - t0
            host.wait_loaded()
            sink = self._watch(host, header[3], stream, attempt)
            try:
                fut, ids = self._submit(header, model, host, prompt, sampling)
                secede_if_in_task()  # the engine works for us; free the worker slot meanwhile
                try:
                    result = self._result(header, model, host, ids, fut.result(), load_wait, ready_at, chat)
                except Exception as e:
                    host = self._retry_or_raise(e, attempt, attempts, header, model)
                    continue
            except BaseException:
                self._unwatch(header[3])
                raise
            finally:
                host.stream_sinks.pop(header[3], None)
            if sink is not None:
                sink.close()  # (before the result leaves: the caller's iterator has every delta)
            return result
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _watch(self, host: Any, key: str, topic: str | None, attempt: int) -> "DeltaSink | None":
        """A streaming call's sink on ``host`` (None without a topic); on a retry (a restarted
        engine) the caller is told its output starts over."""
        if topic is None:
            return None
        sink = self._sinks.get(key)
        if sink is None:
            import dask_agents.config as agents_config

            sink = self._sinks[key] = DeltaSink(lambda msg: self._publish(topic, msg), key,
                                                agents_config.seconds("llm.stream-interval"))
        elif attempt:
            sink.restart()
        host.stream_sinks[key] = sink
        return sink

    def _publish(self, topic: str, msg: dict) -> None:
        if msg.get("end"):
            self._sinks.pop(msg["key"], None)
        if self.on_stream is not None:
            self.on_stream(topic, msg)

    def _unwatch(self, key: str) -> None:
        """The call ended without its end (it failed: its caller's iterator raises its error)."""
        self._sinks.pop(key, None)

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

    async def agenerate(self, header: tuple, model: str, prompt: str | list[int] | None,
                        max_tokens: int | None = None, temperature: float = 0.0, seed: int | None = None,
                        options: dict | None = None, chat: dict | None = None, stream: str | None = None) -> Any:
        """:meth:`generate` for a task that runs on the worker's event loop: the call leaves
        the worker's slots at once (it is long-running while the engine works) and waits on
        the engine's future without a thread, so any number of calls wait for one engine."""
        import asyncio

        from dask_agents.worker_plugin.dask_compat import secede_async_task

        host, prompt, sampling = self._prepare(header, model, prompt, max_tokens, temperature, seed, options, chat)
        secede_async_task(header[3])
        attempts = self._attempts()
        load_wait, ready_at = 0.0, None
        for attempt in range(attempts):
            if not host.loaded.is_set():
                t0 = time.time()
                await asyncio.to_thread(host.loaded.wait)
                ready_at = time.time()
                load_wait += ready_at - t0
            host.wait_loaded()
            sink = self._watch(host, header[3], stream, attempt)
            try:
                fut, ids = self._submit(header, model, host, prompt, sampling)
                self._inflight[header[3]] = host
                try:
                    out = await asyncio.wrap_future(fut)
                except asyncio.CancelledError:  # the task was cancelled (worker closing): stop the request too
                    host.abort(header[3])
                    raise
                except Exception as e:
                    if header[3] in self._given_up:  # aborted: nobody wants its result any more
                        raise
                    host = self._retry_or_raise(e, attempt, attempts, header, model)
                    continue
                finally:
                    self._inflight.pop(header[3], None)
            except BaseException:
                self._unwatch(header[3])
                raise
            finally:
                host.stream_sinks.pop(header[3], None)
            result = self._result(header, model, host, ids, out, load_wait, ready_at, chat)
            if sink is not None:
                sink.close()  # (before the result leaves: the caller's iterator has every delta)
                if self.stream_barrier is not None:
                    await self.stream_barrier()
            return result
        raise AssertionError("unreachable: the last attempt returns or raises")

    def abort_call(self, key: str) -> bool:
        """The scheduler released LLM call ``key`` while it ran (its creator failed, its session
        was given up): stop its request in the engine, which frees its batch slot and KV blocks
        (Dask lets a released coroutine task run on to its end). True if a request was stopped."""
        host = self._inflight.get(key)
        if host is None:
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
        return host.kv_directive(op, session, timeout, **args)

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
            ready = host.loaded.is_set() and host.load_error is None
            if ready and host.kv_hint(session, state, node, wait_key, at) is not None:
                out.append(name)
        return out

    def end_session(self, session: str) -> None:
        """Invalidate ``session``'s KV on every engine here (asynchronously: nobody waits)."""
        for host in list(self._hosts.values()):
            if not host.loaded.is_set() or host.load_error is not None:
                continue
            host.kv_session_end(session)

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

    def is_loaded(self, model: str) -> bool:
        """Whether ``model``'s engine here finished loading and serves (see :meth:`loaded_models`)."""
        h = self._hosts.get(model)
        return h is not None and h.loaded.is_set() and h.load_error is None and model not in self.failed

    def loaded_models(self) -> list[str]:
        """Models whose engine finished loading (not those given up)."""
        return [n for n, h in self._hosts.items()
                if h.loaded.is_set() and h.load_error is None and n not in self.failed]

    def close(self) -> None:
        """Close every engine."""
        for host in list(self._hosts.values()):
            host.close()
        self._hosts.clear()


def _engine_options(options: dict | None, chat: dict | None) -> dict | None:
    """What the engine host gets: the call's options, plus for a chat with tools the
    ``tool_choice`` constraint (``"required"`` or a tool's name: vLLM's tool-call JSON) and
    ``keep_special`` (a tool parser reads the tags the model writes around its calls)."""
    if chat is None or not chat.get("tools") or chat.get("tool_choice") == "none":
        return options
    out = dict(options or ())
    if chat["tool_choice"] != "auto":
        out["tool_constraint"] = {"tools": chat["tools"], "choice": chat["tool_choice"]}
    else:
        out["keep_special"] = True
    return out


def _assistant_turn(host: Any, text: str, chat: dict) -> Any:
    """A chat completion as the assistant's turn: with tools, the tool calls in it (constrained
    by ``tool_choice``: vLLM's JSON; ``"auto"``: the host's parser, the model's ``tool-parser``
    or the JSON fallback), the rest as content."""
    from dask_agents.models import ChatMessage, ToolCall
    from dask_agents.worker_plugin.sampling import tool_calls_from_constraint

    tools, choice = chat.get("tools"), chat.get("tool_choice")
    content: str | None = text
    calls: list[dict] = []
    if tools and choice not in (None, "none"):
        if choice != "auto":
            parsed = tool_calls_from_constraint(text, {"tools": tools, "choice": choice})
            if parsed is not None:  # else cut short (finish_reason "length"): kept as content
                content, calls = None, parsed
        else:
            content, calls = host.extract_tool_calls(text, tools)
    return ChatMessage(content=content, tool_calls=[ToolCall(**c) for c in calls])


class DeltaSink:
    """A streaming call's output on its way to the caller: the host's per-step deltas, sent at
    most every ``interval`` seconds (``agents.llm.stream-interval``; 0: every step) as one message
    per completion, then ``{"key", "end": True}`` (:meth:`close`). Thread-safe."""

    def __init__(self, publish: Any, key: str, interval: float):
        self.publish, self.key, self.interval = publish, key, interval
        self._buf: dict[int, list] = {}  # index -> [text, token ids] not sent yet
        self._last = 0.0
        self._lock = threading.Lock()

    def __call__(self, index: int, text: str, token_ids: list[int]) -> None:
        with self._lock:
            b = self._buf.setdefault(index, ["", []])
            b[0] += text
            b[1].extend(token_ids)
            now = time.monotonic()
            if now - self._last >= self.interval:
                self._flush(now)

    def _flush(self, now: float) -> None:
        for index in sorted(self._buf):
            text, ids = self._buf[index]
            self.publish({"key": self.key, "index": index, "text": text, "token_ids": ids})
        self._buf.clear()
        self._last = now

    def restart(self) -> None:
        """The engine restarted and the call runs again: its output starts over."""
        with self._lock:
            self._buf.clear()
            self.publish({"key": self.key, "restart": True})

    def close(self) -> None:
        """The rest, then the end."""
        with self._lock:
            self._flush(time.monotonic())
            self.publish({"key": self.key, "end": True})
