"""Protocol core (black writes, red checks): the per-channel heartbeat of DESIGN.md 3.4.

Canonical UTF-8 JSON (sorted keys, no spaces), validated strictly like the bundle
manifest: SchemaVersionError for an unknown ``format``, ManifestError for anything
else wrong; unknown keys are tolerated and ignored (forward compatibility, as for
manifests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bridge.errors import ManifestError, SchemaVersionError
from bridge.protocol import manifest as _m  # its strict-JSON validation helpers
from bridge.protocol.naming import CHANNEL_RE, MAX_SEQ

__all__ = ["HEARTBEAT_FORMAT", "Heartbeat"]

HEARTBEAT_FORMAT = 1
_MAX_COUNTERS = 1024
_MAX_COUNTER_NAME = 128
_FIELDS = (
    "format",
    "channel",
    "bridge_id",
    "heartbeat_seq",
    "last_bundle_seq",
    "last_seq",
    "black_time",
    "interval_seconds",
    "counters",
)


@dataclass(frozen=True)
class Heartbeat:
    """Black's word on a channel, sent every ``interval_seconds`` even when idle.

    ``last_bundle_seq`` is None before the channel's first bundle; ``last_seq`` is the
    last message seq sealed into a bundle (None before the first message).
    """

    channel: str
    bridge_id: str
    heartbeat_seq: int
    last_bundle_seq: int | None
    last_seq: int | None
    black_time: str
    interval_seconds: float
    counters: dict[str, int]
    format: int = HEARTBEAT_FORMAT

    def __post_init__(self) -> None:
        if isinstance(self.interval_seconds, int) and not isinstance(self.interval_seconds, bool):
            object.__setattr__(self, "interval_seconds", float(self.interval_seconds))
        if isinstance(self.counters, dict):
            object.__setattr__(self, "counters", dict(self.counters))
        self._validate()

    @property
    def where(self) -> str:
        """The ids of this heartbeat, for error and log messages."""
        return (
            f"heartbeat channel={self.channel!r} heartbeat_seq={self.heartbeat_seq!r} "
            f"bridge_id={self.bridge_id!r}"
        )[:240]

    def _validate(self) -> None:
        w = self.where
        if type(self.format) is not int or self.format != HEARTBEAT_FORMAT:
            raise SchemaVersionError(
                f"{w}: heartbeat format {_m._short(self.format)} is unknown to this reader "
                f"(known: [{HEARTBEAT_FORMAT}]); upgrade diode-bridge on this side"
            )
        _m._str(self.channel, "channel", w, CHANNEL_RE)
        _m._str(self.bridge_id, "bridge_id", w, CHANNEL_RE)
        _m._int(self.heartbeat_seq, "heartbeat_seq", w, lo=1, hi=MAX_SEQ)
        _m._opt_int(self.last_bundle_seq, "last_bundle_seq", w, lo=1, hi=MAX_SEQ)
        _m._opt_int(self.last_seq, "last_seq", w)
        _m._time(self.black_time, "black_time", w)
        iv = self.interval_seconds
        if type(iv) is not float or not math.isfinite(iv) or not 0 < iv <= 86400:
            got = _m._short(iv)
            raise _m._fail(w, f"interval_seconds must be a number in (0, 86400], got {got}")
        if not isinstance(self.counters, dict) or len(self.counters) > _MAX_COUNTERS:
            raise _m._fail(w, f"counters must be an object of at most {_MAX_COUNTERS} name -> int")
        for name, value in self.counters.items():
            if not isinstance(name, str) or not 0 < len(name) <= _MAX_COUNTER_NAME:
                raise _m._fail(w, f"counter name {_m._short(name)} is malformed")
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise _m._fail(w, f"counter name {_m._short(name)} is not valid Unicode") from None
            _m._int(value, f"counters[{name!r}]", w)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "channel": self.channel,
            "bridge_id": self.bridge_id,
            "heartbeat_seq": self.heartbeat_seq,
            "last_bundle_seq": self.last_bundle_seq,
            "last_seq": self.last_seq,
            "black_time": self.black_time,
            "interval_seconds": self.interval_seconds,
            "counters": dict(self.counters),
        }

    def to_json(self) -> bytes:
        """Canonical UTF-8 JSON: sorted keys, no spaces; equal heartbeats give equal bytes."""
        return _m._dump(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes | str) -> Heartbeat:
        """Strictly parse and validate a heartbeat (hostile input)."""
        doc = _m._load(data, "heartbeat", floats=True)
        if "format" not in doc:
            raise ManifestError("heartbeat: missing field 'format'")
        if type(doc["format"]) is not int or doc["format"] != HEARTBEAT_FORMAT:
            raise SchemaVersionError(
                f"heartbeat format {_m._short(doc['format'])} is unknown to this reader "
                f"(known: [{HEARTBEAT_FORMAT}]); upgrade diode-bridge on this side"
            )
        _m._require(doc, _FIELDS, "heartbeat")
        return cls(**{k: doc[k] for k in _FIELDS})
