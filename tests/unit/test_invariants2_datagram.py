"""UDP datagrams (mutation review, wave 2): a link heartbeat is authenticated like a symbol,
an unknown protocol version (lower too) is refused, and a symbol whose object header was seen
before is still held to its object's symbol size."""

from __future__ import annotations

import hashlib
import time

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from bridge.protocol.datagram import (
    TAG_LEN,
    DatagramCodec,
    DatagramError,
    LinkHeartbeat,
    ObjectHeader,
    ObjectKind,
    Symbol,
    derive_key,
)

PSK = bytes(range(32))
OTHER_PSK = bytes(range(1, 33))


def _heartbeat() -> LinkHeartbeat:
    return LinkHeartbeat(
        7, 11, time.time(), 2.0, {"u1": {"last_seq": 5, "objects": 3}},
        {"datagrams": 10, "objects_started": 4},
    )  # fmt: skip


def _reseal(data: bytes, psk: bytes) -> bytes:
    """``data`` (tag dropped) with a valid tag under ``psk``: an authentic datagram."""
    body = data[:-TAG_LEN]
    return body + AESGCM(derive_key(psk)).encrypt(body[4:20], b"", body)


def test_a_heartbeat_sealed_under_another_key_is_dropped_for_its_tag() -> None:
    forged = DatagramCodec(OTHER_PSK).seal_heartbeat(_heartbeat())
    with pytest.raises(DatagramError) as e:
        DatagramCodec(PSK).open(forged)
    assert e.value.reason == "tag"


def test_a_heartbeat_whose_json_was_altered_is_dropped_for_its_tag() -> None:
    codec = DatagramCodec(PSK)
    data = codec.seal_heartbeat(_heartbeat())
    assert isinstance(codec.open(data), LinkHeartbeat)  # the genuine one opens
    altered = data.replace(b'"objects_started":4', b'"objects_started":9')
    assert altered != data and len(altered) == len(data)
    with pytest.raises(DatagramError) as e:
        codec.open(altered)
    assert e.value.reason == "tag"


@pytest.mark.parametrize("version", [0, 2, 255])
def test_every_other_protocol_version_is_refused_even_an_authentic_one(version: int) -> None:
    codec = DatagramCodec(PSK)
    for data in (codec.seal_heartbeat(_heartbeat()), _symbol_datagram(codec, 0)):
        other = bytearray(data)
        other[2] = version
        with pytest.raises(DatagramError) as e:
            codec.open(_reseal(bytes(other), PSK))
        assert e.value.reason == "version"


OBJ = ObjectHeader(3, ObjectKind.BUNDLE, "u1", 9, 4000, hashlib.sha256(b"x").digest(), 64, 16)


def _symbol_datagram(codec: DatagramCodec, esi: int) -> bytes:
    return codec.seal_symbol(7, 100 + esi, OBJ, 0, esi, bytes([esi]) * OBJ.symbol_size)


@pytest.mark.parametrize("delta", [8, 64, -8])
def test_a_symbol_of_an_object_seen_before_must_still_be_t_bytes(delta: int) -> None:
    codec = DatagramCodec(PSK)
    first = codec.open(_symbol_datagram(codec, 0))  # the object's header is now known (cached)
    assert isinstance(first, Symbol) and len(first.payload) == OBJ.symbol_size
    good = _symbol_datagram(codec, 1)
    body = good[:-TAG_LEN]
    body = body + bytes(delta) if delta > 0 else body[:delta]
    odd = _reseal(body + bytes(TAG_LEN), PSK)  # authentic, but its payload is not T bytes
    with pytest.raises(DatagramError) as e:
        codec.open(odd)
    assert e.value.reason == "malformed"
    fresh = DatagramCodec(PSK)  # the header not cached: refused the same way
    with pytest.raises(DatagramError) as e2:
        fresh.open(odd)
    assert e2.value.reason == "malformed"
