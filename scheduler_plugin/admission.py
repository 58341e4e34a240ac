"""Admission and late binding of LLM calls: the control plane holds the work engines cannot serve now.

An LLM call handed to an engine at once waits in the engine's own queue, where no policy can
see or order it, and a session admitted to an engine claims KV whether or not it fits: under
load the engine evicts live sessions' prefixes and recomputes them (thrash), and every
workflow policy is blind. So the scheduler keeps LLM calls until an engine has room:

- **Slots.** An engine takes at most ``slot-factor`` (1.25) x its batch size (``max_batch`` in
  its report, vLLM's ``max_num_seqs``) calls at once: a few queue in the engine, so a batch
  slot that frees is refilled in the same step instead of after a round trip to the
  scheduler (as Dask's ``worker-saturation`` keeps a little more than a worker's threads).
  The scheduler counts the calls it bound there that have not ended, exactly (no report lag).
- **KV working sets.** A session is *admitted* to an engine only while the working sets of
  the live sessions admitted there, plus its own, fit ``kv-target`` of the engine's KV
  blocks. An admitted session's working set is what it holds: its largest context so far
  (reports) or its pending call's prompt and output budget; a new session must fit at the
  typical peak context of the model's ended sessions (an EWMA: the learned growth, which
  adapts to phase changes) if that is larger. The prefix sessions share (a system prompt,
  learned from the cache hits of sessions' first calls) counts once per engine, not per
  session. An admitted session keeps its engine; its later calls bind there whenever a slot
  is free. One session alone on an engine is always admitted (it must run somewhere).
- **Stepping aside.** Holding costs a call a pump and a round trip, and a new session its
  wait. While nothing of a model is short (no call of it held, every engine under 0.9 of its
  slots and of its KV limit: :meth:`Admission.short`), a call binds at once with session
  affinity, its dependencies done or not, and a new session is admitted if its pending call
  fits (not its predicted peak). The bookkeeping (slots in flight, admitted sessions, working
  sets) is kept either way, so admission takes over the moment something runs short. A new
  session then goes to the engine beside the component making its call when that engine is
  within one live session of the least loaded, and each worker holds a **lease** on the
  sessions admitted to its engine: their LLM calls made there skip the scheduler (the worker's
  fast path, ``worker_plugin/local.py``); it is withdrawn as soon as the model is short.
- **Waiting.** A call that cannot bind is a ``no-worker`` task pinned to :data:`HELD` (an
  address no worker has). Calls bind in priority order (the prioritize policy's progress
  order, then arrival), so sessions that advanced go first; new sessions are admitted oldest
  first within priority (once one waits, later new sessions of the model wait behind it).
  Binding re-pins the call to its engine's worker and asks Dask to place it.
- **Policies act on waiting calls.** Held calls are in the control loop's view (worker
  None): ``SetPriority`` reorders them, ``Migrate`` names the engine to bind one to (checked:
  the target must host the model; the call binds there as soon as it has a slot).
- **Rebinding.** A call of an admitted session whose engine has no free slot moves its
  session to another engine with room once it has waited longer than recomputing its
  prefix there takes (context tokens / ``prefill-rate``), and only to an engine none of whose
  own sessions' calls waits (never taking a slot from them).
- **Engines where demand is.** A model no worker hosted when it said hello (loaded lazily,
  by its first call) gets engines on more workers as sessions arrive, up to its
  ``max-replicas``: a new session prefers a ready worker without the engine over engines
  that already serve live sessions (the call starts the engine there).
- **Estimates corrected by the engines.** Per engine, an EWMA of returning calls whose
  session's prefix was evicted (cache hits below half of what the session held) moves the
  limit (``adaptive``): additive increase while new sessions wait and nothing is evicted,
  multiplicative decrease when prefixes go missing (:meth:`Admission.adapt`).
- **Parking (pause and resume at tool boundaries).** An admitted session paused on a tool
  unlikely to return before its KV could move to the host tier and back (``park-margin`` x its
  working set's offload plus restore time at ``agents.kv.tiers.host.bandwidth``; the odds from
  :meth:`KVHints.resume_within`, learned per tool kind) is left out of its engine's resident
  working sets while the engine's host tier has room for it (longest pauses first), so a
  waiting session is admitted in its place (``counts["admitted_parked"]``), borrowing the
  room of as few parked sessions as cover it; those stay parked until they are back. Nothing is sent:
  the engine's KV manager moves the parked KV to the host when the newcomer's prefill needs
  the room (paused sessions on long tools come first in its eviction order) and restores it
  when the tool returns (the ``running`` hint). A parked session that resumes is admitted as
  it is (its calls never wait for room it had); the engine restores or recomputes what it must.
  Two such sessions in a row returning to a recompute pause parking on that engine for
  ``max-wait``.
- **Bounded wait.** A new session held for ``max-wait`` is admitted to the engine with a
  free slot and the smallest working set anyway, and the admission says so (event topic
  ``agents-admission``, counter ``waited_out``): never starved.

Everything here runs on the scheduler's event loop: hooks are O(1); :meth:`Admission.pump`
is O(held calls x log + live sessions of the model's engines) and runs in a callback after
the events that may free room (a call ended, an engine reported, a session ended), never
inside a transition.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import dask_agents.config as agents_config
from dask_agents.stats import percentile

from dask_agents.scheduler_plugin import dask_compat
from dask_agents.scheduler_plugin.roster import Roster, model_bounds
from dask_agents.scheduler_plugin.state import WorkflowState

if TYPE_CHECKING:
    from dask_agents.scheduler_plugin.placement import Placement


class Pauses(Protocol):
    """How much longer a paused session waits (:class:`~dask_agents.scheduler_plugin.kv_hints.KVHints`)."""

    def remaining(self, sid: str, now: float) -> float | None:
        """Expected seconds until ``sid``'s pause ends; None when it is not paused on a tool."""

    def resume_within(self, sid: str, now: float, horizon: float) -> float | None:
        """Probability that ``sid``'s pause ends within ``horizon`` s; None when not paused on a tool."""


HELD = "inproc://dask-agents-held-llm-call"
TOPIC = "agents-admission"
LEASE_OP = "agents-lease"  # scheduler -> worker: dask_agents.worker_plugin.plugin.LEASE_OP
DEFAULT_SLOTS = 256  # vLLM's max_num_seqs default, until the engine reports its own
ENDED = ("memory", "erred", "released", "forgotten")


