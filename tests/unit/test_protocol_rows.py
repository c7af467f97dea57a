"""Rows (schema v2): delivery -> row -> bundle -> row -> the same delivery, byte for byte;
decoded columns derived from the raw property bytes."""

from __future__ import annotations

import gc
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.errors import ProtocolError
from bridge.protocol.bundle import manifest_for, pack_bundle, unpack_bundle
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.headers import headers_to_typed_json, render_queryable
from bridge.protocol.manifest import format_utc, new_bundle_id
from bridge.protocol.properties import (
    NO_PROPERTIES,
    Properties,
    decode_properties,
    encode_properties,
    field_table,
)
from bridge.protocol.rows import (
    UNKNOWN_EXCHANGE_TYPE,
    Message,
    RowBuilder,
    build_rows,
    row_to_message,
    table_to_messages,
)
from bridge.protocol.schema import PROPERTY_COLUMNS, row_schema
from tests.unit.test_protocol_properties import property_blocks, w_long, w_short

NOW = format_utc(datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC))
UNDECODABLE = b"\x20\x00" + w_long(w_short("k") + b"Q")  # unknown field type 'Q'


def short_text() -> st.SearchStrategy[str]:
    return st.text(st.characters(exclude_categories=["Cs"]), max_size=40)


plain_values = st.one_of(
    st.text(max_size=8),
    st.integers(-(2**63), 2**63 - 1),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
)
exchange_decls = st.builds(
    ExchangeDecl,
    name=st.sampled_from(["ex-a", "ex-b", ""]),
    type=st.sampled_from(["direct", "fanout", "topic", "headers", "x-consistent-hash"]),
    durable=st.booleans(),
    auto_delete=st.booleans(),
    internal=st.booleans(),
    arguments=st.dictionaries(st.text(max_size=8), plain_values, max_size=3),
)
blocks = property_blocks | st.binary(max_size=24) | st.just(UNDECODABLE) | st.just(NO_PROPERTIES)
deliveries = st.tuples(
    st.sampled_from(["ex-a", "ex-b", "", "not-in-catalog"]),
    short_text(),
    st.booleans(),
    blocks,
    st.binary(max_size=200),
)


def _text(v: Any) -> Any:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def expected_columns(raw: bytes) -> dict[str, Any] | None:
    """The decoded columns of a block, derived here from decode_properties; None if it fails."""
    try:
        p = decode_properties(raw)
    except ProtocolError:
        return None
    out = {name: _text(getattr(p, name)) for name in PROPERTY_COLUMNS}
    if p.timestamp is not None and p.timestamp >= 2**63:
        out["timestamp"] = p.timestamp - 2**64
    if p.headers is None:
        out["headers_typed"] = out["headers"] = None
    else:
        out["headers_typed"] = headers_to_typed_json(p.headers)
        out["headers"] = list(render_queryable(p.headers).items())
    return out


