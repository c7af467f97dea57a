"""Diode, UDP (black): spreads each block's symbols over a window of datagrams (burst loss).

Each block added with n symbols gets virtual send times ``now + (i + 0.5) * max(n, W) / n``;
``pop`` sends the earliest and advances ``now`` by one datagram. With at most about W symbols
pending, a block is spread over about max(n, W) consecutive datagrams, so a burst of B lost
datagrams takes about ``B * n / W`` of its symbols (at least one), whatever its size.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

__all__ = ["Interleaver"]

B = TypeVar("B")


class Interleaver(Generic[B]):
    """A heap of (virtual time, order, block, symbol index)."""

    __slots__ = ("window", "_heap", "_now", "_order")

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"interleave window must be >= 1 datagram, got {window}")
        self.window = window
        self._heap: list[tuple[float, int, B, int]] = []
        self._now = 0.0
        self._order = itertools.count()

    def add(self, block: B, n_symbols: int) -> None:
        """Schedule symbols 0..n_symbols-1 of ``block``."""
        if n_symbols <= 0:
            return
        step = max(n_symbols, self.window) / n_symbols
        base, heap, order = self._now, self._heap, self._order
        for i in range(n_symbols):
            heapq.heappush(heap, (base + (i + 0.5) * step, next(order), block, i))

    def wants_more(self) -> bool:
        """True while fewer than ``window`` symbols are pending: add another block."""
        return len(self._heap) < self.window

    def pending(self) -> int:
        return len(self._heap)

    def pop(self) -> tuple[B, int] | None:
        """The next (block, symbol index) to send, or None when nothing is pending."""
        if not self._heap:
            return None
        t, _, block, i = heapq.heappop(self._heap)
        self._now = max(self._now + 1.0, t)
        return block, i
