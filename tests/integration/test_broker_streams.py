"""Integration canary: what RabbitMQ stream queues do to AMQP 0.9.1 headers on this broker.

Measured on RabbitMQ 3.10.8 (docs/runbook.md, "Broker limits"): a stream converts each message
to AMQP 1.0, which (1) silently drops header entries whose value is a table or an array and
(2) cannot convert decimals at all — the broker closes the *publisher's* connection with 541
INTERNAL_ERROR. The bridge cannot carry what the broker never stored. If this test fails after
a broker upgrade, the limitation is gone: update the runbook and ``broker_preserved`` in
test_black_pipeline.py.
"""

from __future__ import annotations

import datetime as dt
import decimal
import time

import pika
import pika.exceptions
import pytest

pytestmark = pytest.mark.broker

SIMPLE = {
    "s": "é",
    "b": b"\x00\xff",
    "i": -5,
    "l": 2**40,
    "t": True,
    "v": None,
    "ts": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
}


def _stream(url: str) -> pika.BlockingConnection:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_declare("canary", durable=True, arguments={"x-queue-type": "stream"})
    return conn


def _read_all(url: str, n: int) -> list[dict]:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=100)
    got: list[dict] = []
    ch.basic_consume(
        "canary",
        lambda _c, _m, p, _b: got.append(dict(p.headers or {})),
        arguments={"x-stream-offset": "first"},
    )
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.2)
    conn.close()
    for h in got:
        h.pop("x-stream-offset", None)
    return got


def test_streams_keep_simple_headers_and_drop_tables_and_arrays(black_vhost) -> None:  # type: ignore[no-untyped-def]
    conn = _stream(black_vhost.amqp_url)
    ch = conn.channel()
    ch.basic_publish("", "canary", b"1", pika.BasicProperties(headers=dict(SIMPLE)))
    ch.basic_publish(
        "",
        "canary",
        b"2",
        pika.BasicProperties(headers={"keep": 1, "table": {"a": 1}, "array": [1, 2]}),
    )
    conn.close()
    first, second = _read_all(black_vhost.amqp_url, 2)
    assert first == SIMPLE
    assert second == {"keep": 1}, "tables/arrays in stream headers: broker behaviour changed"


def test_streams_refuse_decimal_headers_by_closing_the_publisher(black_vhost) -> None:  # type: ignore[no-untyped-def]
    conn = _stream(black_vhost.amqp_url)
    ch = conn.channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.AMQPError):
        ch.basic_publish(
            "", "canary", b"d", pika.BasicProperties(headers={"d": decimal.Decimal("1.5")})
        )
    assert not conn.is_open


def test_fidelity_probe_reports_what_the_broker_does(black_vhost) -> None:  # type: ignore[no-untyped-def]
    """`diode check` runs this probe: it must agree with the canaries above and clean up."""
    from bridge.black.probe import probe_stream_fidelity
    from bridge.config import BlackConfig

    rep = probe_stream_fidelity(BlackConfig(amqp_url=black_vhost.amqp_url))
    assert rep.dropped == ["table", "array"] and rep.refused == ["decimal"]
    assert set(rep.kept) == {"string", "bytes", "int32", "int64", "bool", "timestamp", "void"}
    assert not rep.exact
    import urllib.parse

    import requests

    q = urllib.parse.quote(black_vhost.name, safe="")
    queues = requests.get(
        f"{black_vhost.management_url}/api/queues/{q}", auth=("guest", "guest"), timeout=10
    ).json()
    assert not [x["name"] for x in queues if x["name"].startswith("diode.probe.")]
