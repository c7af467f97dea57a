"""Diode, UDP (red): object ids of a sender epoch that no datagram ever came for, kept as ranges.

A sender numbers its objects 0, 1, 2... in each epoch. The receiver learns that ids exist from
two kinds of evidence: a later id seen (every id below it was sent), or the sender's link
heartbeat, whose counter ``objects_started`` says that every id below it had a datagram sent
before the heartbeat. Once an epoch's heartbeats carry that counter, only they count: a
sender that stops may have numbered an object it never sent, below one it did send. An id
claimed for ``grace`` seconds (a reordering link delivers late) that was never seen is
recorded once, as a range, and everything below the range is settled from then on.

Memory stays bounded whatever the ids: seen ids above the settled point are ranges, not ids
(capped), claims are coalesced per second, few epochs are tracked, and a hole of any size is
one range. The state is saved to ``<spool>/unseen.json`` (temp file, fsync, rename); a
restart merges what the journals (``done.jsonl``, ``gaps.jsonl``, the spool) recorded since.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.fsutil import atomic_write_bytes
from bridge.logs import get_logger, log_event

__all__ = ["STATE", "IdRanges", "EpochLedger", "UnseenTracker"]

log = get_logger("bridge.diode.udp_unseen")

STATE = "unseen.json"
_VERSION = 1
MAX_RANGES = 10_000
"""Seen ranges kept per epoch above its settled point; beyond, the highest is forgotten."""
MAX_REPORTED = 1_000
"""Recorded-unseen ranges remembered per epoch (to log an object that arrives after all)."""
MAX_EPOCHS = 8
"""Epochs tracked at once: the current one and older ones with claims still pending."""
SAVE_EVERY = 5.0
"""Seconds between saves of a changed state (at once after records were written)."""


class IdRanges:
    """A set of non-negative ints as sorted, disjoint, non-touching ranges ``[lo, hi)``."""

    __slots__ = ("_lo", "_hi")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        for lo, hi in ranges:
            self.add(lo, hi)

    def __len__(self) -> int:
        return len(self._lo)

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self._lo, x) - 1
        return i >= 0 and x < self._hi[i]

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._lo, self._hi, strict=True))

    def add(self, lo: int, hi: int) -> None:
        """Add ``[lo, hi)``, merged with every range it overlaps or touches."""
        if lo >= hi:
            return
        i = bisect.bisect_left(self._hi, lo)  # the first range ending at or after lo
        j = bisect.bisect_right(self._lo, hi)  # past the last range starting at or before hi
        if i < j:
            lo, hi = min(lo, self._lo[i]), max(hi, self._hi[j - 1])
        self._lo[i:j] = [lo]
        self._hi[i:j] = [hi]

    def holes(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of ``[lo, hi)`` no range covers, as ranges (at most one more than ours)."""
        out: list[tuple[int, int]] = []
        at = lo
        k = bisect.bisect_right(self._hi, lo)
        while at < hi and k < len(self._lo) and self._lo[k] < hi:
            if self._lo[k] > at:
                out.append((at, self._lo[k]))
            at = max(at, self._hi[k])
            k += 1
        if at < hi:
            out.append((at, hi))
        return out

    def drop_below(self, n: int) -> None:
        """Forget every id below ``n``."""
        i = bisect.bisect_right(self._hi, n)
        del self._lo[:i], self._hi[:i]
        if self._lo and self._lo[0] < n:
            self._lo[0] = n

    def keep_highest(self, n: int) -> None:
        """Forget the lowest ranges beyond ``n``."""
        if len(self._lo) > n:
            del self._lo[: len(self._lo) - n], self._hi[: len(self._hi) - n]

    def drop_highest(self) -> None:
        if self._lo:
            self._lo.pop()
            self._hi.pop()


def _ranges_json(r: IdRanges) -> list[list[int]]:
    return [[lo, hi] for lo, hi in r.ranges()]


def _ranges_from(doc: Any) -> IdRanges:
    if not isinstance(doc, list):
        raise ValueError(f"ranges must be a list, got {type(doc).__name__}")
    pairs = [(int(lo), int(hi)) for lo, hi in doc]
    return IdRanges(pairs)


