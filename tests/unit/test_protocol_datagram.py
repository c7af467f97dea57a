"""UDP datagrams: round trips, and every forged, truncated or foreign datagram is refused."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.protocol.datagram import (
    MAGIC,
    SYMBOL_HEADER_LEN,
    TAG_LEN,
    DatagramCodec,
    DatagramError,
    LinkHeartbeat,
    ObjectHeader,
    ObjectKind,
    Symbol,
    heartbeat_room,
    split_heartbeat,
    symbol_size_for,
)

PSK = bytes(range(32))
CODEC = DatagramCodec(PSK)
u64 = st.integers(0, 2**64 - 1)
channels = st.from_regex(r"\A[a-z0-9][a-z0-9_-]{0,62}\Z")


@st.composite
def symbols(draw: st.DrawFn) -> tuple[int, int, ObjectHeader, int, int, bytes]:
    t = draw(st.integers(2, 187)) * 8
    k = draw(st.integers(1, 300))
    length = draw(st.one_of(st.integers(0, 10**7), st.integers(0, 2**40)))
    obj = ObjectHeader(
        object_id=draw(u64),
        kind=draw(st.sampled_from(list(ObjectKind))),
        channel=draw(channels),
        seq=draw(st.integers(0, 10**12 - 1)),
        length=length,
        digest=draw(st.binary(min_size=32, max_size=32)),
        symbol_size=t,
        block_symbols=k,
    )
    block = draw(st.integers(0, obj.block_count - 1))
    esi = draw(st.integers(0, 2**24 - 1))
    payload = draw(st.binary(min_size=t, max_size=t))
    return draw(u64), draw(u64), obj, block, esi, payload


@given(symbols())
def test_symbol_round_trip(case: tuple[int, int, ObjectHeader, int, int, bytes]) -> None:
    epoch, packet, obj, block, esi, payload = case
    data = CODEC.seal_symbol(epoch, packet, obj, block, esi, payload)
    assert len(data) == SYMBOL_HEADER_LEN + len(obj.channel) + obj.symbol_size + TAG_LEN
    got = CODEC.open(data)
    assert got == Symbol(epoch, packet, obj, block, esi, payload)
    assert DatagramCodec(PSK).open(bytearray(data)) == got  # a fresh codec, no cached header


@given(symbols(), st.integers(0, 3000), st.binary(min_size=1, max_size=1))
def test_seal_into_writes_the_same_datagram_at_any_offset_and_nothing_else(
    case: tuple[int, int, ObjectHeader, int, int, bytes], off: int, fill: bytes
) -> None:
    epoch, packet, obj, block, esi, payload = case
    sealer = CODEC.symbol_sealer(epoch, obj)
    whole = sealer.seal(packet, block, esi, payload)
    buf = bytearray(fill * (off + sealer.size + 100))
    end = sealer.seal_into(memoryview(buf), off, packet, block, esi, payload)
    assert end == off + sealer.size == off + len(whole)
    assert bytes(buf[off:end]) == whole
    assert buf[:off] == fill * off and buf[end:] == fill * 100


@given(symbols(), st.data())
@settings(max_examples=200)
def test_any_flipped_bit_is_refused(
    case: tuple[int, int, ObjectHeader, int, int, bytes], data: st.DataObject
) -> None:
    epoch, packet, obj, block, esi, payload = case
    raw = bytearray(CODEC.seal_symbol(epoch, packet, obj, block, esi, payload))
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(DatagramError) as e:
        CODEC.open(raw)
    assert e.value.reason in {"magic", "version", "type", "tag"}


@given(symbols(), st.data())
@settings(max_examples=100)
def test_truncated_or_extended_is_refused(
    case: tuple[int, int, ObjectHeader, int, int, bytes], data: st.DataObject
) -> None:
    raw = CODEC.seal_symbol(*case)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(DatagramError) as e:
        CODEC.open(raw[:cut])
    assert e.value.reason in {"short", "tag"}
    with pytest.raises(DatagramError):
        CODEC.open(raw + b"\0")


def test_foreign_key_garbage_and_other_versions_are_refused() -> None:
    obj = ObjectHeader(1, ObjectKind.BUNDLE, "orders", 5, 100, bytes(32), 64, 4)
    good = CODEC.seal_symbol(9, 1, obj, 0, 0, bytes(64))
    with pytest.raises(DatagramError) as e:
        DatagramCodec(os.urandom(32)).open(good)
    assert e.value.reason == "tag"
    with pytest.raises(DatagramError) as e:
        CODEC.open(os.urandom(len(good)))
    assert e.value.reason == "magic"
    with pytest.raises(DatagramError) as e:
        CODEC.open(MAGIC + b"\x02" + good[3:])
    assert e.value.reason == "version"
    assert "upgrade" in str(e.value)
    with pytest.raises(DatagramError) as e:
        CODEC.open(b"")
    assert e.value.reason == "short"


def _forge(body: bytes) -> bytes:
    """Seal arbitrary header bytes under the real key: authentic but malformed input."""
    aead = CODEC._aead
    return body + aead.encrypt(body[4:20], b"", body)


def test_authentic_but_inconsistent_symbols_are_malformed() -> None:
    obj = ObjectHeader(1, ObjectKind.BUNDLE, "orders", 5, 1000, bytes(32), 64, 4)
    good = bytearray(CODEC.seal_symbol(9, 1, obj, 0, 0, bytes(64))[:-TAG_LEN])
    cases = {
        "block beyond the object": (82, struct.pack(">I", 4)),
        "unknown kind": (28, b"\x09"),
        "channel length 0": (29, b"\x00"),
        "symbol size disagrees": (30, struct.pack(">H", 72)),
        "symbol size not aligned": (30, struct.pack(">H", 65)),
        "bad channel bytes": (SYMBOL_HEADER_LEN, b"O"),
    }
    for what, (offset, patch) in cases.items():
        body = bytearray(good)
        body[offset : offset + len(patch)] = patch
        with pytest.raises(DatagramError) as e:
            DatagramCodec(PSK).open(_forge(bytes(body)))
        assert e.value.reason == "malformed", what
        assert "epoch=9 packet=1" in str(e.value)


@given(
    u64,
    u64,
    st.dictionaries(channels, st.tuples(st.none() | st.integers(0, 10**12), u64)),
    u64,
)
def test_link_heartbeat_round_trip(
    epoch: int, packet: int, chans: dict[str, tuple[int | None, int]], started: int
) -> None:
    """The counters include ``objects_started`` (protocol §12.2), the receiver's evidence of
    which object ids exist."""
    chans = dict(list(chans.items())[:20])
    hb = LinkHeartbeat(
        epoch,
        packet,
        1.7e9,
        2.0,
        {c: {"last_seq": last, "objects": n} for c, (last, n) in chans.items()},
        {"datagrams": 5, "bytes": 7, "objects_started": started},
    )
    assert CODEC.open(CODEC.seal_heartbeat(hb)) == hb


def test_link_heartbeat_with_bad_json_is_malformed() -> None:
    head = MAGIC + bytes((1, 2)) + struct.pack(">QQ", 3, 4)
    for body in (b"{", b'{"channels":{}}', b'{"sender_time":1,"interval_seconds":"x"}'):
        with pytest.raises(DatagramError) as e:
            CODEC.open(_forge(head + body))
        assert e.value.reason == "malformed"


def test_link_heartbeat_with_numbers_or_nesting_past_any_limit_is_malformed() -> None:
    """Authentic (sealed with the link key, which sits on black, the less trusted side) but
    hostile: a number no float holds, JSON nested past the parser's depth, counters beyond
    64 bits. Each is dropped as malformed; none raises anything else into the receive loop."""
    head = MAGIC + bytes((1, 2)) + struct.pack(">QQ", 3, 4)
    base = '"sender_time":1,"interval_seconds":2'
    for body in (
        '{"sender_time":1' + "0" * 400 + ',"interval_seconds":2,"channels":{},"counters":{}}',
        "{" + base + ',"channels":{},"counters":{"x":' + "[" * 1500 + "]" * 1500 + "}}",
        "{" + base + ',"channels":{},"counters":{"objects_started":' + str(1 << 64) + "}}",
        "{" + base + ',"channels":{},"counters":{"objects_started":-1}}',
        "{" + base + ',"channels":{"c":{"last_seq":null,"objects":' + "9" * 400 + "}},"
        '"counters":{}}',
    ):
        with pytest.raises(DatagramError) as e:
            CODEC.open(_forge(head + body.encode()))
        assert e.value.reason == "malformed", body[:80]


def test_symbol_size_fills_the_mtu() -> None:
    for mtu, v6 in ((1500, False), (1500, True), (9000, False), (576, False)):
        t = symbol_size_for(mtu, "orders", ipv6=v6)
        datagram = SYMBOL_HEADER_LEN + len("orders") + t + TAG_LEN
        assert datagram + (40 if v6 else 20) + 8 <= mtu < datagram + (40 if v6 else 20) + 8 + 8
        assert t % 8 == 0
    with pytest.raises(ValueError):
        symbol_size_for(150, "orders")


def test_object_header_refuses_bad_values() -> None:
    ok = dict(
        object_id=1,
        kind=ObjectKind.BUNDLE,
        channel="orders",
        seq=1,
        length=1,
        digest=hashlib.sha256(b"").digest(),
        symbol_size=64,
        block_symbols=1,
    )
    for key, bad in (("channel", "Orders"), ("digest", b"x"), ("symbol_size", 8), ("seq", -1)):
        with pytest.raises(ValueError):
            ObjectHeader(**{**ok, key: bad})  # type: ignore[arg-type]


def _big_heartbeat(n: int, name_len: int) -> LinkHeartbeat:
    chans: dict[str, dict[str, int | None]] = {
        f"{i:03d}" + "c" * (name_len - 3): {"last_seq": 10**12 - 1, "objects": 123456}
        for i in range(n)
    }
    counters = {"datagrams": 10**12, "bytes": 10**15, "objects": 10**6, "skipped": 0,
                "objects_started": 10**6}  # fmt: skip
    return LinkHeartbeat(1 << 62, 10**12, 1.7e9, 2.0, chans, counters)


@pytest.mark.parametrize(("mtu", "v6"), [(576, True), (576, False), (1500, False), (9000, False)])
@pytest.mark.parametrize(("n", "name_len"), [(1, 10), (20, 20), (64, 24), (300, 63)])
def test_a_heartbeat_of_many_channels_is_split_into_datagrams_within_the_mtu(
    mtu: int, v6: bool, n: int, name_len: int
) -> None:
    """Each part is a whole heartbeat (epoch, time, counters, its own packet number) within
    one IP packet of the MTU; together they name every channel once (protocol §12.2)."""
    hb = _big_heartbeat(n, name_len)
    parts = split_heartbeat(hb, heartbeat_room(mtu, ipv6=v6))
    sealed = [CODEC.seal_heartbeat(p) for p in parts]
    assert all(len(d) <= mtu - (40 if v6 else 20) - 8 for d in sealed)
    opened = [CODEC.open(d) for d in sealed]
    assert opened == parts
    assert [p.packet for p in parts] == list(range(hb.packet, hb.packet + len(parts)))
    assert [(p.part, p.parts) for p in parts] == [(i, len(parts)) for i in range(len(parts))]
    assert all((p.epoch, p.sender_time, p.counters) == (hb.epoch, hb.sender_time, hb.counters)
               for p in parts)  # fmt: skip
    merged = {c: v for p in parts for c, v in p.channels.items()}
    assert merged == hb.channels and sum(len(p.channels) for p in parts) == n
    if len(parts) == 1:
        assert parts == [hb] and b'"part' not in sealed[0]  # byte for byte as before


def test_heartbeat_part_numbers_out_of_range_are_malformed() -> None:
    head = MAGIC + bytes((1, 2)) + struct.pack(">QQ", 3, 4)
    base = '"sender_time":1,"interval_seconds":2,"channels":{},"counters":{}'
    for extra in ('"part":2,"parts":2', '"part":-1,"parts":2', '"part":0,"parts":0',
                  '"part":"0","parts":2', '"part":0,"parts":65536'):  # fmt: skip
        with pytest.raises(DatagramError) as e:
            CODEC.open(_forge(head + ("{" + base + "," + extra + "}").encode()))
        assert e.value.reason == "malformed", extra
    ok = CODEC.open(_forge(head + ("{" + base + ',"part":1,"parts":3}').encode()))
    assert isinstance(ok, LinkHeartbeat) and (ok.part, ok.parts) == (1, 3)
