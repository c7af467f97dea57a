"""Red, sequence checks (pure): what they take in and give out, and the per-channel state
with its JSON form (``red-state.json``); the checks themselves are in ``sequence``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from bridge.errors import StateError
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.manifest import Manifest

STATE_FORMAT = 1

Verdict = Literal["new", "duplicate", "conflict"]

Interval = tuple[int, int]

COUNTERS = (
    "bundles",
    "rows",
    "declared_lost",
    "overlap_seqs",
    "chain_broken",
    "coverage_mismatch",
    "heartbeats",
)
"""Per channel counters of the state (``ChannelState.counters``)."""

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

    def brief(self) -> dict[str, Any]:
        """What reports show of it (the state keeps ``interval_seconds`` too)."""
        return {
            "heartbeat_seq": self.heartbeat_seq,
            "last_bundle_seq": self.last_bundle_seq,
            "last_seq": self.last_seq,
            "black_time": self.black_time,
            "received_at": self.received_at,
        }


def _zero_counters() -> dict[str, int]:
    return dict.fromkeys(COUNTERS, 0)


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
            else {**hb.brief(), "interval_seconds": hb.interval_seconds},
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
