"""Typed AMQP header codec: every pika-decodable wire type round-trips byte-identically."""

from __future__ import annotations

import decimal
import json
import struct
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pika import data as amqp
from pika.compat import long

from bridge.errors import ProtocolError
from bridge.protocol.headers import decode_typed, encode_typed, render_queryable, typed_into

I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)
T_MAX = 253402300799


def wire_table(table: dict[Any, Any] | None) -> bytes:
    pieces: list[bytes] = []
    amqp.encode_table(pieces, table)
    return b"".join(pieces)


# ------------------------------------------------------------- wire-level generator
# A table is generated as AMQP *wire* fields, then decoded by pika: exactly what black sees.


def _w_short(raw: bytes) -> bytes:
    return struct.pack("B", len(raw)) + raw


def _w_value(kind: str, payload: Any) -> bytes:
    fixed = {"b": ">b", "B": ">B", "U": ">h", "u": ">H", "s": ">h", "I": ">i", "i": ">I"}
    if kind in fixed:
        return kind.encode() + struct.pack(fixed[kind], payload)
    if kind in "Ll":
        return kind.encode() + struct.pack(">q", payload)
    if kind == "f":
        return b"f" + struct.pack(">f", payload)
    if kind == "d":
        return b"d" + struct.pack(">d", payload)
    if kind == "t":
        return b"t" + struct.pack(">B", payload)
    if kind == "D":
        return b"D" + struct.pack(">Bi", *payload)
    if kind in "Sx":
        return kind.encode() + struct.pack(">I", len(payload)) + payload
    if kind == "T":
        return b"T" + struct.pack(">Q", payload)
    if kind == "V":
        return b"V"
    if kind == "A":
        body = b"".join(_w_value(k, p) for k, p in payload)
        return b"A" + struct.pack(">I", len(body)) + body
    if kind == "F":
        return b"F" + _w_table(payload)
    raise AssertionError(kind)


def _w_table(fields: list[tuple[bytes, tuple[str, Any]]]) -> bytes:
    body = b"".join(_w_short(k) + _w_value(*v) for k, v in fields)
    return struct.pack(">I", len(body)) + body


_f32 = st.floats(min_value=-(2.0**60), max_value=2.0**60, width=32, allow_nan=False)
_f64 = st.floats(min_value=-9e18, max_value=9e18, allow_nan=False)
wire_scalars = st.one_of(
    st.tuples(st.just("t"), st.integers(0, 1)),
    st.tuples(st.just("b"), st.integers(-128, 127)),
    st.tuples(st.just("B"), st.integers(0, 255)),
    st.tuples(st.just("U"), st.integers(-(2**15), 2**15 - 1)),
    st.tuples(st.just("u"), st.integers(0, 2**16 - 1)),
    st.tuples(st.just("s"), st.integers(-(2**15), 2**15 - 1)),
    st.tuples(st.just("I"), st.integers(*I32) | st.sampled_from(I32)),
    st.tuples(st.just("i"), st.integers(0, 2**32 - 1) | st.just(2**32 - 1)),
    st.tuples(st.sampled_from("Ll"), st.integers(*I64) | st.sampled_from([*I64, 0, 1, -1])),
    st.tuples(st.just("f"), _f32),
    st.tuples(st.just("d"), _f64),
    st.tuples(
        st.just("D"),
        st.tuples(
            st.integers(0, 255) | st.integers(0, 12), st.integers(*I32) | st.sampled_from(I32)
        ),
    ),
    st.tuples(st.just("S"), st.binary(max_size=40) | st.text(max_size=20).map(str.encode)),
    st.tuples(st.just("x"), st.binary(max_size=40)),
    st.tuples(st.just("T"), st.integers(0, T_MAX) | st.sampled_from([0, T_MAX])),
    st.just(("V", None)),
)
wire_keys = st.text(max_size=12).map(str.encode).filter(lambda b: len(b) <= 255) | st.binary(
    min_size=1, max_size=8
)


