"""Protocol core (UDP sender packs, receiver parses): the authenticated datagram of DESIGN.md 3.6.

Every datagram can be placed on its own: it names the sender session (``epoch``), its own
number (``packet``), and for a symbol the whole object it belongs to (id, kind, channel, seq,
length, SHA-256 digest, FEC parameters) and where it goes in it (block, symbol id). All
integers are big-endian and unsigned; ``docs/protocol.md`` §12 draws the layout::

     0  2  magic 0xD1 0x0D            20  8  object id        48 32  object digest (SHA-256)
     2  1  version (1)                28  1  object kind      80  2  block symbols K
     3  1  type (1 symbol, 2 link     29  1  channel length c 82  4  block index
           heartbeat)                 30  2  symbol size T    86  4  symbol id (esi)
     4  8  sender epoch               32  8  object seq       90  c  channel (ASCII)
    12  8  packet number              40  8  object length  90+c T  symbol payload
                                                           then 16  tag

A link heartbeat has, after byte 20, a canonical JSON document, then the tag; when the
channels do not fit one datagram of the MTU, a round of heartbeats splits them (``part`` k of
``parts``), each datagram complete on its own (``split_heartbeat``).

The tag is AES-256-GCM with an empty plaintext and every byte before the tag as associated
data (i.e. GMAC), under a key derived by HKDF-SHA256 from the link's pre-shared key; the nonce
is bytes 4..20 (epoch and packet number), unique as long as a sender never reuses an epoch and
numbers its packets strictly upwards within one, which the sender guarantees. A datagram whose
tag fails is dropped before any of its fields is trusted. No counter wraps in practice: epoch,
packet number and object id are 64-bit.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from bridge.errors import ProtocolError
from bridge.protocol.naming import CHANNEL_RE, MAX_SEQ

__all__ = [
    "MAGIC",
    "VERSION",
    "TAG_LEN",
    "KEY_LEN",
    "SYMBOL_HEADER_LEN",
    "HEARTBEAT_HEADER_LEN",
    "MAX_DATAGRAM",
    "MAX_OBJECT_LENGTH",
    "MAX_BLOCK_SYMBOLS",
    "DatagramError",
    "DatagramType",
    "ObjectKind",
    "ObjectHeader",
    "Symbol",
    "LinkHeartbeat",
    "DatagramCodec",
    "symbol_size_for",
    "ip_udp_header_len",
    "heartbeat_room",
    "split_heartbeat",
]

MAGIC = b"\xd1\x0d"
VERSION = 1
TAG_LEN = 16
KEY_LEN = 32
"""Pre-shared key length in bytes (the HKDF input)."""
_COMMON = struct.Struct(">2sBBQQ")  # magic, version, type, epoch, packet: 20 bytes
_OBJECT = struct.Struct(">QBBHQQ32sHII")  # from byte 20 to byte 90
SYMBOL_HEADER_LEN = _COMMON.size + _OBJECT.size  # 90, then the channel
_PACKET_AT = 12
"""Offset of the packet number (after magic 2, version 1, type 1, epoch 8)."""
_BLOCK_ESI_AT = _COMMON.size + _OBJECT.size - 8
"""Offset of the block index and symbol id: the object header's last two u32 (82)."""
HEARTBEAT_HEADER_LEN = _COMMON.size
MAX_DATAGRAM = 65507
"""The largest UDP payload over IPv4."""
MAX_OBJECT_LENGTH = 1 << 40
"""1 TiB: far above any bundle; a larger length is malformed."""
MAX_BLOCK_SYMBOLS = 65535
MIN_SYMBOL_SIZE = 16
MAX_ESI = (1 << 24) - 1
"""Symbol ids fit 24 bits (RaptorQ's encoding symbol id); larger ones are malformed."""
_HKDF_SALT = b"diode-bridge udp datagram v1"
_HKDF_INFO = b"aes-256-gcm tag key"
_MAX_HEARTBEAT_JSON = 4096
_OBJECT_CACHE = 1024


