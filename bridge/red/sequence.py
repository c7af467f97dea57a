"""Red, sequence checks (pure): duplicates, hash chain, coverage, transit gaps, heartbeats.

Nothing here does I/O or reads a clock: the landing passes ``now`` in and saves the state.
Docs: protocol.md §6 (seqs, gaps, coverage rule, hash chain), §8 (duplicates), §9 (heartbeats).

Per channel the state is a *frontier* that stays small however long the link runs:

- ``contig``: the highest bundle seq n with 1..n all landed, with the plaintext SHA-256 and the
  coverage end ("accounted up to seq") of bundle n;
- ``runs``: landed bundles above ``contig`` (only while a hole is open), as runs of
  consecutive bundle seqs keeping just what the links at their two edges still need, so a hole
  that never fills costs one run, not one record per bundle behind it;
- ``gaps``: bundle-seq ranges known to exist but not arrived (lost in transit, so far);
- ``landed``: merged message-seq intervals accounted for (rows and declared gaps), so no seq
  lands twice; normally a single interval ``[0, end]``;
- the last heartbeat and whether the link is silent.

Every link ``(n-1, n)`` is checked exactly once, when its second end lands (two runs join):
``prev_sha256`` of n against the SHA-256 of n-1 (``chain_verified`` / ``chain_broken``, reported
on n) and the coverage of n against the coverage end of n-1 (``coverage_mismatch``). A bundle
without any coverage (no rows, no gaps) passes its predecessor's end on; a coverage check
waiting on such a bundle's end runs when that end becomes known.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal, TypeVar

from bridge.errors import StateError
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.manifest import Manifest, format_utc, parse_utc

__all__ = [
    "STATE_FORMAT",
    "Verdict",
    "Lookup",
    "BundleFacts",
    "HeartbeatFacts",
    "Event",
    "Admission",
    "Run",
    "TransitGap",
    "WrittenOff",
    "Retirement",
    "HeartbeatSeen",
    "ChannelState",
    "SequenceState",
    "classify",
    "judge",
    "admit",
    "heartbeat",
    "tick",
    "open_gaps",
    "write_off",
    "retire",
    "seqs_within",
    "summary",
]

STATE_FORMAT = 1
UNSAVED_CAP = 65_536
"""At most this many (channel, bundle_seq) -> sha256 of the current, unsaved landing kept."""

Verdict = Literal["new", "duplicate", "conflict"]
Lookup = Callable[[str, int], str | None]
"""``lookup(channel, bundle_seq)``: the plaintext SHA-256 the ledger holds for a landed bundle."""

Interval = tuple[int, int]

_COUNTERS = (
    "bundles",
    "rows",
    "declared_lost",
    "overlap_seqs",
    "chain_broken",
    "coverage_mismatch",
    "heartbeats",
)


# ------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class BundleFacts:
    """What the sequence checks need to know of one verified bundle."""

    channel: str
    bundle_seq: int
    bundle_id: str
    sha256: str
    """Lowercase hex SHA-256 of the plaintext Parquet bytes (never the ciphertext)."""
    prev_sha256: str | None
    rows: int
    first_seq: int | None
    last_seq: int | None
    gaps: tuple[tuple[int, int, str], ...] = ()
    """Message seq ranges black declared lost: ``(first_seq, last_seq, reason)``, inclusive."""
    created_at: str | None = None

    @property
    def coverage(self) -> Interval | None:
        """``[min(first_seq, gap firsts), max(last_seq, gap lasts)]`` (protocol §6.3)."""
        lo = [g[0] for g in self.gaps]
        hi = [g[1] for g in self.gaps]
        if self.rows > 0 and self.first_seq is not None and self.last_seq is not None:
            lo.append(self.first_seq)
            hi.append(self.last_seq)
        return (min(lo), max(hi)) if lo else None

    @property
    def unaccounted(self) -> int:
        """Seqs inside the coverage that are neither a row nor in a gap (0 when well formed)."""
        cov = self.coverage
        if cov is None:
            return 0
        lost = sum(g[1] - g[0] + 1 for g in self.gaps)
        return (cov[1] - cov[0] + 1) - self.rows - lost

    @property
    def where(self) -> str:
        return f"bundle channel={self.channel!r} bundle_seq={self.bundle_seq} id={self.bundle_id}"

    @classmethod
    def from_manifest(cls, m: Manifest, sha256: str) -> BundleFacts:
        return cls(
            channel=m.channel,
            bundle_seq=m.bundle_seq,
            bundle_id=m.bundle_id,
            sha256=sha256,
            prev_sha256=m.prev_sha256,
            rows=m.rows,
            first_seq=m.first_seq,
            last_seq=m.last_seq,
            gaps=tuple((g.first_seq, g.last_seq, g.reason) for g in m.gaps),
            created_at=m.created_at,
        )


@dataclass(frozen=True)
class HeartbeatFacts:
    """What the sequence checks need to know of one verified heartbeat."""

    channel: str
    heartbeat_seq: int
    last_bundle_seq: int | None
    last_seq: int | None
    black_time: str
    interval_seconds: float

    @classmethod
    def from_heartbeat(cls, hb: Heartbeat) -> HeartbeatFacts:
        return cls(
            channel=hb.channel,
            heartbeat_seq=hb.heartbeat_seq,
            last_bundle_seq=hb.last_bundle_seq,
            last_seq=hb.last_seq,
            black_time=hb.black_time,
            interval_seconds=hb.interval_seconds,
        )

    @classmethod
    def from_json(cls, data: str | bytes) -> HeartbeatFacts:
        """Parse (strictly, protocol §9) a heartbeat plaintext; raises ManifestError."""
        return cls.from_heartbeat(Heartbeat.from_json(data))


# ------------------------------------------------------------------------------ outputs


@dataclass(frozen=True)
class Event:
    """Something the audit table records; ``detail`` is JSON-able."""

    kind: str
    channel: str
    bundle_seq: int | None = None
    seq_first: int | None = None
    seq_last: int | None = None
    reason: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "channel": self.channel,
            "bundle_seq": self.bundle_seq,
            "seq_first": self.seq_first,
            "seq_last": self.seq_last,
            "reason": self.reason,
            "detail": dict(self.detail),
        }


@dataclass
class Admission:
    """What ``admit`` found: events to audit, and message seq ranges not to land (inclusive)."""

    events: list[Event]
    skip: list[Interval]


# ------------------------------------------------------------------------------ state


@dataclass(frozen=True)
class Run:
    """Landed bundles ``lo..hi`` above ``contig``, bundle ``lo - 1`` not landed (yet)."""

    lo: int
    hi: int
    prev_sha256: str | None
    """``prev_sha256`` of bundle ``lo``: checked when bundle ``lo - 1`` lands."""
    sha256: str
    """SHA-256 of bundle ``hi``: checked when bundle ``hi + 1`` lands."""
    end: int | None
    """Coverage end of the last bundle of the run that has coverage (None: none has)."""
    wait: Interval | None
    """``(k, coverage first seq)`` of the first bundle of the run with coverage: its coverage
    check waits for the coverage end before ``lo``. None exactly when ``end`` is None."""


@dataclass(frozen=True)
class TransitGap:
    """Bundle seqs ``first..last`` known to exist that have not arrived."""

    first: int
    last: int
    since: str | None
    """When red learnt of it (RFC 3339 UTC), or black's seal time of the revealing bundle."""


