"""AMQP client (both sides): AMQP 0-9-1 frames as bytes, pure (no sockets).

A frame on the wire is ``type(1) channel(2) size(4) payload(size) 0xCE``. This module splits
complete frames out of a receive buffer, builds and parses content headers while keeping the
property bytes verbatim, parses the hot incoming methods (``basic.deliver``, ``basic.return``,
publisher confirms) by hand, and marshals the methods the client sends. Field tables given as
dicts are encoded by pamqp; incoming methods that are not on the hot path are decoded by pamqp.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

from pamqp import encode as pamqp_encode
from pamqp import frame as pamqp_frame
from pamqp.base import Frame as PamqpMethod

from bridge.errors import AmqpFrameError

__all__ = [
    "SHORT_MAX",
    "HEADER_FRAME_OVERHEAD",
    "FRAME_METHOD",
    "FRAME_HEADER",
    "FRAME_BODY",
    "FRAME_HEARTBEAT",
    "FRAME_END",
    "PROTOCOL_HEADER",
    "HEARTBEAT",
    "BASIC",
    "DELIVER",
    "RETURN",
    "ACK",
    "NACK",
    "FrameSpan",
    "ContentHeader",
    "DeliverArgs",
    "ReturnArgs",
    "split_frames",
    "frame",
    "method_frame",
    "content_header_payload",
    "parse_content_header",
    "parse_deliver",
    "parse_return",
    "parse_confirm",
    "unmarshal_method",
    "method_id",
    "shortstr",
    "longstr",
    "table",
    "publish_frames",
    "ack_frame",
    "nack_frame",
    "reject_frame",
]

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
HEARTBEAT = b"\x08\x00\x00\x00\x00\x00\x00\xce"

BASIC = 60
# (class id << 16) | method id of the incoming methods parsed by hand
DELIVER = 0x003C003C
RETURN = 0x003C0032
ACK = 0x003C0050
NACK = 0x003C0078

_HEAD = struct.Struct(">BHI")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_CH = struct.Struct(">HHQ")  # content header: class id, weight, body size
_ACK = struct.Struct(">BHIIQB")  # frame head, method index, delivery tag, bits
_QB = struct.Struct(">QB")
_END = b"\xce"
SHORT_MAX = 255
"""An AMQP short string (an exchange name, a routing key) holds at most 255 bytes."""
HEADER_FRAME_OVERHEAD = _HEAD.size + len(_END) + _CH.size
"""Bytes of a content header frame beside its property bytes: frame head and end, class id,
weight and body size (the frame must stay within the connection's frame_max)."""
_EMPTY_TABLE = b"\x00\x00\x00\x00"


class FrameSpan(NamedTuple):
    """One complete frame inside a buffer: its payload is ``buffer[start:end]``."""

    type: int
    channel: int
    start: int
    end: int


class ContentHeader(NamedTuple):
    """A content header frame's payload; ``properties_raw`` is kept byte for byte."""

    class_id: int
    weight: int
    body_size: int
    properties_raw: bytes


class DeliverArgs(NamedTuple):
    """The arguments of ``basic.deliver``."""

    consumer_tag: str
    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str


class ReturnArgs(NamedTuple):
    """The arguments of ``basic.return``."""

    reply_code: int
    reply_text: str
    exchange: str
    routing_key: str


def _text(raw: bytes) -> str:
    """A short string as text: UTF-8, or with undecodable bytes kept as surrogate escapes."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode("utf-8", "surrogateescape")


# ---------------------------------------------------------------------------- splitting
def split_frames(
    data: bytes | bytearray | memoryview, pos: int = 0, end: int | None = None, max_payload: int = 0
) -> tuple[list[FrameSpan], int]:
    """The complete frames in ``data[pos:end]`` and the offset just after the last of them.

    A trailing partial frame is left for the next call. (The client's reader inlines this loop
    on its hot path; tests feed both the same byte streams.) ``max_payload`` (0: no limit) is the
    negotiated frame_max minus the 8 bytes of framing. Raises :class:`AmqpFrameError` (naming
    the offset and channel) on a missing frame-end octet or an oversized frame.
    """
    if end is None:
        end = len(data)
    out: list[FrameSpan] = []
    unpack = _HEAD.unpack_from
    while end - pos >= 8:
        ftype, channel, size = unpack(data, pos)
        stop = pos + 7 + size  # offset of the frame-end octet
        if max_payload and size > max_payload:
            raise AmqpFrameError(
                f"frame of {size} bytes on channel {channel} at offset {pos} exceeds the "
                f"negotiated frame_max ({max_payload + 8})"
            )
        if stop >= end:
            break
        if data[stop] != FRAME_END:
            raise AmqpFrameError(
                f"frame type {ftype} on channel {channel} at offset {pos} does not end with "
                f"0xCE (got {data[stop]:#04x}): the byte stream is not AMQP 0-9-1"
            )
        out.append(FrameSpan(ftype, channel, pos + 7, stop))
        pos = stop + 1
    return out, pos


def frame(ftype: int, channel: int, payload: bytes) -> bytes:
    """One whole frame around ``payload``."""
    return b"".join((_HEAD.pack(ftype, channel, len(payload)), payload, _END))


# ---------------------------------------------------------------------------- content
def content_header_payload(body_size: int, properties_raw: bytes, class_id: int = BASIC) -> bytes:
    """The payload of a content header frame; ``properties_raw`` starts with the flag words."""
    return _CH.pack(class_id, 0, body_size) + properties_raw


def parse_content_header(payload: bytes | memoryview) -> ContentHeader:
    """Split a content header payload; the property bytes are returned unchanged."""
    if len(payload) < 14:
        raise AmqpFrameError(f"content header of {len(payload)} bytes is shorter than 14")
    class_id, weight, body_size = _CH.unpack_from(payload, 0)
    return ContentHeader(class_id, weight, body_size, bytes(payload[12:]))


def publish_frames(
    channel: int,
    exchange: bytes,
    routing_key: bytes,
    properties_raw: bytes,
    body: bytes | bytearray | memoryview,
    frame_max: int,
    mandatory: bool = False,
) -> bytes:
    """``basic.publish`` + content header + body frames of at most ``frame_max - 8`` bytes."""
    if len(exchange) > SHORT_MAX or len(routing_key) > SHORT_MAX:
        raise ValueError(
            f"exchange and routing key are short strings: at most {SHORT_MAX} bytes each"
        )
    size = len(body)
    parts: list[bytes | bytearray | memoryview] = [
        _HEAD.pack(FRAME_METHOD, channel, 9 + len(exchange) + len(routing_key)),
        b"\x00\x3c\x00\x28\x00\x00",
        bytes((len(exchange),)),
        exchange,
        bytes((len(routing_key),)),
        routing_key,
        b"\x01\xce" if mandatory else b"\x00\xce",
        _HEAD.pack(FRAME_HEADER, channel, 12 + len(properties_raw)),
        _CH.pack(BASIC, 0, size),
        properties_raw,
        _END,
    ]
    room = frame_max - 8 if frame_max else size
    if size <= room:
        if size:
            parts += (_HEAD.pack(FRAME_BODY, channel, size), body, _END)
    else:
        view = memoryview(body)
        for at in range(0, size, room):
            piece = view[at : at + room]
            parts += (_HEAD.pack(FRAME_BODY, channel, len(piece)), piece, _END)
    return b"".join(parts)


# ---------------------------------------------------------------------------- incoming methods
def method_id(data: bytes | memoryview, start: int) -> int:
    """``(class id << 16) | method id`` of the method frame payload at ``start``."""
    result: int = _U32.unpack_from(data, start)[0]
    return result


def parse_deliver(data: bytes, start: int) -> DeliverArgs:
    """``basic.deliver`` from the method payload at ``start`` (class and method ids included)."""
    p = start + 4
    n = data[p]
    tag = _text(data[p + 1 : p + 1 + n])
    p += 1 + n
    dtag, bits = _QB.unpack_from(data, p)
    p += 9
    n = data[p]
    exchange = _text(data[p + 1 : p + 1 + n])
    p += 1 + n
    n = data[p]
    return DeliverArgs(tag, dtag, bool(bits & 1), exchange, _text(data[p + 1 : p + 1 + n]))


def parse_return(data: bytes, start: int) -> ReturnArgs:
    """``basic.return`` from the method payload at ``start``."""
    p = start + 4
    (code,) = _U16.unpack_from(data, p)
    p += 2
    n = data[p]
    text = _text(data[p + 1 : p + 1 + n])
    p += 1 + n
    n = data[p]
    exchange = _text(data[p + 1 : p + 1 + n])
    p += 1 + n
    n = data[p]
    return ReturnArgs(code, text, exchange, _text(data[p + 1 : p + 1 + n]))


def parse_confirm(data: bytes, start: int) -> tuple[int, bool]:
    """(delivery tag, multiple) of a broker's ``basic.ack`` / ``basic.nack``."""
    dtag, bits = _QB.unpack_from(data, start + 4)
    return dtag, bool(bits & 1)


def unmarshal_method(payload: bytes) -> PamqpMethod:
    """Any method frame payload as a pamqp object (for the methods off the hot path)."""
    try:
        _used, _channel, value = pamqp_frame.unmarshal(frame(FRAME_METHOD, 0, payload))
    except Exception as e:  # pamqp raises its own exception types and struct/value errors
        raise AmqpFrameError(f"undecodable method frame ({type(e).__name__}: {e})") from None
    if not isinstance(value, PamqpMethod):  # pragma: no cover - a method frame always is
        raise AmqpFrameError(f"method frame decoded as {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------- outgoing methods
def shortstr(value: str | bytes) -> bytes:
    """An AMQP short string (length octet + UTF-8)."""
    raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
    if len(raw) > SHORT_MAX:
        raise ValueError(f"short string of {len(raw)} bytes (at most {SHORT_MAX}): {raw[:40]!r}...")
    return bytes((len(raw),)) + raw


def longstr(value: str | bytes) -> bytes:
    """An AMQP long string (32-bit length + bytes)."""
    raw = value.encode() if isinstance(value, str) else value
    return _U32.pack(len(raw)) + raw


def table(arguments: bytes | Mapping[str, Any] | None) -> bytes:
    """A field table: pre-encoded bytes (with their 32-bit length) as they are, or a dict
    encoded by pamqp (keys sorted; integers in the smallest signed/unsigned width)."""
    if arguments is None:
        return _EMPTY_TABLE
    if isinstance(arguments, (bytes, bytearray, memoryview)):
        raw = bytes(arguments)
        if len(raw) < 4 or _U32.unpack_from(raw)[0] != len(raw) - 4:
            raise ValueError(
                "a pre-encoded field table must be its 32-bit length followed by that many bytes"
            )
        return raw
    return pamqp_encode.field_table(dict(arguments))


def bits(*flags: bool) -> bytes:
    """Up to 8 consecutive bit arguments packed into one octet (first flag = lowest bit)."""
    octet = 0
    for i, f in enumerate(flags):
        if f:
            octet |= 1 << i
    return bytes((octet,))


def method_frame(channel: int, index: int, args: bytes = b"") -> bytes:
    """A method frame: ``index`` is ``(class id << 16) | method id``, ``args`` its marshalled
    arguments."""
    return b"".join(
        (_HEAD.pack(FRAME_METHOD, channel, 4 + len(args)), _U32.pack(index), args, _END)
    )


def ack_frame(channel: int, delivery_tag: int, multiple: bool = False) -> bytes:
    """``basic.ack``."""
    return _ACK.pack(FRAME_METHOD, channel, 13, ACK, delivery_tag, multiple) + _END


def nack_frame(
    channel: int, delivery_tag: int, multiple: bool = False, requeue: bool = True
) -> bytes:
    """``basic.nack``."""
    return _ACK.pack(FRAME_METHOD, channel, 13, NACK, delivery_tag, multiple | requeue << 1) + _END


def reject_frame(channel: int, delivery_tag: int, requeue: bool = True) -> bytes:
    """``basic.reject``."""
    return _ACK.pack(FRAME_METHOD, channel, 13, 0x003C005A, delivery_tag, requeue) + _END


# (class id << 16) | method id of every method the client sends or waits for
CONNECTION_START = 0x000A000A
CONNECTION_START_OK = 0x000A000B
CONNECTION_SECURE = 0x000A0014
CONNECTION_TUNE = 0x000A001E
CONNECTION_TUNE_OK = 0x000A001F
CONNECTION_OPEN = 0x000A0028
CONNECTION_OPEN_OK = 0x000A0029
CONNECTION_CLOSE = 0x000A0032
CONNECTION_CLOSE_OK = 0x000A0033
CONNECTION_BLOCKED = 0x000A003C
CONNECTION_UNBLOCKED = 0x000A003D
CHANNEL_OPEN = 0x0014000A
CHANNEL_OPEN_OK = 0x0014000B
CHANNEL_FLOW = 0x00140014
CHANNEL_FLOW_OK = 0x00140015
CHANNEL_CLOSE = 0x00140028
CHANNEL_CLOSE_OK = 0x00140029
EXCHANGE_DECLARE = 0x0028000A
EXCHANGE_DECLARE_OK = 0x0028000B
QUEUE_DECLARE = 0x0032000A
QUEUE_DECLARE_OK = 0x0032000B
QUEUE_BIND = 0x00320014
QUEUE_BIND_OK = 0x00320015
BASIC_QOS = 0x003C000A
BASIC_QOS_OK = 0x003C000B
BASIC_CONSUME = 0x003C0014
BASIC_CONSUME_OK = 0x003C0015
BASIC_CANCEL = 0x003C001E
BASIC_CANCEL_OK = 0x003C001F
CONFIRM_SELECT = 0x0055000A
CONFIRM_SELECT_OK = 0x0055000B

_U16_U32_U16 = struct.Struct(">HIH")
_CLOSE = struct.Struct(">H")
_QOS = struct.Struct(">IHB")


def start_ok_frame(client_properties: Mapping[str, Any], user: str, password: str) -> bytes:
    """``connection.start-ok`` with PLAIN authentication."""
    response = b"\x00" + user.encode() + b"\x00" + password.encode()
    args = table(client_properties) + shortstr("PLAIN") + longstr(response) + shortstr("en_US")
    return method_frame(0, CONNECTION_START_OK, args)


def tune_ok_frame(channel_max: int, frame_max: int, heartbeat: int) -> bytes:
    """``connection.tune-ok``."""
    return method_frame(0, CONNECTION_TUNE_OK, _U16_U32_U16.pack(channel_max, frame_max, heartbeat))


def connection_open_frame(vhost: str) -> bytes:
    """``connection.open``."""
    return method_frame(0, CONNECTION_OPEN, shortstr(vhost) + b"\x00\x00")


def close_frame(channel: int, reply_code: int, reply_text: str, failing_index: int = 0) -> bytes:
    """``connection.close`` (channel 0) or ``channel.close``."""
    index = CONNECTION_CLOSE if channel == 0 else CHANNEL_CLOSE
    args = _CLOSE.pack(reply_code) + shortstr(reply_text[:255]) + _U32.pack(failing_index)
    return method_frame(channel, index, args)


def close_ok_frame(channel: int) -> bytes:
    """``connection.close-ok`` (channel 0) or ``channel.close-ok``."""
    return method_frame(channel, CONNECTION_CLOSE_OK if channel == 0 else CHANNEL_CLOSE_OK)


def channel_open_frame(channel: int) -> bytes:
    """``channel.open``."""
    return method_frame(channel, CHANNEL_OPEN, b"\x00")


def flow_ok_frame(channel: int, active: bool) -> bytes:
    """``channel.flow-ok``."""
    return method_frame(channel, CHANNEL_FLOW_OK, bits(active))


def exchange_declare_frame(
    channel: int,
    exchange: str,
    exchange_type: str,
    *,
    passive: bool = False,
    durable: bool = False,
    auto_delete: bool = False,
    internal: bool = False,
    arguments: bytes | Mapping[str, Any] | None = None,
) -> bytes:
    """``exchange.declare`` (waits for declare-ok)."""
    args = (
        b"\x00\x00"
        + shortstr(exchange)
        + shortstr(exchange_type)
        + bits(passive, durable, auto_delete, internal, False)
        + table(arguments)
    )
    return method_frame(channel, EXCHANGE_DECLARE, args)


def queue_declare_frame(
    channel: int,
    queue: str,
    *,
    passive: bool = False,
    durable: bool = False,
    exclusive: bool = False,
    auto_delete: bool = False,
    arguments: bytes | Mapping[str, Any] | None = None,
) -> bytes:
    """``queue.declare`` (waits for declare-ok)."""
    args = (
        b"\x00\x00"
        + shortstr(queue)
        + bits(passive, durable, exclusive, auto_delete, False)
        + table(arguments)
    )
    return method_frame(channel, QUEUE_DECLARE, args)


def queue_bind_frame(
    channel: int,
    queue: str,
    exchange: str,
    routing_key: str = "",
    arguments: bytes | Mapping[str, Any] | None = None,
) -> bytes:
    """``queue.bind`` (waits for bind-ok)."""
    args = (
        b"\x00\x00"
        + shortstr(queue)
        + shortstr(exchange)
        + shortstr(routing_key)
        + b"\x00"
        + table(arguments)
    )
    return method_frame(channel, QUEUE_BIND, args)


def qos_frame(channel: int, prefetch_count: int) -> bytes:
    """``basic.qos`` for the channel's consumers (prefetch size 0 = no byte limit)."""
    return method_frame(channel, BASIC_QOS, _QOS.pack(0, prefetch_count, 0))


def consume_frame(
    channel: int,
    queue: str,
    consumer_tag: str = "",
    *,
    no_ack: bool = False,
    exclusive: bool = False,
    arguments: bytes | Mapping[str, Any] | None = None,
) -> bytes:
    """``basic.consume`` (waits for consume-ok; an empty tag lets the broker choose one)."""
    args = (
        b"\x00\x00"
        + shortstr(queue)
        + shortstr(consumer_tag)
        + bits(False, no_ack, exclusive, False)
        + table(arguments)
    )
    return method_frame(channel, BASIC_CONSUME, args)


def cancel_frame(channel: int, consumer_tag: str) -> bytes:
    """``basic.cancel`` (waits for cancel-ok)."""
    return method_frame(channel, BASIC_CANCEL, shortstr(consumer_tag) + b"\x00")


def cancel_ok_frame(channel: int, consumer_tag: str) -> bytes:
    """``basic.cancel-ok`` (answer to a broker's cancel that asks for one)."""
    return method_frame(channel, BASIC_CANCEL_OK, shortstr(consumer_tag))


def confirm_select_frame(channel: int) -> bytes:
    """``confirm.select`` (waits for select-ok)."""
    return method_frame(channel, CONFIRM_SELECT, b"\x00")