def _unique(fields: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
    seen: dict[bytes, Any] = {}
    for k, v in fields:
        seen.setdefault(k, v)  # pika keeps the last duplicate; generate unique keys
    return list(seen.items())


wire_values = st.recursive(
    wire_scalars,
    lambda inner: st.one_of(
        st.tuples(st.just("A"), st.lists(inner, max_size=4)),
        st.tuples(st.just("F"), st.lists(st.tuples(wire_keys, inner), max_size=4).map(_unique)),
    ),
    max_leaves=12,
)
wire_tables = st.lists(st.tuples(wire_keys, wire_values), max_size=8).map(_unique)


def pika_decode(fields: list[tuple[bytes, tuple[str, Any]]]) -> dict[Any, Any]:
    raw = _w_table(fields)
    table, end = amqp.decode_table(raw, 0)
    assert end == len(raw)
    return table


def same_types(a: Any, b: Any) -> None:
    """Deep equality including Python types (pika chooses the wire type from them).

    Only ``int`` vs ``pika.compat.long`` outside int32 may differ: pika writes both as 'l'.
    """
    if type(a) in (int, long) and type(b) in (int, long) and not I32[0] <= a <= I32[1]:
        assert a == b
        return
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)  # same keys, same order
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert type(ka) is type(kb) and ka == kb
            same_types(va, vb)
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same_types(x, y)
    elif isinstance(a, decimal.Decimal):
        assert str(a) == str(b)
    elif isinstance(a, datetime):
        assert a == b and a.utcoffset() == b.utcoffset()
    else:
        assert a == b


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(wire_tables)
def test_wire_tables_round_trip_byte_identically(fields: list[Any]) -> None:
    table = pika_decode(fields)
    text = encode_typed(table)
    assert text is not None and text.isascii()
    back = decode_typed(text)
    assert back is not None
    same_types(table, back)
    assert wire_table(back) == wire_table(table)
    assert encode_typed(back) == text  # canonical: a fixed point
    render_queryable(table)  # never raises on anything pika can decode


# ------------------------------------------------------------- Python-value generator
# What a producer hands pika: the codec must give back values pika encodes alike.


def _dec(t: tuple[int, int]) -> decimal.Decimal:
    raw, exp = t
    return decimal.Decimal(raw).scaleb(exp)


