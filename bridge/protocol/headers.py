"""Protocol core (both sides): AMQP field tables as canonical typed JSON and as queryable text.

Tables are the typed trees of ``bridge.protocol.properties`` (``((key, (tag, value)), ...)``).

Typed JSON (``headers_typed`` and ``exchange_arguments`` columns) keeps every wire detail, so
``typed_json_to_headers(headers_to_typed_json(t))`` encodes to the same bytes as ``t``::

    table   = [ [key, value], ... ]                 wire order, duplicate keys kept
    key     = "text"                                 the key's bytes are UTF-8
            | {"base64": "<b64>"}                    they are not
    value   = [tag, payload]                         tag = the wire type letter
      t  true | false | 2..255                       octet 1 / 0 / any other (true) octet
      b B s u U I i l L  JSON integer               in the tag's range (U = int16, L = int64)
      T  JSON integer 0 .. 2**64-1                   seconds
      f d  "<float text>"                            see below
      D  [scale, unscaled]                           0..255, int32: value = unscaled / 10**scale
      S  "text" | {"base64": "<b64>"}                long string: UTF-8 text, or raw bytes
      x  "<b64>"                                     byte array
      A  [value, ...]
      F  table
      V  null

Float text: ``"Infinity"``, ``"-Infinity"``, ``"NaN:<hex bits>"`` (8 lowercase hex digits for
``f``, 16 for ``d``: the exact bit pattern, sign and payload), or a JSON-number-shaped decimal
text that, correctly rounded to the tag's width, gives the value; black writes the shortest
such text (Python ``repr`` of the double for ``d``; for ``f`` the shortest text that rounds to
the same float32: ``1.1``, not ``1.100000023841858``). ``-0.0`` is ``"-0.0"``.
Base64 is standard with padding. The text is ASCII (``\\uXXXX`` escapes), has no spaces and no
JSON floats; the writer is canonical and the reader strict (ProtocolError on anything else).

``render_queryable``: flat text per top-level key for SQL (lossy, never parsed back).
``encode_typed`` / ``decode_typed``: the same typed JSON from / to plain Python values (exchange
arguments as the management API reports them).
"""

from __future__ import annotations

import base64
import binascii
import decimal
import json
import re
import struct
from collections.abc import Mapping
from datetime import UTC, datetime
from json.encoder import encode_basestring_ascii as _ascii
from typing import Any

from bridge.errors import ProtocolError
from bridge.protocol.properties import (
    Field,
    FieldTable,
    Float32Bits,
    decimal_parts,
    decode_table,
    field_table,
    to_python,
)

__all__ = [
    "headers_to_typed_json",
    "typed_json_to_headers",
    "render_queryable",
    "float_text",
    "table_columns",
    "encode_typed",
    "decode_typed",
    "TAGS",
]

TAGS = frozenset("tbBsuUIilLfdDSxATFV")

_RANGES = {
    "b": (-(2**7), 2**7 - 1),
    "B": (0, 2**8 - 1),
    "s": (-(2**15), 2**15 - 1),
    "U": (-(2**15), 2**15 - 1),
    "u": (0, 2**16 - 1),
    "I": (-(2**31), 2**31 - 1),
    "i": (0, 2**32 - 1),
    "l": (-(2**63), 2**63 - 1),
    "L": (-(2**63), 2**63 - 1),
    "T": (0, 2**64 - 1),
}
_T_MAX = 253402300799  # 9999-12-31T23:59:59Z, the last second a datetime holds
_pack_f, _unpack_f = struct.Struct(">f").pack, struct.Struct(">f").unpack
_pack_d, _unpack_d = struct.Struct(">d").pack, struct.Struct(">d").unpack
_pack_I, _pack_Q = struct.Struct(">I").pack, struct.Struct(">Q").pack
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NAN = {"f": re.compile(r"NaN:[0-9a-f]{8}"), "d": re.compile(r"NaN:[0-9a-f]{16}")}
_INF = float("inf")


