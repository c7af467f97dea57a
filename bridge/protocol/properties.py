"""Protocol core (both sides): exact codec of AMQP 0-9-1 Basic content-header property bytes.

The *property bytes* are what follows class-id(2) weight(2) body-size(8) in a content header
frame payload: one 16-bit property-flags word (bit 15 content-type ... bit 2 cluster-id; bit 1
is unused and bit 0 would announce another flags word: both are refused), then the present
properties in flag order. Black stores these bytes verbatim (row column ``properties_raw``);
this module derives everything else from them and is the codec of record.

Decoding keeps every wire detail, so that ``encode_properties(decode_properties(raw)) == raw``
for every ``raw`` that decodes:

* a field table is a tuple of ``(key, (tag, value))`` pairs in wire order, duplicates kept;
* every value keeps its wire tag (``Field = (tag, value)``, ``tag`` a one-letter ``str``);
* a short string (property or key) or an ``S`` long string is ``str`` when its bytes are
  UTF-8 and ``bytes`` otherwise;
* values by tag: ``t`` bool (``True``/``False`` for octets 1/0; any other octet, which AMQP
  also reads as true, stays an ``int`` 2..255), ``b B s u I i l`` and the spec letters ``U``
  (int16) and ``L`` (int64) ``int``, ``f d`` ``float`` (-0.0 and NaN payloads kept; a float32
  signalling NaN, which a Python float cannot hold, is a ``Float32Bits``), ``D``
  ``decimal.Decimal`` whose exponent is minus the wire scale (``1.50`` = scale 2, value 150;
  the 32-bit value is read signed, as pika, Java and .NET clients write it; RabbitMQ and pamqp
  read it unsigned), ``S`` str/bytes, ``x`` bytes, ``T`` int (uint64 seconds), ``A`` tuple of
  fields, ``F`` field table, ``V`` None.

Malformed input (truncated, trailing bytes, unknown tag, set continuation bit) raises
ProtocolError naming the offset, never IndexError or struct.error.

``field_table`` / ``field_value`` build tables from Python values (``Typed`` and the
``Int8`` ... ``Float32`` helpers choose a tag explicitly); ``to_python`` goes the other way.
"""

from __future__ import annotations

import calendar
import decimal
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeAlias

from bridge.errors import ProtocolError

__all__ = [
    "Properties",
    "PROPERTY_NAMES",
    "Field",
    "FieldTable",
    "Float32Bits",
    "decode_properties",
    "encode_properties",
    "headers_table",
    "scan_properties",
    "decode_table",
    "encode_table",
    "decimal_parts",
    "Typed",
    "field_table",
    "field_value",
    "to_python",
    "Int8",
    "UInt8",
    "Int16",
    "UInt16",
    "Int32",
    "UInt32",
    "Int64",
    "Float32",
    "Float64",
    "Timestamp",
    "ByteArray",
    "LongString",
    "NO_PROPERTIES",
]

Key: TypeAlias = "bytes | str"
Field: TypeAlias = "tuple[str, Any]"
FieldTable: TypeAlias = "tuple[tuple[bytes | str, tuple[str, Any]], ...]"

NO_PROPERTIES = b"\x00\x00"
"""The property bytes of a message without any property."""

PROPERTY_NAMES = (
    "content_type",
    "content_encoding",
    "headers",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
    "cluster_id",
)
"""The 14 Basic properties in flag order: property ``i`` is flag bit ``15 - i``."""


@dataclass(frozen=True, slots=True)
class Float32Bits:
    """A float32 signalling NaN (bit pattern ``bits``): converting it to a Python float would
    set its quiet bit, so the decoder keeps the bits instead."""

    bits: int


@dataclass(frozen=True, slots=True)
class Properties:
    """The Basic content-header properties; ``None`` means absent (its flag bit clear)."""

    content_type: str | bytes | None = None
    content_encoding: str | bytes | None = None
    headers: FieldTable | None = None
    delivery_mode: int | None = None
    priority: int | None = None
    correlation_id: str | bytes | None = None
    reply_to: str | bytes | None = None
    expiration: str | bytes | None = None
    message_id: str | bytes | None = None
    timestamp: int | None = None
    type: str | bytes | None = None
    user_id: str | bytes | None = None
    app_id: str | bytes | None = None
    cluster_id: str | bytes | None = None


