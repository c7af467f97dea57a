"""Row builder: AMQP message -> row -> bundle -> row -> the same AMQP message, byte for byte."""

from __future__ import annotations

import copy
import os
import time
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pika.spec import BasicProperties

from bridge.errors import ProtocolError
from bridge.protocol.bundle import manifest_for, pack_bundle, unpack_bundle
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.manifest import format_utc, new_bundle_id
from bridge.protocol.rows import (
    STREAM_OFFSET_HEADER,
    Message,
    RowBuilder,
    row_to_message,
    table_to_messages,
)
from bridge.protocol.schema import row_schema
from tests.unit.test_protocol_headers import pika_decode, py_tables, wire_tables

NOW = format_utc(datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC))


def short_text() -> st.SearchStrategy[str]:
    # AMQP short strings: <= 255 UTF-8 bytes (63 chars is at most 252 bytes)
    return st.text(st.characters(blacklist_categories=("Cs",)), max_size=63)


def opt(s: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | s


headers_strategy = opt(
    st.one_of(
        wire_tables.map(pika_decode),
        py_tables,
        st.tuples(wire_tables.map(pika_decode), st.integers(0, 2**40)).map(
            lambda t: {STREAM_OFFSET_HEADER: t[1], **t[0]}
        ),
        st.integers(0, 2**40).map(lambda o: {STREAM_OFFSET_HEADER: o}),
    )
)

properties_strategy = st.builds(
    BasicProperties,
    content_type=opt(short_text()),
    content_encoding=opt(short_text()),
    headers=headers_strategy,
    delivery_mode=opt(st.integers(0, 255)),
    priority=opt(st.integers(0, 255)),
    correlation_id=opt(short_text()),
    reply_to=opt(short_text()),
    expiration=opt(short_text()),
    message_id=opt(short_text()),
    timestamp=opt(st.integers(0, 2**64 - 1) | st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1])),
    type=opt(short_text()),
    user_id=opt(short_text()),
    app_id=opt(short_text()),
    cluster_id=opt(short_text()),
)

exchange_strategy = opt(
    st.builds(
        ExchangeDecl,
        name=st.just("ex"),
        type=st.sampled_from(["direct", "fanout", "topic", "headers", "x-consistent-hash"]),
        durable=st.booleans(),
        auto_delete=st.booleans(),
        internal=st.booleans(),
        arguments=py_tables,
    )
)

message_strategy = st.tuples(
    exchange_strategy,
    short_text(),
    properties_strategy,
    st.binary(max_size=300) | st.sampled_from([b"", b"\xff\xfe\x00", "é".encode()]),
)


def encoded(props: BasicProperties) -> bytes:
    return b"".join(props.encode())


def expected_properties(props: BasicProperties) -> BasicProperties:
    """What red must publish: the same, minus the broker's x-stream-offset."""
    want = copy.copy(props)
    h = props.headers
    if h is not None:
        h = {k: v for k, v in h.items() if k != STREAM_OFFSET_HEADER}
    want.headers = h or None
    return want


def seal(builder: RowBuilder, *, bundle_seq: int = 1) -> bytes:
    table = builder.to_table()
    manifest = manifest_for(
        table,
        channel=builder.channel,
        bundle_seq=bundle_seq,
        bundle_id=new_bundle_id(),
        created_at=NOW,
        bridge_id="black-1",
        prev_sha256=None if bundle_seq == 1 else "0" * 64,
    )
    return pack_bundle(table, manifest)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(message_strategy, min_size=1, max_size=8), st.integers(0, 2**40))
def test_message_row_bundle_message_round_trip(messages: list[Any], first_seq: int) -> None:
    builder = RowBuilder("ch-1")
    for i, (exchange, routing_key, props, body) in enumerate(messages):
        name = exchange.name if exchange is not None else f"unknown-{i % 2}"
        builder.append(first_seq + 3 * i, exchange, name, routing_key, props, body)
    batch = builder.to_batch()
    assert batch.schema.equals(row_schema(), check_metadata=True)
    assert batch.num_rows == len(builder) == len(messages)
    manifest, table = unpack_bundle(seal(builder))
    assert manifest.rows == len(messages)
    assert table.equals(pa.Table.from_batches([batch]))
    out = list(table_to_messages(table))
    one_by_one = [row_to_message(r) for r in table.to_pylist()]
    assert len(out) == len(one_by_one) == len(messages)
    for i, ((exchange, routing_key, props, body), got, got1) in enumerate(
        zip(messages, out, one_by_one, strict=True)
    ):
        for m in (got, got1):
            assert isinstance(m, Message)
            assert m.channel == "ch-1" and m.seq == first_seq + 3 * i
            assert m.routing_key == routing_key and m.body == body
            assert encoded(m.properties) == encoded(expected_properties(props))
            if exchange is None:
                assert m.exchange == ExchangeDecl(
                    f"unknown-{i % 2}", "unknown", durable=False, auto_delete=False, internal=False
                )
            else:
                assert (m.exchange.name, m.exchange.type) == (exchange.name, exchange.type)
                assert (m.exchange.durable, m.exchange.auto_delete, m.exchange.internal) == (
                    exchange.durable,
                    exchange.auto_delete,
                    exchange.internal,
                )
                assert m.exchange.arguments == exchange.arguments


