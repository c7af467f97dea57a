"""Typed JSON and queryable text of AMQP field tables: exact, canonical, strict."""

from __future__ import annotations

import decimal
import json
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.errors import ProtocolError
from bridge.protocol import headers as headers_module
from bridge.protocol.headers import (
    TAGS,
    decode_typed,
    encode_typed,
    float_text,
    headers_to_typed_json,
    render_queryable,
    table_columns,
    typed_json_to_headers,
)
from bridge.protocol.properties import (
    Float32,
    Float32Bits,
    Int8,
    Timestamp,
    Typed,
    UInt16,
    decode_table,
    encode_table,
    field_table,
)
from tests.unit.test_protocol_properties import canon, keys, tables, w_long, w_short, w_table


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(tables)
def test_typed_json_round_trips_every_table_byte_for_byte(table: Any) -> None:
    text = headers_to_typed_json(table)
    # canonical: exactly what a compact, ASCII-only JSON writer prints of the same document
    assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=True) == text
    back = typed_json_to_headers(text)
    assert canon(back) == canon(table)
    assert encode_table(back) == encode_table(table)
    assert headers_to_typed_json(back) == text  # canonical: a fixed point
    render_queryable(table)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(tables)
def test_table_columns_equal_the_generic_path(table: Any) -> None:
    raw = w_table(table)
    rendered = render_queryable(decode_table(raw))
    assert table_columns(raw) == (
        headers_to_typed_json(decode_table(raw)),
        list(rendered),
        list(rendered.values()),
    )


flat_values = st.one_of(
    st.tuples(st.just("S"), st.text(max_size=12)),
    st.tuples(st.sampled_from("bB"), st.integers(0, 127)),
    st.tuples(st.sampled_from("sUu"), st.integers(0, 2**15 - 1)),
    st.tuples(st.sampled_from("Ii"), st.integers(0, 2**31 - 1)),
    st.tuples(st.sampled_from("lL"), st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.just("t"), st.booleans()),
)
flat_tables = st.lists(
    st.tuples(st.text(max_size=8), flat_values), max_size=6, unique_by=lambda p: p[0]
)


@settings(max_examples=200)
@given(flat_tables)
def test_flat_tables_take_the_fast_path_with_the_same_result(pairs: list[Any]) -> None:
    table = tuple(pairs)
    raw = w_table(table)
    fast = headers_module._flat_columns(raw)
    assert fast is not None  # the case under test happened
    rendered = render_queryable(table)
    assert fast == (headers_to_typed_json(table), list(rendered), list(rendered.values()))


def test_fast_path_declines_what_it_does_not_handle() -> None:
    declined: list[Any] = [
        (("a", ("S", "x")), ("a", ("S", "y"))),  # duplicate key: render keeps the first
        ((b"\xff", ("I", 1)),),
        (("s", ("S", b"\xff")),),
        (("t", ("t", 2)),),
        (("f", ("d", 1.0)),),
        (("n", ("F", ())),),
    ]
    for table in declined:
        raw = w_table(table)
        assert headers_module._flat_columns(raw) is None
        assert table_columns(raw)[0] == headers_to_typed_json(table)
    for bad in [b"", b"\x00\x00\x00\x05ab", w_long(w_short("k") + b"S\x00\x00\x00\x09ab")]:
        with pytest.raises(ProtocolError):
            table_columns(bad)


def test_every_tag_has_a_documented_text() -> None:
    table = (
        ("t", ("t", True)),
        ("t2", ("t", 2)),
        ("b", ("b", -128)),
        ("B", ("B", 255)),
        ("s", ("s", -32768)),
        ("U", ("U", 1)),
        ("u", ("u", 65535)),
        ("I", ("I", -1)),
        ("i", ("i", 2**32 - 1)),
        ("l", ("l", -(2**63))),
        ("L", ("L", 2**63 - 1)),
        ("T", ("T", 2**64 - 1)),
        ("f", ("f", struct.unpack(">f", struct.pack(">f", 1.1))[0])),
        ("d", ("d", -0.0)),
        ("D", ("D", decimal.Decimal("1.50"))),
        ("S", ("S", "é")),
        ("Sb", ("S", b"\xff")),
        ("x", ("x", b"\x00\xff")),
        ("A", ("A", (("V", None),))),
        ("F", ("F", ((b"\xfe", ("I", 1)),))),
        ("V", ("V", None)),
    )
    assert {f[0] for _, f in table} == TAGS
    assert headers_to_typed_json(table) == (
        '[["t",["t",true]],["t2",["t",2]],["b",["b",-128]],["B",["B",255]],'
        '["s",["s",-32768]],["U",["U",1]],["u",["u",65535]],["I",["I",-1]],'
        '["i",["i",4294967295]],["l",["l",-9223372036854775808]],'
        '["L",["L",9223372036854775807]],["T",["T",18446744073709551615]],'
        '["f",["f","1.1"]],["d",["d","-0.0"]],["D",["D",[2,150]]],["S",["S","\\u00e9"]],'
        '["Sb",["S",{"base64":"/w=="}]],["x",["x","AP8="]],["A",["A",[["V",null]]]],'
        '["F",["F",[[{"base64":"/g=="},["I",1]]]]],["V",["V",null]]]'
    )


