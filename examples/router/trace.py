"""The Azure LLM inference trace 2023 (code and conversation services) as an arrival sequence.

The trace files ship with the package (``dask_agents/data/traces/azure-llm-2023/``:
``AzureLLMInferenceTrace_code.csv`` and ``AzureLLMInferenceTrace_conv.csv``, the licence beside
them); a directory given as ``directory=`` or in the environment variable ``DASK_AGENTS_TRACES``
(the ``azure-llm-2023`` directory itself or a directory holding it) is read instead.

Data: Azure Public Dataset, "Azure LLM inference trace 2023", © Microsoft, licensed under
Creative Commons Attribution 4.0 International (CC-BY 4.0,
https://github.com/Azure/AzurePublicDataset/blob/master/LICENSE). Please cite: P. Patel,
E. Choukse, C. Zhang, A. Shah, Í. Goiri, S. Maleki, R. Bianchini, "Splitwise: Efficient generative
LLM inference using phase splitting", ISCA 2024. Nothing from the files is copied here.

Each file has the columns ``TIMESTAMP`` (invocation time), ``ContextTokens`` and
``GeneratedTokens``. Every row is validated: the timestamp must parse and both token counts must
be non-negative integers; the first malformed row raises ``ValueError`` naming the file and its
line number (line 1 is the header).

    trace = Trace.load()                          # both files, merged, sorted by arrival
    burst = trace.window(120, 10, time_scale=0.1)  # trace seconds 120..130, replayed 10x faster
    phases = skewed(trace, 40, phases=2)           # 20 mostly-code, then 20 mostly-conversation
"""

from __future__ import annotations

import csv
import math
import os
import random
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Sequence

ENV = "DASK_AGENTS_TRACES"
SUBDIR = "azure-llm-2023"
FILES = {"code": "AzureLLMInferenceTrace_code.csv", "conversation": "AzureLLMInferenceTrace_conv.csv"}
LABELS = tuple(FILES)
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class Arrival:
    """One request of the replay.

    ``at``: seconds from the start of the replay (trace seconds until ``window``/``scaled``
    rebase and scale it); ``label``: ``"code"`` or ``"conversation"``; ``source``/``line``:
    where the row came from; ``phase``: the phase of a :func:`skewed` sequence (0 otherwise).
    """

    at: float
    label: str
    context_tokens: int
    generated_tokens: int
    timestamp: datetime
    source: str
    line: int
    phase: int = 0


def trace_dir(directory: str | os.PathLike | None = None) -> Path:
    """The directory holding the two CSV files: ``directory``, else ``$DASK_AGENTS_TRACES``, else
    the copy the package ships (``dask_agents/data/traces``). A given directory may be the trace
    directory itself or one that holds ``azure-llm-2023``.

    FileNotFoundError (saying where it looked) if the files are not there."""
    if directory is None:
        from dask_agents.data import traces_dir

        directory = traces_dir()
    base = Path(directory).expanduser()
    for cand in (base, base / SUBDIR):
        if all((cand / f).is_file() for f in FILES.values()):
            return cand
    raise FileNotFoundError(
        f"Azure LLM 2023 trace files ({', '.join(FILES.values())}) not found in {base} or {base / SUBDIR}; "
        f"pass directory= or set {ENV}"
    )


def _count(value: str, column: str, where: str) -> int:
    text = value.strip()
    if not text or not (text.isdigit() and text.isascii()) or len(text) > 12:
        raise ValueError(f"{where}: {column} must be a non-negative integer below 10**12, got {_short(value)}")
    return int(text)


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (a garbage row must not flood the message)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text_lines(f, name: str) -> Iterator[str]:
    """The lines of the binary file ``f`` as text (UTF-8, a leading BOM dropped); ValueError
    naming the file and the line that is not UTF-8."""
    for n, raw in enumerate(f, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}: line {n}: not UTF-8 text (byte {e.start + 1} of the line)") from None
        yield text.removeprefix("\ufeff") if n == 1 else text