def seal(table: pa.Table, channel: str) -> bytes:
    manifest = manifest_for(
        table,
        channel=channel,
        bundle_seq=1,
        bundle_id=new_bundle_id(),
        created_at=NOW,
        bridge_id="black-1",
        prev_sha256=None,
    )
    return pack_bundle(table, manifest)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(deliveries, min_size=1, max_size=10),
    st.integers(0, 2**40),
    st.integers(1, 3),
    st.dictionaries(st.sampled_from(["ex-a", "ex-b", ""]), exchange_decls, max_size=3),
    st.booleans(),
)
def test_delivery_row_bundle_message_round_trip(
    items: list[Any], first: int, step: int, decls: dict[str, ExchangeDecl], repeat: bool
) -> None:
    if repeat:  # the same property block on several rows: the decode cache's path
        items = [(x, rk, red, items[0][3], body) for x, rk, red, _, body in items]
    catalog = {
        name: ExchangeDecl(name, d.type, d.durable, d.auto_delete, d.internal, d.arguments)
        for name, d in decls.items()
    }
    seqs = [first + step * i for i in range(len(items))]
    names, rks, reds, raws, bodies = (list(c) for c in zip(*items, strict=True))
    bad: list[int] = []
    batch = build_rows("ch-1", seqs, names, rks, reds, raws, bodies, catalog, undecodable=bad)
    assert batch.schema.equals(row_schema(), check_metadata=True)

    builder = RowBuilder("ch-1")
    for seq, (name, rk, red, raw, body) in zip(seqs, items, strict=True):
        builder.append(seq, catalog.get(name), name, rk, red, raw, body)
    assert builder.to_batch().equals(batch)
    arrow_batch = build_rows(
        "ch-1",
        pa.chunked_array([pa.array(seqs[:1], pa.int64()), pa.array(seqs[1:], pa.int64())]),
        pa.array(names, pa.large_string()),
        pa.array(rks),
        pa.array(reds),
        pa.array(raws, pa.large_binary()),
        pa.array(bodies, pa.binary()),
        catalog,
    )
    assert arrow_batch.equals(batch)

    table = pa.Table.from_batches([batch])
    _, unpacked = unpack_bundle(seal(table, "ch-1"))
    assert unpacked.equals(table)
    rows = unpacked.to_pylist()
    want_bad = [s for s, raw in zip(seqs, raws, strict=True) if expected_columns(raw) is None]
    assert bad == want_bad and builder.undecodable_rows == len(want_bad)
    messages = list(table_to_messages(unpacked, chunk_rows=3))
    for seq, (name, rk, red, raw, body), row, m in zip(seqs, items, rows, messages, strict=True):
        assert m == row_to_message(row)
        assert isinstance(m, Message) and (m.channel, m.seq) == ("ch-1", seq)
        assert (m.routing_key, m.properties_raw, m.body) == (rk, raw, body)
        assert row["redelivered"] is red and row["properties_raw"] == raw
        decl = catalog.get(name) or ExchangeDecl(name, UNKNOWN_EXCHANGE_TYPE, durable=False)
        assert m.exchange == decl
        want = expected_columns(raw)
        got = {k: row[k] for k in (*PROPERTY_COLUMNS, "headers_typed", "headers")}
        assert got == (want if want is not None else dict.fromkeys(got))


def test_columns_of_one_row() -> None:
    props = Properties(
        content_type="application/json",
        delivery_mode=2,
        message_id=b"\xffid",
        timestamp=2**64 - 1,
        headers=field_table({"n": 1.5, "s": "x"}),
    )
    raw = encode_properties(props)
    decl = ExchangeDecl("orders", "topic", arguments={"alternate-exchange": "ae"})
    batch = build_rows("ch", [7], ["orders"], ["a.b"], [True], [raw], [b"body"], {"orders": decl})
    (row,) = batch.to_pylist()
    assert row == {
        "channel": "ch",
        "seq": 7,
        "exchange": "orders",
        "exchange_type": "topic",
        "exchange_durable": True,
        "exchange_auto_delete": False,
        "exchange_internal": False,
        "exchange_arguments": '[["alternate-exchange",["S","ae"]]]',
        "routing_key": "a.b",
        "redelivered": True,
        "properties_raw": raw,
        "content_type": "application/json",
        "content_encoding": None,
        "delivery_mode": 2,
        "priority": None,
        "correlation_id": None,
        "reply_to": None,
        "expiration": None,
        "message_id": "\ufffdid",
        "timestamp": -1,
        "type": None,
        "user_id": None,
        "app_id": None,
        "cluster_id": None,
        "headers_typed": '[["n",["d","1.5"]],["s",["S","x"]]]',
        "headers": [("n", "1.5"), ("s", "x")],
        "body": b"body",
    }
    assert row_to_message(row).exchange == decl
    assert gc.isenabled()  # the decode loop pauses the cyclic GC and turns it back on


