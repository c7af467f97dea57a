"""Demo, traffic: declare sample exchanges and publish varied messages into a black vhost.

The mix: a sensor stream of temperature events (JSON, topic exchange), fan-out events,
headers-routed audit records carrying every AMQP 0-9-1 header type (floats, doubles and
decimals included, which pika cannot send), direct-routed orders, every basic property, empty
bodies and multi-MB binary bodies. Messages are (exchange, routing key, property bytes, body)
and go out through the bridge's own AMQP client with publisher confirms.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from bridge.amqp.client import Connection
from bridge.black.broker import connect_url
from bridge.errors import BrokerError
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.properties import (
    ByteArray,
    Float32,
    Float64,
    Int8,
    Int16,
    LongString,
    Properties,
    Timestamp,
    UInt8,
    UInt16,
    UInt32,
    encode_properties,
    field_table,
)

__all__ = [
    "DEMO_EXCHANGES",
    "DEMO_DIRECT_KEYS",
    "Published",
    "declare_exchanges",
    "publish_mix",
    "sample_messages",
]

DEMO_EXCHANGES = (
    ExchangeDecl("sensors", "topic", durable=True),
    ExchangeDecl("events", "fanout", durable=True, arguments={"alternate-exchange": "unrouted"}),
    ExchangeDecl("audit", "headers", durable=True),
    ExchangeDecl("orders", "direct", durable=True),
    ExchangeDecl("unrouted", "fanout", durable=True),
)
DEMO_DIRECT_KEYS = {"orders": ["order.created", "order.cancelled"]}


@dataclass
class Published:
    """What the generator sent (for the summary and for tests that compare field by field)."""

    count: int = 0
    body_bytes: int = 0
    by_exchange: dict[str, int] = field(default_factory=dict)
    messages: list[tuple[str, str, bytes, bytes]] = field(default_factory=list)
    """(exchange, routing key, property bytes, body), with ``keep=True``."""


def declare_exchanges(url: str) -> None:
    conn = connect_url(url, purpose="demo-declare")
    try:
        ch = conn.channel()
        for x in DEMO_EXCHANGES:
            ch.exchange_declare(
                x.name,
                x.type,
                durable=x.durable,
                auto_delete=x.auto_delete,
                internal=x.internal,
                arguments=x.arguments or None,
            )
    finally:
        conn.close()


def _every_header_type(i: int) -> Any:
    """A header table with every AMQP 0-9-1 field type, nested tables and arrays included."""
    return field_table(
        {
            "str": f"value-{i}",
            "unicode": "température °C ✓",
            "not-utf8": LongString(b"\xff\xfe raw"),
            "int8": Int8(-7), "uint8": UInt8(200), "int16": Int16(-300), "uint16": UInt16(60000),
            "int32": -(2**31), "uint32": UInt32(4_000_000_000), "int64": 2**40 + i,
            "float": Float32(1.5), "double": Float64(-273.15), "decimal": Decimal("19.990"),
            "bool": bool(i % 2),
            "bytes": ByteArray(bytes([0, 255, i % 256]) + b"\x80\xfe"),
            "timestamp": Timestamp(dt.datetime(2026, 11, 21, 12, 0, i % 60, tzinfo=dt.UTC)),
            "none": None,
            "nested": {"a": 1, "b": [1, "two", {"three": ByteArray(b"\x03")}], "c": {"d": -7}},
            "array": [1, 2**33, "x", True, None, ByteArray(b"\x00"), Float64(0.1)],
        }
    )  # fmt: skip


def _p(**kw: Any) -> bytes:
    return encode_properties(Properties(**kw))


def sample_messages(
    n: int, *, seed: int = 7, big_every: int = 0, big_bytes: int = 3 * 1024 * 1024
) -> Iterator[tuple[str, str, bytes, bytes]]:
    """``n`` (exchange, routing key, property bytes, body) in a deterministic varied mix."""
    rnd = random.Random(seed)
    now = int(dt.datetime(2026, 11, 21, tzinfo=dt.UTC).timestamp())
    for i in range(n):
        kind = i % 10
        if big_every and i % big_every == big_every - 1:
            yield (
                "events",
                "",
                _p(content_type="application/octet-stream", delivery_mode=2, message_id=f"big-{i}"),
                os.urandom(big_bytes),
            )
        elif kind < 6:
            sensor = f"s{rnd.randrange(40):02d}"
            body = json.dumps(
                {"sensor": sensor, "celsius": round(rnd.gauss(21.0, 4.0), 2), "seq": i}
            ).encode()
            yield (
                "sensors",
                f"site{rnd.randrange(3)}.temp.{sensor}",
                _p(
                    content_type="application/json",
                    delivery_mode=2,
                    timestamp=now + i,
                    message_id=f"t-{i}",
                    app_id="thermo",
                ),
                body,
            )
        elif kind == 6:
            yield ("events", "", _p(), b"")  # empty body, no properties at all
        elif kind == 7:
            yield (
                "audit",
                "ignored",
                _p(
                    content_type="application/x-audit",
                    content_encoding="identity",
                    headers=_every_header_type(i),
                    delivery_mode=2,
                    priority=i % 10,
                    correlation_id=f"corr-{i}",
                    reply_to="audit.replies",
                    expiration="600000",
                    message_id=f"audit-{i}",
                    timestamp=now + i,
                    type="audit.record",
                    user_id="guest",
                    app_id="auditor",
                ),
                bytes(rnd.getrandbits(8) for _ in range(64)),
            )  # binary, not UTF-8
        elif kind == 8:
            key = DEMO_DIRECT_KEYS["orders"][i % 2]
            yield (
                "orders",
                key,
                _p(content_type="text/plain", delivery_mode=1, headers=field_table({"order": i})),
                f"order {i}".encode(),
            )
        else:
            yield (
                "orders",
                "order.unmirrored",  # a routing key black is not configured to carry
                _p(),
                b"not mirrored",
            )


def publish_mix(
    url: str,
    n: int,
    *,
    keep: bool = False,
    big_every: int = 0,
    seed: int = 7,
    skip_unmirrored: bool = True,
    window: int = 1000,
) -> Published:
    """Publish ``n`` sample messages with publisher confirms (``window`` in flight); returns
    once the broker confirmed every one (a nack raises)."""
    out = Published()
    conn = Connection.open(url, client_name="diode-demo-publisher")
    try:
        ch = conn.channel()
        ch.confirm_select()
        sent = confirmed = 0
        for ex, rk, props, body in sample_messages(n, seed=seed, big_every=big_every):
            if skip_unmirrored and rk == "order.unmirrored":
                continue
            sent = ch.publish(ex, rk, props, body)
            out.count += 1
            out.body_bytes += len(body)
            out.by_exchange[ex] = out.by_exchange.get(ex, 0) + 1
            if keep:
                out.messages.append((ex, rk, props, body))
            while sent - confirmed >= window:
                confirmed = _confirmed(conn, confirmed, 0.5)
        while confirmed < sent:
            confirmed = _confirmed(conn, confirmed, 1.0)
    except BrokerError as e:
        raise BrokerError(f"demo publish failed after {out.count} messages: {e}") from e
    finally:
        conn.close()
    return out


def _confirmed(conn: Connection, confirmed: int, timeout: float) -> int:
    for c in conn.poll(timeout).confirms:
        if not c.ack:
            raise BrokerError(f"the broker nacked demo message {c.delivery_tag}")
        confirmed = max(confirmed, c.delivery_tag)
    return confirmed
