"""Demo, traffic: declare sample exchanges and publish varied messages into a black vhost.

The mix: a sensor stream of temperature events (JSON, topic exchange), fan-out events,
headers-routed audit records carrying every AMQP header type, direct-routed orders, every
basic property, empty bodies and multi-MB binary bodies.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pika
from pika.spec import BasicProperties

from bridge.black.broker import connect_url
from bridge.protocol.exchange import ExchangeDecl

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
    messages: list[tuple[str, str, BasicProperties, bytes]] = field(default_factory=list)


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


def _every_header_type(i: int) -> dict[str, Any]:
    """Every AMQP field type pika can send except decimals, which a RabbitMQ 3.10 stream
    refuses by closing the publisher's connection. The stream also drops the table and
    array entries below (docs/runbook.md, "Broker limits"); they show what red will miss."""
    return {
        "str": f"value-{i}",
        "unicode": "température °C ✓",
        "int32": -(2**31),
        "int64": 2**40 + i,
        "bool": bool(i % 2),
        "bytes": bytes([0, 255, i % 256]) + b"\x80\xfe",
        "timestamp": dt.datetime(2026, 11, 21, 12, 0, i % 60, tzinfo=dt.UTC),
        "none": None,
        "nested": {"a": 1, "b": [1, "two", {"three": b"\x03"}], "c": {"d": -7}},
        "array": [1, 2**33, "x", True, None, b"\x00"],
    }


def sample_messages(
    n: int, *, seed: int = 7, big_every: int = 0, big_bytes: int = 3 * 1024 * 1024
) -> Iterator[tuple[str, str, BasicProperties, bytes]]:
    """``n`` (exchange, routing key, properties, body) in a deterministic varied mix."""
    rnd = random.Random(seed)
    now = int(dt.datetime(2026, 11, 21, tzinfo=dt.UTC).timestamp())
    for i in range(n):
        kind = i % 10
        if big_every and i % big_every == big_every - 1:
            yield (
                "events",
                "",
                BasicProperties(
                    content_type="application/octet-stream", delivery_mode=2, message_id=f"big-{i}"
                ),
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
                BasicProperties(
                    content_type="application/json",
                    delivery_mode=2,
                    timestamp=now + i,
                    message_id=f"t-{i}",
                    app_id="thermo",
                ),
                body,
            )
        elif kind == 6:
            yield ("events", "", BasicProperties(), b"")  # empty body, no properties at all
        elif kind == 7:
            yield (
                "audit",
                "ignored",
                BasicProperties(
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
                BasicProperties(content_type="text/plain", delivery_mode=1, headers={"order": i}),
                f"order {i}".encode(),
            )
        else:
            yield (
                "orders",
                "order.unmirrored",  # a routing key black is not configured to carry
                BasicProperties(),
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
) -> Published:
    """Publish ``n`` sample messages (no confirms: callers check the stream tail instead)."""
    out = Published()
    conn = connect_url(url, purpose="demo-publish")
    try:
        ch = conn.channel()
        for ex, rk, props, body in sample_messages(n, seed=seed, big_every=big_every):
            if skip_unmirrored and rk == "order.unmirrored":
                continue
            ch.basic_publish(ex, rk, body, props, mandatory=False)
            out.count += 1
            out.body_bytes += len(body)
            out.by_exchange[ex] = out.by_exchange.get(ex, 0) + 1
            if keep:
                out.messages.append((ex, rk, props, body))
    except pika.exceptions.AMQPError as e:
        raise RuntimeError(f"demo publish failed after {out.count} messages: {e}") from e
    finally:
        if conn.is_open:
            conn.close()
    return out