def test_absent_and_empty_headers_differ() -> None:
    raws = [NO_PROPERTIES, encode_properties(Properties(headers=()))]
    rows = build_rows("ch", [1, 2], ["x", "x"], ["", ""], [False, False], raws, [b"", b""], {})
    r0, r1 = rows.to_pylist()
    assert r0["headers_typed"] is None and r0["headers"] is None
    assert r1["headers_typed"] == "[]" and r1["headers"] == []


def test_undecodable_blocks_travel_raw_and_are_counted_once() -> None:
    bad_table = b"\x20\x00" + w_long(w_short("k") + b"I\x00")  # the 'I' value is truncated
    b = RowBuilder("ch")
    b.append(1, None, "x", "", False, UNDECODABLE, b"a")
    b.append(2, None, "x", "", False, NO_PROPERTIES, b"b")
    b.append(3, None, "x", "", False, bad_table, b"c")
    b.append(4, None, "x", "", False, UNDECODABLE, b"d")
    rows = b.to_batch().to_pylist()
    assert b.undecodable_rows == 3
    assert [r["properties_raw"] for r in rows] == [
        UNDECODABLE,
        NO_PROPERTIES,
        bad_table,
        UNDECODABLE,
    ]
    for r in (rows[0], rows[2], rows[3]):
        assert all(r[c] is None for c in (*PROPERTY_COLUMNS, "headers_typed", "headers"))
    b.to_batch()
    assert b.undecodable_rows == 3  # building again does not count again
    b.clear()
    b.append(5, None, "x", "", False, UNDECODABLE, b"e")
    b.to_batch()
    assert b.undecodable_rows == 4
    assert [m.properties_raw for m in table_to_messages(b.to_table())] == [UNDECODABLE]


def test_bodies_are_not_copied() -> None:
    bodies = pa.array([b"x" * 1000, b"y" * 1000], pa.binary())
    batch = build_rows(
        "ch", [0, 1], ["e", "e"], ["", ""], [False, False], [NO_PROPERTIES] * 2, bodies, {}
    )
    assert batch.column("body").buffers()[2].address == bodies.buffers()[2].address


def test_empty_inputs_give_empty_batches_of_the_schema() -> None:
    for batch in (
        RowBuilder("ch").to_batch(),
        build_rows("ch", [], [], [], [], [], [], {}),
    ):
        assert batch.num_rows == 0 and batch.schema.equals(row_schema(), check_metadata=True)


@pytest.mark.parametrize(
    ("columns", "match"),
    [
        (([1, 1], ["e", "e"], ["", ""], [False, False]), "seq 1 does not follow seq 1"),
        (([2, 1], ["e", "e"], ["", ""], [False, False]), "seq 1 does not follow seq 2"),
        (([-1, 1], ["e", "e"], ["", ""], [False, False]), "negative"),
        (([0, None], ["e", "e"], ["", ""], [False, False]), "seq holds 1 null"),
        (([0, 1], ["e", None], ["", ""], [False, False]), "exchange holds"),
        (([0, 1], ["e", "e"], ["", ""], [False, None]), "redelivered holds"),
        (([0, 1], ["e", "e"], [""], [False, False]), "lengths"),
        (([0, 1], ["e", "e"], ["", 5], [False, False]), "routing_key is malformed"),
    ],
)
def test_build_rows_refuses_bad_input_naming_the_channel(columns: Any, match: str) -> None:
    seqs, names, rks, reds = columns
    with pytest.raises(ProtocolError, match=f"'orders'.*{match}"):
        build_rows("orders", seqs, names, rks, reds, [NO_PROPERTIES] * 2, [b"", b""], {})


def test_builder_seq_must_strictly_increase_even_across_clear() -> None:
    b = RowBuilder("orders")
    b.append(5, None, "ex", "", False, NO_PROPERTIES, b"")
    for bad in (5, 4):
        with pytest.raises(ProtocolError, match="orders.*seq"):
            b.append(bad, None, "ex", "", False, NO_PROPERTIES, b"")
    b.clear()
    assert len(b) == 0 and b.nbytes_estimate == 0 and b.last_seq == 5
    with pytest.raises(ProtocolError):
        b.append(5, None, "ex", "", False, NO_PROPERTIES, b"")
    with pytest.raises(ProtocolError, match="properties_raw must be bytes"):
        b.append(6, None, "ex", "", False, "text", b"")  # type: ignore[arg-type]
    b.append(6, None, "ex", "", False, bytearray(NO_PROPERTIES), memoryview(b"b"))  # type: ignore[arg-type]
    assert b.to_batch().column("body").to_pylist() == [b"b"] and b.nbytes_estimate > 0


