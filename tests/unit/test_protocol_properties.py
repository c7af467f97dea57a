"""Property-bytes codec: every decodable block re-encodes byte for byte; bad input is a
ProtocolError. Blocks are written here by an independent test-side writer (struct only)."""

from __future__ import annotations

import decimal
import struct
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pika.spec import BasicProperties

from bridge.errors import ProtocolError
from bridge.protocol.properties import (
    NO_PROPERTIES,
    PROPERTY_NAMES,
    ByteArray,
    Float32,
    Float32Bits,
    Float64,
    Int8,
    Int16,
    Int32,
    Int64,
    LongString,
    Properties,
    Timestamp,
    Typed,
    UInt8,
    UInt16,
    UInt32,
    decimal_parts,
    decode_properties,
    decode_table,
    encode_properties,
    encode_table,
    field_table,
    field_value,
    headers_table,
    scan_properties,
    to_python,
)

# ------------------------------------------------------------------ test-side wire writer

_INT_FORMATS = {
    "b": ">b",
    "B": ">B",
    "s": ">h",
    "U": ">h",
    "u": ">H",
    "I": ">i",
    "i": ">I",
    "l": ">q",
    "L": ">q",
    "T": ">Q",
}


def w_short(v: str | bytes) -> bytes:
    b = v.encode() if isinstance(v, str) else v
    assert len(b) <= 255
    return bytes([len(b)]) + b


def w_long(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def w_value(field: tuple[str, Any]) -> bytes:
    tag, v = field
    head = tag.encode()
    if tag in _INT_FORMATS:
        return head + struct.pack(_INT_FORMATS[tag], v)
    if tag == "t":
        return head + bytes([int(v)])
    if tag == "f":
        if isinstance(v, Float32Bits):
            return head + struct.pack(">I", v.bits)
        return head + struct.pack(">f", v)
    if tag == "d":
        return head + struct.pack(">d", v)
    if tag == "D":
        sign, digits, exp = v.as_tuple()
        raw = int("".join(map(str, digits))) * (-1 if sign else 1)
        return head + struct.pack(">Bi", -exp, raw)
    if tag == "S":
        return head + w_long(v.encode() if isinstance(v, str) else v)
    if tag == "x":
        return head + w_long(v)
    if tag == "V":
        return head
    if tag == "A":
        return head + w_long(b"".join(w_value(x) for x in v))
    if tag == "F":
        return head + w_table(v)
    raise AssertionError(tag)


def w_table(table: Any) -> bytes:
    return w_long(b"".join(w_short(k) + w_value(f) for k, f in table))


def w_properties(p: Properties) -> bytes:
    flags, out = 0, b""
    for i, name in enumerate(PROPERTY_NAMES):
        v = getattr(p, name)
        if v is None:
            continue
        flags |= 0x8000 >> i
        if name == "headers":
            out += w_table(v)
        elif name in ("delivery_mode", "priority"):
            out += bytes([v])
        elif name == "timestamp":
            out += struct.pack(">Q", v)
        else:
            out += w_short(v)
    return struct.pack(">H", flags) + out


# ------------------------------------------------------------------ generators (decoded form)


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return True
    return False


def _f32_of_bits(bits: int) -> float | Float32Bits:
    raw = struct.pack(">I", bits)
    v = struct.unpack(">f", raw)[0]
    return v if struct.pack(">f", v) == raw else Float32Bits(bits)


def _edges(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi) | st.sampled_from(
        [lo, hi, 0, lo + 1, hi - 1] if lo < 0 else [lo, hi]
    )


text = st.text(max_size=20)
raw_bytes = st.binary(min_size=1, max_size=20).filter(_not_utf8)
short_values = st.text(max_size=30).filter(lambda s: len(s.encode()) <= 255) | st.binary(
    min_size=1, max_size=30
).filter(_not_utf8)
keys = st.text(max_size=10) | st.binary(min_size=1, max_size=6).filter(_not_utf8)
nan_bits_32 = st.sampled_from([0x7F800001, 0x7FBFFFFF, 0xFF800001, 0x7FC00000, 0xFFC00001])
nan_bits_64 = st.sampled_from(
    [0x7FF0000000000001, 0xFFF8000000000000, 0x7FF8000000000001, 0x7FF7FFFFFFFFFFFF]
)

scalars = st.one_of(
    st.tuples(st.just("t"), st.booleans() | st.integers(2, 255)),
    st.tuples(st.just("b"), _edges(-(2**7), 2**7 - 1)),
    st.tuples(st.just("B"), _edges(0, 2**8 - 1)),
    st.tuples(st.sampled_from("sU"), _edges(-(2**15), 2**15 - 1)),
    st.tuples(st.just("u"), _edges(0, 2**16 - 1)),
    st.tuples(st.just("I"), _edges(-(2**31), 2**31 - 1)),
    st.tuples(st.just("i"), _edges(0, 2**32 - 1)),
    st.tuples(st.sampled_from("lL"), _edges(-(2**63), 2**63 - 1)),
    st.tuples(st.just("T"), _edges(0, 2**64 - 1)),
    st.tuples(
        st.just("f"),
        st.floats(width=32) | (st.integers(0, 2**32 - 1) | nan_bits_32).map(_f32_of_bits),
    ),
    st.tuples(
        st.just("d"),
        st.floats()
        | (st.integers(0, 2**64 - 1) | nan_bits_64).map(
            lambda b: struct.unpack(">d", struct.pack(">Q", b))[0]
        ),
    ),
    st.tuples(
        st.just("D"),
        st.tuples(
            st.integers(0, 255) | st.sampled_from([0, 2, 255]), _edges(-(2**31), 2**31 - 1)
        ).map(lambda t: decimal.Decimal(f"{t[1]}E-{t[0]}")),
    ),
    st.tuples(st.just("S"), text | raw_bytes),
    st.tuples(st.just("x"), st.binary(max_size=20)),
    st.just(("V", None)),
)
fields = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.tuples(st.just("A"), st.lists(inner, max_size=4).map(tuple)),
        st.tuples(st.just("F"), st.lists(st.tuples(keys, inner), max_size=4).map(tuple)),
    ),
    max_leaves=16,
)
# duplicates on purpose: a table is a list of pairs
tables = st.lists(st.tuples(keys | st.just("dup"), fields), max_size=8).map(tuple)