# ------------------------------------------------------------------------------ decode

_SHORT, _OCTET, _U64, _TABLE = 0, 1, 2, 3
_KINDS = (
    _SHORT,
    _SHORT,
    _TABLE,
    _OCTET,
    _OCTET,
    _SHORT,
    _SHORT,
    _SHORT,
    _SHORT,
    _U64,
    _SHORT,
    _SHORT,
    _SHORT,
    _SHORT,
)
_plans: dict[int, tuple[tuple[int, int], ...]] = {}

_u16 = struct.Struct(">H").unpack_from
_u32 = struct.Struct(">I").unpack_from
_i32 = struct.Struct(">i").unpack_from
_i16 = struct.Struct(">h").unpack_from
_i64 = struct.Struct(">q").unpack_from
_u64 = struct.Struct(">Q").unpack_from
_f32 = struct.Struct(">f").unpack_from
_f64 = struct.Struct(">d").unpack_from
_i8 = struct.Struct(">b").unpack_from
_pack_f32 = struct.Struct(">f").pack


def _plan(flags: int) -> tuple[tuple[int, int], ...]:
    plan = _plans.get(flags)
    if plan is None:
        plan = tuple((i, _KINDS[i]) for i in range(14) if flags & (0x8000 >> i))
        _plans[flags] = plan
    return plan


def decode_properties(raw: bytes) -> Properties:
    """The properties ``raw`` holds (see the module docstring for the value types)."""
    return Properties(*_scan(raw, True))


def scan_properties(raw: bytes) -> list[Any]:
    """The 14 property values of ``raw`` in flag order, the headers left as their raw table
    bytes (length prefix included) for the caller to decode or cache; validates the rest."""
    return _scan(raw, False)


def headers_table(raw: bytes) -> bytes | None:
    """The raw headers table of property block ``raw`` (length prefix included), or None when
    it has none. Checks the block's structure exactly as :func:`scan_properties` does (flags,
    lengths, no trailing bytes; ProtocolError otherwise) but decodes no value: the cheap check
    for a caller that only forwards the bytes."""
    raw, n, flags = _block(raw)
    table = None
    off = 2
    try:
        for _i, kind in _plan(flags):
            if kind == _SHORT:
                off += 1 + raw[off]
            elif kind == _OCTET:
                off += 1
            elif kind == _U64:
                off += 8
            else:
                end = off + 4 + _u32(raw, off)[0]
                if end > n:
                    raise ProtocolError(f"headers table at byte offset {off} runs past the end")
                table = raw[off:end]  # the one table of Basic: headers
                off = end
    except (IndexError, struct.error):
        raise ProtocolError(
            f"property bytes are truncated: {n} bytes, property flags 0x{flags:04x}"
        ) from None
    _ends_at(n, off)
    return table


def _block(raw: Any) -> tuple[bytes, int, int]:
    """``raw`` as bytes, its length and its property flags (checked: two bytes, no
    continuation, no unknown bit)."""
    if type(raw) is not bytes:
        raw = _bytes(raw, "property bytes")
    n = len(raw)
    if n < 2:
        raise ProtocolError(f"property bytes are {n} byte(s) long: the property flags need 2")
    flags = raw[0] << 8 | raw[1]
    if flags & 3:
        what = "continuation flag (bit 0)" if flags & 1 else "unknown property flag bit 1"
        raise ProtocolError(f"property flags 0x{flags:04x} set the {what}: not AMQP 0-9-1 Basic")
    return raw, n, flags


def _ends_at(n: int, off: int) -> None:
    """The properties, read up to ``off``, must end exactly at the block's end ``n``."""
    if off != n:
        if off > n:
            raise ProtocolError(
                f"property bytes are truncated: {n} bytes, the properties need {off}"
            )
        raise ProtocolError(f"property bytes have {n - off} trailing byte(s) at offset {off}")


def _bytes(raw: Any, what: str) -> bytes:
    if isinstance(raw, bytearray | memoryview):
        return bytes(raw)
    raise ProtocolError(f"{what} must be bytes, not {type(raw).__name__}")


