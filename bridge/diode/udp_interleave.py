"""Diode, UDP (black): spreads each block's symbols over a window of datagrams (burst loss).

Each block added with n symbols gets virtual send times ``now + (i + 0.5) * max(n, W) / n``;
``pop`` sends the earliest and advances ``now`` by one datagram. With at most about W symbols
pending, a block is spread over about max(n, W) consecutive datagrams, so a burst of B lost
datagrams takes about ``B * n / W`` of its symbols (at least one), whatever its size.

A block's times rise with its symbol index, so the heap holds one entry per block (the time of
its next symbol) rather than one per symbol: the earliest symbol overall is the earliest
block's next one, ties going to the block added first, the same order a heap of every symbol
gives, for a heap of about W / n entries instead of W.
"""

from __future__ import annotations

import heapq
from typing import Any, Generic, TypeVar

__all__ = ["Interleaver"]

B = TypeVar("B")


class Interleaver(Generic[B]):
    """A heap of blocks by the virtual time of their next symbol: entries ``[time, order,
    block, next index, base, step, symbols]`` (lists, re-keyed in place)."""

    __slots__ = ("window", "_heap", "_now", "_order", "_pending")

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"interleave window must be >= 1 datagram, got {window}")
        self.window = window
        self._heap: list[list[Any]] = []
        self._now = 0.0
        self._order = 0
        self._pending = 0

    def add(self, block: B, n_symbols: int) -> None:
        """Black, interleave stage: schedule symbols 0..n_symbols-1 of ``block``."""
        if n_symbols <= 0:
            return
        step = max(n_symbols, self.window) / n_symbols
        base = self._now
        entry = [base + 0.5 * step, self._order, block, 0, base, step, n_symbols]
        heapq.heappush(self._heap, entry)
        self._order += 1
        self._pending += n_symbols

    def wants_more(self) -> bool:
        """True while fewer than ``window`` symbols are pending: add another block."""
        return self._pending < self.window

    def pending(self) -> int:
        return self._pending

    def peek(self) -> B | None:
        """The block of the next symbol to send (None when nothing is pending)."""
        return self._heap[0][2] if self._heap else None

    def pop(self) -> tuple[B, int] | None:
        """The next (block, symbol index) to send, or None when nothing is pending."""
        got = self.take(1)
        return got[0] if got else None

    def take(self, n: int) -> list[tuple[B, int]]:
        """Black, interleave stage: the next ``n`` (block, symbol index) to send, in order
        (fewer when fewer are pending): ``n`` pops in one call."""
        heap, now = self._heap, self._now
        out: list[tuple[B, int]] = []
        append, replace, heappop = out.append, heapq.heapreplace, heapq.heappop
        for _ in range(min(n, self._pending)):
            top = heap[0]
            t, i = top[0], top[3]
            append((top[2], i))
            i += 1
            if i < top[6]:
                top[0] = top[4] + (i + 0.5) * top[5]  # the time add() would have given it
                top[3] = i
                replace(heap, top)  # re-sift the same entry
            else:
                heappop(heap)
            now += 1.0
            if t > now:
                now = t
        self._now = now
        self._pending -= len(out)
        return out
