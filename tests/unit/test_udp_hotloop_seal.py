"""UDP datagrams, black: a block stamped at once (``SymbolSealer.stamp``) and numbered and
tagged a batch at a time (``seal_stamped``) gives byte for byte the datagrams the one-at-a-time
``seal`` gives, which is the layout of docs/protocol.md §12 (checked here against struct)."""

from __future__ import annotations

import hashlib
import os
import random
import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.protocol.datagram import (
    TAG_LEN,
    DatagramCodec,
    ObjectHeader,
    ObjectKind,
    Symbol,
    derive_key,
)

PSK = bytes(range(32))
CODEC = DatagramCodec(PSK)


def by_the_book(epoch: int, packet: int, obj: ObjectHeader, block: int, esi: int,
                payload: bytes) -> bytes:  # fmt: skip
    """The datagram as docs/protocol.md §12 draws it, packed field by field."""
    body = struct.pack(
        ">2sBBQQQBBHQQ32sHII", b"\xd1\x0d", 1, 1, epoch, packet, obj.object_id, obj.kind,
        len(obj.channel), obj.symbol_size, obj.seq, obj.length, obj.digest, obj.block_symbols,
        block, esi,
    ) + obj.channel.encode() + payload  # fmt: skip
    return body + AESGCM(derive_key(PSK)).encrypt(body[4:20], b"", body)


@st.composite
def blocks(draw: st.DrawFn) -> tuple[int, ObjectHeader, int, list[tuple[int, bytes]], int]:
    """An object header, a block index, runs of (first esi, symbols) and a first packet."""
    t = draw(st.integers(2, 40)) * 8
    obj = ObjectHeader(
        object_id=draw(st.integers(0, 2**64 - 1)),
        kind=draw(st.sampled_from(list(ObjectKind))),
        channel=draw(st.from_regex(r"\A[a-z0-9][a-z0-9_-]{0,62}\Z")),
        seq=draw(st.integers(0, 10**12 - 1)),
        length=draw(st.integers(0, 2**40)),
        digest=draw(st.binary(min_size=32, max_size=32)),
        symbol_size=t,
        block_symbols=draw(st.integers(1, 300)),
    )
    block = draw(st.integers(0, obj.block_count - 1))
    runs = [
        (draw(st.integers(0, 2**24 - 20)), os.urandom(t * draw(st.integers(0, 12))))
        for _ in range(draw(st.integers(1, 3)))
    ]
    return draw(st.integers(0, 2**64 - 1)), obj, block, runs, draw(st.integers(0, 2**63))


@given(blocks(), st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_stamped_then_sealed_in_any_order_is_what_seal_gives(
    case: tuple[int, ObjectHeader, int, list[tuple[int, bytes]], int], rng: random.Random
) -> None:
    epoch, obj, block, runs, packet = case
    sealer = CODEC.symbol_sealer(epoch, obj)
    t, size = obj.symbol_size, sealer.size
    symbols = [(first + j, data[j * t : (j + 1) * t]) for first, data in runs
               for j in range(len(data) // t)]  # fmt: skip
    stamped = memoryview(sealer.stamp(block, runs))
    assert len(stamped) == len(symbols) * size
    order = list(range(len(symbols)))
    rng.shuffle(order)  # the interleaver's order, not the block's
    views = [stamped[i * size : (i + 1) * size] for i in order]
    sealer.seal_stamped(views, packet)
    for p, i in enumerate(order):
        esi, payload = symbols[i]
        want = sealer.seal(packet + p, block, esi, payload)
        assert bytes(views[p]) == want == by_the_book(epoch, packet + p, obj, block, esi, payload)
        assert CODEC.open(views[p]) == Symbol(epoch, packet + p, obj, block, esi, payload)


def test_datagrams_of_two_objects_sealed_in_one_call() -> None:
    """One batch mixes objects of one datagram size (the next file's blocks interleave with
    the last ones of this file): any sealer of the link tags them all."""
    t = 64
    objs = [
        ObjectHeader(
            i, ObjectKind.BUNDLE, "alpha", i + 1, 10_000, hashlib.sha256(bytes([i])).digest(), t, 16
        )
        for i in range(2)
    ]
    sealers = [CODEC.symbol_sealer(9, o) for o in objs]
    data = [os.urandom(3 * t), os.urandom(3 * t)]
    stamped = [memoryview(s.stamp(1, [(0, d)])) for s, d in zip(sealers, data, strict=True)]
    size = sealers[0].size
    views = [stamped[o][i * size : (i + 1) * size] for i in range(3) for o in (0, 1)]
    sealers[1].seal_stamped(views, 100)
    for p, (i, o) in enumerate((i, o) for i in range(3) for o in (0, 1)):
        assert bytes(views[p]) == sealers[o].seal(100 + p, 1, i, data[o][i * t : (i + 1) * t])


def test_stamp_refuses_what_is_not_whole_symbols_and_leaves_tags_for_seal_stamped() -> None:
    obj = ObjectHeader(3, ObjectKind.BUNDLE, "alpha", 1, 1000, bytes(32), 64, 16)
    sealer = CODEC.symbol_sealer(1, obj)
    with pytest.raises(ValueError, match="not whole symbols of T = 64"):
        sealer.stamp(0, [(0, bytes(65))])
    with pytest.raises(ValueError, match="ids below 16777216"):
        sealer.stamp(0, [(2**24 - 1, bytes(128))])
    assert sealer.stamp(0, [(0, b""), (5, b"")]) == b""  # a block without repair symbols
    one = sealer.stamp(0, [(0, bytes(64))])
    assert one[-TAG_LEN:] == bytes(TAG_LEN) and one[12:20] == bytes(8)  # not yet numbered
    sealer.seal_stamped([], 7)  # nothing to do