@pytest.mark.parametrize(
    ("tag", "value", "text"),
    [
        ("f", float("inf"), "Infinity"),
        ("d", float("-inf"), "-Infinity"),
        ("f", float("nan"), "NaN:7fc00000"),
        (
            "d",
            struct.unpack(">d", struct.pack(">Q", 0xFFF0000000000001))[0],
            "NaN:fff0000000000001",
        ),
        ("f", Float32Bits(0x7F800001), "NaN:7f800001"),
        ("f", 16777216.0, "16777216.0"),
        ("f", struct.unpack(">f", struct.pack(">f", 3.4028234663852886e38))[0], "3.4028235e+38"),
        ("f", 1e-45, "1e-45"),
        ("d", 0.1, "0.1"),
        ("d", 5e-324, "5e-324"),
        ("d", 1e300, "1e+300"),
        ("f", 0.5, "0.5"),
        ("d", 3, "3.0"),
    ],
)
def test_float_text(tag: str, value: Any, text: str) -> None:
    assert float_text(tag, value) == text
    field = typed_json_to_headers(f'[["k",["{tag}","{text}"]]]')[0][1]
    assert encode_table((("k", field),)) == encode_table((("k", (tag, value)),))


@pytest.mark.parametrize("text", ["1", "1.10000002", "0.1e1", "-0", "1E2"])
def test_float_reader_accepts_any_number_text_rounding_to_the_width(text: str) -> None:
    ((_, (tag, v)),) = typed_json_to_headers(f'[["k",["f","{text}"]]]')
    assert tag == "f" and v == struct.unpack(">f", struct.pack(">f", float(text)))[0]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{}",
        "null",
        "[1]",
        '[["k"]]',
        '[["k",["S"]]]',
        '[["k",["S","x","y"]]]',
        '[["k",["Q",1]]]',
        '[["k",["S",1]]]',
        '[["k",["S",{"base64":"YQ=="}]]]',  # UTF-8 bytes must be written as text
        '[["k",["S",{"base64":"/w==","x":1}]]]',
        '[[{"base64":"YQ=="},["V",null]]]',
        '[["k",["I",2147483648]]]',
        '[["k",["i",-1]]]',
        '[["k",["b",128]]]',
        '[["k",["T",-1]]]',
        '[["k",["T",18446744073709551616]]]',
        '[["k",["I",true]]]',
        '[["k",["I",1.0]]]',
        '[["k",["t",1]]]',
        '[["k",["t",256]]]',
        '[["k",["f",1.5]]]',
        '[["k",["f","1e39"]]]',
        '[["k",["d","1e999"]]]',
        '[["k",["d","NaN"]]]',
        '[["k",["d","NaN:3ff0000000000000"]]]',
        '[["k",["f","NaN:7FC00000"]]]',
        '[["k",["f","NaN:7fc0000"]]]',
        '[["k",["d","0x1p3"]]]',
        '[["k",["d"," 1"]]]',
        '[["k",["D",[256,1]]]]',
        '[["k",["D",[2,2147483648]]]]',
        '[["k",["D","1.50"]]]',
        '[["k",["x","not base64!"]]]',
        '[["k",["x","AP8"]]]',
        '[["k",["V",0]]]',
        '[["k",["F",{}]]]',
        '[["k",["A",{}]]]',
        '[["k",["S","\\ud800"]]]',
        '[["\\ud800",["V",null]]]',
        '[["' + "k" * 256 + '",["V",null]]]',
        '[["k",["S",NaN]]]',
        '[["k",["A",' + '["A",[' * 5000 + "]]" * 5000 + "]]]",
    ],
)
def test_malformed_typed_json_is_a_protocol_error(text: str) -> None:
    with pytest.raises(ProtocolError):
        typed_json_to_headers(text)


json_docs = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=5)
    | st.sampled_from(sorted(TAGS))
    | st.sampled_from(["NaN:7fc00000", "1.5", "Infinity", "AP8="]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["base64", "x"]), inner)
    ),
    max_leaves=12,
)