@dataclass(frozen=True)
class WrittenOff:
    """Bundle seqs ``first..last`` an operator declared lost for good (``diode red write-off``):
    no longer an open gap. Should one still arrive, it lands and closes its part of this."""

    first: int
    last: int
    at: str
    note: str


@dataclass(frozen=True)
class Retirement:
    """An operator retired the channel (``diode red retire``): removed from red's config, not
    watched for silence; its open gaps were written off. Configuring it again reinstates it."""

    at: str
    note: str


@dataclass(frozen=True)
class HeartbeatSeen:
    heartbeat_seq: int
    last_bundle_seq: int | None
    last_seq: int | None
    black_time: str
    received_at: str
    interval_seconds: float


def _zero_counters() -> dict[str, int]:
    return dict.fromkeys(_COUNTERS, 0)


@dataclass
class ChannelState:
    contig: int = 0
    contig_sha256: str | None = None
    contig_end: int = -1
    runs: list[Run] = field(default_factory=list)
    gaps: list[TransitGap] = field(default_factory=list)
    written_off: list[WrittenOff] = field(default_factory=list)
    landed: list[Interval] = field(default_factory=list)
    highest: int = 0
    """Highest bundle seq landed."""
    known: int = 0
    """Highest bundle seq known to exist (landed, or announced by a heartbeat)."""
    heartbeat: HeartbeatSeen | None = None
    silent: bool = False
    watch_since: str | None = None
    """Silence is measured from here, or from the last heartbeat if that came later (set at
    the first watch and at reinstatement)."""
    counters: dict[str, int] = field(default_factory=_zero_counters)
    retired: Retirement | None = None

    def to_json(self) -> dict[str, Any]:
        hb = self.heartbeat
        return {
            "contig": self.contig,
            "contig_sha256": self.contig_sha256,
            "contig_end": self.contig_end,
            "runs": [
                {
                    "lo": r.lo,
                    "hi": r.hi,
                    "prev_sha256": r.prev_sha256,
                    "sha256": r.sha256,
                    "end": r.end,
                    "wait": None if r.wait is None else list(r.wait),
                }
                for r in self.runs
            ],
            "gaps": [[g.first, g.last, g.since] for g in self.gaps],
            "written_off": [[w.first, w.last, w.at, w.note] for w in self.written_off],
            "landed": [list(iv) for iv in self.landed],
            "highest": self.highest,
            "known": self.known,
            "heartbeat": None
            if hb is None
            else {
                "heartbeat_seq": hb.heartbeat_seq,
                "last_bundle_seq": hb.last_bundle_seq,
                "last_seq": hb.last_seq,
                "black_time": hb.black_time,
                "received_at": hb.received_at,
                "interval_seconds": hb.interval_seconds,
            },
            "silent": self.silent,
            "watch_since": self.watch_since,
            "counters": dict(self.counters),
            "retired": None
            if self.retired is None
            else {"at": self.retired.at, "note": self.retired.note},
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> ChannelState:
        if not isinstance(d, dict):
            raise StateError(f"{where}: not an object")
        runs: list[Run] = []
        for i, r in enumerate(_get(d, "runs", list, where)):
            w = f"{where} runs[{i}]"
            runs.append(
                Run(
                    lo=_int(_get(r, "lo", int, w), w, lo=1),
                    hi=_int(_get(r, "hi", int, w), w, lo=1),
                    prev_sha256=_get(r, "prev_sha256", str, w, optional=True),
                    sha256=_get(r, "sha256", str, w),
                    end=_opt_int(_get(r, "end", int, w, optional=True), w),
                    wait=_pair(_get(r, "wait", list, w, optional=True), w),
                )
            )
        gaps = [
            TransitGap(_int(g[0], where), _int(g[1], where), _opt_str(g[2], where))
            for g in _rows(_get(d, "gaps", list, where), 3, where)
        ]
        written_off = [
            WrittenOff(_int(w[0], where, lo=1), _int(w[1], where, lo=1), str(w[2]), str(w[3]))
            for w in _rows(d.get("written_off", []), 4, where)  # absent before write-offs
        ]
        landed = [
            (_int(a, where), _int(b, where))
            for a, b in _rows(_get(d, "landed", list, where), 2, where)
        ]
        hb_doc = _get(d, "heartbeat", dict, where, optional=True)
        hb = None
        if hb_doc is not None:
            w = f"{where} heartbeat"
            interval = _get(hb_doc, "interval_seconds", (int, float), w)
            hb = HeartbeatSeen(
                heartbeat_seq=_int(_get(hb_doc, "heartbeat_seq", int, w), w),
                last_bundle_seq=_opt_int(_get(hb_doc, "last_bundle_seq", int, w, True), w),
                last_seq=_opt_int(_get(hb_doc, "last_seq", int, w, True), w),
                black_time=_get(hb_doc, "black_time", str, w),
                received_at=_get(hb_doc, "received_at", str, w),
                interval_seconds=float(interval),
            )
        counters = {str(k): _int(v, where) for k, v in _get(d, "counters", dict, where).items()}
        ret = d.get("retired")  # absent before retirements existed
        retired = None
        if ret is not None:
            w = f"{where} retired"
            retired = Retirement(_get(ret, "at", str, w), _get(ret, "note", str, w))
        return cls(
            contig=_int(_get(d, "contig", int, where), where),
            contig_sha256=_get(d, "contig_sha256", str, where, optional=True),
            contig_end=_int(_get(d, "contig_end", int, where), where, lo=-1),
            runs=runs,
            gaps=gaps,
            written_off=written_off,
            landed=landed,
            highest=_int(_get(d, "highest", int, where), where),
            known=_int(_get(d, "known", int, where), where),
            heartbeat=hb,
            silent=_get(d, "silent", bool, where),
            watch_since=_get(d, "watch_since", str, where, optional=True),
            counters=counters,
            retired=retired,
        )


@dataclass
class SequenceState:
    """The sequence state of every channel; ``to_json``/``from_json`` round-trip exactly."""

    channels: dict[str, ChannelState] = field(default_factory=dict)
    unsaved: dict[tuple[str, int], str] = field(default_factory=dict, compare=False, repr=False)
    """SHA-256 of bundles admitted through this object (not serialised): lets ``classify``
    tell a duplicate within one landing, before the ledger holds the first copy."""

    def channel(self, name: str) -> ChannelState:
        return self.channels.setdefault(name, ChannelState())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "channels": {name: cs.to_json() for name, cs in sorted(self.channels.items())},
        }

    @classmethod
    def from_json(cls, doc: Any) -> SequenceState:
        """The state ``to_json`` wrote; StateError (red cannot guess) for anything else."""
        where = "red sequence state"
        if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise StateError(f"{where}: format {got!r} is unknown (known: [{STATE_FORMAT}])")
        chans = _get(doc, "channels", dict, where)
        return cls(
            channels={
                str(name): ChannelState.from_json(d, f"{where} channel={name!r}")
                for name, d in chans.items()
            }
        )


