"""What every engine host shares: the interface the worker's engines registry uses, and the
helpers the hosts have in common (vLLM's process-wide locks, load waits, future settling,
priorities). One module per host: :mod:`.vllm_host` (vLLM stepped in the worker),
:mod:`.async_engine` (vLLM's AsyncLLM), :mod:`.emulated` (a cost model); :mod:`.engines` is
the registry that starts, restarts and calls them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

# vLLM keeps process-global state that every in-process engine of this process shares: the
# parallel groups (built at load, destroyed by the last shutdown) and the forward context (set
# by each forward pass, a load's warm-up included). Two engines loading, stepping or shutting
# down at once in one process (in-process workers, or two models) race on it: measured here, two
# engines stepping concurrently returned each other's tokens. Loads (and vLLM's lazy imports,
# also for AsyncLLM, whose core runs elsewhere) hold _LOAD_LOCK; forward passes and shutdowns
# hold _STEP_LOCK; an in-process load holds both, in that order.
_LOAD_LOCK = threading.Lock()
_STEP_LOCK = threading.Lock()


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

KV_OPS = ("inspect", "retain", "release", "offload", "prefetch", "invalidate")
# the keyword arguments each directive takes (EngineKV's signatures): anything else is refused
# before it reaches an engine, where it would raise a bare TypeError on the stepping thread
KV_OP_ARGS = {"inspect": (), "retain": ("ttl_s",), "release": (), "offload": ("tier", "blocks"),
              "prefetch": ("max_blocks",), "invalidate": ()}


def resolve(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
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


def gather_completions(seen: dict[int, Any], out: Any) -> Any:
    """vLLM reports the ``n`` completions of a call one at a time as they progress (its default
    cumulative output kind; its final output carries only the last to finish): keep the latest of
    each in ``seen``, and give the finished output all ``n``, in index order."""
    for c in out.outputs:
        seen[c.index] = c
    if out.finished and len(seen) > len(out.outputs):
        out.outputs = [seen[i] for i in sorted(seen)]
    return out


def stream_deltas(seen: dict[int, tuple[int, int]], outputs: Any, sink: Any, text_of: Any) -> None:
    """Send a streaming request's new output to ``sink(index, text, token_ids)``: per
    completion, what it holds beyond what ``seen`` (index -> (ids, characters) sent) says;
    ``text_of(completion)`` is its whole text so far (the engine's own, or decoded here)."""
    for c in outputs:
        n_ids, n_text = seen.get(c.index, (0, 0))
        ids = c.token_ids
        if len(ids) <= n_ids:
            continue
        text = text_of(c)
        sink(c.index, text[n_text:], list(ids[n_ids:]))
        seen[c.index] = (len(ids), len(text))


def engine_priority(priority: tuple) -> int:
    """The control plane's priority tuple as the int vLLM takes (smaller runs first).

    Only the workflow part matters inside an engine: fair-share starvation, then progress
    (``(user, -starved, -progress, -kv_resident, arrival)``; vLLM breaks ties by arrival)."""
    if len(priority) != 5:
        return 0
    user, starved, progress = (int(x) for x in priority[:3])
    # starved is minus the session's fair-share deficit, 0 to 4 (policies/prioritize.MAX_DEFICIT)
    return (user * 5 + max(starved, -4)) * 1_000_000 + max(progress, -999_999)


def task_priority(key: str) -> tuple:
    """The current priority of the running task ``key`` on this worker (``()`` if unknown)."""
    from distributed import get_worker

    from dask_agents.worker_plugin.dask_compat import task_priority as compat_priority

    try:
        return compat_priority(get_worker(), key)
    except ValueError:  # not on a worker (tests calling the engine directly)
        return ()


@runtime_checkable
class EngineHostAPI(Protocol):
    """The one interface of an engine host: what the worker's engines registry
    (:class:`~dask_agents.worker_plugin.engines.Engines`), its plugin and the runtime use.
    Every host implements all of it (:class:`~dask_agents.worker_plugin.vllm_host.EngineHost`,
    :class:`~dask_agents.worker_plugin.async_engine.AsyncEngineHost`,
    :class:`~dask_agents.worker_plugin.emulated.EmulatedEngineHost`); a host without
    per-session KV control refuses directives with a ``KVDirectiveError`` saying why
    (``kv_control_reason``) and ignores hints, instead of lacking the methods."""

    name: str
    settings: Any  # dask_agents.model_settings.ModelSettings
    tokenizer: Any  # a ByteTokenizer or ModelTokenizer (worker_plugin/tokenizer.py), None until loaded
    token_times: Any  # TokenTimes: first-token times, read for TTFT/TPOT
    # request id -> sink(index, text, token_ids) of a streaming call (set by the registry before
    # submit, removed after): the host sends each step's new output there (stream_deltas)
    stream_sinks: dict
    loaded: threading.Event  # set once the load ended (well or not: see load_error)
    load_error: BaseException | None
    load_seconds: float | None
    started_at: float | None
    crashed: BaseException | None  # set when the engine died under its callers
    vocab_size: int | None
    geometry: Any  # KVGeometry (bytes per block) or None
    steps: int
    kv_control: bool
    kv_control_reason: str | None

    def start(self) -> None:
        """Start loading (idempotent)."""

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until loaded; EngineLoadError if the load failed, TimeoutError after ``timeout``."""

    def sampling_params(self, max_tokens: int, temperature: float, seed: int | None, priority: tuple = (),
                        options: dict | None = None) -> Any:
        """The engine's sampling parameters for one call (``options``: the call's checked
        sampling options, ``worker_plugin/sampling.py``); ValueError for what it cannot do."""

    def extract_tool_calls(self, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
        """A chat output's ``(content, [{"id", "name", "arguments"}])``."""

    def submit(self, request_id: str, token_ids: list[int], params: Any, session: str | None) -> Future:
        """Queue one request; the future resolves to vLLM's RequestOutput (or the emulated one)."""

    def abort(self, request_id: str) -> None:
        """Stop a request its caller gave up on (frees its batch slot and KV)."""

    def stats(self) -> dict[str, Any]:
        """Counters the dashboard and /metrics show (empty where the engine exposes none)."""

    def kv_report(self) -> dict | None:
        """Per-session KV tiers, traffic and policy actions (None without per-session KV)."""

    def kv_directive(self, op: str, session: str, timeout: float = 60.0, **args: Any) -> dict:
        """Apply one KV directive (KV_OPS) for ``session``: ``{"result", "residency"}``."""

    def kv_hint(self, session: str, state: str, node: str | None = None, wait_key: str | None = None,
                at: float | None = None) -> Future | None:
        """Tell the engine's KV manager a session's workflow state (non-blocking; None: ignored)."""

    def kv_session_end(self, session: str) -> None:
        """The session ended: drop its KV (asynchronously)."""

    def close(self) -> None:
        """Stop the engine; callers still waiting get EngineStoppedError."""


