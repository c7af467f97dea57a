"""Protocol core (red replay): add one header to AMQP property bytes, keep every other byte."""

from __future__ import annotations

import struct

from bridge.errors import ProtocolError
from bridge.protocol.properties import decode_table, encode_table, headers_table

__all__ = ["with_id_header"]

_U32 = struct.Struct(">I")
_HEADERS_FLAG = 0x2000
"""The property-flags bit of the ``headers`` table."""


def with_id_header(properties_raw: bytes, name: str, value: str) -> bytes:
    """``properties_raw`` with header ``name`` = long string ``value`` added at the end of the
    headers table (created if absent; an existing ``name`` entry is replaced). Every other
    byte is kept: the table's other entries are copied, not re-encoded, unless ``name`` was
    there. ProtocolError if the property bytes do not decode."""
    headers_table(properties_raw)  # validates the whole block's structure
    raw = properties_raw
    flags = (raw[0] << 8) | raw[1]
    if flags & 1:
        raise ProtocolError("property flags continue past the first word (not AMQP basic)")
    pos = 2
    for bit in (0x8000, 0x4000):  # content-type, content-encoding: short strings
        if flags & bit:
            pos += 1 + raw[pos]
    key = name.encode()
    entry = bytes((len(key),)) + key + b"S" + _U32.pack(len(value.encode())) + value.encode()
    if flags & _HEADERS_FLAG:
        size = _U32.unpack_from(raw, pos)[0]
        end = pos + 4 + size
        body = raw[pos + 4 : end]
        old = decode_table(raw[pos:end])
        if any((k.encode() if isinstance(k, str) else k) == key for k, _ in old):
            kept = tuple((k, v) for k, v in old if (k.encode() if isinstance(k, str) else k) != key)
            body = encode_table(kept)[4:]
        table = _U32.pack(len(body) + len(entry)) + body + entry
        return raw[:pos] + table + raw[end:]
    flags |= _HEADERS_FLAG
    table = _U32.pack(len(entry)) + entry
    return bytes((flags >> 8, flags & 0xFF)) + raw[2:pos] + table + raw[pos:]