def opt(s: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | s


properties = st.builds(
    Properties,
    content_type=opt(short_values),
    content_encoding=opt(short_values),
    headers=opt(tables),
    delivery_mode=opt(st.integers(0, 255)),
    priority=opt(st.integers(0, 255)),
    correlation_id=opt(short_values),
    reply_to=opt(short_values),
    expiration=opt(short_values),
    message_id=opt(short_values),
    timestamp=opt(_edges(0, 2**64 - 1)),
    type=opt(short_values),
    user_id=opt(short_values),
    app_id=opt(short_values),
    cluster_id=opt(short_values),
)
property_blocks = properties.map(w_properties)


def canon(x: Any) -> Any:
    """Comparable form: floats by bit pattern (NaN payloads, -0.0), decimals by digits+exp."""
    if isinstance(x, float):
        return ("float", struct.pack(">d", x))
    if isinstance(x, decimal.Decimal):
        return ("decimal", x.as_tuple())
    if isinstance(x, Properties):
        return tuple(canon(getattr(x, n)) for n in PROPERTY_NAMES)
    if isinstance(x, tuple | list):
        return tuple(canon(v) for v in x)
    return (type(x).__name__, x)


# ------------------------------------------------------------------ round trips


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(properties)
def test_decode_gives_the_written_values_and_encodes_back_byte_for_byte(p: Properties) -> None:
    raw = w_properties(p)
    got = decode_properties(raw)
    assert canon(got) == canon(p)
    assert encode_properties(got) == raw
    assert encode_properties(p) == raw  # the codec's writer agrees with the test's


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(tables)
def test_tables_round_trip(table: Any) -> None:
    raw = w_table(table)
    got = decode_table(raw)
    assert canon(got) == canon(table)
    assert encode_table(got) == raw


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(property_blocks)
def test_scan_leaves_the_headers_as_their_bytes(raw: bytes) -> None:
    full = decode_properties(raw)
    scanned = scan_properties(raw)
    for name, v in zip(PROPERTY_NAMES, scanned, strict=True):
        if name == "headers":
            assert (v is None) is (full.headers is None)
            if v is not None:
                assert canon(decode_table(v)) == canon(full.headers)
        else:
            assert canon(v) == canon(getattr(full, name))


# ------------------------------------------------------------------ malformed input


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(property_blocks)
def test_every_truncation_and_any_trailing_byte_is_a_protocol_error(raw: bytes) -> None:
    for end in range(len(raw)):
        with pytest.raises(ProtocolError):
            decode_properties(raw[:end])
        with pytest.raises(ProtocolError):
            scan_properties(raw[:end])
    with pytest.raises(ProtocolError, match="trailing"):
        decode_properties(raw + b"\x00")


def _decodes_exactly_or_refuses(raw: bytes) -> bool:
    try:
        p = decode_properties(raw)
    except ProtocolError:
        return False
    assert encode_properties(p) == raw
    return True


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(property_blocks, st.data())
def test_corrupted_blocks_decode_exactly_or_raise_protocol_error(raw: bytes, data: Any) -> None:
    assume(len(raw) > 2)
    mutated = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(raw) - 1))
        mutated[i] = data.draw(st.integers(0, 255))
    _decodes_exactly_or_refuses(bytes(mutated))