@dataclass
class PlainCompletion:
    """One completion of an engine output as it crosses the pipe (the fields Engines reads)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class PlainOutput:
    """An engine's output as it crosses a process host's pipe (``process_host.py``): plain
    Python, not vLLM's ``RequestOutput``, whose unpickling imported vLLM into the worker (4.5 s
    and ~0.5 GB, at the first answer). Defined here, not in ``process_host`` (the child runs
    that module as ``__main__``, whose classes do not unpickle elsewhere)."""

    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[PlainCompletion]
    emulated: bool = False
    finished: bool = True


def plain_output(out: Any) -> PlainOutput:
    """``out`` (vLLM's RequestOutput or the emulated one) as a :class:`PlainOutput`."""
    comps = []
    for i, c in enumerate(out.outputs):
        lps = getattr(c, "logprobs", None)
        stop = getattr(c, "stop_reason", None)
        comps.append(PlainCompletion(
            int(getattr(c, "index", i)), list(c.token_ids), getattr(c, "text", None), c.finish_reason,
            stop if isinstance(stop, (str, int)) else None,
            None if lps is None else [{int(t): float(getattr(lp, "logprob", lp)) for t, lp in step.items()}
                                      for step in lps]))
    return PlainOutput(str(out.request_id), list(out.prompt_token_ids or ()), int(out.num_cached_tokens or 0), comps,
                       bool(getattr(out, "emulated", False)))