def _scan(raw: bytes, tables: bool) -> list[Any]:
    raw, n, flags = _block(raw)
    out: list[Any] = [None] * 14
    off = 2
    try:
        for i, kind in _plan(flags):
            if kind == _SHORT:
                end = off + 1 + raw[off]
                b = raw[off + 1 : end]
                try:
                    out[i] = b.decode()
                except UnicodeDecodeError:
                    out[i] = b
                off = end
            elif kind == _OCTET:
                out[i] = raw[off]
                off += 1
            elif kind == _U64:
                out[i] = _u64(raw, off)[0]
                off += 8
            elif tables:
                out[i], off = _table(raw, off)
            else:
                end = off + 4 + _u32(raw, off)[0]
                if end > n:
                    raise ProtocolError(f"headers table at byte offset {off} runs past the end")
                out[i] = raw[off:end]
                off = end
    except (IndexError, struct.error):
        raise ProtocolError(
            f"property bytes are truncated: {n} bytes, property flags 0x{flags:04x}"
        ) from None
    except RecursionError:
        raise ProtocolError("headers table is nested too deeply") from None
    _ends_at(n, off)
    return out


def decode_table(raw: bytes) -> FieldTable:
    """The field table ``raw`` holds: a uint32 byte length, then exactly that many bytes."""
    if type(raw) is not bytes:
        raw = _bytes(raw, "a field table")
    try:
        table, off = _table(raw, 0)
    except (IndexError, struct.error):
        raise ProtocolError(f"field table is truncated ({len(raw)} bytes)") from None
    except RecursionError:
        raise ProtocolError("field table is nested too deeply") from None
    if off != len(raw):
        raise ProtocolError(f"field table has {len(raw) - off} trailing byte(s) at offset {off}")
    return table


def _table(raw: bytes, off: int) -> tuple[FieldTable, int]:
    start = off + 4
    end = start + _u32(raw, off)[0]
    if end > len(raw):
        raise ProtocolError(
            f"field table at byte offset {off} declares {end - start} bytes, "
            f"only {len(raw) - start} follow"
        )
    items: list[tuple[Key, Field]] = []
    append = items.append
    off = start
    while off < end:
        kend = off + 1 + raw[off]
        k = raw[off + 1 : kend]
        try:
            key: Key = k.decode()
        except UnicodeDecodeError:
            key = k
        tag = raw[kend]
        off = kend + 1
        if tag == 83:  # S
            vend = off + 4 + _u32(raw, off)[0]
            b = raw[off + 4 : vend]
            try:
                append((key, ("S", b.decode())))
            except UnicodeDecodeError:
                append((key, ("S", b)))
            off = vend
        elif tag == 73:  # I
            append((key, ("I", _i32(raw, off)[0])))
            off += 4
        else:
            field, off = _value(raw, off, tag)
            append((key, field))
    if off != end:
        raise ProtocolError(f"field table at byte offset {start - 4}: a value runs past its end")
    return tuple(items), off


def _value(raw: bytes, off: int, tag: int) -> tuple[Field, int]:
    """The value of type ``tag`` at ``off`` (just after the tag byte), and the next offset."""
    if tag == 83:  # S
        end = off + 4 + _u32(raw, off)[0]
        b = raw[off + 4 : end]
        try:
            return ("S", b.decode()), end
        except UnicodeDecodeError:
            return ("S", b), end
    if tag == 73:  # I
        return ("I", _i32(raw, off)[0]), off + 4
    if tag == 108:  # l
        return ("l", _i64(raw, off)[0]), off + 8
    if tag == 116:  # t
        v = raw[off]
        return ("t", v == 1 if v < 2 else v), off + 1
    if tag == 70:  # F
        return _table_field(raw, off)
    if tag == 65:  # A
        start = off + 4
        end = start + _u32(raw, off)[0]
        if end > len(raw):
            raise ProtocolError(
                f"array at byte offset {off} declares {end - start} bytes, "
                f"only {len(raw) - start} follow"
            )
        values: list[Field] = []
        off = start
        while off < end:
            field, off = _value(raw, off + 1, raw[off])
            values.append(field)
        if off != end:
            raise ProtocolError(f"array at byte offset {start - 4}: a value runs past its end")
        return ("A", tuple(values)), off
    if tag == 100:  # d
        return ("d", _f64(raw, off)[0]), off + 8
    if tag == 102:  # f
        v = _f32(raw, off)[0]
        if v != v and _pack_f32(v) != raw[off : off + 4]:
            return ("f", Float32Bits(_u32(raw, off)[0])), off + 4
        return ("f", v), off + 4
    if tag == 84:  # T
        return ("T", _u64(raw, off)[0]), off + 8
    if tag == 68:  # D
        scale = raw[off]
        return ("D", decimal.Decimal(f"{_i32(raw, off + 1)[0]}E-{scale}")), off + 5
    if tag == 120:  # x
        end = off + 4 + _u32(raw, off)[0]
        return ("x", raw[off + 4 : end]), end
    if tag == 86:  # V
        return ("V", None), off
    if tag == 98:  # b
        return ("b", _i8(raw, off)[0]), off + 1
    if tag == 66:  # B
        return ("B", raw[off]), off + 1
    if tag == 115:  # s
        return ("s", _i16(raw, off)[0]), off + 2
    if tag == 117:  # u
        return ("u", _u16(raw, off)[0]), off + 2
    if tag == 105:  # i
        return ("i", _u32(raw, off)[0]), off + 4
    if tag == 85:  # U
        return ("U", _i16(raw, off)[0]), off + 2
    if tag == 76:  # L
        return ("L", _i64(raw, off)[0]), off + 8
    shown = repr(chr(tag)) if 32 < tag < 127 else "byte"
    raise ProtocolError(f"unknown field value type {shown} (0x{tag:02x}) at byte offset {off - 1}")


