"""Diode, UDP (black): the sender's token bucket, in bytes per second (pure; clock injected)."""

from __future__ import annotations

__all__ = ["TokenBucket"]


class TokenBucket:
    """``rate`` bytes/s on average, at most ``burst`` bytes back to back."""

    __slots__ = ("rate", "burst", "_tokens", "_last")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"token bucket needs rate > 0 and burst > 0, got {rate}, {burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._last = now

    def take(self, n: int, now: float) -> float:
        """Spend ``n`` bytes at ``now``; returns how long to wait first (0.0: send now).

        The debt is recorded at once, so the caller sleeps the returned time and sends: the
        long-run rate never exceeds ``rate`` and no more than ``burst`` goes out back to back.
        """
        tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        tokens -= n
        self._tokens = tokens
        return 0.0 if tokens >= 0 else -tokens / self.rate