py_scalars = st.one_of(
    st.text(max_size=20),
    st.binary(max_size=20),
    st.booleans(),
    st.integers(*I64),
    st.sampled_from([*I32, *I64, I32[0] - 1, I32[1] + 1, 0]),
    st.integers(*I64).map(long),
    st.tuples(st.integers(-99999, 99999), st.integers(-20, 3)).map(_dec),
    st.sampled_from([decimal.Decimal("1.50"), decimal.Decimal("0.00"), decimal.Decimal("-7E+2")]),
    st.integers(0, T_MAX).map(lambda s: datetime.fromtimestamp(s, UTC)),
    st.integers(0, 2**31).map(
        lambda s: datetime.fromtimestamp(s, timezone(timedelta(hours=5, minutes=30)))
    ),
    st.none(),
)
py_values = st.recursive(
    py_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
py_tables = st.dictionaries(st.text(max_size=10), py_values, max_size=8)


@settings(max_examples=300)
@given(py_tables)
def test_python_tables_round_trip_byte_identically(table: dict[str, Any]) -> None:
    text = encode_typed(table)
    back = decode_typed(text)
    assert back is not None
    assert wire_table(back) == wire_table(table)
    # and what red publishes decodes on the far side to what black's consumer saw
    assert amqp.decode_table(wire_table(back), 0)[0] == amqp.decode_table(wire_table(table), 0)[0]


@given(py_tables)
def test_typed_into_equals_encode_plus_render(table: dict[str, Any]) -> None:
    keys: list[str] = ["sentinel"]
    values: list[str | None] = ["sentinel"]
    text = typed_into(table, keys, values)
    assert text == encode_typed(table)
    assert dict(zip(keys[1:], values[1:], strict=True)) == render_queryable(table)
    assert len(keys) == 1 + len(table)


def test_tags_and_canonical_text() -> None:
    table = {
        "b": 1,
        "a": "x",
        "big": 2**40,
        "L": long(3),
        "d": decimal.Decimal("1.50"),
        "t": datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
        "raw": b"\x00\xff",
        "f": False,
        "n": None,
        "arr": [1, [True]],
        "tab": {"q": decimal.Decimal("-5E-20")},
    }
    text = encode_typed(table)
    assert text == (
        '{"b":["I",1],"a":["S","x"],"big":["l",1099511627776],"L":["l",3],"d":["D","1.50"],'
        '"t":["T",1704164645],"raw":["x","AP8="],"f":["t",false],"n":["V",null],'
        '"arr":["A",[["I",1],["A",[["t",true]]]]],"tab":["F",{"q":["D","-5E-20"]}]}'
    )
    back = decode_typed(text)
    assert back is not None
    assert type(back["L"]) is long and type(back["big"]) is long and type(back["b"]) is int
    assert back["t"].tzinfo is not None and back["t"].utcoffset() == timedelta(0)
    assert str(back["d"]) == "1.50"
    assert encode_typed(None) is None and decode_typed(None) is None
    assert encode_typed({}) == "{}" and decode_typed("{}") == {}


def test_int_width_boundaries_follow_pika() -> None:
    text = encode_typed({"a": I32[1], "b": I32[1] + 1, "c": I32[0], "d": I32[0] - 1, "e": I64[1]})
    assert text == '{"a":["I",2147483647],"b":["l",2147483648],"c":["I",-2147483648],' + (
        '"d":["l",-2147483649],"e":["l",9223372036854775807]}'
    )


def test_key_order_is_kept_for_byte_identity() -> None:
    table = {"zeta": 1, "alpha": 2}
    back = decode_typed(encode_typed(table))
    assert back is not None and list(back) == ["zeta", "alpha"]
    assert wire_table(back) == wire_table(table)


def test_non_utf8_key_and_string_survive() -> None:
    raw = _w_table([(b"\xff\xfek", ("S", b"\xc3\x28")), (b"ok", ("S", "é".encode()))])
    table = amqp.decode_table(raw, 0)[0]
    assert b"\xff\xfek" in table and table[b"\xff\xfek"] == b"\xc3\x28"
    back = decode_typed(encode_typed(table))
    assert back == table
    assert wire_table(back) == wire_table(table)


@pytest.mark.parametrize(
    "value",
    [
        1.5,
        float("nan"),
        decimal.Decimal("NaN"),
        decimal.Decimal("Infinity"),
        decimal.Decimal("1E+300"),
        decimal.Decimal("1.23456789012345"),
        2**63,
        -(2**63) - 1,
        datetime(1960, 1, 1, tzinfo=UTC),
        (1, 2),
        {1, 2},
        bytearray(b"x"),
        object(),
        "\udc80",
    ],
)
def test_values_pika_cannot_encode_are_refused(value: Any) -> None:
    with pytest.raises(ProtocolError):
        encode_typed({"k": value})


@pytest.mark.parametrize("key", ["k" * 256, "é" * 128, b"k" * 256, 7, "\ud800"])
def test_bad_keys_are_refused(key: Any) -> None:
    with pytest.raises(ProtocolError):
        encode_typed({key: 1})


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        "null",
        "1",
        "{",
        '{"a":1}',
        '{"a":["S"]}',
        '{"a":["S","x","y"]}',
        '{"a":["Q",1]}',
        '{"a":["S",1]}',
        '{"a":["I",2147483648]}',
        '{"a":["I",true]}',
        '{"a":["I",1.0]}',
        '{"a":["l",9223372036854775808]}',
        '{"a":["t",1]}',
        '{"a":["x","not base64!"]}',
        '{"a":["x","AP8"]}',
        '{"a":["D","1_000"]}',
        '{"a":["D","NaN"]}',
        '{"a":["D","abc"]}',
        '{"a":["D","1E+300"]}',
        '{"a":["T",-1]}',
        '{"a":["T",253402300800]}',
        '{"a":["T",NaN]}',
        '{"a":["V",0]}',
        '{"a":["F",[]]}',
        '{"a":["A",{}]}',
        '{"a":["S","\\ud800"]}',
        '{"\\ud800":["V",null]}',
        '{"a":["V",null],"a":["V",null]}',
        '{"' + "k" * 256 + '":["V",null]}',
        '{"a":' + '["A",[' * 5000 + "]]" * 5000 + "}",
    ],
)
def test_malformed_typed_json_is_a_protocol_error(text: str) -> None:
    with pytest.raises(ProtocolError):
        decode_typed(text)


json_docs = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.sampled_from("SxtIlDTFAV"),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=10,
)


@given(json_docs)
def test_arbitrary_json_decodes_or_raises_protocol_error(doc: Any) -> None:
    try:
        decode_typed(json.dumps(doc))
    except ProtocolError:
        pass


@given(st.binary(max_size=64) | st.text(max_size=64))
def test_garbage_decodes_or_raises_protocol_error(blob: bytes | str) -> None:
    try:
        decode_typed(blob)
    except ProtocolError:
        pass


def test_render_queryable() -> None:
    table = {
        "s": "text",
        "b": b"\x00\xff",
        "yes": True,
        "no": False,
        "i": -5,
        "L": long(2**40),
        "d": decimal.Decimal("1.50"),
        "t": datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
        "n": None,
        "tab": {"x": 1, "y": [b"a", None, "ü"]},
        "arr": [1, {"k": True}],
        b"\xffraw": "v",
    }
    assert render_queryable(table) == {
        "s": "text",
        "b": "AP8=",
        "yes": "true",
        "no": "false",
        "i": "-5",
        "L": "1099511627776",
        "d": "1.50",
        "t": "2024-01-02T03:04:05Z",
        "n": None,
        "tab": '{"x":"1","y":["YQ==",null,"ü"]}',
        "arr": '["1",{"k":"true"}]',
        "\\xffraw": "v",
    }
    assert render_queryable(None) == {} and render_queryable({}) == {}
