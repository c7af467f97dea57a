"""UDP batcher, black: datagrams handed over as views where they were sealed (``room`` then
``extend``, no copy into a batch buffer) leave byte-identical and in order, a GSO send never
above 64 datagrams or the byte cap, one send per datagram without GSO."""

from __future__ import annotations

import os

import pytest

from bridge.diode.udp_batch import MAX_SEGMENTS, DatagramBatcher
from bridge.protocol.datagram import symbol_size_for
from tests.integration.test_udp_batch import CODEC, Calls, batcher, drain, header, receiver, sender


def hand(b: DatagramBatcher, n: int, channel: str, packet: int) -> tuple[list[bytes], float]:
    """``n`` symbols of one block stamped at once, numbered from ``packet`` and handed over
    as the sender does (``room``, then at most that many); the datagrams expected."""
    t = symbol_size_for(1500, channel)
    sealer = CODEC.symbol_sealer(5, header(channel, t))
    data = os.urandom(n * t)
    stamped = memoryview(sealer.stamp(2, [(0, data)]))
    size = sealer.size
    views = [stamped[i * size : (i + 1) * size] for i in range(n)]
    waited, at = 0.0, 0
    while at < n:
        fit, w = b.room(size)
        waited += w
        part = views[at : at + fit]
        sealer.seal_stamped(part, packet + at)
        b.extend(part, size)
        at += len(part)
    expect = [sealer.seal(packet + i, 2, i, data[i * t : (i + 1) * t]) for i in range(n)]
    return expect, waited


@pytest.mark.parametrize("gso", [True, False])
def test_views_handed_over_arrive_as_the_datagrams_sealed(gso: bool) -> None:
    r, s, calls = receiver(), sender(), Calls()
    with r, s:
        b = batcher(s, r.getsockname(), calls, gso=gso, max_bytes=30_000)
        first, _ = hand(b, 150, "alpha", 0)
        second, _ = hand(b, 10, "a-much-longer-channel", 150)  # another size: a new batch
        b.flush()
        expect = first + second
        assert drain(r, len(expect)) == expect
        assert max(calls.paced) <= 30_000 and sum(calls.paced) == sum(map(len, expect))
        if gso:
            assert b.gso and b.sends == b.gso_sends >= 160 * len(expect[0]) // 30_000
        else:
            assert b.gso_sends == 0 and b.sends == len(expect)


def test_room_counts_what_joins_the_batch() -> None:
    r, s, calls = receiver(), sender(), Calls()
    with r, s:
        b = batcher(s, r.getsockname(), calls)
        size = CODEC.symbol_sealer(5, header("alpha", 1360)).size
        assert b.room(size) == (min(MAX_SEGMENTS, 65_507 // size), 0.0)
        hand(b, 10, "alpha", 0)
        assert b.room(size)[0] == min(MAX_SEGMENTS, 65_507 // size) - 10 and calls.sent == 0
        assert b.room(size + 8)[0] == min(MAX_SEGMENTS, 65_507 // (size + 8))
        assert calls.sent == 1  # another size: what was collected went first
        assert len(drain(r, 10)) == 10
        assert batcher(s, r.getsockname(), calls, gso=False).room(size) == (1, 0.0)
