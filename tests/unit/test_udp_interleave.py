"""UDP interleaver: every symbol once, in order within its block, spread over the window."""

from __future__ import annotations

import math
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.diode.udp_fec import BlockDecoder, block_count, block_plan, encode_block, repair_count
from bridge.diode.udp_interleave import Interleaver


def _drain(window: int, sizes: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Feed blocks 0.. of ``sizes`` as the sender does (while it wants more); the pop order and
    the position from which no block was left to add (the tail is not spread)."""
    il: Interleaver[int] = Interleaver(window)
    queue = list(enumerate(sizes))
    order: list[tuple[int, int]] = []
    tail = -1
    while queue or il.pending():
        if not queue and tail < 0:
            tail = len(order)
        while queue and il.wants_more():
            il.add(*queue.pop(0))
        got = il.pop()
        assert got is not None
        order.append(got)
    assert il.pop() is None
    return order, tail if tail >= 0 else len(order)


def _worst_burst(positions: list[int], burst: int) -> int:
    """Most of ``positions`` (sorted) inside any ``burst`` consecutive datagrams."""
    worst, lo = 0, 0
    for hi, p in enumerate(positions):
        while p - positions[lo] >= burst:
            lo += 1
        worst = max(worst, hi - lo + 1)
    return worst


@given(st.integers(1, 300), st.lists(st.integers(1, 400), max_size=30))
@settings(max_examples=80, deadline=None)
def test_every_symbol_once_and_in_order_within_its_block(window: int, sizes: list[int]) -> None:
    order, _ = _drain(window, sizes)
    assert sorted(order) == [(b, i) for b, n in enumerate(sizes) for i in range(n)]
    last: dict[int, int] = {}
    for b, i in order:
        assert last.get(b, -1) == i - 1  # symbols of a block leave in index order
        last[b] = i


def test_pending_wants_more_and_ties() -> None:
    with pytest.raises(ValueError):
        Interleaver(0)
    il: Interleaver[str] = Interleaver(4)
    assert il.pop() is None and il.wants_more() and il.pending() == 0
    il.add("empty", 0)
    assert il.pending() == 0
    il.add("a", 2)
    il.add("b", 2)  # same virtual times as "a": insertion order decides
    assert il.pending() == 4 and not il.wants_more()
    assert [il.pop() for _ in range(4)] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert il.pop() is None


def test_a_small_block_is_spread_over_the_window() -> None:
    window = 1000
    order, tail = _drain(window, [2] + [100] * 40)
    positions = [p for p, (b, _) in enumerate(order) if b == 0]
    assert positions[1] - positions[0] >= window // 2 - 1 and positions[1] < tail


@pytest.mark.parametrize("seed", range(3))
def test_bursts_take_few_symbols_of_any_block(seed: int) -> None:
    """Blocks as the sender makes them (K + R, the last of each object smaller): a burst of B
    consecutive datagrams takes at most ceil(B * n / W) + 1 symbols of any block of n."""
    rng = random.Random(seed)
    window, burst, k = 4096, 50, 128
    sizes: list[int] = []
    for _ in range(300):
        length = rng.randrange(1, 1360 * k * 4)
        for b in range(block_count(length, 1360, k)):
            kb = block_plan(length, 1360, k, b).k
            sizes.append(kb + repair_count(kb, 0.1, 2))
    order, tail = _drain(window, sizes)
    positions: dict[int, list[int]] = {}
    for p, (b, _) in enumerate(order):
        positions.setdefault(b, []).append(p)
    checked = 0
    for b, ps in positions.items():
        if ps[-1] < tail:  # blocks that had others to mix with all along
            n = len(ps)
            assert _worst_burst(ps, burst) <= math.ceil(burst * n / window) + 1, (b, n)
            checked += 1
    assert checked > len(sizes) // 2


def test_mixed_block_sizes_stay_near_the_bound() -> None:
    """Very unequal blocks (3 .. 1000 symbols) in one window: the heap runs behind its virtual
    clock where many symbols crowd, so a burst may take ~20 % more than B * n / W (measured)."""
    rng = random.Random(0)
    window, burst = 4096, 50
    sizes = [rng.choice([3, 5, 20, 141, 141, 141, 160, 300, 1000]) for _ in range(800)]
    order, tail = _drain(window, sizes)
    positions: dict[int, list[int]] = {}
    for p, (b, _) in enumerate(order):
        positions.setdefault(b, []).append(p)
    for b, ps in positions.items():
        if ps[-1] < tail:
            n = len(ps)
            assert _worst_burst(ps, burst) <= math.ceil(1.3 * burst * n / window) + 1, (b, n)


def test_bursts_and_random_loss_with_a_quarter_of_repair() -> None:
    """W = 4096, bursts of 50 consecutive datagrams every 1000 plus 5 % random loss, 25 %
    repair: every block of every object rebuilds."""
    rng = random.Random(5)
    window, t, k = 4096, 32, 128
    objects = [os.urandom(rng.randrange(1, t * k * 3)) for _ in range(60)]
    encoded: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    sizes: list[int] = []
    ids: list[tuple[int, int]] = []
    for o, obj in enumerate(objects):
        for b in range(block_count(len(obj), t, k)):
            p = block_plan(len(obj), t, k, b)
            syms = encode_block(obj[p.offset : p.offset + p.length], t, repair_count(p.k, 0.25, 4))
            encoded[(o, b)] = syms
            sizes.append(len(syms))
            ids.append((o, b))
    order, _ = _drain(window, sizes)
    lost = {p for p in range(len(order)) if rng.random() < 0.05}
    for start in range(0, len(order), 1000):
        lost.update(range(start, start + 50))
    decoders = {(o, b): BlockDecoder(block_plan(len(objects[o]), t, k, b), t) for (o, b) in encoded}
    for pos, (blk, i) in enumerate(order):
        if pos not in lost:
            esi, sym = encoded[ids[blk]][i]
            decoders[ids[blk]].add(esi, sym)
    for o, obj in enumerate(objects):
        n = block_count(len(obj), t, k)
        assert b"".join(decoders[(o, b)].data() for b in range(n)) == obj
