"""Red, replay: what a pass and a run of the replay publisher did (counts, events, errors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ReplaySummary", "StepResult"]


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

    def add(self, r: StepResult, *, final: bool = False) -> None:
        self.published += r.published
        self.confirmed += r.confirmed
        for name, per in r.exchanges.items():
            mine = self.exchanges.setdefault(name, {"published": 0, "confirmed": 0})
            mine["published"] += per["published"]
            mine["confirmed"] += per["confirmed"]
        self.events.extend(r.events)
        for ev in r.events:
            if ev["event"] == "replay_failed":
                self.errors.append(f"exchange {ev['exchange']!r}: {ev['reason']}")
        if r.error and (not self.errors or self.errors[-1] != r.error):
            self.errors.append(r.error)
        if not final:
            self.caught_up = r.caught_up

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
            "events": len(self.events),
            "caught_up": self.caught_up,
            "seconds": round(self.seconds, 3),
            "confirmed_per_second": round(self.rate, 1),
        }