@settings(max_examples=500)
@given(st.binary(max_size=80))
def test_garbage_decodes_exactly_or_raises_protocol_error(raw: bytes) -> None:
    _decodes_exactly_or_refuses(raw)
    try:
        t = decode_table(raw)
    except ProtocolError:
        return
    assert encode_table(t) == raw


def _scan_outcome(f: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", f(raw)
    except ProtocolError:
        return "refused", None


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(property_blocks, st.data())
def test_headers_table_checks_exactly_what_scan_checks(raw: bytes, data: Any) -> None:
    """The value-free walk replay runs before each publish refuses the same blocks as the full
    scan and returns the same table bytes: on the block, its truncations, and mutations."""
    mutated = bytearray(raw)
    if len(raw) > 2:
        for _ in range(data.draw(st.integers(1, 3))):
            mutated[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for block in (raw, bytes(mutated), raw[:cut], raw + b"\x00"):
        kind, values = _scan_outcome(scan_properties, block)
        assert _scan_outcome(headers_table, block) == (kind, None if values is None else values[2])
    assert headers_table(raw) == scan_properties(raw)[2]


def test_only_bytes_like_input_is_read() -> None:
    assert decode_properties(memoryview(NO_PROPERTIES)) == Properties()  # type: ignore[arg-type]
    assert decode_table(bytearray(b"\x00\x00\x00\x00")) == ()  # type: ignore[arg-type]
    for bad in (None, 2, "\x00\x00"):
        with pytest.raises(ProtocolError, match="must be bytes"):
            decode_properties(bad)  # type: ignore[arg-type]
        with pytest.raises(ProtocolError, match="must be bytes"):
            decode_table(bad)  # type: ignore[arg-type]


def test_flag_bits_0_and_1_are_refused_and_empty_flags_decode() -> None:
    assert decode_properties(NO_PROPERTIES) == Properties()
    assert encode_properties(Properties()) == NO_PROPERTIES
    with pytest.raises(ProtocolError, match="continuation"):
        decode_properties(b"\x00\x01")
    with pytest.raises(ProtocolError, match="bit 1"):
        decode_properties(b"\x00\x02")
    for short in (b"", b"\x00"):
        with pytest.raises(ProtocolError, match="flags"):
            decode_properties(short)


def test_unknown_field_type_names_tag_and_offset() -> None:
    table = w_long(w_short("ok") + b"I" + struct.pack(">i", 1) + w_short("k") + b"Q\x00")
    raw = b"\x20\x00" + table  # headers only
    offset = 2 + 4 + 3 + 5 + 2  # flags, table length, "ok", I value, "k"
    with pytest.raises(ProtocolError, match=rf"'Q' \(0x51\) at byte offset {offset}"):
        decode_properties(raw)
    with pytest.raises(ProtocolError, match="0x00"):
        decode_table(w_long(w_short("k") + b"\x00"))


def test_a_value_that_overruns_its_table_is_refused() -> None:
    # the 'I' value of the inner table reaches into the outer table's next key
    inner = struct.pack(">I", 4) + w_short("k") + b"I"  # declares 4 bytes: k, I + 1 of the int
    raw = w_long(w_short("a") + b"F" + inner + struct.pack(">i", 7)[:3] + w_short("b") + b"V")
    with pytest.raises(ProtocolError):
        decode_table(raw)


def test_deep_nesting_is_a_protocol_error() -> None:
    depth = 20_000
    inner = b"V"
    raw = inner
    for _ in range(depth):
        raw = b"A" + w_long(raw)
    with pytest.raises(ProtocolError, match="deep"):
        decode_table(w_long(w_short("k") + raw))


# ------------------------------------------------------------------ exactness edge cases


def test_bits_a_python_float_would_change_are_kept() -> None:
    snan32 = struct.pack(">I", 0x7F800001)
    raw = w_long(
        w_short("snan")
        + b"f"
        + snan32
        + w_short("qnan")
        + b"f"
        + struct.pack(">I", 0xFFC00123)
        + w_short("dnan")
        + b"d"
        + struct.pack(">Q", 0x7FF0000000000001)
        + w_short("neg0")
        + b"f"
        + struct.pack(">f", -0.0)
    )
    t = decode_table(raw)
    assert t[0] == ("snan", ("f", Float32Bits(0x7F800001)))  # a float would set the quiet bit
    assert isinstance(t[1][1][1], float) and isinstance(t[2][1][1], float)
    assert struct.pack(">d", t[3][1][1]) == struct.pack(">d", -0.0)
    assert encode_table(t) == raw


def test_wire_details_kept() -> None:
    raw = w_long(
        w_short("dup")
        + b"t\x02"  # a true octet that is not 1
        + w_short("dup")
        + b"U"
        + struct.pack(">h", -2)  # spec letter kept
        + w_short(b"\xff\xfe")
        + b"L"
        + struct.pack(">q", -1)
        + w_short("dec")
        + b"D"
        + struct.pack(">Bi", 255, -150)
        + w_short("s")
        + b"S"
        + w_long(b"\xc3\x28")
        + w_short("zero")
        + b"D"
        + struct.pack(">Bi", 2, 0)
    )
    t = decode_table(raw)
    assert t[0] == ("dup", ("t", 2)) and t[1] == ("dup", ("U", -2))
    assert t[2] == (b"\xff\xfe", ("L", -1))
    assert t[3][1][1].as_tuple().exponent == -255 and t[3][1][1] < 0
    assert t[4] == ("s", ("S", b"\xc3\x28"))
    assert str(t[5][1][1]) == "0.00"
    assert encode_table(t) == raw
    assert to_python(t)["dup"] == -2  # plain values: the last duplicate wins


def test_non_utf8_short_strings_stay_bytes() -> None:
    p = Properties(message_id=b"\xffid", type="t\u00e9", headers=())
    raw = encode_properties(p)
    assert decode_properties(raw) == p
    assert raw == b"\x20\xa0" + b"\x00\x00\x00\x00" + b"\x03\xffid" + b"\x03t\xc3\xa9"


def test_a_pika_encoded_block_decodes_to_what_pika_was_given() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    headers = {
        "s": "text",
        "i": 7,
        "big": 2**40,
        "yes": True,
        "d": decimal.Decimal("1.50"),
        "at": when,
        "raw": b"\x00\xff",
        "nested": {"a": [1, "x", None]},
        "none": None,
    }
    pika_props = BasicProperties(
        content_type="application/json",
        delivery_mode=2,
        priority=9,
        message_id="m-1",
        timestamp=1_700_000_000,
        headers=headers,
        app_id="app",
    )
    raw = b"".join(pika_props.encode())
    p = decode_properties(raw)
    assert (p.content_type, p.delivery_mode, p.priority, p.message_id, p.app_id) == (
        "application/json",
        2,
        9,
        "m-1",
        "app",
    )
    assert p.timestamp == 1_700_000_000
    assert to_python(p.headers) == headers
    assert dict(p.headers or ())["i"] == ("I", 7) and dict(p.headers or ())["big"][0] == "l"
    assert encode_properties(p) == raw


def test_pamqp_reads_our_bytes_alike() -> None:
    decode = pytest.importorskip("pamqp.decode")
    table = field_table(
        {
            "f": Float32(1.5),
            "d": 2.25,
            "b": Int8(-3),
            "u": UInt16(65535),
            "i": UInt32(2**32 - 1),
            "l": 2**40,
            "dec": decimal.Decimal("1.50"),
            "x": b"\x00",
            "s": "é",
            "arr": [True, None],
        }
    )
    _, got = decode.field_table(encode_table(table))
    assert got["f"] == 1.5 and got["d"] == 2.25 and got["b"] == -3
    assert got["u"] == 65535 and got["i"] == 2**32 - 1 and got["l"] == 2**40
    assert got["dec"] == decimal.Decimal("1.50") and bytes(got["x"]) == b"\x00"
    assert got["s"] == "é" and got["arr"] == [True, None]


# ------------------------------------------------------------------ encode errors


@pytest.mark.parametrize(
    ("props", "match"),
    [
        (Properties(message_id="x" * 256), "message_id.*255"),
        (Properties(type=b"\xff" * 256), "type.*255"),
        (Properties(app_id="\ud800"), "app_id"),
        (Properties(delivery_mode=256), "delivery_mode"),
        (Properties(priority=-1), "priority"),
        (Properties(timestamp=2**64), "timestamp"),
        (Properties(timestamp=-1), "timestamp"),
        (Properties(content_type=7), "content_type"),  # type: ignore[arg-type]
        (Properties(headers=(("k", ("I", 2**31)),)), "headers at k"),
        (Properties(headers=(("k", ("Q", 1)),)), "unknown field value type 'Q'"),
        (Properties(headers=(("k", ("V", 0)),)), "'V'"),
        (Properties(headers=(("k", ("t", 256)),)), "'t'"),
        (Properties(headers=(("k", ("f", 1e39)),)), "headers at k"),
        (Properties(headers=(("k", ("d", "1.5")),)), "float"),
        (Properties(headers=(("k", ("D", decimal.Decimal("NaN"))),)), "finite"),
        (Properties(headers=(("k", ("D", decimal.Decimal("1E-256"))),)), "fit"),
        (Properties(headers=(("k", ("D", decimal.Decimal(2**31))),)), "fit"),
        (Properties(headers=(("k", ("F", (("in", ("A", (("b", 200),))),))),)), r"k/in/\[0\]"),
        (Properties(headers=(("k" * 256, ("V", None)),)), "255"),
        (Properties(headers=(("\ud800", ("V", None)),)), "UTF-8"),
        (Properties(headers=(("k", ("S", "\udc80")),)), "k: .*UTF-8"),
        (Properties(headers=(("k", ("F", (("\ud800", ("I", 1)),))),)), "UTF-8"),
        (Properties(headers=(("k", "S"),)), "pair"),  # type: ignore[arg-type]
        (Properties(headers={"k": ("S", "v")}), "field_table"),  # type: ignore[arg-type]
        (Properties(headers=(("k", ("x", "text")),)), "'x'"),
        (Properties(headers=(("k", ("d", Float32Bits(1))),)), "tag 'f'"),
    ],
)
def test_values_that_cannot_be_encoded_raise_protocol_error(props: Properties, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        encode_properties(props)


# ------------------------------------------------------------------ building from Python


def test_field_table_default_tags() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    t = field_table(
        {
            "s": "x",
            "t": True,
            "i": 2**31 - 1,
            "l": 2**31,
            "f": 1.5,
            "x": bytearray(b"\x01"),
            "D": decimal.Decimal("-7E+2"),
            "T": when,
            "naive": datetime(1970, 1, 1, 0, 0, 10),
            "F": {"k": None},
            "A": [1, (2,)],
            "V": None,
        }
    )
    assert t == (
        ("s", ("S", "x")),
        ("t", ("t", True)),
        ("i", ("I", 2**31 - 1)),
        ("l", ("l", 2**31)),
        ("f", ("d", 1.5)),
        ("x", ("x", b"\x01")),
        ("D", ("D", decimal.Decimal("-700"))),
        ("T", ("T", int(when.timestamp()))),
        ("naive", ("T", 10)),
        ("F", ("F", (("k", ("V", None)),))),
        ("A", ("A", (("I", 1), ("A", (("I", 2),))))),
        ("V", ("V", None)),
    )
    assert field_table(None) == () and field_table([("a", 1), ("a", 2)])[1] == ("a", ("I", 2))


def test_explicit_type_helpers() -> None:
    helpers = [
        (Int8(-1), "b"),
        (UInt8(255), "B"),
        (Int16(-2), "s"),
        (UInt16(2), "u"),
        (Int32(3), "I"),
        (UInt32(4), "i"),
        (Int64(5), "l"),
        (Float32(1.1), "f"),
        (Float64(1.1), "d"),
        (Timestamp(datetime(1970, 1, 2, tzinfo=UTC)), "T"),
        (ByteArray(b"b"), "x"),
        (LongString(b"\xff"), "S"),
        (Typed("L", -9), "L"),
        (Typed("U", 9), "U"),
        (Typed("F", {"k": Int8(1)}), "F"),
        (Typed("A", [Int8(1)]), "A"),
    ]
    for helper, tag in helpers:
        field = field_value(helper)
        assert field[0] == tag
        assert decode_table(encode_table((("k", field),)))[0][1] == field
    assert field_value(Float32(1.1))[1] == struct.unpack(">f", struct.pack(">f", 1.1))[0]
    assert field_value(Timestamp(datetime(1970, 1, 2, tzinfo=UTC))) == ("T", 86400)


@pytest.mark.parametrize(
    "value",
    [
        2**63,
        object(),
        {1, 2},
        decimal.Decimal("Infinity"),
        decimal.Decimal("1.23456789012345"),
        datetime(1960, 1, 1, tzinfo=UTC),
        Int8(128),
        UInt32(-1),
        Float32(1e39),
        Typed("Q", 1),
        "\ud800",
        {"k" * 256: 1},
    ],
)
def test_values_field_table_cannot_carry_are_refused(value: Any) -> None:
    with pytest.raises(ProtocolError):
        field_table({"k": value})


def test_decimal_parts() -> None:
    assert decimal_parts(decimal.Decimal("1.50")) == (2, 150)
    assert decimal_parts(decimal.Decimal("-7E+2")) == (0, -700)
    with pytest.raises(ProtocolError):
        decimal_parts(decimal.Decimal("sNaN"))


def test_to_python() -> None:
    t = field_table({"T": Timestamp(2**64 - 1), "t": True, "nested": {"a": [Float32(0.5)]}})
    t = (*t, ("snan", ("f", Float32Bits(0x7F800001))), ("odd", ("t", 7)))
    py = to_python(t)
    assert py["T"] == 2**64 - 1 and py["t"] is True and py["odd"] is True
    assert py["nested"] == {"a": [0.5]} and py["snan"] != py["snan"]
    assert to_python(field_table({"at": Timestamp(0)}))["at"] == datetime(1970, 1, 1, tzinfo=UTC)
    assert to_python(None) == {} and to_python(()) == {}