# ---------------------------------------------------------------- state JSON helpers


def _get(d: Any, key: str, typ: Any, where: str, optional: bool = False) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise StateError(f"{where}: missing field {key!r}")
    v = d[key]
    if v is None and optional:
        return None
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise StateError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


def _int(v: Any, where: str, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
        raise StateError(f"{where}: {str(v)[:40]!r} is not an integer >= {lo}")
    return v


def _opt_int(v: Any, where: str) -> int | None:
    return None if v is None else _int(v, where)


def _opt_str(v: Any, where: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise StateError(f"{where}: {str(v)[:40]!r} is not a string")
    return v


def _pair(v: list[Any] | None, where: str) -> Interval | None:
    if v is None:
        return None
    if len(v) != 2:
        raise StateError(f"{where}: a seq range has two ends")
    return _int(v[0], where), _int(v[1], where)


def _rows(v: list[Any], width: int, where: str) -> list[list[Any]]:
    for r in v:
        if not isinstance(r, list) or len(r) != width:
            raise StateError(f"{where}: expected rows of {width} values, got {str(r)[:60]}")
    return v


# ------------------------------------------------------------------------- intervals


def _add_interval(ivs: list[Interval], lo: int, hi: int) -> list[Interval]:
    """``ivs`` (sorted, disjoint, non-adjacent) with ``[lo, hi]`` merged in."""
    i = bisect.bisect_left(ivs, (lo, lo))
    if i > 0 and ivs[i - 1][1] >= lo - 1:
        i -= 1
    j = i
    while j < len(ivs) and ivs[j][0] <= hi + 1:
        lo, hi = min(lo, ivs[j][0]), max(hi, ivs[j][1])
        j += 1
    return [*ivs[:i], (lo, hi), *ivs[j:]]


def _intersect(ivs: list[Interval], lo: int, hi: int) -> list[Interval]:
    """The parts of ``[lo, hi]`` inside ``ivs``."""
    i = bisect.bisect_left(ivs, (lo, lo))
    if i > 0 and ivs[i - 1][1] >= lo:
        i -= 1
    out: list[Interval] = []
    while i < len(ivs) and ivs[i][0] <= hi:
        a, b = max(lo, ivs[i][0]), min(hi, ivs[i][1])
        if a <= b:
            out.append((a, b))
        i += 1
    return out


# ---------------------------------------------------------------------- classify


def _landed_sha(
    state: SequenceState, channel: str, n: int, lookup: Lookup
) -> tuple[bool, str | None]:
    """(landed?, its plaintext sha256 if known) of bundle ``channel``/``n``."""
    cs = state.channels.get(channel)
    if cs is None:
        return False, None
    if n == cs.contig:
        return True, cs.contig_sha256
    if n > cs.contig:
        run = _run_holding(cs, n)
        if run is None:
            return False, None
        if n == run.hi:
            return True, run.sha256
    sha = state.unsaved.get((channel, n))
    return True, sha if sha is not None else lookup(channel, n)


def judge(state: SequenceState, facts: BundleFacts, lookup: Lookup) -> tuple[Verdict, list[Event]]:
    """``classify`` with the duplicate / conflict event. Does not change ``state``.

    A bundle seq the state says landed, whose SHA-256 neither the state nor ``lookup`` knows,
    is a conflict: it cannot be shown to be the same bundle (fail safe: quarantined).
    """
    landed, sha = _landed_sha(state, facts.channel, facts.bundle_seq, lookup)
    if not landed:
        return "new", []
    kind: Verdict = "duplicate" if sha == facts.sha256 else "conflict"
    ev = Event(
        kind,
        facts.channel,
        facts.bundle_seq,
        reason=None if kind == "duplicate" else "conflict",
        detail={"sha256": facts.sha256, "landed_sha256": sha, "bundle_id": facts.bundle_id},
    )
    return kind, [ev]


def classify(state: SequenceState, facts: BundleFacts, lookup: Lookup) -> Verdict:
    """new / duplicate (same bundle seq, same plaintext) / conflict (another plaintext)."""
    return judge(state, facts, lookup)[0]


# ------------------------------------------------------------------------- admit


def _run_holding(cs: ChannelState, n: int) -> Run | None:
    """The run of landed bundles above ``contig`` that holds bundle seq ``n``, if any."""
    i = bisect.bisect_right([r.lo for r in cs.runs], n) - 1
    return cs.runs[i] if i >= 0 and cs.runs[i].hi >= n else None


def _contig_run(cs: ChannelState) -> Run:
    """``contig`` as a run from the virtual bundle 0 (no plaintext, coverage ends at -1)."""
    return Run(0, cs.contig, None, cs.contig_sha256 or "", cs.contig_end, None)


def _end_of(cs: ChannelState, n: int) -> int | None:
    """Coverage end after bundle ``n`` (the top of what is landed), None when unknown."""
    if n == cs.contig:
        return cs.contig_end
    run = _run_holding(cs, n)
    return run.end if run is not None and run.hi == n else None


def _chain_event(channel: str, n: int, prev: str | None, pred_sha: str | None) -> list[Event]:
    if n == 1 and prev is None:
        return []  # the start of the chain: no link to check
    if prev == pred_sha:
        return [Event("chain_verified", channel, n, detail={"prev_bundle_seq": n - 1})]
    detail = {"prev_bundle_seq": n - 1, "expected_prev_sha256": pred_sha, "prev_sha256": prev}
    return [Event("chain_broken", channel, n, reason="prev_sha256", detail=detail)]


def _coverage_event(channel: str, n: int, first: int, pred_end: int) -> list[Event]:
    want = pred_end + 1
    if first == want:
        return []
    hole = first > want
    return [
        Event(
            "coverage_mismatch",
            channel,
            n,
            seq_first=want if hole else first,
            seq_last=first - 1 if hole else pred_end,
            reason="hole" if hole else "overlap",
            detail={"prev_bundle_seq": n - 1, "expected_first_seq": want, "coverage_first": first},
        )
    ]


def _join(channel: str, left: Run, right: Run) -> tuple[Run, list[Event]]:
    """Join two adjacent runs (``left.hi + 1 == right.lo``): the link between them is complete,
    and so is the coverage check ``right`` waits for if ``left`` knows its end."""
    pred_sha = None if left.hi == 0 else left.sha256
    events = _chain_event(channel, right.lo, right.prev_sha256, pred_sha)
    wait = left.wait
    if right.wait is not None:
        if left.end is not None:
            events += _coverage_event(channel, right.wait[0], right.wait[1], left.end)
        else:  # nothing in ``left`` has coverage: ``right`` keeps waiting, for what is below
            wait = right.wait
    end = right.end if right.end is not None else left.end
    return Run(left.lo, right.hi, left.prev_sha256, right.sha256, end, wait), events


def _place(cs: ChannelState, f: BundleFacts) -> list[Event]:
    """Put bundle n in: join it to the landed run ending at n-1 and the one starting at n+1
    (checking both links), and fold what reaches ``contig`` into the frontier."""
    n, cov = f.bundle_seq, f.coverage
    i = bisect.bisect_right([r.lo for r in cs.runs], n)
    run = Run(n, n, f.prev_sha256, f.sha256, None if cov is None else cov[1],
              None if cov is None else (n, cov[0]))  # fmt: skip
    events: list[Event] = []
    below = cs.runs[i - 1] if i > 0 and cs.runs[i - 1].hi == n - 1 else None
    if below is None and n - 1 == cs.contig:
        below = _contig_run(cs)
    if below is not None:
        run, events = _join(f.channel, below, run)
    above = cs.runs[i] if i < len(cs.runs) and cs.runs[i].lo == n + 1 else None
    if above is not None:
        run, more = _join(f.channel, run, above)
        events += more
    start = i - 1 if below is not None and below.lo > 0 else i
    stop = i + 1 if above is not None else i
    if run.lo == 0:
        if run.end is None:  # cannot happen: the contig run always knows its end
            raise StateError(f"{f.where}: coverage end after bundle {run.hi} is unknown")
        cs.contig, cs.contig_sha256, cs.contig_end = run.hi, run.sha256, run.end
        cs.runs[start:stop] = []
    else:
        cs.runs[start:stop] = [run]
    return events


def _seq_bounds(lo: int | None, hi: int | None) -> tuple[int | None, int | None]:
    if lo is not None and hi is not None and hi < lo:
        return None, None
    return lo, hi


def _open_gap(
    cs: ChannelState, channel: str, first: int, last: int, since: str | None, seq_last: int | None
) -> Event:
    """Open the transit gap ``first..last`` (bundle seqs above ``cs.known``)."""
    below = _end_of(cs, first - 1)
    lo, hi = _seq_bounds(None if below is None else below + 1, seq_last)
    cs.gaps.append(TransitGap(first, last, since))
    cs.known = last
    detail = {"first_bundle_seq": first, "last_bundle_seq": last}
    return Event("gap_opened", channel, None, lo, hi, "transit", detail)


_R = TypeVar("_R", TransitGap, WrittenOff)


def _take(ranges: list[_R], n: int) -> _R | None:
    """Take bundle seq ``n`` out of the range of ``ranges`` holding it (split around ``n``);
    returns that range as it was, or None."""
    for i, r in enumerate(ranges):
        if r.first <= n <= r.last:
            parts = [replace(r, first=a, last=b) for a, b in ((r.first, n - 1), (n + 1, r.last))]
            ranges[i : i + 1] = [x for x in parts if x.first <= x.last]
            return r
    return None


def _close_gap(cs: ChannelState, channel: str, n: int, cov: Interval | None) -> list[Event]:
    lo, hi = cov if cov is not None else (None, None)
    detail: dict[str, Any] = {"first_bundle_seq": n, "last_bundle_seq": n}
    w = _take(cs.written_off, n)  # written off, yet it came
    if w is not None:
        detail |= {"gap_first_bundle_seq": w.first, "gap_last_bundle_seq": w.last,
                   "written_off_at": w.at}  # fmt: skip
        return [Event("gap_closed", channel, n, lo, hi, "written_off", detail)]
    g = _take(cs.gaps, n)
    if g is None:
        return []
    detail |= {"gap_first_bundle_seq": g.first, "gap_last_bundle_seq": g.last, "opened": g.since}
    return [Event("gap_closed", channel, n, lo, hi, "transit", detail)]


def _transit(cs: ChannelState, f: BundleFacts, since: str | None) -> list[Event]:
    n, cov = f.bundle_seq, f.coverage
    if n > cs.known:
        evs = []
        if n > cs.known + 1:
            seq_last = None if cov is None else cov[0] - 1
            evs.append(_open_gap(cs, f.channel, cs.known + 1, n - 1, since, seq_last))
        cs.known = n
        return evs
    return _close_gap(cs, f.channel, n, cov)


def _declared(f: BundleFacts) -> list[Event]:
    evs = [
        Event("gap_declared", f.channel, f.bundle_seq, a, b, reason, {"count": b - a + 1})
        for a, b, reason in f.gaps
    ]
    if f.unaccounted:
        cov = f.coverage
        assert cov is not None
        detail = {"unaccounted": f.unaccounted, "rows": f.rows, "bundle_id": f.bundle_id}
        evs.append(Event("coverage_mismatch", f.channel, f.bundle_seq, cov[0], cov[1],
                         "unaccounted", detail))  # fmt: skip
    return evs


def _overlap(cs: ChannelState, f: BundleFacts) -> tuple[list[Interval], list[Event]]:
    if f.rows == 0 or f.first_seq is None or f.last_seq is None:
        return [], []
    skip = _intersect(cs.landed, f.first_seq, f.last_seq)
    detail = {"bundle_id": f.bundle_id}
    evs = [Event("overlap_skipped", f.channel, f.bundle_seq, a, b, "already_landed", detail)
           for a, b in skip]  # fmt: skip
    return skip, evs


def _count(cs: ChannelState, key: str, k: int = 1) -> None:
    cs.counters[key] = cs.counters.get(key, 0) + k


def _remember(state: SequenceState, f: BundleFacts) -> None:
    state.unsaved[(f.channel, f.bundle_seq)] = f.sha256
    while len(state.unsaved) > UNSAVED_CAP:
        del state.unsaved[next(iter(state.unsaved))]


def admit(state: SequenceState, facts: BundleFacts, now: datetime | None = None) -> Admission:
    """Record a new bundle (``classify`` said "new") as landed; return events and skip ranges.

    ``now`` dates a transit gap this bundle reveals (default: the bundle's ``created_at``).
    """
    if facts.bundle_seq < 1:
        raise StateError(f"{facts.where}: bundle seqs start at 1")
    cs = state.channel(facts.channel)
    n = facts.bundle_seq
    if n <= cs.contig or _run_holding(cs, n) is not None:
        raise StateError(f"{facts.where}: already landed; classify it before admitting it")
    since = format_utc(now) if now is not None else facts.created_at
    events = _transit(cs, facts, since)
    events += _declared(facts)
    skip, overlap_events = _overlap(cs, facts)
    events += overlap_events
    events += _place(cs, facts)
    cov = facts.coverage
    if cov is not None:
        cs.landed = _add_interval(cs.landed, *cov)
    cs.highest = max(cs.highest, n)
    _remember(state, facts)
    _count(cs, "bundles")
    _count(cs, "rows", facts.rows)
    _count(cs, "declared_lost", sum(b - a + 1 for a, b, _ in facts.gaps))
    _count(cs, "overlap_seqs", sum(b - a + 1 for a, b in skip))
    for ev in events:
        if ev.kind in ("chain_broken", "coverage_mismatch"):
            _count(cs, ev.kind)
    return Admission(events, skip)


# ---------------------------------------------------------------- heartbeats, silence


def heartbeat(state: SequenceState, hb: HeartbeatFacts, now: datetime) -> list[Event]:
    """Take a verified heartbeat: replay check, link resumed, missing last bundle(s)."""
    cs = state.channel(hb.channel)
    last = cs.heartbeat
    if last is not None and hb.heartbeat_seq <= last.heartbeat_seq:
        detail: dict[str, Any] = {
            "heartbeat_seq": hb.heartbeat_seq,
            "last_heartbeat_seq": last.heartbeat_seq,
        }
        return [Event("heartbeat_replayed", hb.channel, reason="stale", detail=detail)]
    at = format_utc(now)
    events: list[Event] = []
    if cs.silent:
        quiet_since = last.received_at if last is not None else cs.watch_since
        resumed = {"heartbeat_seq": hb.heartbeat_seq, "last_heard_at": quiet_since}
        events.append(Event("link_resumed", hb.channel, detail=resumed))
        cs.silent = False
    cs.heartbeat = HeartbeatSeen(
        hb.heartbeat_seq, hb.last_bundle_seq, hb.last_seq, hb.black_time, at, hb.interval_seconds
    )
    _count(cs, "heartbeats")
    top = hb.last_bundle_seq
    if top is not None and top > cs.known:
        gap = _open_gap(cs, hb.channel, cs.known + 1, top, at, hb.last_seq)
        detail = {**gap.detail, "heartbeat_seq": hb.heartbeat_seq}
        missing = replace(gap, kind="missing_last_bundle", detail=detail)
        events += [gap, missing]
    return events


def tick(
    state: SequenceState, now: datetime, silent_seconds: float, channels: Iterable[str] = ()
) -> list[Event]:
    """``link_silent`` (once per silence) for every channel not heard from for too long.

    Channels named in ``channels`` are watched from the first tick even before any heartbeat.
    A retired channel is not watched; named in ``channels`` again (configured again), it is
    reinstated (``channel_reinstated``) and watched from ``now``.
    """
    events: list[Event] = []
    configured = set(channels)
    for name in sorted(set(state.channels) | configured):
        cs = state.channel(name)
        if cs.retired is not None:
            if name not in configured:
                continue
            was = {"retired_at": cs.retired.at, "retired_note": cs.retired.note}
            events.append(Event("channel_reinstated", name, reason="configured", detail=was))
            cs.retired, cs.silent, cs.watch_since = None, False, format_utc(now)
            continue
        heard = cs.heartbeat.received_at if cs.heartbeat is not None else None
        ref = max(
            (t for t in (heard, cs.watch_since) if t is not None), key=parse_utc, default=None
        )
        if ref is None:
            cs.watch_since = format_utc(now)
            continue
        quiet = (now - parse_utc(ref)).total_seconds()
        if cs.silent or quiet <= silent_seconds:
            continue
        cs.silent = True
        seq = None if cs.heartbeat is None else cs.heartbeat.heartbeat_seq
        detail = {"last_heard_at": ref, "quiet_seconds": quiet, "last_heartbeat_seq": seq}
        events.append(Event("link_silent", name, reason="no_heartbeat", detail=detail))
    return events


# ------------------------------------------------------------------------- write-off


def seqs_within(ranges: Iterable[TransitGap | WrittenOff], first: int, last: int) -> int:
    """How many bundle seqs of ``first..last`` the (disjoint) ``ranges`` hold."""
    return sum(max(0, min(r.last, last) - max(r.first, first) + 1) for r in ranges)


def write_off(
    state: SequenceState, channel: str, first: int, last: int, note: str, now: datetime
) -> list[Event]:
    """Declare the open transit gap bundles ``first..last`` of ``channel`` lost for good (black
    no longer has them): they leave the open gaps, one ``gap_written_off`` event per open gap
    they cut. StateError, naming the open gaps, when the range is not entirely open."""
    cs = state.channels.get(channel)
    where = f"channel {channel!r} bundle seqs {first}..{last}"
    if first < 1 or last < first:
        raise StateError(f"{where}: not a range of bundle seqs (1 <= first <= last)")
    gaps = cs.gaps if cs is not None else []
    if cs is None or seqs_within(gaps, first, last) != last - first + 1:
        listed = ", ".join(f"{g.first}..{g.last}" for g in gaps) or "none"
        raise StateError(
            f"{where}: not all in an open transit gap (open gaps of {channel!r}: {listed}); "
            "only bundles red is still waiting for can be written off"
        )
    at = format_utc(now)
    events: list[Event] = []
    kept: list[TransitGap] = []
    for g in gaps:
        a, b = max(g.first, first), min(g.last, last)
        if a > b:
            kept.append(g)
            continue
        kept += [
            TransitGap(x, y, g.since) for x, y in ((g.first, a - 1), (b + 1, g.last)) if x <= y
        ]
        detail = {"first_bundle_seq": a, "last_bundle_seq": b, "opened": g.since, "note": note}
        events.append(Event("gap_written_off", channel, None, None, None, "operator", detail))
    cs.gaps = kept
    cs.written_off.append(WrittenOff(first, last, at, note))
    cs.written_off.sort(key=lambda w: w.first)
    return events


def retire(
    state: SequenceState, channel: str, note: str, now: datetime, configured: Iterable[str]
) -> list[Event]:
    """Retire ``channel`` (no longer configured on red): its open gaps are written off with
    ``note`` (``gap_written_off`` each), then ``channel_retired``; silence is no longer
    watched. StateError when red never saw the channel, it is still in ``configured`` (red's
    channels) or it is retired already."""
    cs = state.channels.get(channel)
    if cs is None:
        known = sorted(state.channels) or "none"
        raise StateError(f"channel {channel!r} is unknown to red's state (channels: {known})")
    if channel in set(configured):
        raise StateError(
            f"channel {channel!r} is still in red's [[channels]]: remove it from the config "
            "first (its files are then quarantined as unknown_channel), then retire it"
        )
    if cs.retired is not None:
        raise StateError(f"channel {channel!r} was retired already at {cs.retired.at}")
    events: list[Event] = []
    gaps = [(g.first, g.last) for g in cs.gaps]
    for first, last in gaps:
        events += write_off(state, channel, first, last, note, now)
    detail = {
        "note": note,
        "gaps_written_off": [list(g) for g in gaps],
        "contig": cs.contig,
        "highest": cs.highest,
        "known": cs.known,
        "was_silent": cs.silent,
    }
    events.append(Event("channel_retired", channel, None, None, None, "operator", detail))
    cs.retired, cs.silent = Retirement(format_utc(now), note), False
    return events


# ------------------------------------------------------------------------- reports


def open_gaps(state: SequenceState) -> list[dict[str, Any]]:
    """Every open transit gap: bundle seqs known to exist that have not arrived."""
    return [
        {"channel": name, "first_bundle_seq": g.first, "last_bundle_seq": g.last, "since": g.since}
        for name, cs in sorted(state.channels.items())
        for g in cs.gaps
    ]


def summary(state: SequenceState) -> dict[str, dict[str, Any]]:
    """Per channel: frontier, open gaps, accounted message seqs, heartbeat, counters."""
    out: dict[str, dict[str, Any]] = {}
    for name, cs in sorted(state.channels.items()):
        hb = cs.heartbeat
        out[name] = {
            "contig": cs.contig,
            "highest": cs.highest,
            "known": cs.known,
            "landed_above": [[r.lo, r.hi] for r in cs.runs],
            "open_gaps": [
                {"first_bundle_seq": g.first, "last_bundle_seq": g.last, "since": g.since}
                for g in cs.gaps
            ],
            "written_off": [
                {"first_bundle_seq": w.first, "last_bundle_seq": w.last, "at": w.at, "note": w.note}
                for w in cs.written_off
            ],
            "accounted_seqs": sum(b - a + 1 for a, b in cs.landed),
            "seq_range": [cs.landed[0][0], cs.landed[-1][1]] if cs.landed else None,
            "seq_holes": max(len(cs.landed) - 1, 0),
            "last_heartbeat": None
            if hb is None
            else {
                "heartbeat_seq": hb.heartbeat_seq,
                "last_bundle_seq": hb.last_bundle_seq,
                "last_seq": hb.last_seq,
                "black_time": hb.black_time,
                "received_at": hb.received_at,
            },
            "silent": cs.silent,
            "retired": None
            if cs.retired is None
            else {"at": cs.retired.at, "note": cs.retired.note},
            "counters": dict(cs.counters),
        }
    return out