def read_csv(path: str | os.PathLike, label: str) -> list[Arrival]:
    """Validated rows of one trace file, in file order, ``at`` = seconds since its first row's
    timestamp (:meth:`Trace.load` rebases them on the earliest timestamp of all files).

    ValueError naming the file and line of the first malformed row (missing column, wrong
    number of fields, unparsable timestamp, token count that is not a non-negative integer),
    or if the file holds no rows."""
    path = Path(path)
    with open(path, "rb") as f:
        reader = csv.reader(_text_lines(f, path.name))
        try:
            return _rows(path, label, reader)
        except csv.Error as e:  # NUL bytes, an unterminated quote, a huge field...
            raise ValueError(f"{path.name}: line {reader.line_num}: not CSV ({e})") from None


def _rows(path: Path, label: str, reader) -> list[Arrival]:
    """The body of :func:`read_csv`: validate ``reader``'s rows."""
    rows: list[Arrival] = []
    header = next(reader, None)
    if header is None:
        raise ValueError(f"{path.name}: line 1: empty file (expected header {','.join(COLUMNS)})")
    names = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{path.name}: line {reader.line_num}: missing column(s) {', '.join(missing)} "
                         f"(header {','.join(names)!r}, expected {','.join(COLUMNS)})")
    i_ts, i_ctx, i_gen = (names.index(c) for c in COLUMNS)
    start_line = reader.line_num
    for row in reader:
        line = reader.line_num
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # blank line (e.g. a trailing newline)
        where = f"{path.name}: line {line}"
        if len(row) != len(names):
            raise ValueError(f"{where}: expected {len(names)} fields ({','.join(names)}), got {len(row)}: {_short(row)}")
        try:
            ts = datetime.fromisoformat(row[i_ts].strip())
        except ValueError:
            raise ValueError(f"{where}: TIMESTAMP {_short(row[i_ts])} does not parse as a date and time") from None
        if ts.tzinfo is not None:  # compare like the trace's own (naive, UTC) timestamps
            try:
                ts = ts.astimezone(timezone.utc).replace(tzinfo=None)
            except OverflowError:
                raise ValueError(f"{where}: TIMESTAMP {_short(row[i_ts])} is out of range") from None
        rows.append(Arrival(at=0.0, label=label, timestamp=ts, source=path.name, line=line,
                            context_tokens=_count(row[i_ctx], "ContextTokens", where),
                            generated_tokens=_count(row[i_gen], "GeneratedTokens", where)))
    if not rows:
        raise ValueError(f"{path.name}: line {start_line}: no data rows after the header")
    t0 = min(r.timestamp for r in rows)
    return [replace(r, at=(r.timestamp - t0).total_seconds()) for r in rows]