def test_row_columns_and_nullability() -> None:
    b = RowBuilder("ch")
    props = BasicProperties(headers={STREAM_OFFSET_HEADER: 7})
    b.append(7, None, "ex", "rk", props, b"")
    b.append(9, ExchangeDecl("ex2", "topic"), "ex2", "", BasicProperties(headers={"a": "b"}), b"x")
    row0, row1 = b.to_batch().to_pylist()
    assert row0["headers_typed"] is None and row0["headers"] is None  # empty after strip: null
    assert (row0["exchange_type"], row0["exchange_durable"], row0["exchange_arguments"]) == (
        "unknown",
        False,
        None,
    )
    assert row1["headers_typed"] == '{"a":["S","b"]}' and row1["headers"] == [("a", "b")]
    assert (row1["exchange_type"], row1["exchange_durable"]) == ("topic", True)
    assert row0["body"] == b"" and row0["content_type"] is None
    assert b.nbytes_estimate > 0 and b.last_seq == 9


def test_empty_builder_gives_an_empty_batch_of_the_schema() -> None:
    batch = RowBuilder("ch").to_batch()
    assert batch.num_rows == 0 and batch.schema.equals(row_schema(), check_metadata=True)


def test_seq_must_strictly_increase_and_error_names_the_channel() -> None:
    b = RowBuilder("orders")
    b.append(5, None, "ex", "", BasicProperties(), b"")
    for bad in (5, 4):
        with pytest.raises(ProtocolError, match="orders.*seq"):
            b.append(bad, None, "ex", "", BasicProperties(), b"")
    b.clear()
    assert len(b) == 0 and b.nbytes_estimate == 0
    with pytest.raises(ProtocolError):
        b.append(5, None, "ex", "", BasicProperties(), b"")  # never reused, even after clear


def test_exchange_declaration_must_match_the_delivery() -> None:
    b = RowBuilder("ch")
    with pytest.raises(ProtocolError, match="'a'.*'b'"):
        b.append(1, ExchangeDecl("b", "direct"), "a", "", BasicProperties(), b"")


def test_changed_declaration_of_the_same_exchange_is_kept_per_row() -> None:
    b = RowBuilder("ch")
    b.append(1, ExchangeDecl("ex", "direct"), "ex", "", BasicProperties(), b"")
    b.append(2, ExchangeDecl("ex", "direct"), "ex", "", BasicProperties(), b"")  # equal, new object
    b.append(3, ExchangeDecl("ex", "topic", arguments={"x": 1}), "ex", "", BasicProperties(), b"")
    rows = b.to_batch().to_pylist()
    assert [r["exchange_type"] for r in rows] == ["direct", "direct", "topic"]
    assert rows[2]["exchange_arguments"] == '{"x":["I",1]}'


def test_timestamp_above_int64_wraps_and_comes_back() -> None:
    b = RowBuilder("ch")
    b.append(1, None, "ex", "", BasicProperties(timestamp=2**64 - 1), b"")
    b.append(2, None, "ex", "", BasicProperties(timestamp=5), b"")
    rows = b.to_batch().to_pylist()
    assert rows[0]["timestamp"] == -1 and rows[1]["timestamp"] == 5
    assert row_to_message(rows[0]).properties.timestamp == 2**64 - 1


def test_non_utf8_short_string_property_is_counted_as_lossy() -> None:
    b = RowBuilder("ch")
    b.append(1, None, "ex", "", BasicProperties(message_id=b"\xffid"), b"")
    b.append(2, None, "ex", "", BasicProperties(message_id=b"ok"), b"")
    rows = b.to_batch().to_pylist()
    assert rows[0]["message_id"] == "\ufffdid" and rows[1]["message_id"] == "ok"
    assert b.lossy_rows == 1


def test_row_to_message_rejects_incomplete_or_bad_rows() -> None:
    b = RowBuilder("ch")
    b.append(1, None, "ex", "", BasicProperties(headers={"a": 1}), b"")
    row = b.to_batch().to_pylist()[0]
    with pytest.raises(ProtocolError, match="seq=1"):
        row_to_message({k: v for k, v in row.items() if k != "body"})
    with pytest.raises(ProtocolError, match="seq=1"):
        row_to_message({**row, "headers_typed": '{"a":["I","x"]}'})
    with pytest.raises(ProtocolError, match="seq=1"):
        list(table_to_messages(pa.Table.from_pylist([{**row, "headers_typed": "{"}], row_schema())))


def test_row_builder_throughput_floor() -> None:
    """Regression floor only (shared CI box); the measured figure is in the report."""
    n = 20_000
    bodies = [os.urandom(1024) for _ in range(64)]
    ex = ExchangeDecl("orders", "topic")
    props = [
        BasicProperties(
            content_type="application/json",
            delivery_mode=2,
            message_id=f"m-{i}",
            timestamp=1_700_000_000 + i,
            headers={STREAM_OFFSET_HEADER: i, "trace-id": f"t{i:016x}", "retries": 3, "src": "s"},
        )
        for i in range(n)
    ]
    b = RowBuilder("ch")
    t0 = time.perf_counter()
    for i in range(n):
        b.append(i, ex, "orders", "a.b.c", props[i], bodies[i % 64])
    batch = b.to_batch()
    rate = n / (time.perf_counter() - t0)
    assert batch.num_rows == n
    assert rate > 30_000, f"RowBuilder at {rate:,.0f} rows/s"