@dataclass
class EpochLedger:
    """What the receiver knows of one epoch's object ids (pure: times are passed in).

    ``base``: every id below it is settled (seen, or recorded unseen); None until the first
    evidence when the receiver started without any state (ids before that are not checked).
    ``marked``: ids at or above ``base`` seen or recorded. ``claims``: ``(bound, since)``,
    ids below ``bound`` exist since wall time ``since``; both strictly increase.
    """

    base: int | None = 0
    marked: IdRanges = field(default_factory=IdRanges)
    reported: IdRanges = field(default_factory=IdRanges)
    claims: list[tuple[int, float]] = field(default_factory=list)
    announced: bool = False
    """A heartbeat of this epoch counted ``objects_started``: from then on only it claims."""
    channel: str | None = None
    """The epoch's only channel, when its heartbeat names exactly one."""

    def mark(self, oid: int, now: float) -> bool:
        """A datagram of ``oid`` came; True when the id had been recorded unseen."""
        if self.base is None:
            self.base = oid
        was = oid in self.reported
        if oid < self.base:
            return was
        self.marked.add(oid, oid + 1)
        if len(self.marked) > MAX_RANGES:
            self.marked.drop_highest()
        if not self.announced:
            self.claim(oid + 1, now)  # every id below a seen one was sent
        return was

    def claim(self, bound: int, now: float) -> None:
        """Ids below ``bound`` exist from ``now`` on (coalesced into one claim per second, so
        the list stays short: an id's grace starts at most a second late, never early)."""
        if self.base is None:
            self.base = bound
        if bound <= self.base or (self.claims and bound <= self.claims[-1][0]):
            return
        since = float(math.ceil(now))
        if self.claims and self.claims[-1][1] >= since:
            self.claims[-1] = (bound, self.claims[-1][1])
        else:
            self.claims.append((bound, since))

    def announce(self, started: int, channels: Mapping[str, Any], now: float) -> None:
        """A heartbeat: ids below ``started`` had a datagram sent before it."""
        if not self.announced:
            self.announced = True
            self.claims.clear()  # claims from seen ids: the heartbeat's word replaces them
        if len(channels) == 1:
            self.channel = next(iter(channels))
        self.claim(started, now)

    def due(self, now: float, grace: float) -> list[tuple[int, int]]:
        """The unseen ranges claimed at least ``grace`` seconds ago: recorded, and settled."""
        bound = None
        while self.claims and self.claims[0][1] + grace <= now:
            bound = self.claims.pop(0)[0]
        if bound is None or self.base is None:
            return []
        holes = self.marked.holes(self.base, bound)
        for lo, hi in holes:
            self.reported.add(lo, hi)
        self.reported.keep_highest(MAX_REPORTED)
        self.marked.drop_below(bound)
        self.base = bound
        return holes

    def to_json(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "marked": _ranges_json(self.marked),
            "reported": _ranges_json(self.reported),
            "claims": [[b, s] for b, s in self.claims],
            "announced": self.announced,
            "channel": self.channel,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> EpochLedger:
        base = doc["base"]
        channel = doc.get("channel")
        return cls(
            base=None if base is None else int(base),
            marked=_ranges_from(doc["marked"]),
            reported=_ranges_from(doc["reported"]),
            claims=[(int(b), float(s)) for b, s in doc["claims"]],
            announced=bool(doc["announced"]),
            channel=channel if isinstance(channel, str) else None,
        )


class UnseenTracker:
    """The ledgers of the epochs tracked, and their state file. Used by the receive loop only."""

    def __init__(self, spool_dir: Path) -> None:
        self.path = Path(spool_dir) / STATE
        self.ledgers: dict[int, EpochLedger] = {}
        self.current: int | None = None
        self.adopting = True
        """No state: the first epoch is checked from its first evidence on (after an upgrade,
        or a new spool, ids sent before cannot be judged)."""
        self.gaps_offset = 0
        """Bytes of ``gaps.jsonl`` the saved state accounts for (read past them at a start)."""
        self.dirty = False
        self.urgent = False
        self.saved_at = 0.0
        self._load()

    def _load(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        try:
            doc = json.loads(raw)
            if doc.get("version") != _VERSION:
                raise ValueError(f"version {doc.get('version')!r}, this receiver knows {_VERSION}")
            ledgers = {int(e["epoch"]): EpochLedger.from_json(e) for e in doc["epochs"]}
            current = doc["current"]
            offset = int(doc["gaps_offset"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log_event(log, 30, "unseen-object state unreadable: object ids sent before now are "
                      "not checked", path=str(self.path), error=str(e))  # fmt: skip
            return
        self.ledgers, self.gaps_offset, self.adopting = ledgers, offset, False
        self.current = None if current is None else int(current)

    # -- evidence ---------------------------------------------------------------------------
    def ledger(self, epoch: int) -> EpochLedger | None:
        """The epoch's ledger; a new one for an epoch above every one seen, None for an older
        epoch no longer (or never) tracked."""
        led = self.ledgers.get(epoch)
        if led is None and (self.current is None or epoch > self.current):
            led = self.ledgers[epoch] = EpochLedger(base=None if self.adopting else 0)
            self.adopting = False
            self.current = epoch
            self._retire()
        return led

    def seen(self, epoch: int, oid: int, now: float) -> bool:
        """A first datagram of ``(epoch, oid)``; True when it had been recorded unseen."""
        led = self.ledger(epoch)
        if led is None:
            return False
        self.dirty = True
        return led.mark(oid, now)

    def heard(
        self, epoch: int, started: int | None, channels: Mapping[str, Any], now: float
    ) -> None:
        """A link heartbeat taken; ``started`` is its ``objects_started`` (None: a sender
        that does not count it, whose heartbeats claim nothing)."""
        led = self.ledger(epoch)
        if led is None or started is None:
            return
        self.dirty = True
        led.announce(started, channels, now)

    def recovered(
        self, seen: Iterable[tuple[int, int]], reported: Iterable[tuple[int, int, int]], now: float
    ) -> None:
        """Merge what the journals recorded since the state was saved: ids seen ``(epoch,
        id)`` and ranges recorded unseen ``(epoch, first, last)``; an epoch newer than the
        state's is tracked from 0. Without a state, only the newest epoch among them is, from
        its lowest id on."""
        seen, reported = sorted(seen), sorted(reported)
        if self.adopting and (seen or reported):
            top = max([e for e, _ in seen] + [e for e, _, _ in reported])
            ids = [i for e, i in seen if e == top] + [a for e, a, _ in reported if e == top]
            led = self.ledger(top)
            assert led is not None
            led.base = min(ids)
        for epoch, first, last in reported:
            if (led := self.ledger(epoch)) is not None and led.base is not None:
                led.reported.add(first, last + 1)
                led.marked.add(max(first, led.base), last + 1)
        for epoch, oid in seen:
            if (led := self.ledger(epoch)) is not None:
                led.mark(oid, now)
        self.dirty = True

    # -- records --------------------------------------------------------------------------
    def due(self, now: float, grace: float) -> list[dict[str, Any]]:
        """Gap records (without reason and time) for every unseen range now due."""
        out = []
        for epoch in sorted(self.ledgers):
            led = self.ledgers[epoch]
            if led.claims and led.claims[0][1] + grace <= now:
                self.dirty = True  # settled further, records or not
            for lo, hi in led.due(now, grace):
                rec: dict[str, Any] = {
                    "epoch": epoch,
                    "object_id": lo,
                    "object_id_last": hi - 1,
                    "objects": hi - lo,
                    "evidence": "heartbeat" if led.announced else "later_object",
                }
                if led.channel is not None:
                    rec["channel"] = led.channel
                out.append(rec)
        if out:
            self.urgent = True
        self._retire()
        return out

    def _retire(self) -> None:
        """Forget older epochs with nothing pending nor recorded, and the oldest beyond
        ``MAX_EPOCHS``."""
        for epoch in sorted(self.ledgers):
            led = self.ledgers[epoch]
            idle = not led.claims and not len(led.reported)
            if epoch == self.current or not (idle or len(self.ledgers) > MAX_EPOCHS):
                continue
            if led.claims:
                log_event(log, 30, "unseen-object check of an old sender epoch dropped: too "
                          "many epochs", epoch=epoch, claimed_through=led.claims[-1][0],
                          settled_through=led.base)  # fmt: skip
            del self.ledgers[epoch]
            self.dirty = True

    # -- state file -----------------------------------------------------------------------
    def save_due(self, now: float, *, force: bool = False) -> bool:
        """Whether the state changed and is to be saved now: at once after records were
        written (or ``force``: at a stop), else every ``SAVE_EVERY`` s."""
        if not (self.dirty or self.urgent):
            return False
        return force or self.urgent or now - self.saved_at >= SAVE_EVERY

    def save(self, now: float, gaps_offset: int) -> bool:
        """Write the state (temp file, fsync, rename). False when the disk refused it (tried
        again later; a restart merges what the journals recorded since)."""
        doc = {
            "version": _VERSION,
            "current": self.current,
            "gaps_offset": gaps_offset,
            "epochs": [{"epoch": e, **led.to_json()} for e, led in sorted(self.ledgers.items())],
        }
        try:
            atomic_write_bytes(self.path, json.dumps(doc).encode(), mode=0o600)
        except OSError as e:
            log_event(log, 40, "unseen-object state not written: retried", path=str(self.path),
                      error=str(e))  # fmt: skip
            return False
        self.gaps_offset, self.saved_at = gaps_offset, now
        self.dirty = self.urgent = False
        return True