def test_exchange_declaration_must_match_the_delivery() -> None:
    with pytest.raises(ProtocolError, match="'a'.*'b'"):
        RowBuilder("ch").append(1, ExchangeDecl("b", "direct"), "a", "", False, NO_PROPERTIES, b"")
    with pytest.raises(ProtocolError, match="'a'.*'b'"):
        build_rows(
            "ch",
            [1],
            ["a"],
            [""],
            [False],
            [NO_PROPERTIES],
            [b""],
            {"a": ExchangeDecl("b", "direct")},
        )
    with pytest.raises(ProtocolError, match="'ex'.*arguments"):
        build_rows(
            "ch",
            [1],
            ["ex"],
            [""],
            [False],
            [NO_PROPERTIES],
            [b""],
            {"ex": ExchangeDecl("ex", "direct", arguments={"big": 2**64})},
        )


def test_a_changed_declaration_of_the_same_exchange_is_kept_per_row() -> None:
    b = RowBuilder("ch")
    b.append(1, ExchangeDecl("ex", "direct"), "ex", "", False, NO_PROPERTIES, b"")
    b.append(2, ExchangeDecl("ex", "direct"), "ex", "", False, NO_PROPERTIES, b"")
    b.append(
        3, ExchangeDecl("ex", "topic", arguments={"x": 1}), "ex", "", False, NO_PROPERTIES, b""
    )
    rows = b.to_batch().to_pylist()
    assert [r["exchange_type"] for r in rows] == ["direct", "direct", "topic"]
    assert rows[2]["exchange_arguments"] == '[["x",["I",1]]]'
    assert row_to_message(rows[2]).exchange.arguments == {"x": 1}


def test_row_to_message_rejects_incomplete_or_bad_rows() -> None:
    row = RowBuilder("ch")
    row.append(1, None, "ex", "", False, NO_PROPERTIES, b"")
    good = row.to_batch().to_pylist()[0]
    with pytest.raises(ProtocolError, match="seq=1.*body"):
        row_to_message({k: v for k, v in good.items() if k != "body"})
    with pytest.raises(ProtocolError, match="seq=1"):
        row_to_message({**good, "exchange_arguments": '[["a",["I","x"]]]'})
    with pytest.raises(ProtocolError, match="seq=1"):
        row_to_message({**good, "properties_raw": None})
    bad_args = pa.Table.from_pylist([{**good, "exchange_arguments": "["}], row_schema())
    with pytest.raises(ProtocolError, match="seq=1"):
        list(table_to_messages(bad_args))
    with pytest.raises(ProtocolError, match="lack a column"):
        list(table_to_messages(pa.table({"seq": [1]})))
    nullable = pa.schema([f.with_nullable(True) for f in row_schema()])
    null_body = pa.Table.from_pylist([{**good, "body": None}], nullable)
    with pytest.raises(ProtocolError, match="seq=1"):
        list(table_to_messages(null_body))


def test_table_to_messages_accepts_batches() -> None:
    b = RowBuilder("ch")
    for i in range(5):
        b.append(i, ExchangeDecl("ex", "fanout"), "ex", f"k{i}", False, NO_PROPERTIES, b"%d" % i)
    batch = b.to_batch()
    got = list(table_to_messages([batch.slice(0, 2), batch.slice(2)], chunk_rows=2))
    assert [(m.seq, m.routing_key, m.body) for m in got] == [
        (i, f"k{i}", b"%d" % i) for i in range(5)
    ]
    assert list(table_to_messages(batch)) == got