@dataclass
class EngineRoom:
    """What the scheduler knows of one engine (a model on a worker)."""

    worker: str
    model: str
    slots: int = DEFAULT_SLOTS
    capacity: int | None = None  # KV blocks on the device; None: not reported (KV never holds)
    block_size: int = 16
    used: int | None = None
    pinned: int | None = None
    free: int | None = None
    block_bytes: int | None = None  # bytes of one KV block (reported capacity / blocks)
    host_free: int | None = None  # blocks the host tier has free (None: no host tier reported)
    lent: set[str] = field(default_factory=set)  # parked sessions whose room a newcomer took, until they return
    park_misses: int = 0  # such sessions in a row whose return found their prefix gone
    park_off_until: float = 0.0  # parking paused here until then (returns kept missing)
    inflight: set[str] = field(default_factory=set)  # calls bound here that have not ended
    sessions: set[str] = field(default_factory=set)  # sessions admitted here
    # sessions bound here by an agent call whose first LLM call has not come yet: calls on their
    # way, so that a burst of new sessions does not all pick the engine with fewest calls now
    early: set[str] = field(default_factory=set)
    # The estimates' correction, learned from what the engine shows (see KVFeedback): the
    # working sets may fill factor x kv-target of the blocks.
    factor: float = 1.0
    misses: float = 0.0  # EWMA of returning calls that found their session's prefix evicted
    samples: int = 0
    adjusted_at: float = 0.0

    def has_slot(self) -> bool:
        """Whether one more call may bind here now."""
        return len(self.inflight) < self.slots

    def kv_limit(self, target: float) -> float:
        """Blocks the admitted sessions' working sets may fill (inf: capacity unknown)."""
        return math.inf if self.capacity is None else target * self.factor * self.capacity


@dataclass
class HeldCall:
    """An LLM call the scheduler holds (or is about to bind)."""

    key: str
    session: str
    model: str
    component: str
    since: float
    tokens: int  # its prompt and output budget (0: unknown)
    target: str | None = None  # a policy's choice of engine
    note: str = ""  # why it was admitted without room (max-wait)
    near: str | None = None  # the worker its creator runs on (an engine there keeps it local)


@dataclass(frozen=True)
class Admitted:
    """One admission decision (kept in :attr:`Admission.recent`)."""

    time: float
    session: str
    model: str
    worker: str
    waited_s: float
    note: str = ""


def _prefix_missed(r: EngineRoom, prompt: int, cached: int, held_before: int) -> bool | None:
    """Whether a returning call of a session admitted to ``r`` found its prefix evicted: its
    cache hits below half of what the session held before (None: too short to tell a miss from
    block rounding)."""
    expected = min(prompt, held_before)
    if expected < 2 * r.block_size:
        return None
    return cached < 0.5 * expected


