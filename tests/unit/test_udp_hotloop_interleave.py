"""UDP interleaver, black: the per-block heap sends symbols in exactly the order of the heap of
every symbol it replaced (so the burst-loss spread its tests prove is unchanged), and ``take``
is so many ``pop``s."""

from __future__ import annotations

import heapq
import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.diode.udp_interleave import Interleaver


class ReferenceInterleaver:
    """The interleaver as it was: one heap entry per symbol (the order to keep)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._heap: list[tuple[float, int, int, int]] = []
        self._now = 0.0
        self._order = itertools.count()

    def add(self, block: int, n_symbols: int) -> None:
        if n_symbols <= 0:
            return
        step = max(n_symbols, self.window) / n_symbols
        for i in range(n_symbols):
            heapq.heappush(self._heap, (self._now + (i + 0.5) * step, next(self._order), block, i))

    def wants_more(self) -> bool:
        return len(self._heap) < self.window

    def pending(self) -> int:
        return len(self._heap)

    def pop(self) -> tuple[int, int] | None:
        if not self._heap:
            return None
        t, _, block, i = heapq.heappop(self._heap)
        self._now = max(self._now + 1.0, t)
        return block, i


def _run(il: Interleaver[int] | ReferenceInterleaver, sizes: list[int], takes: list[int],
         use_take: bool) -> list[tuple[int, int]]:  # fmt: skip
    """Feed blocks as the sender does; pop in runs of ``takes`` (cycled) with take, or one
    by one with pop."""
    queue = list(enumerate(sizes))
    order: list[tuple[int, int]] = []
    runs = itertools.cycle(takes)
    while queue or il.pending():
        while queue and il.wants_more():
            il.add(*queue.pop(0))
        n = next(runs)
        if use_take and isinstance(il, Interleaver):
            got = il.take(n)
            assert len(got) == min(n, il.pending() + len(got))
            order.extend(got)
        else:
            for _ in range(n):
                one = il.pop()
                if one is None:
                    break
                order.append(one)
    return order


@given(
    st.integers(1, 600),
    st.lists(st.integers(0, 500), max_size=40),
    st.lists(st.integers(1, 70), min_size=1, max_size=5),
)
@settings(max_examples=120, deadline=None)
def test_the_order_is_the_symbol_heap_s(window: int, sizes: list[int], takes: list[int]) -> None:
    ref = _run(ReferenceInterleaver(window), sizes, takes, use_take=False)
    assert _run(Interleaver(window), sizes, takes, use_take=False) == ref
    assert _run(Interleaver(window), sizes, takes, use_take=True) == ref


def test_the_order_of_sender_like_blocks_at_the_default_window() -> None:
    rng = random.Random(7)
    sizes = [rng.choice([141, 141, 141, 60, 5, 300]) for _ in range(400)]
    for takes in ([1], [45, 1, 64, 7]):
        ref = _run(ReferenceInterleaver(4096), sizes, takes, use_take=False)
        assert _run(Interleaver(4096), sizes, takes, use_take=True) == ref


def test_take_counts_pending_and_stops_when_empty() -> None:
    il: Interleaver[str] = Interleaver(4)
    assert il.take(3) == [] and il.pending() == 0
    il.add("a", 2)
    il.add("b", 3)
    assert il.pending() == 5 and not il.wants_more()
    # times: a at 1, 3; b at 2/3, 2, 10/3
    assert il.take(2) == [("b", 0), ("a", 0)] and il.pending() == 3 and il.wants_more()
    assert il.take(10) == [("b", 1), ("a", 1), ("b", 2)] and il.pending() == 0
    assert il.pop() is None