class _Bad(Exception):
    """Internal: a malformed value; ``path`` grows as the error unwinds."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg
        self.path: list[str] = []


def _fail(e: _Bad, what: str) -> ProtocolError:
    where = "".join(e.path)
    return ProtocolError(f"{what}{' at ' + where if where else ''}: {e.msg}")


# ---------------------------------------------------------------------------- write


def headers_to_typed_json(table: FieldTable) -> str:
    """The canonical typed JSON of a field table (ProtocolError if it is not a valid tree)."""
    try:
        return _w_table(table)
    except _Bad as e:
        raise _fail(e, "field table") from None
    except RecursionError:
        raise ProtocolError("field table is nested too deeply") from None
    except (TypeError, ValueError) as e:
        raise ProtocolError(
            f"field table is not a tuple of (key, (tag, value)) pairs: {e}"
        ) from None


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _w_text_or_bytes(v: bytes) -> str:
    """Bytes as typed JSON writes them: text when they are UTF-8 (same wire bytes)."""
    try:
        return _ascii(v.decode())
    except UnicodeDecodeError:
        return '{"base64":"' + _b64(v) + '"}'


def _w_key(k: Any) -> str:
    if type(k) is str:
        return _ascii(k)
    if isinstance(k, bytes):
        return _w_text_or_bytes(k)
    raise _Bad(f"key {k!r:.40} is not str or bytes")


def _w_table(table: Any) -> str:
    parts = []
    for k, f in table:
        try:
            parts.append("[" + _w_key(k) + "," + _w_value(f) + "]")
        except _Bad as e:
            e.path.insert(0, "/" + (k if isinstance(k, str) else repr(k)))
            raise
    return "[" + ",".join(parts) + "]"


def _w_value(field: Field) -> str:
    tag, v = field
    if tag == "S":
        if type(v) is str:
            return '["S",' + _ascii(v) + "]"
        if isinstance(v, bytes):
            return '["S",' + _w_text_or_bytes(v) + "]"
        raise _Bad(f"'S' value {v!r:.40} is not str or bytes")
    r = _RANGES.get(tag)
    if r is not None:
        if type(v) is not int or not r[0] <= v <= r[1]:
            raise _Bad(f"{tag!r} value {v!r:.40} is not an int in [{r[0]}, {r[1]}]")
        return f'["{tag}",{v}]'
    if tag == "t":
        if v is True:
            return '["t",true]'
        if v is False:
            return '["t",false]'
        if type(v) is int and 2 <= v <= 255:
            return f'["t",{v}]'
        raise _Bad(f"'t' value {v!r:.40} is not a bool or an octet 2..255")
    if tag == "F":
        return '["F",' + _w_table(v) + "]"
    if tag == "A":
        items = []
        for i, x in enumerate(v):
            try:
                items.append(_w_value(x))
            except _Bad as e:
                e.path.insert(0, f"[{i}]")
                raise
        return '["A",[' + ",".join(items) + "]]"
    if tag == "f" or tag == "d":
        return f'["{tag}","{_float_text(tag, v)}"]'
    if tag == "x":
        if not isinstance(v, bytes):
            raise _Bad(f"'x' value {v!r:.40} is not bytes")
        return '["x","' + _b64(v) + '"]'
    if tag == "D":
        try:
            scale, unscaled = decimal_parts(v)
        except ProtocolError as e:
            raise _Bad(str(e)) from None
        return f'["D",[{scale},{unscaled}]]'
    if tag == "V":
        if v is not None:
            raise _Bad(f"'V' value {v!r:.40} is not None")
        return '["V",null]'
    raise _Bad(f"unknown field value type {tag!r:.10}")


def float_text(tag: str, v: float | Float32Bits) -> str:
    """The typed-JSON text of a float of tag ``f`` or ``d`` (see the module docstring)."""
    try:
        return _float_text(tag, v)
    except _Bad as e:
        raise ProtocolError(e.msg) from None


def _float_text(tag: str, v: Any) -> str:
    if type(v) is Float32Bits:
        if tag != "f":
            raise _Bad("Float32Bits is a value of tag 'f'")
        return f"NaN:{v.bits & 0xFFFFFFFF:08x}"
    if type(v) is not float:
        if type(v) is not int:
            raise _Bad(f"{tag!r} value {v!r:.40} is not a float")
        v = float(v)
    if v != v:
        if tag == "f":
            return f"NaN:{_pack_f(v).hex()}"
        return f"NaN:{_pack_d(v).hex()}"
    if v == _INF or v == -_INF:
        return "Infinity" if v > 0 else "-Infinity"
    if tag == "d":
        return repr(v)
    try:
        bits = _pack_f(v)
    except OverflowError:
        raise _Bad(f"{v!r} is too large for a float32") from None
    for digits in range(1, 10):
        candidate = float(f"{v:.{digits}g}")
        try:
            if _pack_f(candidate) == bits:
                return repr(candidate)
        except OverflowError:  # rounded past the largest float32: more digits
            continue
    return repr(_unpack_f(bits)[0])  # pragma: no cover - 9 digits always identify a float32


# ---------------------------------------------------------------------------- read


def _reject(text: str) -> Any:
    raise ValueError(f"JSON number {text[:30]} is not allowed here (floats are strings)")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return d


def typed_json_to_headers(text: str | bytes) -> FieldTable:
    """The field table typed JSON describes (strict: ProtocolError for anything malformed)."""
    try:
        doc = json.loads(
            text, object_pairs_hook=_object, parse_float=_reject, parse_constant=_reject
        )
    except (ValueError, TypeError, RecursionError) as e:
        raise ProtocolError(f"typed JSON is malformed: {e}") from None
    try:
        return _r_table(doc)
    except _Bad as e:
        raise _fail(e, "typed JSON") from None
    except RecursionError:
        raise ProtocolError("typed JSON is nested too deeply") from None


def _r_bytes(p: Any) -> bytes:
    if type(p) is not str:
        raise _Bad(f"{p!r:.40} is not base64 text")
    try:
        b = base64.b64decode(p, validate=True)
    except (binascii.Error, ValueError):
        raise _Bad(f"{p[:40]!r} is not base64") from None
    if _b64(b) != p:
        raise _Bad(f"{p[:40]!r} is not canonical base64")
    return b


def _r_text_or_bytes(p: Any, what: str) -> str | bytes:
    if type(p) is str:
        try:
            p.encode()
        except UnicodeEncodeError:
            raise _Bad(f"{what} holds a lone surrogate") from None
        return p
    if type(p) is dict and len(p) == 1 and "base64" in p:
        b = _r_bytes(p["base64"])
        try:
            b.decode()
        except UnicodeDecodeError:
            return b
        raise _Bad(f"{what} bytes are UTF-8: they must be written as text")
    raise _Bad(f'{what} must be text or {{"base64": ...}}, not {p!r:.40}')


def _r_table(doc: Any) -> FieldTable:
    if type(doc) is not list:
        raise _Bad(f"a table must be a JSON array of [key, value] pairs, not {doc!r:.40}")
    out = []
    for i, pair in enumerate(doc):
        if type(pair) is not list or len(pair) != 2:
            raise _Bad(f"entry {i} is not a [key, value] pair")
        key = _r_text_or_bytes(pair[0], f"key of entry {i}")
        if len(key.encode() if type(key) is str else key) > 255:
            raise _Bad(f"key of entry {i} is longer than 255 bytes")
        try:
            out.append((key, _r_value(pair[1])))
        except _Bad as e:
            e.path.insert(0, "/" + (key if type(key) is str else repr(key)))
            raise
    return tuple(out)


def _r_value(item: Any) -> Field:
    if type(item) is not list or len(item) != 2 or type(item[0]) is not str:
        raise _Bad(f"{item!r:.60} is not a [tag, payload] pair")
    tag, p = item
    if tag == "S":
        return ("S", _r_text_or_bytes(p, "'S' value"))
    r = _RANGES.get(tag)
    if r is not None:
        if type(p) is not int or not r[0] <= p <= r[1]:
            raise _Bad(f"{tag!r} payload {p!r:.40} is not an integer in [{r[0]}, {r[1]}]")
        return (tag, p)
    if tag == "t":
        if type(p) is bool or (type(p) is int and 2 <= p <= 255):
            return ("t", p)
        raise _Bad(f"'t' payload {p!r:.40} is not true, false or an integer 2..255")
    if tag == "F":
        return ("F", _r_table(p))
    if tag == "A":
        if type(p) is not list:
            raise _Bad(f"'A' payload {p!r:.40} is not a JSON array")
        out = []
        for i, x in enumerate(p):
            try:
                out.append(_r_value(x))
            except _Bad as e:
                e.path.insert(0, f"[{i}]")
                raise
        return ("A", tuple(out))
    if tag == "f" or tag == "d":
        return (tag, _r_float(tag, p))
    if tag == "x":
        return ("x", _r_bytes(p))
    if tag == "D":
        if (
            type(p) is list
            and len(p) == 2
            and type(p[0]) is int
            and type(p[1]) is int
            and 0 <= p[0] <= 255
            and -(2**31) <= p[1] < 2**31
        ):
            return ("D", decimal.Decimal(f"{p[1]}E-{p[0]}"))
        raise _Bad(f"'D' payload {p!r:.40} is not [scale 0..255, int32]")
    if tag == "V":
        if p is not None:
            raise _Bad(f"'V' payload {p!r:.40} is not null")
        return ("V", None)
    raise _Bad(f"unknown tag {tag!r:.10}")


def _r_float(tag: str, p: Any) -> float | Float32Bits:
    if type(p) is not str:
        raise _Bad(f"{tag!r} payload {p!r:.40} is not float text")
    if p == "Infinity":
        return _INF
    if p == "-Infinity":
        return -_INF
    if _NAN[tag].fullmatch(p):
        bits = int(p[4:], 16)
        if tag == "d":
            v = _unpack_d(_pack_Q(bits))[0]
            if v == v:
                raise _Bad(f"{p!r} is not a NaN bit pattern")
            return float(v)
        raw = _pack_I(bits)
        f = _unpack_f(raw)[0]
        if f == f:
            raise _Bad(f"{p!r} is not a NaN bit pattern")
        return f if _pack_f(f) == raw else Float32Bits(bits)
    if not _NUMBER.fullmatch(p):
        raise _Bad(f"{tag!r} payload {p[:40]!r} is not float text")
    v = float(p)
    if v == _INF or v == -_INF:
        raise _Bad(f"{tag!r} payload {p[:40]!r} overflows a double")
    if tag == "f":
        try:
            return float(_unpack_f(_pack_f(v))[0])
        except OverflowError:
            raise _Bad(f"'f' payload {p[:40]!r} overflows a float32") from None
    return v


# ---------------------------------------------------------------------------- render


def render_queryable(table: FieldTable | None) -> dict[str, str | None]:
    """Flat ``{key: text}`` of a table's top level, for SQL and humans (lossy, never parsed).

    Keys and ``S`` values as text (U+FFFD where not UTF-8; the first of duplicate keys wins),
    ints and decimals as decimal text (``"1.50"``), bools ``"true"``/``"false"``, floats as
    their typed-JSON text but NaN as ``"NaN"``, timestamps RFC 3339 (``...Z``; seconds past
    year 9999 as an integer), byte arrays base64, ``V`` null, tables and arrays compact JSON
    of their rendered values.
    """
    out: dict[str, str | None] = {}
    if not table:
        return out
    for k, f in table:
        key = k if isinstance(k, str) else k.decode("utf-8", "replace")
        if key not in out:
            r = _render(f)
            out[key] = r if r is None or type(r) is str else _compact(r)
    return out


_compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _render(field: Field) -> Any:
    tag, v = field
    if tag == "S":
        return v if type(v) is str else v.decode("utf-8", "replace")
    if tag in _RANGES:
        if tag == "T":
            if v <= _T_MAX:
                return datetime.fromtimestamp(v, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return str(v)
    if tag == "t":
        return "true" if v else "false"
    if tag == "f" or tag == "d":
        text = _float_text(tag, v)
        return "NaN" if text.startswith("NaN") else text
    if tag == "x":
        return _b64(v)
    if tag == "D":
        return str(v)
    if tag == "V":
        return None
    if tag == "A":
        return [_render(x) for x in v]
    if tag == "F":
        nested: dict[str, Any] = {}
        for k, f in v:
            key = k if type(k) is str else k.decode("utf-8", "replace")
            if key not in nested:
                nested[key] = _render(f)
        return nested
    return repr(v)  # pragma: no cover - trees from the codec have known tags


# ---------------------------------------------------------------------------- from the wire

_FLAT_INTS = {
    73: ("I", struct.Struct(">i").unpack_from, 4),
    108: ("l", struct.Struct(">q").unpack_from, 8),
    98: ("b", struct.Struct(">b").unpack_from, 1),
    66: ("B", struct.Struct(">B").unpack_from, 1),
    115: ("s", struct.Struct(">h").unpack_from, 2),
    117: ("u", struct.Struct(">H").unpack_from, 2),
    105: ("i", struct.Struct(">I").unpack_from, 4),
    85: ("U", struct.Struct(">h").unpack_from, 2),
    76: ("L", struct.Struct(">q").unpack_from, 8),
}
_u32 = struct.Struct(">I").unpack_from


def table_columns(table_bytes: bytes) -> tuple[str, list[str], list[str | None]]:
    """Typed JSON and the rendered (keys, values) of a wire table (uint32 length + pairs).

    Equal to ``headers_to_typed_json(t)`` and ``render_queryable(t)`` of
    ``t = decode_table(table_bytes)``, with a fast path straight from the bytes for flat
    tables of UTF-8 long strings, integers and canonical booleans (the common headers).
    ProtocolError when the bytes do not decode.
    """
    fast = _flat_columns(table_bytes)
    if fast is not None:
        return fast
    table = decode_table(table_bytes)
    rendered = render_queryable(table)
    return headers_to_typed_json(table), list(rendered), list(rendered.values())


def _flat_columns(tb: bytes) -> tuple[str, list[str], list[str | None]] | None:
    """``table_columns`` of a flat table of common types, None for anything else."""
    try:
        return _flat(tb)
    except (IndexError, struct.error, UnicodeDecodeError):
        return None


def _flat(tb: bytes) -> tuple[str, list[str], list[str | None]] | None:
    n = len(tb)
    if n < 4 or 4 + _u32(tb, 0)[0] != n:
        return None
    parts: list[str] = []
    keys: list[str] = []
    values: list[str | None] = []
    off = 4
    while off < n:
        kend = off + 1 + tb[off]
        key = tb[off + 1 : kend].decode()
        tag = tb[kend]
        off = kend + 1
        if tag == 83:  # S
            vend = off + 4 + _u32(tb, off)[0]
            if vend > n:
                return None
            text = tb[off + 4 : vend].decode()
            parts.append(f'[{_ascii(key)},["S",{_ascii(text)}]]')
            values.append(text)
            off = vend
        elif tag == 116:  # t
            octet = tb[off]
            if octet > 1:
                return None
            parts.append(f'[{_ascii(key)},["t",{"true" if octet else "false"}]]')
            values.append("true" if octet else "false")
            off += 1
        else:
            spec = _FLAT_INTS.get(tag)
            if spec is None:
                return None
            v = spec[1](tb, off)[0]
            parts.append(f'[{_ascii(key)},["{spec[0]}",{v}]]')
            values.append(str(v))
            off += spec[2]
        keys.append(key)
    if off != n or len(set(keys)) != len(keys):
        return None
    return "[" + ",".join(parts) + "]", keys, values


# ---------------------------------------------------------------------------- plain values


def encode_typed(values: Mapping[Any, Any] | None) -> str | None:
    """Typed JSON of plain Python values (``field_table`` tags); None for None or empty."""
    if not values:
        return None
    return headers_to_typed_json(field_table(values))


def decode_typed(text: str | bytes | None) -> dict[Any, Any] | None:
    """Plain Python values of typed JSON (``to_python``: lossy); None for None."""
    if text is None:
        return None
    return to_python(typed_json_to_headers(text))