class DatagramError(ProtocolError):
    """A datagram that must be dropped; ``reason`` is its metric label.

    Reasons: ``short`` (too small to hold a header and tag), ``magic`` (not ours at all),
    ``version`` (a protocol version this receiver does not know), ``type``, ``tag`` (forged,
    corrupted, or sealed under another key), ``malformed`` (authentic but inconsistent).
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class DatagramType(IntEnum):
    SYMBOL = 1
    LINK_HEARTBEAT = 2


class ObjectKind(IntEnum):
    """What a carried file is; the transport never looks inside it."""

    BUNDLE = 1
    HEARTBEAT_FILE = 2
    OTHER = 3


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    """The part of a symbol datagram that is the same for every symbol of one object."""

    object_id: int
    kind: ObjectKind
    channel: str
    seq: int
    length: int
    digest: bytes
    symbol_size: int
    block_symbols: int

    def __post_init__(self) -> None:
        w = f"object {self.object_id!r} channel={self.channel!r} seq={self.seq!r}"[:200]
        if not isinstance(self.channel, str) or not CHANNEL_RE.fullmatch(self.channel):
            raise ValueError(f"{w}: channel must match {CHANNEL_RE.pattern}")
        checks = (
            (self.object_id, 0, (1 << 64) - 1, "object_id"),
            (self.seq, 0, MAX_SEQ, "seq"),
            (self.length, 0, MAX_OBJECT_LENGTH, "length"),
            (self.symbol_size, MIN_SYMBOL_SIZE, MAX_DATAGRAM, "symbol_size"),
            (self.block_symbols, 1, MAX_BLOCK_SYMBOLS, "block_symbols"),
        )
        for value, lo, hi, name in checks:
            if type(value) is not int or not lo <= value <= hi:
                raise ValueError(f"{w}: {name} must be an int in [{lo}, {hi}], got {value!r}")
        if self.symbol_size % 8:
            raise ValueError(f"{w}: symbol_size must be a multiple of 8, got {self.symbol_size}")
        if not isinstance(self.digest, bytes) or len(self.digest) != 32:
            raise ValueError(f"{w}: digest must be 32 bytes (SHA-256)")
        object.__setattr__(self, "kind", ObjectKind(self.kind))

    @property
    def block_count(self) -> int:
        """Blocks of ``block_symbols`` symbols of ``symbol_size`` bytes; at least one."""
        return max(1, math.ceil(self.length / (self.symbol_size * self.block_symbols)))

    @property
    def key(self) -> tuple[int, int]:
        """Not unique across epochs: pair it with the epoch of the datagram."""
        return (self.object_id, self.seq)


@dataclass(slots=True)
class Symbol:
    """One FEC symbol of one block of one object, authenticated."""

    epoch: int
    packet: int
    obj: ObjectHeader
    block: int
    esi: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class LinkHeartbeat:
    """The sender's periodic word on the link: what it sent, per channel, in this epoch.

    ``channels`` maps a channel to ``{"last_seq": <last object seq sent or None>,
    "objects": <objects sent>}``; ``counters`` are the sender's totals (datagrams, bytes...),
    among them ``objects_started``: every object id below it had a datagram sent before this
    heartbeat (absent from older senders' heartbeats; a receiver must accept both).
    ``part`` / ``parts``: this datagram is part k of a round of ``parts`` that share the
    channels between them (1: every channel; the JSON then has neither key, as before).
    """

    epoch: int
    packet: int
    sender_time: float
    interval_seconds: float
    channels: dict[str, dict[str, int | None]]
    counters: dict[str, int]
    part: int = 0
    parts: int = 1

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "sender_time": self.sender_time,
            "interval_seconds": self.interval_seconds,
            "channels": self.channels,
            "counters": self.counters,
        }
        if self.parts != 1:
            doc["part"], doc["parts"] = self.part, self.parts
        return _canonical(doc)


def _canonical(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("ascii")


MAX_HEARTBEAT_PARTS = 65535
"""Parts of one heartbeat round at most (far above any channel count that fits a config)."""


def ip_udp_header_len(*, ipv6: bool) -> int:
    """IP and UDP header bytes around every datagram (no IP options): what an MTU holds more
    than the datagram."""
    return (40 if ipv6 else 20) + 8


def heartbeat_room(mtu: int, *, ipv6: bool = False) -> int:
    """Sender: the bytes of JSON a link heartbeat may hold so that its datagram fits one IP
    packet of ``mtu`` (IP, UDP and our 20-byte header and tag subtracted; at most 4096)."""
    room = mtu - ip_udp_header_len(ipv6=ipv6) - HEARTBEAT_HEADER_LEN - TAG_LEN
    return max(0, min(room, _MAX_HEARTBEAT_JSON))


def split_heartbeat(hb: LinkHeartbeat, room: int) -> list[LinkHeartbeat]:
    """Sender: ``hb`` as one round of heartbeats of at most ``room`` bytes of JSON each,
    numbered ``hb.packet``, ``hb.packet + 1``...; each carries the epoch, time and counters and
    a share of the channels (in name order). ``[hb]`` when it fits whole. A channel whose entry
    alone overflows ``room`` goes alone (never above the 4096 bytes a heartbeat may hold)."""
    if len(hb.to_json()) <= room or len(hb.channels) < 2:
        return [hb]
    n = len(hb.channels)
    base = len(replace(hb, channels={}, part=n, parts=n).to_json())  # widest part numbers
    groups: list[list[str]] = [[]]
    used = base
    for name in sorted(hb.channels):
        cost = len(_canonical({name: hb.channels[name]})) - 1  # less braces, plus a comma
        if groups[-1] and used + cost > room:
            groups.append([])
            used = base
        groups[-1].append(name)
        used += cost
    if len(groups) > MAX_HEARTBEAT_PARTS:
        raise ValueError(f"link heartbeat of epoch {hb.epoch}: {n} channels need "
                         f"{len(groups)} datagrams (at most {MAX_HEARTBEAT_PARTS})")  # fmt: skip
    return [
        replace(
            hb,
            packet=hb.packet + i,
            channels={c: hb.channels[c] for c in g},
            part=i,
            parts=len(groups),
        )  # fmt: skip
        for i, g in enumerate(groups)
    ]


def symbol_size_for(mtu: int, channel: str, *, ipv6: bool = False) -> int:
    """The symbol size T that makes one datagram of ``channel`` fill an IP packet of ``mtu``.

    IP (20 or 40) and UDP (8) headers, our header and tag are subtracted; T is rounded down to
    a multiple of 8. Raises ValueError when the MTU leaves less than 64 bytes of payload.
    """
    overhead = ip_udp_header_len(ipv6=ipv6) + SYMBOL_HEADER_LEN + len(channel) + TAG_LEN
    room = min(mtu - overhead, MAX_DATAGRAM - SYMBOL_HEADER_LEN - len(channel) - TAG_LEN)
    t = room - room % 8
    if t < 64:
        raise ValueError(f"MTU {mtu} leaves {room} bytes per symbol for channel {channel!r}")
    return t


def derive_key(psk: bytes) -> bytes:
    """The AES-256-GCM tag key of a link, from its pre-shared key (HKDF-SHA256)."""
    if not isinstance(psk, bytes) or len(psk) < KEY_LEN:
        raise ValueError(f"the pre-shared key must be at least {KEY_LEN} random bytes")
    return HKDF(hashes.SHA256(), KEY_LEN, salt=_HKDF_SALT, info=_HKDF_INFO).derive(psk)


class DatagramCodec:
    """Seals and opens datagrams of one link (one pre-shared key)."""

    __slots__ = ("_aead", "_objects")

    def __init__(self, psk: bytes) -> None:
        self._aead = AESGCM(derive_key(psk))
        self._objects: dict[bytes, tuple[ObjectHeader, int]] = {}  # recent: (header, blocks)

    # -- sender ---------------------------------------------------------------------------

    def seal_symbol(
        self, epoch: int, packet: int, obj: ObjectHeader, block: int, esi: int, payload: bytes
    ) -> bytes:
        """One symbol datagram; ``payload`` must be exactly ``obj.symbol_size`` bytes."""
        return self.symbol_sealer(epoch, obj).seal(packet, block, esi, payload)

    def symbol_sealer(self, epoch: int, obj: ObjectHeader) -> SymbolSealer:
        """A sealer for every symbol of ``obj`` in ``epoch`` (the header packed once)."""
        return SymbolSealer(self._aead, epoch, obj)

    def seal_heartbeat(self, hb: LinkHeartbeat) -> bytes:
        body = hb.to_json()
        if len(body) > _MAX_HEARTBEAT_JSON:
            raise ValueError(
                f"link heartbeat of epoch {hb.epoch} is {len(body)} bytes of JSON "
                f"(at most {_MAX_HEARTBEAT_JSON}): too many channels for one datagram"
            )
        head = _COMMON.pack(MAGIC, VERSION, DatagramType.LINK_HEARTBEAT, hb.epoch, hb.packet)
        aad = head + body
        return aad + self._aead.encrypt(head[4:20], b"", aad)

    # -- receiver -------------------------------------------------------------------------

    def open(self, data: bytes | bytearray | memoryview) -> Symbol | LinkHeartbeat:
        """Check and parse one datagram (hostile input); raises DatagramError to drop it."""
        view = memoryview(data)
        n = len(view)
        if n < _COMMON.size + TAG_LEN:
            raise DatagramError(f"datagram of {n} bytes is too short", reason="short")
        magic, version, dtype, epoch, packet = _COMMON.unpack_from(view, 0)
        if magic != MAGIC:
            raise DatagramError(
                "datagram does not start with the diode-bridge magic", reason="magic"
            )
        if version != VERSION:
            raise DatagramError(
                f"datagram protocol version {version} is unknown to this receiver (known: "
                f"[{VERSION}]); upgrade diode-bridge on this side",
                reason="version",
            )
        if dtype != 1 and dtype != 2:
            raise DatagramError(f"datagram type {dtype} is unknown (epoch {epoch})", reason="type")
        body = view[: n - TAG_LEN]
        try:
            self._aead.decrypt(view[4:20], view[n - TAG_LEN :], body)
        except InvalidTag:
            raise DatagramError(
                f"datagram epoch={epoch} packet={packet}: authentication tag does not verify "
                "(corrupted, forged, or sealed with another pre-shared key)",
                reason="tag",
            ) from None
        if dtype == 1:
            return self._symbol(view, n - TAG_LEN, epoch, packet)
        return _parse_heartbeat(view, n - TAG_LEN, epoch, packet)

    def _symbol(self, view: memoryview, end: int, epoch: int, packet: int) -> Symbol:
        clen = view[29] if end > 29 else 0
        start = SYMBOL_HEADER_LEN + clen
        key = bytes(view[_COMMON.size : _BLOCK_ESI_AT]) + bytes(view[SYMBOL_HEADER_LEN:start])
        cached = self._objects.get(key)
        if cached is None:
            obj = _parse_object(view, end, epoch, packet)
            if len(self._objects) >= _OBJECT_CACHE:
                self._objects.clear()
            cached = self._objects[key] = (obj, obj.block_count)
        obj, blocks = cached
        if end - start != obj.symbol_size:
            raise _malformed(epoch, packet, f"object {obj.object_id}: payload is not T bytes")
        block, esi = _U32X2.unpack_from(view, _BLOCK_ESI_AT)
        if block >= blocks or esi > MAX_ESI:
            raise _malformed(
                epoch,
                packet,
                f"object {obj.object_id}: block {block} / symbol {esi} out of range "
                f"({blocks} blocks, symbol ids < {MAX_ESI + 1})",
            )
        return Symbol(epoch, packet, obj, block, esi, bytes(view[start:end]))


class SymbolSealer:
    """Packs and tags the symbols of one object in one epoch; the hot path of the sender.

    Two ways to the same bytes: ``seal`` / ``seal_into`` one datagram at a time; or ``stamp``
    a whole block's datagrams at once (everything but the packet number and the tag, numpy
    writing the header into every one), then ``seal_stamped`` numbers and tags them in the
    order they leave, a GSO batch per call.
    """

    __slots__ = ("_aead", "_template", "_t", "size")

    def __init__(self, aead: AESGCM, epoch: int, obj: ObjectHeader) -> None:
        self._aead = aead
        self._template = b"".join(
            (
                _COMMON.pack(MAGIC, VERSION, DatagramType.SYMBOL, epoch, 0),
                _OBJECT.pack(
                    obj.object_id,
                    obj.kind,
                    len(obj.channel),
                    obj.symbol_size,
                    obj.seq,
                    obj.length,
                    obj.digest,
                    obj.block_symbols,
                    0,
                    0,
                ),
                obj.channel.encode("ascii"),
            )
        )
        self._t = obj.symbol_size
        self.size = len(self._template) + obj.symbol_size + TAG_LEN
        """Bytes of every datagram of this object."""

    def seal(self, packet: int, block: int, esi: int, payload: bytes | memoryview) -> bytes:
        buf = bytearray(self.size)
        self.seal_into(memoryview(buf), 0, packet, block, esi, payload)
        return bytes(buf)

    def seal_into(
        self,
        buf: memoryview,
        off: int,
        packet: int,
        block: int,
        esi: int,
        payload: bytes | memoryview,
    ) -> int:
        """Write the datagram at ``buf[off:]`` (``self.size`` bytes); returns its end."""
        if len(payload) != self._t:
            raise ValueError(f"symbol payload is {len(payload)} bytes, the object's T is {self._t}")
        h = len(self._template)
        end = off + h + self._t
        buf[off : off + h] = self._template
        _U64.pack_into(buf, off + _PACKET_AT, packet)
        _U32X2.pack_into(buf, off + _BLOCK_ESI_AT, block, esi)
        buf[off + h : end] = payload
        buf[end : end + TAG_LEN] = self._aead.encrypt(buf[off + 4 : off + 20], b"", buf[off:end])
        return end + TAG_LEN

    def stamp(self, block: int, runs: Sequence[tuple[int, bytes | memoryview]]) -> bytearray:
        """Sender, seal stage: every datagram of one block, ``self.size`` bytes apart, whole but
        for the packet number and the tag (``seal_stamped``); ``runs`` are ``(first symbol id,
        that many symbols of T bytes back to back)``, e.g. the source symbols from 0, then the
        repair symbols from k."""
        import numpy as np  # here only: the sender pays its import, never the receiver

        t, size, h = self._t, self.size, len(self._template)
        counts = []
        for first, data in runs:
            if len(data) % t or first < 0 or first + len(data) // t - 1 > MAX_ESI:
                raise ValueError(
                    f"block {block}: {len(data)} bytes from symbol {first} are not whole "
                    f"symbols of T = {t} with ids below {MAX_ESI + 1}"
                )
            counts.append(len(data) // t)
        out = bytearray(sum(counts) * size)
        rows = np.frombuffer(out, np.uint8).reshape(-1, size)
        rows[:, :h] = np.frombuffer(self._template, np.uint8)
        rows[:, _BLOCK_ESI_AT : _BLOCK_ESI_AT + 4] = np.frombuffer(_U32.pack(block), np.uint8)
        at, esi_at = 0, _BLOCK_ESI_AT + 4
        for (first, data), m in zip(runs, counts, strict=True):
            ids = np.arange(first, first + m, dtype=np.uint32).astype(">u4").view(np.uint8)
            rows[at : at + m, esi_at : esi_at + 4] = ids.reshape(m, 4)
            rows[at : at + m, h : h + t] = np.frombuffer(data, np.uint8).reshape(m, t)
            at += m
        return out

    def seal_stamped(self, datagrams: Sequence[memoryview], packet: int) -> None:
        """Sender, seal stage: number ``datagrams`` (each one whole stamped datagram, all of one
        size, of any object of this link: the tag key is the link's) ``packet``, ``packet + 1``...
        and tag each in place."""
        if not datagrams:
            return
        encrypt, pack = self._aead.encrypt, _U64.pack_into
        end = len(datagrams[0]) - TAG_LEN
        for dg in datagrams:
            pack(dg, _PACKET_AT, packet)
            dg[end:] = encrypt(dg[4:20], b"", dg[:end])
            packet += 1


_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_U32X2 = struct.Struct(">II")


def _malformed(epoch: int, packet: int, what: str) -> DatagramError:
    return DatagramError(f"datagram epoch={epoch} packet={packet}: {what}", reason="malformed")


def _parse_object(view: memoryview, end: int, epoch: int, packet: int) -> ObjectHeader:
    if end < SYMBOL_HEADER_LEN:
        raise _malformed(epoch, packet, f"{end} bytes cannot hold a symbol header")
    oid, kind, clen, t, seq, length, digest, k, block, esi = _OBJECT.unpack_from(view, 20)
    start = SYMBOL_HEADER_LEN + clen
    if not 1 <= clen <= 63 or end - start != t:
        raise _malformed(
            epoch, packet, f"object {oid}: channel length {clen} / symbol size {t} do not add up"
        )
    try:
        channel = bytes(view[SYMBOL_HEADER_LEN:start]).decode("ascii")
        obj = ObjectHeader(oid, ObjectKind(kind), channel, seq, length, digest, t, k)
    except ValueError as e:  # includes UnicodeDecodeError and an unknown kind
        raise _malformed(epoch, packet, f"object {oid}: {e}") from None
    return obj


def _u64(v: object) -> bool:
    return type(v) is int and 0 <= v < 1 << 64


def _parse_heartbeat(view: memoryview, end: int, epoch: int, packet: int) -> LinkHeartbeat:
    raw = bytes(view[HEARTBEAT_HEADER_LEN:end])
    try:
        if len(raw) > _MAX_HEARTBEAT_JSON:
            raise ValueError(f"{len(raw)} bytes of JSON")
        doc: Any = json.loads(raw.decode("ascii"))
        st, iv = doc["sender_time"], doc["interval_seconds"]
        channels, counters = doc["channels"], doc["counters"]
        if not all(isinstance(x, int | float) and math.isfinite(x) for x in (st, iv)):
            raise ValueError("sender_time / interval_seconds must be finite numbers")
        if not isinstance(channels, dict) or not isinstance(counters, dict):
            raise ValueError("channels / counters must be objects")
        clean: dict[str, dict[str, int | None]] = {}
        for name, info in channels.items():
            if not CHANNEL_RE.fullmatch(name) or not isinstance(info, dict):
                raise ValueError(f"channel entry {name[:64]!r} is malformed")
            last, objs = info.get("last_seq"), info.get("objects")
            if not (last is None or _u64(last)) or not _u64(objs):
                raise ValueError(f"channel {name!r}: last_seq / objects must be integers 0..2^64-1")
            clean[name] = {"last_seq": last, "objects": objs}
        if not all(isinstance(c, str) and _u64(v) for c, v in counters.items()):
            raise ValueError("counters must map names to integers 0..2^64-1")
        part, parts = doc.get("part", 0), doc.get("parts", 1)
        if not (
            type(part) is int and type(parts) is int and 0 <= part < parts <= MAX_HEARTBEAT_PARTS
        ):
            raise ValueError(f"part {part!r} of {parts!r}: must be ints, 0 <= part < parts <= "
                             f"{MAX_HEARTBEAT_PARTS}")  # fmt: skip
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
        # OverflowError: a number no float holds; RecursionError: JSON nested too deep
        raise _malformed(epoch, packet, f"link heartbeat: {e}") from None
    return LinkHeartbeat(epoch, packet, float(st), float(iv), clean, dict(counters), part, parts)
