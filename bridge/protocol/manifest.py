"""Protocol core (black writes, red checks): the bundle manifest of DESIGN.md 3.3, format 1.

The manifest is canonical UTF-8 JSON (sorted keys, no spaces) under the Parquet
key-value metadata key ``diode.manifest``. ``Manifest.from_json`` validates every field
strictly (types, ranges, cross-field rules) and raises SchemaVersionError for a
``format`` or ``schema_version`` this reader does not know, ManifestError otherwise.

Forward compatibility: unknown top-level keys (and unknown keys inside a gap) are
tolerated and ignored, so a newer black may add optional fields within format 1; a
change that old readers must not misread bumps ``format``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bridge.errors import ManifestError, SchemaVersionError
from bridge.protocol.naming import BUNDLE_ID_RE, CHANNEL_RE, MAX_SEQ
from bridge.protocol.schema import ROW_SCHEMA_VERSION, check_row_schema_version

__all__ = [
    "MANIFEST_KEY",
    "MANIFEST_FORMAT",
    "MAX_MANIFEST_BYTES",
    "Gap",
    "Manifest",
    "format_utc",
    "parse_utc",
    "new_bundle_id",
]

MANIFEST_KEY = b"diode.manifest"
MANIFEST_FORMAT = 1
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
"""A larger manifest is refused before parsing (hostile input)."""

_I64_MAX = 2**63 - 1
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_UTC_RE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z")
_MAX_REASON = 1024


def format_utc(dt: datetime) -> str:
    """RFC 3339 UTC with microseconds and 'Z' (``2026-01-02T03:04:05.000006Z``)."""
    if dt.tzinfo is None:
        raise ValueError("format_utc needs a timezone-aware datetime")
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_utc(text: str) -> datetime:
    """The aware UTC datetime of a ``format_utc`` string; ValueError for anything else."""
    if not isinstance(text, str) or _UTC_RE.fullmatch(text) is None:
        raise ValueError(f"{str(text)[:40]!r} is not RFC 3339 UTC 'YYYY-MM-DDTHH:MM:SS.ffffffZ'")
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def new_bundle_id() -> str:
    """A fresh random bundle id: 32 lowercase hex digits."""
    return secrets.token_hex(16)


# ------------------------------------------------------------ validation helpers (shared)


def _fail(where: str, msg: str) -> ManifestError:
    return ManifestError(f"{where}: {msg}")


def _int(v: object, name: str, where: str, lo: int = 0, hi: int = _I64_MAX) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _fail(where, f"{name} must be an integer in {lo}..{hi}, got {_short(v)}")
    return v


def _opt_int(v: object, name: str, where: str, lo: int = 0, hi: int = _I64_MAX) -> int | None:
    return None if v is None else _int(v, name, where, lo, hi)


def _str(v: object, name: str, where: str, pattern: re.Pattern[str] | None = None) -> str:
    if not isinstance(v, str) or (pattern is not None and pattern.fullmatch(v) is None):
        raise _fail(where, f"{name} is malformed: {_short(v)}")
    return v


def _time(v: object, name: str, where: str) -> str:
    try:
        parse_utc(v)  # type: ignore[arg-type]
    except ValueError:
        raise _fail(where, f"{name} is not RFC 3339 UTC with microseconds: {_short(v)}") from None
    return v  # type: ignore[return-value]


def _short(v: object) -> str:
    return ascii(v)[:80]


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key")
    return d


def _reject(s: str) -> Any:
    raise ValueError(f"{s} is not allowed")


def _load(data: bytes | str, what: str, *, floats: bool) -> dict[str, Any]:
    """Parse strict JSON (no duplicate keys, no NaN, optionally no floats) into a dict."""
    if not isinstance(data, bytes | bytearray | memoryview | str):
        raise ManifestError(f"{what} must be bytes or str, not {type(data).__name__}")
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{what} is {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        doc = json.loads(
            text,
            object_pairs_hook=_pairs,
            parse_constant=_reject,
            parse_float=float if floats else _reject,
        )
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{what} is not valid strict UTF-8 JSON: {str(e)[:120]}") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{what} must be a JSON object")
    return doc


def _require(doc: Mapping[str, Any], keys: Iterable[str], where: str) -> None:
    missing = [k for k in keys if k not in doc]
    if missing:
        raise _fail(where, f"missing fields {missing}")


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# ------------------------------------------------------------------------------ types


@dataclass(frozen=True, slots=True)
class Gap:
    """Message seqs ``first_seq..last_seq`` (inclusive) known lost on black, and why."""

    first_seq: int
    last_seq: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"first_seq": self.first_seq, "last_seq": self.last_seq, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: object, where: str = "gap") -> Gap:
        if not isinstance(d, dict):
            raise _fail(where, f"a gap must be an object, got {_short(d)}")
        _require(d, ("first_seq", "last_seq", "reason"), where)
        return cls(d["first_seq"], d["last_seq"], d["reason"])

    def validate(self, where: str) -> None:
        first = _int(self.first_seq, "gap first_seq", where)
        _int(self.last_seq, "gap last_seq", where, lo=first)
        if not isinstance(self.reason, str) or not 0 < len(self.reason) <= _MAX_REASON:
            raise _fail(where, f"gap reason must be 1..{_MAX_REASON} characters")


_FIELDS = (
    "format",
    "channel",
    "bundle_seq",
    "bundle_id",
    "first_seq",
    "last_seq",
    "rows",
    "exchanges",
    "created_at",
    "bridge_id",
    "schema_version",
    "prev_sha256",
    "gaps",
)


@dataclass(frozen=True)
class Manifest:
    """What a bundle holds (DESIGN.md 3.3); validated on construction.

    ``first_seq``/``last_seq`` are None only for a bundle with zero rows (one that
    carries only gaps). ``prev_sha256`` is None exactly for ``bundle_seq`` 1.
    ``gaps`` is stored as a tuple; ``exchanges`` is a dict, so a Manifest is not hashable.
    """

    channel: str
    bundle_seq: int
    bundle_id: str
    first_seq: int | None
    last_seq: int | None
    rows: int
    exchanges: dict[str, int]
    created_at: str
    bridge_id: str
    prev_sha256: str | None
    gaps: tuple[Gap, ...] = ()
    schema_version: int = ROW_SCHEMA_VERSION
    inexact: tuple[Gap, ...] = ()
    """Seq ranges whose rows ARE in this bundle but not byte-exact as the producer sent them,
    with why (e.g. ``quorum-reencoded``: the broker re-ordered a redelivery's header table).
    Optional on the wire (``inexact``, omitted when empty)."""
    format: int = MANIFEST_FORMAT

    def __post_init__(self) -> None:
        if isinstance(self.gaps, list | tuple):
            object.__setattr__(self, "gaps", tuple(self.gaps))
        if isinstance(self.inexact, list | tuple):
            object.__setattr__(self, "inexact", tuple(self.inexact))
        if isinstance(self.exchanges, Mapping):
            object.__setattr__(self, "exchanges", dict(self.exchanges))
        self._validate()

    @property
    def where(self) -> str:
        """The ids of this bundle, for error and log messages."""
        return (
            f"manifest channel={self.channel!r} bundle_seq={self.bundle_seq!r} "
            f"bundle_id={self.bundle_id!r}"
        )[:240]

    def _validate(self) -> None:  # one rule per field
        w = self.where
        if type(self.format) is not int or self.format != MANIFEST_FORMAT:
            raise SchemaVersionError(
                f"{w}: manifest format {_short(self.format)} is unknown to this reader "
                f"(known: [{MANIFEST_FORMAT}]); upgrade diode-bridge on this side"
            )
        try:
            check_row_schema_version(self.schema_version)
        except SchemaVersionError as e:
            raise SchemaVersionError(f"{w}: {e}") from None
        _str(self.channel, "channel", w, CHANNEL_RE)
        _int(self.bundle_seq, "bundle_seq", w, lo=1, hi=MAX_SEQ)
        _str(self.bundle_id, "bundle_id", w, BUNDLE_ID_RE)
        _str(self.bridge_id, "bridge_id", w, CHANNEL_RE)
        _time(self.created_at, "created_at", w)
        rows = _int(self.rows, "rows", w)
        first = _opt_int(self.first_seq, "first_seq", w)
        last = _opt_int(self.last_seq, "last_seq", w)
        if rows == 0:
            if first is not None or last is not None:
                raise _fail(w, "a bundle with 0 rows has first_seq and last_seq null")
        else:
            if first is None or last is None:
                raise _fail(w, f"a bundle with {rows} rows needs first_seq and last_seq")
            if last < first or last - first + 1 < rows:
                raise _fail(w, f"seqs {first}..{last} cannot hold {rows} distinct rows")
        if not isinstance(self.exchanges, dict):
            raise _fail(w, "exchanges must be an object of name -> row count")
        for name, count in self.exchanges.items():
            if not isinstance(name, str) or len(name.encode("utf-8", "replace")) > 255:
                raise _fail(w, f"exchange name {_short(name)} is not an AMQP exchange name")
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise _fail(w, f"exchange name {_short(name)} is not valid Unicode") from None
            _int(count, f"exchanges[{name!r}]", w, lo=1)
        if sum(self.exchanges.values()) != rows:
            raise _fail(w, f"exchange counts add up to {sum(self.exchanges.values())}, not {rows}")
        if self.prev_sha256 is None:
            if self.bundle_seq != 1:
                raise _fail(w, "prev_sha256 is null but this is not the first bundle (seq 1)")
        else:
            _str(self.prev_sha256, "prev_sha256", w, _SHA256_RE)
            if self.bundle_seq == 1:
                raise _fail(w, "the first bundle (seq 1) has prev_sha256 null")
        if not isinstance(self.gaps, tuple):
            raise _fail(w, "gaps must be a list of Gap")
        prev_last = -1
        for i, gap in enumerate(self.gaps):
            if not isinstance(gap, Gap):
                raise _fail(w, f"gaps[{i}] is not a Gap")
            gap.validate(f"{w} gaps[{i}]")
            if gap.first_seq <= prev_last:
                raise _fail(w, f"gaps[{i}] overlaps or is out of order")
            prev_last = gap.last_seq
        if not isinstance(self.inexact, tuple):
            raise _fail(w, "inexact must be a list of seq ranges")
        prev_last = -1
        for i, r in enumerate(self.inexact):
            if not isinstance(r, Gap):
                raise _fail(w, f"inexact[{i}] is not a seq range")
            r.validate(f"{w} inexact[{i}]")
            if r.first_seq <= prev_last:
                raise _fail(w, f"inexact[{i}] overlaps or is out of order")
            if first is None or last is None or r.first_seq < first or r.last_seq > last:
                raise _fail(w, f"inexact[{i}] is outside the bundle's rows")
            prev_last = r.last_seq

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "channel": self.channel,
            "bundle_seq": self.bundle_seq,
            "bundle_id": self.bundle_id,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "rows": self.rows,
            "exchanges": dict(self.exchanges),
            "created_at": self.created_at,
            "bridge_id": self.bridge_id,
            "schema_version": self.schema_version,
            "prev_sha256": self.prev_sha256,
            "gaps": [g.to_dict() for g in self.gaps],
            **({"inexact": [r.to_dict() for r in self.inexact]} if self.inexact else {}),
        }

    def to_json(self) -> bytes:
        """Canonical UTF-8 JSON: sorted keys, no spaces; equal manifests give equal bytes."""
        return _dump(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Strictly parse and validate a manifest (hostile input)."""
        doc = _load(data, "manifest", floats=False)
        where = "manifest"
        if "format" not in doc:
            raise _fail(where, "missing field 'format'")
        if type(doc["format"]) is not int or doc["format"] != MANIFEST_FORMAT:
            raise SchemaVersionError(
                f"manifest format {_short(doc['format'])} is unknown to this reader "
                f"(known: [{MANIFEST_FORMAT}]); upgrade diode-bridge on this side"
            )
        _require(doc, _FIELDS, where)
        gaps = doc["gaps"]
        if not isinstance(gaps, list):
            raise _fail(where, "gaps must be a list")
        inexact = doc.get("inexact", [])
        if not isinstance(inexact, list):
            raise _fail(where, "inexact must be a list")
        return cls(
            format=doc["format"],
            channel=doc["channel"],
            bundle_seq=doc["bundle_seq"],
            bundle_id=doc["bundle_id"],
            first_seq=doc["first_seq"],
            last_seq=doc["last_seq"],
            rows=doc["rows"],
            exchanges=doc["exchanges"],
            created_at=doc["created_at"],
            bridge_id=doc["bridge_id"],
            schema_version=doc["schema_version"],
            prev_sha256=doc["prev_sha256"],
            gaps=tuple(Gap.from_dict(g, f"manifest gaps[{i}]") for i, g in enumerate(gaps)),
            inexact=tuple(
                Gap.from_dict(r, f"manifest inexact[{i}]") for i, r in enumerate(inexact)
            ),
        )

    @property
    def created_datetime(self) -> datetime:
        """``created_at`` as an aware UTC datetime."""
        return parse_utc(self.created_at)