@settings(max_examples=300)
@given(json_docs)
def test_arbitrary_json_decodes_canonically_or_raises_protocol_error(doc: Any) -> None:
    try:
        table = typed_json_to_headers(json.dumps(doc))
    except ProtocolError:
        return
    assert canon(typed_json_to_headers(headers_to_typed_json(table))) == canon(table)


@given(st.binary(max_size=64) | st.text(max_size=64))
def test_garbage_decodes_or_raises_protocol_error(blob: bytes | str) -> None:
    try:
        typed_json_to_headers(blob)
    except ProtocolError:
        pass


@pytest.mark.parametrize(
    "table",
    [
        (("k", ("I", 2**31)),),
        (("k", ("I", True)),),
        (("k", ("Q", 1)),),
        (("k", ("t", 1)),),
        (("k", ("S", 1)),),
        (("k", ("x", "s")),),
        (("k", ("V", 1)),),
        (("k", ("d", "1")),),
        (("k", ("D", decimal.Decimal("NaN"))),),
        ((1, ("V", None)),),
        (("k",),),
    ],
)
def test_invalid_trees_are_refused(table: Any) -> None:
    with pytest.raises(ProtocolError):
        headers_to_typed_json(table)


def test_render_queryable() -> None:
    table = (
        ("s", ("S", "text")),
        ("bad", ("S", b"a\xffb")),
        ("x", ("x", b"\x00\xff")),
        ("yes", ("t", True)),
        ("odd", ("t", 2)),
        ("no", ("t", False)),
        ("i", ("b", -5)),
        ("L", ("l", 2**40)),
        ("f", field_table({"f": Float32(1.1)})[0][1]),
        ("nan", ("d", float("nan"))),
        ("inf", ("f", float("-inf"))),
        ("d", ("D", decimal.Decimal("1.50"))),
        ("t", ("T", 1704164645)),
        ("far", ("T", 2**64 - 1)),
        ("n", ("V", None)),
        ("tab", ("F", (("x", ("I", 1)), ("y", ("A", (("x", b"a"), ("V", None), ("S", "ü"))))))),
        ("arr", ("A", (("I", 1), ("F", (("k", ("t", True)), ("k", ("t", False))))))),
        (b"\xffraw", ("S", "v")),
        ("s", ("S", "second")),  # duplicate: the first wins
    )
    assert render_queryable(table) == {
        "s": "text",
        "bad": "a\ufffdb",
        "x": "AP8=",
        "yes": "true",
        "odd": "true",
        "no": "false",
        "i": "-5",
        "L": "1099511627776",
        "f": "1.1",
        "nan": "NaN",
        "inf": "-Infinity",
        "d": "1.50",
        "t": "2024-01-02T03:04:05Z",
        "far": "18446744073709551615",
        "n": None,
        "tab": '{"x":"1","y":["YQ==",null,"ü"]}',
        "arr": '["1",{"k":"true"}]',
        "\ufffdraw": "v",
    }
    assert render_queryable(None) == {} and render_queryable(()) == {}


def test_plain_values_for_exchange_arguments() -> None:
    args = {"alternate-exchange": "ae", "x-max": 10, "flag": True, "nested": {"a": [1.5, None]}}
    text = encode_typed(args)
    assert text == (
        '[["alternate-exchange",["S","ae"]],["x-max",["I",10]],["flag",["t",true]],'
        '["nested",["F",[["a",["A",[["d","1.5"],["V",null]]]]]]]]'
    )
    assert decode_typed(text) == args
    assert encode_typed(None) is None and encode_typed({}) is None and decode_typed(None) is None
    assert decode_typed("[]") == {}


def test_utf8_bytes_are_written_as_text() -> None:
    table = ((b"key", ("S", b"value")), ("k", ("S", b"\xff")))
    text = headers_to_typed_json(table)
    assert text == '[["key",["S","value"]],["k",["S",{"base64":"/w=="}]]]'
    back = typed_json_to_headers(text)
    assert back == (("key", ("S", "value")), ("k", ("S", b"\xff")))
    assert encode_table(back) == encode_table(table)


def test_typed_helpers_survive_typed_json() -> None:
    table = field_table({"a": Int8(-1), "b": UInt16(7), "c": Timestamp(5), "d": Typed("L", 1)})
    assert typed_json_to_headers(headers_to_typed_json(table)) == table


@given(st.lists(st.tuples(keys, st.just(("V", None))), max_size=4).map(tuple))
def test_keys_round_trip(table: Any) -> None:
    assert typed_json_to_headers(headers_to_typed_json(table)) == table