class Admission:
    """Holds LLM calls of sessions in the scheduler and binds them to engines with room."""

    SHORT = 0.9  # an engine this full (slots, or KV limit) makes its model short: see short()

    def __init__(self, roster: Roster, state: WorkflowState, placement: "Placement",
                 pauses: Pauses | None = None):
        self.roster = roster
        self.state = state
        self.placement = placement  # binds the calls admitted (and lists an engine's candidates)
        self.pauses = pauses  # how much longer paused sessions wait (KVHints): parking
        self.enabled = bool(agents_config.get("scheduler.admission.enabled", True))
        self.max_wait = agents_config.seconds("scheduler.admission.max-wait")
        self.kv_target = float(agents_config.get("scheduler.admission.kv-target", 0.9))
        self.prefill_rate = float(agents_config.get("scheduler.admission.prefill-rate", 8000))
        self.slot_factor = float(agents_config.get("scheduler.admission.slot-factor", 1.25))
        self.adaptive = bool(agents_config.get("scheduler.admission.adaptive", True))
        self.step_aside = bool(agents_config.get("scheduler.admission.step-aside", True))
        self.leasing = self.step_aside and bool(agents_config.get("scheduler.admission.lease", True))
        self.near_slack = int(agents_config.get("scheduler.admission.near-slack", 1))
        # what "least loaded" counts while stepping aside: "calls" in flight on an engine now, or
        # its live "sessions" (a session paused on a long tool holds KV and no batch slot)
        self.balance_by = str(agents_config.get("scheduler.admission.balance-by", "calls"))
        self.park = bool(agents_config.get("scheduler.admission.park", True))
        self.park_margin = float(agents_config.get("scheduler.admission.park-margin", 2.0))
        self.host_bandwidth = agents_config.parse_bandwidth(agents_config.get("kv.tiers.host.bandwidth", "25 GB/s"))
        self.interval = agents_config.seconds("scheduler.admission.interval")
        self.open: dict[str, bool] = {}  # model -> its lease is out (nothing of it short), as last sent
        self._lease_dirty: set[str] = set()  # workers whose lease changed since it was last sent
        self._lease_soon = False
        self.held: dict[str, HeldCall] = {}
        self.held_by_model: Counter = Counter()  # model -> calls of it in ``held`` (short() in O(1))
        self.engines: dict[tuple[str, str], EngineRoom] = {}
        self.bound_to: dict[str, tuple[str, str]] = {}  # key -> (worker, model) while in flight
        self.admitted_on: dict[tuple[str, str], str] = {}  # (session, model) -> worker
        # sessions bound by their first agent call (bind_early) whose LLM calls have not come yet:
        # their working set is the model's typical peak until then
        self.early: set[tuple[str, str]] = set()
        # LLM calls held or bound and not ended, per (session, model): such a session is back
        # (or about to be) whatever its tools say, so it is never parked
        self._open: Counter = Counter()
        self._open_sk: dict[str, tuple[str, str]] = {}  # call key -> its (session, model) in ``_open``
        self.tokens: dict[tuple[str, str], int] = {}  # (session, model) -> largest call budget seen
        self.models_of: dict[str, set[str]] = defaultdict(set)  # session -> models it called (cleanup index)
        self.peak: dict[tuple[str, str], int] = {}  # (session, model) -> largest context reported
        # (session, model) -> the context each of its threads of LLM calls (those one call makes:
        # an agent's steps) had after its last call: what that thread's next prompt extends
        self.threads: dict[tuple[str, str], dict[str | None, int]] = {}
        self.typical: dict[str, float] = {}  # model -> EWMA of ended sessions' peak contexts
        self.shared: dict[str, float] = {}  # model -> EWMA of the tokens sessions share (first calls' hits)
        self.counts: Counter = Counter()
        self.waits_by_model: Counter = Counter()  # model -> LLM calls that were held for room
        self.recent: deque[Admitted] = deque(maxlen=200)
        self.waits: deque[float] = deque(maxlen=1000)
        self.explicit: set[str] = set()  # models some worker hosted at its hello (not lazily loaded)
        self.starting: set[tuple[str, str]] = set()  # (worker, model): engines a call is starting lazily
        self._bounds: dict[str, tuple[int, int | None]] | None = None
        self.block_size: dict[str, int] = {}  # model -> tokens per KV block (its engines' report)
        self._blocked: set[str] = set()  # models for which a new session waited at the last pump
        self._pump_soon = False

    # -- state ------------------------------------------------------------------------------
    def is_held(self, key: str) -> bool:
        """Whether the scheduler holds ``key`` (an LLM call waiting for an engine)."""
        return key in self.held

    def room(self, worker: str, model: str) -> EngineRoom:
        """The engine of ``model`` on ``worker`` (created on first use)."""
        r = self.engines.get((worker, model))
        if r is None:
            r = self.engines[(worker, model)] = EngineRoom(worker, model)
            # an engine that reports after its model's lease went out gets it too: the lease is
            # sent when it opens or closes, so without this a late engine's worker never has it
            self._lease_changed(worker, model)
        return r

    def working_set(self, sid: str, model: str, new: bool = False) -> int:
        """Estimated KV blocks only session ``sid`` holds on ``model``'s engine: its largest
        context so far or its pending call's budget; for a ``new`` session (being admitted) also
        the typical peak of the model's ended sessions (what it will grow to). Less the prefix
        sessions share (a system prompt: counted once per engine, :meth:`resident`). Admitted
        sessions count what they hold, not their peak: counting every live session at its peak
        held sessions back that fit (measured: 0.92x plain Dask's mean at a load it sustained)."""
        sk = (sid, model)
        tokens = max(self.peak.get(sk, 0), self.tokens.get(sk, 0))
        if new or sk in self.early:
            tokens = max(tokens, int(self.typical.get(model, 0)))
        bs = self.block_size.get(model, 16)
        tokens = max(bs, tokens - int(self.shared.get(model, 0)))
        return -(-tokens // bs)

    def shared_blocks(self, model: str) -> int:
        """Blocks of the prefix the model's sessions share (learned: the cached tokens of
        sessions' first calls, which only other sessions' blocks can serve)."""
        return int(self.shared.get(model, 0)) // self.block_size.get(model, 16)

    def _live(self, sid: str) -> bool:
        s = self.state.sessions.get(sid)
        return s is not None and s.state != "completed"

    def resident(self, room: EngineRoom, parked: bool = True) -> int:
        """Blocks of the working sets of the live sessions admitted to ``room`` (dropping the
        ones that ended without our hook running: expired records), less the parked ones'
        (:meth:`parked`) unless ``parked`` is False."""
        gone = [sid for sid in room.sessions if not self._live(sid)]
        for sid in gone:
            self._forget_session(sid, room.model)
        if not room.sessions:
            return 0
        total = self.shared_blocks(room.model) + sum(self.working_set(sid, room.model) for sid in room.sessions)
        if parked:
            total -= sum(self.parked(room, time.time()).values())
        return total

    def parked(self, room: EngineRoom, now: float) -> dict[str, int]:
        """Sessions admitted to ``room`` whose KV may leave its device for the host tier now, with
        their working sets (blocks): paused on tools (``pauses``) unlikely (below
        ``PARK_PROBABILITY``) to return within ``park-margin`` x the time to offload and
        restore that KV, nor within two admission intervals (the pump must see the room before
        the session is back); the longest expected pauses first, as many as the host tier's
        free blocks hold; and, until they are back, those whose room was lent (their KV is on
        its way to the host: the host's free blocks no longer count it). Never a session with
        an LLM call held or bound. Empty without a host tier, without pause estimates, with
        ``park`` off, or for ``max-wait`` after :data:`PARK_MISSES` sessions in a row whose
        room was lent came back to find their prefix gone (recomputed)."""
        if not (self.park and self.pauses is not None and room.host_free and room.block_bytes) \
                or now < room.park_off_until:
            return {}
        out: dict[str, int] = {}
        candidates = []
        for sid in room.sessions:
            sk = (sid, room.model)
            if sk in self.early or self._open.get(sk):
                continue  # not started yet, or a call of it is held or bound: it is back
            blocks = self.working_set(sid, room.model)
            move_s = 2 * blocks * room.block_bytes / self.host_bandwidth  # offload, then restore
            back = self.pauses.resume_within(sid, now, max(2 * self.interval, self.park_margin * move_s))
            if back is None:
                continue  # not paused on a tool
            if sid in room.lent:  # its room was lent: parked until it is back (its KV went, or goes, down)
                out[sid] = blocks
            elif back < self.PARK_PROBABILITY:
                candidates.append((self.pauses.remaining(sid, now) or 0.0, sid, blocks))
        room_left = room.host_free
        for _rest, sid, blocks in sorted(candidates, reverse=True):
            if blocks <= room_left:
                out[sid] = blocks
                room_left -= blocks
        return out

    def short(self, model: str, rooms: dict) -> bool:
        """Whether ``model``'s engines are short of room, so admission must hold and order calls
        (DESIGN: "admission steps aside when nothing is short"): a call of the model is held, or
        one of its engines has ``SHORT`` of its slots taken or its admitted working sets past
        ``SHORT`` of its KV limit. When nothing is short, a call binds at once with session
        affinity (its session's engine, else the roomiest) and a new session is admitted if its
        pending call fits, not its predicted peak: holding pays only when there is something
        to order or protect, and otherwise costs a call a pump and a round trip. Its LLM calls
        made beside their engine then run there under the lease (:meth:`push_leases`).
        O(1) for the held calls (``held_by_model``), O(engines of the model x their admitted
        sessions) for the rest (``rooms`` caches each engine's resident blocks for the caller)."""
        if self.held_by_model[model] > 0:
            return True
        for w in self.roster.hosts.get(model, ()):
            r = self.engines.get((w, model))
            if r is None:
                continue
            if len(r.inflight) >= self.SHORT * r.slots:
                return True
            limit = r.kv_limit(self.kv_target)
            if limit != math.inf and self._resident(r, rooms) > self.SHORT * limit:
                return True
        return False

    # -- hooks from the plugin (O(1) each) ------------------------------------------------
    def on_call(self, ts: Any, rec: Any, ann: dict) -> bool:
        """A new LLM call of a session (``update_graph``): bind it now if an engine has room
        and nothing of its model waits ahead of it (when nothing is short, also before its
        dependencies are done), else hold it. True if handled here."""
        if not self.enabled or rec.session is None:
            return False
        model = ann.get("llm_model")
        if not model:
            return False
        budget = int(ann.get("llm_prompt_len") or 0) + int(ann.get("llm_max_tokens") or 0)
        sk = (rec.session, model)
        self.models_of[rec.session].add(model)
        if sk in self.early:  # (bound early: from now on it counts what its calls need)
            self.early.discard(sk)
            r = self.engines.get((self.admitted_on.get(sk), model))
            if r is not None:
                r.early.discard(rec.session)
        if budget > self.tokens.get(sk, 0):
            self.tokens[sk] = budget
        h = HeldCall(rec.key, rec.session, model, rec.component, time.time(), budget)
        creator = self.state.calls.get(rec.creator)
        h.near = creator.worker if creator is not None and creator.state in ("processing", "running") else None
        rooms: dict = {}
        loose = self.step_aside and not self.short(model, rooms)
        if loose or dask_compat.dependencies_in_memory(ts):
            worker = self._choose(h, h.since, rooms, model in self._blocked, loose=loose)
            if worker is not None:
                self.counts["bound_loose" if loose else "bound_at_once"] += 1
                self._bind(h, ts, worker, rooms)
                return True
        self._hold(h)
        self.counts["held"] += 1
        self.waits_by_model[model] += 1
        dask_compat.restrict_to_worker(ts, HELD)
        self._set_open(model, False)  # something waits: the model's calls come here again
        return True

    def bind_early(self, sid: str, model: str) -> str | None:
        """Placement from the start: the engine of ``model`` a session's first agent call with
        the ``model=`` hint should run beside, binding the session there now if it has no
        engine yet (as its first LLM call would be bound while nothing of the model is short:
        the roomiest engine). Without it the agent was placed before its session had an engine,
        and its LLM calls then went to an engine elsewhere whenever the agent's worker had more
        sessions than the others (4 of 12 sessions of a ReAct workflow ran none of their LLM
        calls beside their agent). None: no engine to choose now (admission off or holding calls
        of the model, no engine of it up yet); the agent is placed as Dask would and its session
        is bound by its first LLM call."""
        sk = (sid, model)
        if sk in self.admitted_on or not (self.enabled and self.step_aside) or not self._live(sid):
            return self.admitted_on.get(sk)
        if not self.roster.hosts.get(model):  # loaded lazily, nowhere yet: its first LLM call starts one
            return None
        rooms: dict = {}
        if self.short(model, rooms):
            return None
        component = f"llm.{model}"
        candidates = self.placement.candidates(model, component)
        if self._spare(model, candidates):  # another engine may start: its first LLM call decides
            return None
        h = HeldCall("", sid, model, component, time.time(), 0)
        # it must fit with the typical peak of the model's sessions (loose=False), and it counts
        # that peak until its own first LLM call says what it needs (``early``): a burst of
        # sessions opened by agent calls must not all bind at one block each, then outgrow the KV
        # nothing is short (checked above): ranked as a first LLM call would be, by load
        worker = self._roomiest(h, candidates, rooms, loose=False, by_load=True)
        if worker is None:
            return None
        self._bind_session(sid, model, worker, "bound_early", "bound at its first agent call")
        return worker

    def _bind_session(self, sid: str, model: str, worker: str, count: str, note: str) -> None:
        """Admit a session with no engine yet to ``worker``'s engine of ``model`` before its
        first LLM call (which then counts its working set, ``early``)."""
        sk = (sid, model)
        self.early.add(sk)
        self.models_of[sid].add(model)
        self.admitted_on[sk] = worker
        self.room(worker, model).sessions.add(sid)
        self.room(worker, model).early.add(sid)
        self._lease_changed(worker, model)
        self.placement.bind(sid, f"llm:{model}", worker)
        self.counts["admitted"] += 1
        self.counts[count] += 1
        self.recent.append(Admitted(time.time(), sid, model, worker, 0.0, note))

    def on_transition(self, key: str, finish: str) -> None:
        """A recorded LLM call changed state."""
        if finish == "no-worker":
            if key in self.held:
                self._soon()
            return
        if finish not in ENDED:
            return
        if self._unhold(key) is not None:  # failed or cancelled while it waited here
            self.counts["ended_while_held"] += 1
            return
        # ended (or released: cancelled, or its worker was lost and recovery places it again)
        where = self.bound_to.pop(key, None)
        self._closed(key)
        if where is not None:
            r = self.engines.get(where)
            if r is not None:
                r.inflight.discard(key)
            self._soon()

    def on_local_llm(self, key: str, worker: str, model: str) -> None:
        """A leased LLM call started on ``worker``'s fast path: it holds a slot of the engine
        there until it ends (:meth:`on_transition`), so :meth:`short` counts it."""
        self.bound_to[key] = (worker, model)
        r = self.room(worker, model)
        r.inflight.add(key)
        rec = self.state.calls.get(key)
        if rec is not None and rec.session is not None:
            r.early.discard(rec.session)  # its call is in flight now (its KV: at its report)
            self._opened(key, (rec.session, model))
            if (rec.session, model) not in self.admitted_on and self._live(rec.session):
                # admitted by the worker itself, under the open lease, for a driver's direct
                # call (worker_plugin/direct.py): the session is bound to that engine now
                self._bind_session(rec.session, model, worker, "admitted_locally", "admitted by its worker")
        self.counts["leased_calls"] += 1

    def on_llm_report(self, rec: Any) -> None:
        """An LLM call of a session finished with its token counts: its context so far."""
        m = rec.metrics or {}
        if rec.model is None or m.get("prompt_tokens") is None or not self._live(rec.session):
            return  # (a report trailing its session's end would leave an entry nobody drops)
        ctx = int(m["prompt_tokens"]) + int(m.get("output_tokens") or 0)
        sk = (rec.session, rec.model)
        # bound early and served under the lease (no update_graph, so on_call never said what
        # it needs): from its first report on it counts what it holds, not the typical peak
        self.early.discard(sk)
        # a miss is judged against the context of the same thread (the calls one caller makes,
        # each extending the last), not the session's largest: in a session of several agents
        # (finance: 3-5 analysts, a summarizer, follow-ups) another agent's first call shares
        # only the system prompt, and taking that for an eviction drove every engine's limit to
        # its floor with nothing ever evicted (all 12 finance units below capacity: factor 0.5)
        self.models_of[rec.session].add(rec.model)  # (what it records here goes at the session's end)
        threads = self.threads.setdefault(sk, {})
        creator = getattr(rec, "creator", None)
        before = threads.get(creator)
        threads[creator] = ctx
        if before is not None and m.get("cached_tokens") is not None and self.admitted_on.get(sk) == rec.worker:
            r = self.engines.get((rec.worker, rec.model))
            if r is not None:
                miss = _prefix_missed(r, int(m["prompt_tokens"]), int(m["cached_tokens"]), before)
                if miss is not None:
                    self._feedback(r, miss)
                self._park_feedback(r, rec.session, miss)
        if sk not in self.peak and m.get("cached_tokens") is not None:  # its first call: hits are shared blocks
            old = self.shared.get(rec.model)
            cached = float(m["cached_tokens"])
            self.shared[rec.model] = cached if old is None else 0.8 * old + 0.2 * cached
        if ctx > self.peak.get(sk, 0):
            self.peak[sk] = ctx

    def on_engine_stats(self, worker: str, engines: dict) -> None:
        """A worker's engines reported (validated): slots, KV capacity and use."""
        for model, st in engines.items():
            r = self.room(worker, model)
            if st.get("max_batch"):  # a few more than its batch: it admits the next call at once
                r.slots = max(int(st["max_batch"]), math.ceil(self.slot_factor * int(st["max_batch"])))
            if st.get("block_size"):
                r.block_size = self.block_size[model] = int(st["block_size"])
            blocks = st.get("kv_blocks") or {}
            if blocks.get("capacity"):
                r.capacity = int(blocks["capacity"])
            r.used, r.pinned, r.free = blocks.get("used"), blocks.get("pinned"), blocks.get("free")
            cap_bytes, held = st.get("kv_capacity_bytes") or {}, st.get("kv_bytes") or {}
            r.block_bytes = max(1, int(cap_bytes["device"]) // r.capacity) \
                if r.capacity and cap_bytes.get("device") else None
            r.host_free = max(0, int(cap_bytes["host"]) - int(held.get("host") or 0)) // r.block_bytes \
                if r.block_bytes and cap_bytes.get("host") else None  # (none reported: no host tier now)
        if self.held:
            self._soon()

    def on_hello(self, models: list[str]) -> None:
        """A worker said hello hosting ``models``: those are placed by the user, not lazily."""
        self.explicit.update(models)

    def on_models(self) -> None:
        """Engines appeared or went (a worker's hosted models changed)."""
        hosting = self.roster.hosts
        self.starting = {(w, m) for w, m in self.starting if w not in hosting.get(m, ())
                         and self.roster.alive(w)}
        if self.held:
            self._soon()

    def on_session_ended(self, sid: str) -> None:
        """``sid`` completed: its working sets leave their engines; its peak teaches the typical one."""
        for model in self.models_of.pop(sid, ()):  # O(its models), not a scan of every admission
            self._forget_session(sid, model, learn=True)
        if self.held:
            self._soon()

    def on_worker_removed(self, worker: str) -> None:
        """``worker`` left: its engines, and the admissions of its sessions, are gone (their next
        call is admitted again elsewhere)."""
        for k in [k for k in self.engines if k[0] == worker]:
            r = self.engines.pop(k)
            for sid in r.sessions:
                self.admitted_on.pop((sid, r.model), None)
        for h in self.held.values():
            if h.target == worker:
                h.target = None
        if self.held:
            self._soon()

    def _forget_session(self, sid: str, model: str, learn: bool = False) -> None:
        worker = self.admitted_on.pop((sid, model), None)
        if worker is not None:
            r = self.engines.get((worker, model))
            if r is not None:
                r.sessions.discard(sid)
                r.early.discard(sid)
                r.lent.discard(sid)
                self._lease_changed(worker, model)
        peak = self.peak.pop((sid, model), 0)
        self.threads.pop((sid, model), None)
        self.tokens.pop((sid, model), None)
        self.early.discard((sid, model))
        models = self.models_of.get(sid)
        if models is not None:
            models.discard(model)
            if not models:
                del self.models_of[sid]
        if learn and peak > 0:
            old = self.typical.get(model)
            self.typical[model] = float(peak) if old is None else 0.8 * old + 0.2 * peak

    # -- policies' say ----------------------------------------------------------------------
    def prefer(self, key: str, target: str) -> str | None:
        """A policy asks that held call ``key`` bind to ``target``; why not, or None (accepted)."""
        h = self.held.get(key)
        if h is None:
            return "not held"
        if target not in self.placement.candidates(h.model, h.component):
            return f"{target} does not host model {h.model!r}"
        h.target = target
        self.counts["policy_targets"] += 1
        self._soon()
        return None

    # -- binding ----------------------------------------------------------------------------
    def _resident(self, r: EngineRoom, rooms: dict) -> int:
        k = (r.worker, r.model)
        if k not in rooms:
            rooms[k] = self.resident(r)
        return rooms[k]

    def _fits(self, r: EngineRoom, sid: str, rooms: dict, loose: bool = False) -> bool:
        """Whether session ``sid`` may be admitted to ``r``: with its predicted peak, or when
        nothing is short (``loose``) with what its pending call needs now."""
        if sid in r.sessions:
            return True
        resident = self._resident(r, rooms)  # (drops expired sessions first)
        return not r.sessions or (resident + self.working_set(sid, r.model, new=not loose)
                                  <= r.kv_limit(self.kv_target))

    def _choose(self, h: HeldCall, now: float, rooms: dict, new_blocked: bool,
                waiting_on: Counter | None = None, loose: bool = False) -> str | None:
        """The worker to bind ``h`` to now, or None (it waits). ``waiting_on``: held calls per
        engine still waiting for it after the pump's first pass; given, a call of a session
        whose engine is busy may move to an engine nobody waits for (the second pass).
        ``loose``: nothing of its model is short (:meth:`short`): no queue to wait behind, and
        a new session fits with its pending call's needs."""
        if loose:
            new_blocked = False
        sk = (h.session, h.model)
        admitted = self.admitted_on.get(sk)
        if h.target is None and admitted is not None and (
                (admitted, h.model) in self.starting or self.placement.bound_ok(admitted, h.model, h.component)):
            # the common case, in O(1): a call of a session on a healthy engine (listing the
            # candidates is O(workers): not per call on the scheduler's event loop)
            return self._on_admitted(h, admitted, now, rooms, waiting_on)
        waited = now - h.since
        if admitted is None and h.target is None and new_blocked and waited < self.max_wait:
            return None  # new sessions queue behind the one that waits (checked before any listing)
        candidates = self.placement.candidates(h.model, h.component)
        if not candidates:
            return None
        if h.target is not None:
            if h.target in candidates:
                r = self.room(h.target, h.model)
                if r.has_slot() and self._fits(r, h.session, rooms, loose):
                    return h.target
                return None  # the policy's engine is full: wait for it
            h.target = None
        if admitted is not None and (admitted in candidates or (admitted, h.model) in self.starting):
            return self._on_admitted(h, admitted, now, rooms, waiting_on, candidates)
        if new_blocked and waited < self.max_wait:
            return None
        if loose and h.near in candidates and self._near_ok(h, candidates, rooms):
            self.counts["admitted_near"] += 1
            return h.near
        spare = self._spare(h.model, candidates)
        w = self._roomiest(h, candidates + spare, rooms, loose)
        if w in spare:
            self.starting.add((w, h.model))
            self.counts["engines_started"] += 1
        if w is None and waited >= self.max_wait:
            w = self._least_resident(h, candidates, rooms)
            if w is not None:
                self.counts["waited_out"] += 1
                h.note = (f"admitted after waiting {waited:.1f}s (max-wait): its working set does not fit; "
                          f"the engine may evict other sessions' KV")
        return w

    def _on_admitted(self, h: HeldCall, admitted: str, now: float, rooms: dict, waiting_on: Counter | None,
                     candidates: list[str] | None = None) -> str | None:
        """A call of a session admitted to ``admitted``: there when it has a slot; else, in the
        pump's second pass (``waiting_on`` given), maybe another engine (see the comment)."""
        r = self.room(admitted, h.model)
        if r.has_slot():
            return admitted
        # Its engine is busy: move only to an engine whose own sessions' calls all got a
        # slot (taking the slot a call of that engine waits for makes both engines' sessions
        # recompute: measured, 30 moves in 80 sessions at overload), and only when waiting
        # has cost more than recomputing the prefix there.
        if waiting_on is None or now - h.since <= self.peak.get((h.session, h.model), 0) / self.prefill_rate:
            return None
        if candidates is None:
            candidates = self.placement.candidates(h.model, h.component)
        alt = self._roomiest(h, [w for w in candidates if w != admitted and not waiting_on[w]], rooms)
        if alt is not None:
            self.counts["rebound"] += 1
        return alt

    def _near_ok(self, h: HeldCall, candidates: list[str], rooms: dict) -> bool:
        """Whether a new session may go to the engine beside its creator (``h.near``) rather
        than the least loaded: it has a slot, the session fits, and its load (``balance-by``:
        calls in flight and on their way, or live sessions) is at most ``near-slack`` more than
        the least loaded engine's (locality, not a pile-up: its LLM calls then run there under
        the lease, with no hop)."""
        r = self.room(h.near, h.model)
        if not r.has_slot() or not self._fits(r, h.session, rooms, True):
            return False
        fewest = min(self._load(self.room(w, h.model)) for w in candidates)
        return self._load(r) <= fewest + self.near_slack

    def _load(self, r: EngineRoom) -> int:
        """An engine's load as ``balance-by`` counts it (calls: those in flight and the first
        calls of sessions bound there early, on their way)."""
        return len(r.inflight) + len(r.early) if self.balance_by == "calls" else len(r.sessions)

    def _spare(self, model: str, candidates: list[str]) -> list[str]:
        """Ready workers without an engine of lazily loaded ``model`` where a new session may
        start one (none sent there yet), while the model has fewer than ``max-replicas``."""
        hosting = self.roster.hosts.get(model)
        if model in self.explicit or not hosting:  # placed by the user, or nothing hosts it yet (any worker)
            return []
        if self._bounds is None:
            self._bounds = model_bounds()
        most = self._bounds.get(model, (1, None))[1]
        engines = len(hosting) + sum(1 for _w, m in self.starting if m == model)
        if most is not None and engines >= most:
            return []
        return [w for w in self.roster.ready if w not in hosting and w not in candidates
                and (w, model) not in self.starting and not getattr(self.engines.get((w, model)), "sessions", None)
                and self.roster.alive(w)]

    def _roomiest(self, h: HeldCall, workers: list[str], rooms: dict, loose: bool = False,
                  by_load: bool | None = None) -> str | None:
        """Of ``workers``, the engine with a free slot where the session fits with the most KV
        room left (the fraction of its limit); ties: the fewest live sessions, then calls in
        flight, then sessions ever sent there (round robin among idle engines). With
        ``balance-by: calls`` and nothing short (``by_load``, by default ``loose``), the engine
        with the fewest calls in flight first. An engine that
        has not reported its capacity yet counts as large as the model's largest one that has
        (engines of one model are alike), not as infinite: it must not take every session."""
        if by_load is None:
            by_load = loose
        known = [r.capacity for (_w, m), r in self.engines.items() if m == h.model and r.capacity]
        default = max(known) if known else None
        best, best_key = None, None
        for w in workers:
            r = self.room(w, h.model)
            if not r.has_slot() or not self._fits(r, h.session, rooms, loose):
                continue
            cap = r.capacity or default
            free = 1.0 - self._resident(r, rooms) / (self.kv_target * r.factor * cap) if cap else 1.0
            key = (round(free, 6), -len(r.sessions), -len(r.inflight), -self.placement.assigned.get(w, 0))
            if by_load and self.balance_by == "calls":  # nothing short: the engine with the fewest calls now
                key = (-self._load(r), round(free, 6), -len(r.sessions), -self.placement.assigned.get(w, 0))
            if best_key is None or key > best_key:
                best, best_key = w, key
        return best

    def _least_resident(self, h: HeldCall, workers: list[str], rooms: dict) -> str | None:
        ok = [w for w in workers if self.room(w, h.model).has_slot()]
        return min(ok, key=lambda w: self._resident(self.room(w, h.model), rooms), default=None)

    def _bind(self, h: HeldCall, ts: Any, worker: str, rooms: dict) -> None:
        sk = (h.session, h.model)
        r = self.room(worker, h.model)
        old = self.admitted_on.get(sk)
        if old != worker:
            if old is not None and (old, h.model) in self.engines:
                self.engines[(old, h.model)].sessions.discard(h.session)
                self.engines[(old, h.model)].early.discard(h.session)
                self.engines[(old, h.model)].lent.discard(h.session)
                self._lease_changed(old, h.model)
            self.admitted_on[sk] = worker
            r.sessions.add(h.session)
            self._lease_changed(worker, h.model)
            rooms.pop((worker, h.model), None)
            waited = time.time() - h.since
            self.waits.append(waited)
            self.counts["admitted"] += 1
            if old is None:
                if self.park and not h.note and self._into_parked(r, h.session, rooms):
                    self.counts["admitted_parked"] += 1
                    h.note = "into the room of sessions parked on tools"
                self.recent.append(Admitted(time.time(), h.session, h.model, worker, waited, h.note))
                if h.note:
                    dask_compat.add_event(self.roster.scheduler, TOPIC, {"action": "admitted", "session": h.session,
                                                               "model": h.model, "worker": worker,
                                                               "waited_s": round(waited, 3), "note": h.note})
        # the session's binding (its later calls, its KV, the placement hint) follows
        self.placement.place(ts, h.session, f"llm:{h.model}", [worker])
        r.inflight.add(h.key)
        self.bound_to[h.key] = (worker, h.model)
        self._opened(h.key, sk)
        self.counts["bound"] += 1

    PARK_MISSES = 2  # lent sessions in a row returning to a recompute: parking pauses on that engine
    PARK_PROBABILITY = 0.5  # a session this likely to be back within the move's time is not parked

    def _into_parked(self, r: EngineRoom, sid: str, rooms: dict) -> bool:
        """Whether session ``sid``, just admitted to ``r``, fits only because parked sessions'
        working sets were left out (``rooms`` still holds ``r``'s count from before it came);
        if so those sessions' room is lent (:meth:`_park_feedback` judges their return)."""
        parked = self.parked(r, time.time())
        if not parked:
            return False
        mine = self.working_set(sid, r.model, new=True)
        resident = self._resident(r, rooms) - self.working_set(sid, r.model)  # (cached, or recounted with it)
        short = resident + sum(parked.values()) + mine - r.kv_limit(self.kv_target)
        if short <= 0:
            return False
        now = time.time()  # lend the room of the longest pauses, as much as covers the shortfall
        for p in sorted(parked, key=lambda p: -(self.pauses.remaining(p, now) or 0.0)):
            if short <= 0:
                break
            if p not in r.lent:
                r.lent.add(p)
                short -= parked[p]
        return True

    def _park_feedback(self, r: EngineRoom, sid: str, miss: bool | None) -> None:
        """A returning call of ``sid`` on ``r``: if its room was lent while it was parked, whether
        its prefix was kept or restored (else recomputed: a ``miss``; None: too short to tell).
        ``PARK_MISSES`` misses in a row pause parking on the engine for ``max-wait``; a hit
        resets the count."""
        if sid not in r.lent:
            return
        r.lent.discard(sid)  # it is back
        if miss is None:
            return
        if not miss:
            r.park_misses = 0
            return
        r.park_misses += 1
        self.counts["park_misses"] += 1
        if r.park_misses >= self.PARK_MISSES:
            r.park_misses = 0
            r.park_off_until = time.time() + self.max_wait
            self.counts["park_paused"] += 1

    def _opened(self, key: str, sk: tuple[str, str]) -> None:
        if key not in self._open_sk:
            self._open_sk[key] = sk
            self._open[sk] += 1

    def _closed(self, key: str) -> None:
        sk = self._open_sk.pop(key, None)
        if sk is not None:
            self._open[sk] -= 1
            if self._open[sk] <= 0:
                del self._open[sk]

    def _hold(self, h: HeldCall) -> None:
        self.held[h.key] = h
        self.held_by_model[h.model] += 1
        self._opened(h.key, (h.session, h.model))

    def _unhold(self, key: str) -> HeldCall | None:
        h = self.held.pop(key, None)
        if h is not None:
            self._closed(key)
            self.held_by_model[h.model] -= 1
            if self.held_by_model[h.model] <= 0:
                del self.held_by_model[h.model]
        return h

    def _soon(self) -> None:
        if not self._pump_soon and self.roster.scheduler is not None:
            self._pump_soon = True
            self.roster.soon(self.pump)

    def pump(self) -> int:
        """Bind every held call that can bind now, in priority order; returns how many."""
        self._pump_soon = False
        if not self.held:
            self._blocked = set()
            return 0
        s = self.roster.scheduler
        now = time.time()
        ready = []
        for key, h in list(self.held.items()):
            ts = dask_compat.task(s, key)
            if ts is None:
                self._unhold(key)
                continue
            if dask_compat.state(ts) == "no-worker":
                ready.append((dask_compat.priority(ts), h.since, key, h, ts))
        ready.sort(key=lambda e: (e[0], e[1]))
        rooms: dict = {}
        blocked: set[str] = set()  # models for which a new session waits (later new ones queue behind)
        placed, stay = [], []
        waiting_on: Counter = Counter()  # engine -> its admitted sessions' calls still waiting
        for entry in ready:
            _prio, _since, key, h, ts = entry
            is_new = (h.session, h.model) not in self.admitted_on
            w = self._choose(h, now, rooms, is_new and h.model in blocked)
            if w is None:
                if is_new:
                    blocked.add(h.model)
                else:
                    waiting_on[self.admitted_on[(h.session, h.model)]] += 1
                    stay.append(entry)
                continue
            self._unhold(key)
            self._bind(h, ts, w, rooms)
            placed.append(key)
        for _prio, _since, key, h, ts in stay:  # second pass: calls of busy engines may move
            old = self.admitted_on.get((h.session, h.model))
            w = self._choose(h, now, rooms, False, waiting_on)
            if w is not None and w != old:
                self._unhold(key)
                waiting_on[old] -= 1
                self._bind(h, ts, w, rooms)
                placed.append(key)
        self._blocked = blocked  # a new session arriving before the next pump queues behind these
        if placed:
            dask_compat.reschedule(s, placed, f"dask-agents-admission-{now}")
        return len(placed)

    def tick(self) -> None:
        """Periodic: waits past ``max-wait`` and rebinds happen with no event to trigger them;
        the working-set limits adapt (:meth:`adapt`); leases open or close with :meth:`short`."""
        self.adapt(time.time())
        if self.held:
            self.pump()
        if self.leasing:
            rooms: dict = {}
            for model in {m for _w, m in self.engines}:
                self._set_open(model, not self.short(model, rooms))

    # -- the lease: LLM calls of admitted sessions on the workers' fast path ----------------------
    # Nalar's two-level control: while nothing of a model is short, the scheduler has nothing to
    # order, so a worker runs the LLM calls its components make for sessions admitted to its own
    # engine without asking (worker_plugin/local.py). The scheduler keeps deciding which sessions
    # an engine holds (admission) and withdraws the lease the moment something runs short (a held
    # call, an engine near its slots or KV limit): then every call waits here again. A call that
    # ran under a lease reports its tokens like any other, so the working sets stay exact.
    def _set_open(self, model: str, open_: bool) -> None:
        open_ = open_ and self.leasing
        if self.open.get(model, False) == open_:
            return
        self.open[model] = open_
        self.counts["lease_opened" if open_ else "lease_closed"] += 1
        for w, m in self.engines:
            if m == model:
                self._lease_changed(w, model, force=True)

    def _lease_changed(self, worker: str, model: str, force: bool = False) -> None:
        if not (force or self.open.get(model)):
            return  # nothing of it is out: nothing to withdraw or add
        self._lease_dirty.add(worker)
        if not self._lease_soon and self.roster.scheduler is not None:
            self._lease_soon = True
            self.roster.soon(self.push_leases)

    def leases_of(self, worker: str) -> dict[str, list[str]]:
        """``worker``'s lease: model -> the sessions admitted to its engine of it, for each
        model whose lease is out."""
        return {m: sorted(r.sessions) for (w, m), r in self.engines.items() if w == worker and self.open.get(m)}

    def push_leases(self) -> None:
        """Send the changed leases (each worker's whole lease: it replaces the last one)."""
        self._lease_soon = False
        dirty, self._lease_dirty = self._lease_dirty, set()
        s = self.roster.scheduler
        for w in dirty:
            if dask_compat.has_worker(s, w):
                dask_compat.send_to_worker(s, w, {"op": LEASE_OP, "leases": self.leases_of(w)})

    # -- the estimates, corrected by what the engines show ------------------------------------
    # Working sets are estimates: too large, and sessions wait that would fit (measured on two
    # real engines: 0.59x plain Dask's mean at a load it sustained without a single eviction);
    # too small, and the engine evicts live sessions' prefixes (thrash). The engine shows which:
    # a returning call of an admitted session whose cached prefix is less than half of what
    # the session held before found it evicted. Per engine, an EWMA of such misses drives the
    # limit: additive increase while new sessions wait and nothing is evicted, multiplicative
    # decrease when misses appear (AIMD: it adapts to load, context length and phases without
    # a tuned cap, and backs off at once when it overshoots).
    MISS_LOW, MISS_HIGH, MIN_SAMPLES = 0.05, 0.2, 8
    FACTOR_MIN, FACTOR_MAX, STEP, BACKOFF, EVERY_S, ALPHA = 0.5, 4.0, 0.1, 0.7, 1.0, 0.1

    def _feedback(self, r: EngineRoom, miss: bool) -> None:
        """A returning call of a session admitted to ``r`` found its prefix (or ``miss``)."""
        if not self.adaptive:
            return
        r.misses += self.ALPHA * (float(miss) - r.misses)
        r.samples += 1

    def adapt(self, now: float) -> None:
        """Move each engine's limit factor (at most once per ``EVERY_S``): up while new sessions
        of its model wait and its returning calls find their prefixes, down when they do not."""
        if not self.adaptive:
            return
        for (worker, model), r in self.engines.items():
            if r.samples < self.MIN_SAMPLES or now - r.adjusted_at < self.EVERY_S:
                continue
            if r.misses > self.MISS_HIGH and r.factor > self.FACTOR_MIN:
                r.factor = max(self.FACTOR_MIN, r.factor * self.BACKOFF)
            elif r.misses < self.MISS_LOW and model in self._blocked and r.factor < self.FACTOR_MAX:
                r.factor = min(self.FACTOR_MAX, r.factor + self.STEP)
            else:
                continue
            r.adjusted_at = now
            self.counts["limit_changes"] += 1

    # -- reporting --------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """For ``agents-control``, ``/metrics`` and the dashboard."""
        import numpy as np

        waits = np.asarray(self.waits, dtype=float)
        held_by_model = self.held_by_model
        return {
            "enabled": self.enabled, "held": len(self.held), "held_by_model": dict(held_by_model),
            "leased": sorted(m for m, o in self.open.items() if o),
            "counts": dict(self.counts),
            "wait_p50_s": percentile(waits, 50) if waits.size else None,
            "wait_p99_s": percentile(waits, 99) if waits.size else None,
            "engines": [{"worker": r.worker, "model": r.model, "slots": r.slots, "inflight": len(r.inflight),
                         "sessions": len(r.sessions), "resident_blocks": self.resident(r),
                         "parked": len(self.parked(r, time.time())), "host_free_blocks": r.host_free,
                         "capacity_blocks": r.capacity, "used_blocks": r.used, "pinned_blocks": r.pinned,
                         "free_blocks": r.free, "limit_factor": round(r.factor, 3),
                         "prefix_miss_rate": round(r.misses, 3)} for r in self.engines.values()],
            "recent": [a.__dict__ for a in list(self.recent)[-20:]],
        }