class Trace(Sequence[Arrival]):
    """An arrival sequence sorted by ``at`` (ties keep their order)."""

    def __init__(self, arrivals: list[Arrival] | tuple[Arrival, ...]):
        self.arrivals: tuple[Arrival, ...] = tuple(sorted(arrivals, key=lambda a: a.at))

    @classmethod
    def load(cls, directory: str | os.PathLike | None = None) -> "Trace":
        """Both files merged (see :func:`trace_dir`); ``at`` counts from the earliest timestamp."""
        d = trace_dir(directory)
        rows = [r for label, name in FILES.items() for r in read_csv(d / name, label)]
        t0 = min(r.timestamp for r in rows)
        return cls([replace(r, at=(r.timestamp - t0).total_seconds()) for r in rows])

    def __len__(self) -> int:
        return len(self.arrivals)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return Trace(self.arrivals[i])
        return self.arrivals[i]

    def __iter__(self) -> Iterator[Arrival]:
        return iter(self.arrivals)

    def __repr__(self) -> str:
        return f"<Trace {len(self)} arrivals over {self.duration:.1f}s {self.counts()}>"

    @property
    def duration(self) -> float:
        """Seconds from the first to the last arrival."""
        return self.arrivals[-1].at - self.arrivals[0].at if self.arrivals else 0.0

    def counts(self) -> dict[str, int]:
        """Arrivals per label."""
        out = dict.fromkeys(LABELS, 0)
        for a in self.arrivals:
            out[a.label] = out.get(a.label, 0) + 1
        return out

    def of(self, label: str) -> "Trace":
        """Only the arrivals labeled ``label``."""
        if label not in LABELS:
            raise ValueError(f"unknown label {label!r} (have {', '.join(LABELS)})")
        return Trace([a for a in self.arrivals if a.label == label])

    def scaled(self, time_scale: float) -> "Trace":
        """The same arrivals with ``at`` multiplied by ``time_scale`` (0.1: ten times faster)."""
        if not (time_scale >= 0 and math.isfinite(time_scale)):
            raise ValueError(f"time_scale must be a finite number >= 0, got {time_scale!r}")
        return Trace([replace(a, at=a.at * time_scale) for a in self.arrivals])

    def window(self, start_s: float, duration_s: float, time_scale: float = 1.0) -> "Trace":
        """Arrivals with ``start_s <= at < start_s + duration_s``, rebased to start at 0 and scaled
        by ``time_scale`` (replay wall seconds per trace second)."""
        if duration_s < 0:
            raise ValueError(f"duration_s must be >= 0, got {duration_s!r}")
        end = start_s + duration_s
        return Trace([replace(a, at=a.at - start_s) for a in self.arrivals if start_s <= a.at < end]).scaled(time_scale)

    def head(self, n: int) -> "Trace":
        """The first ``n`` arrivals, rebased so the first is at 0."""
        first = self.arrivals[:n]
        t0 = first[0].at if first else 0.0
        return Trace([replace(a, at=a.at - t0) for a in first])


def skewed(trace: Trace, n: int, phases: int = 2, dominance: float = 0.95, first: str = "code",
           seed: int = 0, start_s: float = 0.0, time_scale: float = 1.0) -> Trace:
    """``n`` arrivals in ``phases`` equal phases whose dominant label alternates (``first`` first):
    ``ceil(dominance * size)`` of a phase's arrivals carry its dominant label, the rest the other,
    in a seeded order. Arrival times are the trace's own (merged) arrival times from ``start_s``
    on, rebased to 0 and scaled by ``time_scale``; each arrival's token counts come from the next
    unused row of its label in the trace (so sizes follow that service's distribution).

    With the default ``dominance`` (0.95) a phase of 10 or more arrivals is over 90% one label."""
    if first not in LABELS:
        raise ValueError(f"unknown label {first!r} (have {', '.join(LABELS)})")
    if not 0.5 <= dominance <= 1.0:
        raise ValueError(f"dominance must be in [0.5, 1], got {dominance!r}")
    if phases < 1 or n < phases:
        raise ValueError(f"need n >= phases >= 1, got n={n}, phases={phases}")
    times = [a.at for a in trace if a.at >= start_s][:n]
    if len(times) < n:
        raise ValueError(f"the trace has only {len(times)} arrivals from {start_s}s on, {n} asked")
    pools = {label: [a for a in trace if a.at >= start_s and a.label == label] for label in LABELS}
    other = {LABELS[0]: LABELS[1], LABELS[1]: LABELS[0]}
    rng = random.Random(seed)
    labels: list[tuple[int, str]] = []
    bounds = [round(k * n / phases) for k in range(phases + 1)]
    dom = first
    for k in range(phases):
        size = bounds[k + 1] - bounds[k]
        n_dom = min(size, math.ceil(dominance * size))
        phase = [dom] * n_dom + [other[dom]] * (size - n_dom)
        rng.shuffle(phase)
        labels += [(k, lab) for lab in phase]
        dom = other[dom]
    used = dict.fromkeys(LABELS, 0)
    out = []
    for t, (k, label) in zip(times, labels):
        pool = pools[label] or list(trace.of(label))
        if not pool:
            raise ValueError(f"the trace has no {label!r} arrivals")
        row = pool[used[label] % len(pool)]
        used[label] += 1
        out.append(replace(row, at=(t - times[0]) * time_scale, phase=k))
    return Trace(out)
