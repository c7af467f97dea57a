"""Red, replay: what a pass and a run of the replay publisher did (counts, events, errors)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ReplaySummary", "StepResult", "bound_events", "bound_unsunk"]


@dataclass
class StepResult:
    """What one pass did."""

    published: int = 0
    confirmed: int = 0
    exchanges: dict[str, dict[str, int]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    caught_up: bool = False
    held: int = 0
    """Exchanges waiting for an open gap (hold-back) at the end of the pass."""
    stopped: dict[str, str] = field(default_factory=dict)
    """Approved exchanges stopped at the end of the pass (retried later), and why."""
    settled: bool = False
    """Every approved exchange is caught up or stopped (``caught_up`` only if none stopped):
    where ``run(until_caught_up=True)`` ends."""
    error: str | None = None
    seconds: float = 0.0

    def _count(self, exchange: str, what: str, n: int) -> None:
        per = self.exchanges.setdefault(exchange, {"published": 0, "confirmed": 0})
        per[what] += n
        setattr(self, what, getattr(self, what) + n)

    def to_json(self) -> dict[str, Any]:
        return {
            "published": self.published,
            "confirmed": self.confirmed,
            "exchanges": self.exchanges,
            "events": self.events,
            "caught_up": self.caught_up,
            "stopped": self.stopped,
            "held": self.held,
            "error": self.error,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class ReplaySummary:
    """What a ``run`` did: counts per exchange, the errors seen, the events, the time taken."""

    published: int = 0
    confirmed: int = 0
    exchanges: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    caught_up: bool = False
    """Every approved row confirmed or skipped (audited); False while an exchange is stopped."""
    stopped: dict[str, str] = field(default_factory=dict)
    """Exchanges stopped when the run ended, and why (their rows wait: not caught up)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Rows skipped, still landed, per kind (``bad_row``, ``user_id``): audited one by one."""
    unroutable: int = 0
    """Messages the red broker returned (no binding on red): confirmed, dropped by the broker,
    audited as ``replay_failed`` kind ``unroutable``; not in ``errors`` (nothing stopped)."""

    def add(self, r: StepResult, *, final: bool = False) -> None:
        self.published += r.published
        self.confirmed += r.confirmed
        for name, per in r.exchanges.items():
            mine = self.exchanges.setdefault(name, {"published": 0, "confirmed": 0})
            mine["published"] += per["published"]
            mine["confirmed"] += per["confirmed"]
        self.events.extend(r.events)
        for ev in r.events:
            if ev["event"] != "replay_failed":
                continue
            detail = json.loads(ev["detail"]) if ev.get("detail") else {}
            kind = detail.get("kind")
            if kind == "unroutable":
                self.unroutable += int(detail.get("rows", 0))
            else:
                if kind in ("bad_row", "user_id"):
                    self.skipped[kind] = self.skipped.get(kind, 0) + int(detail.get("rows", 1))
                self.errors.append(f"exchange {ev['exchange']!r}: {ev['reason']}")
        if r.error and (not self.errors or self.errors[-1] != r.error):
            self.errors.append(r.error)
        if not final:
            self.caught_up = r.caught_up
            self.stopped = dict(r.stopped)

    @property
    def rate(self) -> float:
        """Confirmed messages per second."""
        return self.confirmed / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "published": self.published,
            "confirmed": self.confirmed,
            "exchanges": self.exchanges,
            "errors": self.errors,
            "unroutable": self.unroutable,
            "events": len(self.events),
            "caught_up": self.caught_up,
            "stopped": self.stopped,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 3),
            "confirmed_per_second": round(self.rate, 1),
        }


def _merge_replayed(into: dict[str, Any], e: dict[str, Any]) -> None:
    a, b = json.loads(into["detail"]), json.loads(e["detail"])
    into["seq_first"] = min(into["seq_first"], e["seq_first"])
    into["seq_last"] = max(into["seq_last"], e["seq_last"])
    a["rows"] += b["rows"]
    a["land_seq_first"] = min(a["land_seq_first"], b["land_seq_first"])
    a["land_seq_last"] = max(a["land_seq_last"], b["land_seq_last"])
    if b.get("without_id_header"):
        a["without_id_header"] = a.get("without_id_header", 0) + b["without_id_header"]
    into["detail"] = json.dumps(a, sort_keys=True)


def bound_unsunk(events: list[dict[str, Any]], cap: int) -> tuple[list[dict[str, Any]], int]:
    """Events a failing audit sink has not taken, kept within about ``cap``: ``replayed``
    ranges are folded into one per (exchange, channel) (rows summed, seq and land_seq spans
    widened, as the saved progress's ``unaudited`` does), so no published row leaves the audit
    trail; of the other events the newest ``cap`` are kept. Returns the kept events (in the
    order they came) and how many were dropped."""
    if len(events) <= cap:
        return events, 0
    folded: dict[tuple[str, str], dict[str, Any]] = {}
    others: list[tuple[int, dict[str, Any]]] = []
    for i, e in enumerate(events):
        if e["event"] != "replayed":
            others.append((i, e))
            continue
        key = (e["exchange"], e["channel"])
        if key in folded:
            _merge_replayed(folded[key], e)
        else:
            folded[key] = {**e, "_at": i}
    kept_others = others[-cap:]
    merged = [(f.pop("_at"), f) for f in folded.values()]
    out = [e for _, e in sorted(kept_others + merged, key=lambda t: t[0])]
    return out, len(others) - len(kept_others)


def _span(a: int | None, b: int | None, pick: Any) -> int | None:
    return a if b is None else b if a is None else pick(a, b)


def _fold(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` (none ``replayed``) as one per (event, exchange, channel, kind), in the order
    each first came; a group of more than one becomes a summary: the seq span widened over
    them, ``detail`` the first one's with ``folded`` (how many events it holds), ``rows``
    summed (where they count rows) and ``first_reason``. Summaries fold again (their counts
    add up); one of skipped rows still starts at the first row skipped (what ``diode red rewind
    --skipped`` looks for)."""
    groups: dict[tuple[Any, ...], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for e in events:
        d = json.loads(e["detail"]) if e.get("detail") else {}
        d = d if isinstance(d, dict) else {"detail": d}
        key = (e["event"], e["exchange"], e.get("channel"), d.get("kind"))
        groups.setdefault(key, []).append((e, d))
    out: list[dict[str, Any]] = []
    for (event, exchange, channel, kind), group in groups.items():
        first, fd = group[0]
        if len(group) == 1:
            out.append(first)
            continue
        f, fd = {**first}, {**fd, "folded": 0}
        fd.setdefault("first_reason", first.get("reason"))
        for e, d in group:
            f["seq_first"] = _span(f.get("seq_first"), e.get("seq_first"), min)
            f["seq_last"] = _span(f.get("seq_last"), e.get("seq_last"), max)
            fd["folded"] += int(d.get("folded", 1))
        if "rows" in fd:
            fd["rows"] = sum(int(d.get("rows", 1)) for _, d in group)
        seqs = "" if f["seq_first"] is None else f" seqs {f['seq_first']}..{f['seq_last']}"
        f["reason"] = (
            f"{fd['folded']} {event} events of exchange {exchange!r} channel {channel!r}"
            f"{f' (kind {kind})' if kind else ''}{seqs}, folded into one while the audit sink "
            f"failed; the first: {fd['first_reason']}"
        )
        f["detail"] = json.dumps(fd, sort_keys=True)
        out.append(f)
    return out


def bound_events(events: list[dict[str, Any]], cap: int) -> tuple[list[dict[str, Any]], int]:
    """:func:`bound_unsunk`, but the events it would drop are folded (:func:`_fold`) into
    events that go first, never dropped: every event is still counted. Returns the events to
    keep and how many were folded."""
    kept, dropped = bound_unsunk(events, cap)
    if not dropped:
        return kept, 0
    oldest = [e for e in events if e["event"] != "replayed"][:dropped]
    return _fold(oldest) + kept, dropped