def _table_field(raw: bytes, off: int) -> tuple[Field, int]:
    table, off = _table(raw, off)
    return ("F", table), off


# ------------------------------------------------------------------------------ encode


class _Bad(Exception):
    """Internal: a value that cannot be encoded; ``path`` grows as the error unwinds."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg
        self.path: list[str] = []


_p_u8 = struct.Struct(">B").pack
_p_u32 = struct.Struct(">I").pack
_p_u64 = struct.Struct(">Q").pack
_FIXED = {
    "I": struct.Struct(">Bi"),
    "l": struct.Struct(">Bq"),
    "b": struct.Struct(">Bb"),
    "B": struct.Struct(">BB"),
    "s": struct.Struct(">Bh"),
    "u": struct.Struct(">BH"),
    "i": struct.Struct(">BI"),
    "U": struct.Struct(">Bh"),
    "L": struct.Struct(">Bq"),
    "T": struct.Struct(">BQ"),
    "d": struct.Struct(">Bd"),
    "f": struct.Struct(">Bf"),
}
_FIXED_PACK = {tag: (ord(tag), s.pack) for tag, s in _FIXED.items()}
_ENCODE_ERRORS = (struct.error, OverflowError, TypeError, ValueError, AttributeError)


def encode_properties(p: Properties) -> bytes:
    """The property bytes of ``p`` (flags word, then the present properties in order)."""
    flags = 0
    parts: list[bytes] = [b""]
    for i, name in enumerate(PROPERTY_NAMES):
        v = getattr(p, name)
        if v is None:
            continue
        flags |= 0x8000 >> i
        kind = _KINDS[i]
        try:
            if kind == _SHORT:
                parts.append(_short(v))
            elif kind == _OCTET:
                parts.append(_p_u8(v))
            elif kind == _U64:
                parts.append(_p_u64(v))
            else:
                parts.append(_enc_table(v))
        except _Bad as e:
            where = "/".join(e.path)
            raise ProtocolError(
                f"property {name}{' at ' + where if where else ''}: {e.msg}"
            ) from None
        except (*_ENCODE_ERRORS, UnicodeEncodeError) as e:
            raise ProtocolError(f"property {name} = {v!r:.60}: {e}") from None
        except RecursionError:
            raise ProtocolError(f"property {name}: nested too deeply") from None
    parts[0] = bytes((flags >> 8, flags & 0xFF))
    return b"".join(parts)


def encode_table(table: FieldTable) -> bytes:
    """The wire form of a field table: uint32 byte length, then the key/value pairs."""
    try:
        return _enc_table(table)
    except _Bad as e:
        raise ProtocolError(f"field table at {'/'.join(e.path) or '.'}: {e.msg}") from None
    except RecursionError:
        raise ProtocolError("field table is nested too deeply") from None


def _short(v: Any) -> bytes:
    b = v.encode() if type(v) is str else v
    if type(b) is not bytes:
        if not isinstance(b, bytes | bytearray | memoryview):
            raise _Bad(f"a short string must be str or bytes, not {type(v).__name__}")
        b = bytes(b)
    if len(b) > 255:
        raise _Bad(f"short string of {len(b)} bytes (at most 255)")
    return _p_u8(len(b)) + b


def _key_text(key: Any) -> str:
    if isinstance(key, bytes):
        return key.decode("utf-8", "backslashreplace")
    return str(key)


def _enc_table(table: Any) -> bytes:
    parts: list[bytes] = []
    if isinstance(table, Mapping):
        raise _Bad(
            "a field table is a tuple of (key, (tag, value)) pairs: build it with field_table()"
        )
    try:
        items = iter(table)
    except TypeError:
        raise _Bad(
            f"a field table must be a sequence of pairs, not {type(table).__name__}"
        ) from None
    for item in items:
        try:
            key, field = item
            if type(key) is str and type(field) is tuple and len(field) == 2:  # fast path
                tag, v = field
                kb = key.encode()
                if len(kb) < 256:
                    if tag == "S" and type(v) is str:
                        vb = v.encode()
                        parts.append(_p_u8(len(kb)) + kb + b"S" + _p_u32(len(vb)) + vb)
                        continue
                    if (tag == "I" and type(v) is int and -(2**31) <= v < 2**31) or (
                        tag == "l" and type(v) is int and -(2**63) <= v < 2**63
                    ):
                        fixed = _FIXED_PACK[tag]
                        parts.append(_p_u8(len(kb)) + kb + fixed[1](fixed[0], v))
                        continue
            try:
                parts.append(_short(key))
            except UnicodeEncodeError:
                raise _Bad("key is not encodable as UTF-8") from None
            parts.append(_enc_value(field))
        except _Bad as e:
            e.path.insert(0, _key_text(item[0]) if _is_pair(item) else "?")
            raise
        except UnicodeEncodeError:
            bad = _Bad("text is not encodable as UTF-8 (a lone surrogate)")
            bad.path.insert(0, _key_text(item[0]))
            raise bad from None
        except (TypeError, ValueError):
            raise _Bad(
                f"a table entry must be a (key, (tag, value)) pair, not {item!r:.60}"
            ) from None
    body = b"".join(parts)
    return _p_u32(len(body)) + body


def _is_pair(item: Any) -> bool:
    return isinstance(item, tuple | list) and len(item) == 2


def _enc_value(field: Any) -> bytes:
    if not _is_pair(field) or type(field[0]) is not str:
        raise _Bad(f"a field must be a (tag, value) pair, not {field!r:.60}")
    tag, v = field
    try:
        if tag == "S":
            b = v.encode() if type(v) is str else v
            if not isinstance(b, bytes | bytearray | memoryview):
                raise _Bad(f"an 'S' value must be str or bytes, not {type(v).__name__}")
            return b"S" + _p_u32(len(b)) + bytes(b)
        fixed = _FIXED_PACK.get(tag)
        if fixed is not None:
            if type(v) is Float32Bits:
                if tag != "f":
                    raise _Bad(f"Float32Bits is a value of tag 'f', not {tag!r}")
                return b"f" + _p_u32(v.bits)
            if tag in "fd":
                if not isinstance(v, float | int) or isinstance(v, bool):
                    raise _Bad(f"a {tag!r} value must be a float, not {type(v).__name__}")
            elif not isinstance(v, int):
                raise _Bad(f"a {tag!r} value must be an int, not {type(v).__name__}")
            return fixed[1](fixed[0], v)
        if tag == "t":
            if v is True or v is False:
                return b"t\x01" if v else b"t\x00"
            if type(v) is int and 2 <= v <= 255:
                return b"t" + _p_u8(v)
            raise _Bad(f"a 't' value must be a bool (or an octet 2..255), not {v!r:.40}")
        if tag == "F":
            return b"F" + _enc_table(v)
        if tag == "A":
            if not isinstance(v, tuple | list):
                raise _Bad(f"an 'A' value must be a tuple of fields, not {type(v).__name__}")
            parts = []
            for i, x in enumerate(v):
                try:
                    parts.append(_enc_value(x))
                except _Bad as e:
                    e.path.insert(0, f"[{i}]")
                    raise
            body = b"".join(parts)
            return b"A" + _p_u32(len(body)) + body
        if tag == "x":
            if not isinstance(v, bytes | bytearray | memoryview):
                raise _Bad(f"an 'x' value must be bytes, not {type(v).__name__}")
            return b"x" + _p_u32(len(v)) + bytes(v)
        if tag == "D":
            scale, unscaled = _decimal_parts(v)
            return b"D" + _p_u8(scale) + struct.pack(">i", unscaled)
        if tag == "V":
            if v is not None:
                raise _Bad(f"a 'V' value must be None, not {v!r:.40}")
            return b"V"
    except _ENCODE_ERRORS as e:
        raise _Bad(f"{tag!r} value {v!r:.60}: {e}") from None
    except UnicodeEncodeError:
        raise _Bad("string is not encodable as UTF-8") from None
    raise _Bad(f"unknown field value type {tag!r}")


def decimal_parts(v: Any) -> tuple[int, int]:
    """``(scale, unscaled int32)`` of a Decimal as an AMQP decimal holds it (ProtocolError if
    it cannot: not finite, exponent below -255, unscaled value beyond int32)."""
    try:
        return _decimal_parts(v)
    except _Bad as e:
        raise ProtocolError(e.msg) from None


def _decimal_parts(v: Any) -> tuple[int, int]:
    """(scale, unscaled int32) of a Decimal whose exponent is in [-255, 0] (or above 0: then
    it is scaled to 0); raises _Bad for anything an AMQP decimal cannot hold exactly."""
    if not isinstance(v, decimal.Decimal):
        raise _Bad(f"a 'D' value must be a decimal.Decimal, not {type(v).__name__}")
    if not v.is_finite():
        raise _Bad(f"decimal {v} is not finite")
    sign, digits, exp = v.as_tuple()
    assert isinstance(exp, int)
    unscaled = int("".join(map(str, digits)) or "0")
    if sign:
        unscaled = -unscaled
    if exp > 0:
        unscaled *= 10**exp
        exp = 0
    if exp < -255 or not -(2**31) <= unscaled < 2**31:
        raise _Bad(f"decimal {v} does not fit an AMQP decimal (scale <= 255, int32 value)")
    return -exp, unscaled


# ------------------------------------------------------------------------------ build


@dataclass(frozen=True, slots=True)
class Typed:
    """A value with an explicit wire tag, for ``field_table``: ``Typed("f", 1.5)``."""

    tag: str
    value: Any


def Int8(v: int) -> Typed:
    return Typed("b", v)


def UInt8(v: int) -> Typed:
    return Typed("B", v)


def Int16(v: int) -> Typed:
    return Typed("s", v)


def UInt16(v: int) -> Typed:
    return Typed("u", v)


def Int32(v: int) -> Typed:
    return Typed("I", v)


def UInt32(v: int) -> Typed:
    return Typed("i", v)


def Int64(v: int) -> Typed:
    return Typed("l", v)


def Float32(v: float) -> Typed:
    return Typed("f", v)


def Float64(v: float) -> Typed:
    return Typed("d", v)


def Timestamp(v: int | datetime) -> Typed:
    return Typed("T", v)


def ByteArray(v: bytes) -> Typed:
    return Typed("x", v)


def LongString(v: str | bytes) -> Typed:
    return Typed("S", v)


_I32 = (-(2**31), 2**31 - 1)
_I64 = (-(2**63), 2**63 - 1)


def field_table(values: Mapping[Any, Any] | Iterable[tuple[Any, Any]] | None) -> FieldTable:
    """A field table from Python values, checked encodable (ProtocolError otherwise).

    ``values``: a mapping, or (key, value) pairs (to repeat a key). Default tags: str ``S``,
    bool ``t``, int ``I`` (int32) or ``l`` (int64), float ``d``, bytes ``x``, Decimal ``D``,
    datetime ``T`` (whole seconds, naive = UTC), mapping ``F``, list/tuple ``A``, None ``V``;
    ``Typed`` (or ``Int8(3)``, ``Float32(1.5)``, ...) picks the tag.
    """
    if values is None:
        return ()
    try:
        table = _to_table(values)
        _enc_table(table)
    except _Bad as e:
        raise ProtocolError(f"field table at {'/'.join(e.path) or '.'}: {e.msg}") from None
    except RecursionError:
        raise ProtocolError("field table is nested too deeply") from None
    return table


def field_value(v: Any) -> Field:
    """The ``(tag, value)`` field of one Python value (``field_table``'s rules)."""
    try:
        field = _to_field(v)
        _enc_value(field)
    except _Bad as e:
        raise ProtocolError(f"value at {'/'.join(e.path) or '.'}: {e.msg}") from None
    return field


def _to_table(values: Any) -> FieldTable:
    pairs = values.items() if isinstance(values, Mapping) else values
    out = []
    for k, v in pairs:
        try:
            out.append((bytes(k) if isinstance(k, bytearray) else k, _to_field(v)))
        except _Bad as e:
            e.path.insert(0, _key_text(k))
            raise
    return tuple(out)


def _to_field(v: Any) -> Field:
    t = type(v)
    if t is str:
        return ("S", v)
    if t is bool:
        return ("t", v)
    if t is int:
        if _I32[0] <= v <= _I32[1]:
            return ("I", v)
        if _I64[0] <= v <= _I64[1]:
            return ("l", v)
        raise _Bad(f"int {v} does not fit 64 bits: use Typed('T', ...) for uint64 timestamps")
    if t is float:
        return ("d", v)
    if t is Typed:
        return _typed_field(v.tag, v.value)
    if isinstance(v, bytes | bytearray | memoryview):
        return ("x", bytes(v))
    if isinstance(v, decimal.Decimal):
        scale, unscaled = _decimal_parts(v)
        return ("D", decimal.Decimal(f"{unscaled}E-{scale}"))
    if isinstance(v, datetime):
        return ("T", _seconds(v))
    if isinstance(v, Mapping):
        return ("F", _to_table(v))
    if isinstance(v, list | tuple):
        return ("A", _to_array(v))
    if v is None:
        return ("V", None)
    raise _Bad(f"a {t.__name__} cannot be carried in an AMQP field table")


def _to_array(values: Iterable[Any]) -> tuple[Field, ...]:
    out = []
    for i, x in enumerate(values):
        try:
            out.append(_to_field(x))
        except _Bad as e:
            e.path.insert(0, f"[{i}]")
            raise
    return tuple(out)


def _typed_field(tag: str, v: Any) -> Field:
    if tag == "F":
        return ("F", _to_table(v))
    if tag == "A":
        return ("A", _to_array(v))
    if tag == "T" and isinstance(v, datetime):
        return ("T", _seconds(v))
    if tag == "D" and isinstance(v, decimal.Decimal):
        scale, unscaled = _decimal_parts(v)
        return ("D", decimal.Decimal(f"{unscaled}E-{scale}"))
    if tag == "f" and isinstance(v, float | int) and not isinstance(v, bool):
        try:
            return ("f", _f32(_pack_f32(v))[0])  # the float32 the wire will carry
        except OverflowError:
            raise _Bad(f"{v!r} is too large for a float32") from None
    if tag == "x" and isinstance(v, bytearray | memoryview):
        return ("x", bytes(v))
    return (tag, v)


def _seconds(v: datetime) -> int:
    if v.tzinfo is None:
        v = v.replace(tzinfo=UTC)
    secs = calendar.timegm(v.utctimetuple())
    if secs < 0:
        raise _Bad(f"timestamp {v.isoformat()} is before 1970: AMQP timestamps are unsigned")
    return secs


_T_MAX = 253402300799  # 9999-12-31T23:59:59Z, the last second a datetime holds


def to_python(table: FieldTable | None) -> dict[Any, Any]:
    """Plain Python values of a table (lossy: tags dropped, the last duplicate key wins).

    ``T`` becomes a UTC datetime when it is one (else the int), ``F`` a dict, ``A`` a list,
    a ``Float32Bits`` NaN a float NaN; everything else is its tree value.
    """
    if not table:
        return {}
    return {k: _py(f) for k, f in table}


def _py(field: Field) -> Any:
    tag, v = field
    if tag == "F":
        return to_python(v)
    if tag == "A":
        return [_py(x) for x in v]
    if tag == "T":
        return datetime.fromtimestamp(v, UTC) if v <= _T_MAX else v
    if tag == "t":
        return bool(v)
    if type(v) is Float32Bits:
        return float("nan")
    return v
