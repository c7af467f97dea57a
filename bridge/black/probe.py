"""Black, preflight: which AMQP header types this broker's stream queues keep, drop or refuse.

A stream stores messages as AMQP 1.0; on RabbitMQ 3.10 that conversion drops table and array
header values and refuses decimals (closing the publisher's connection). The bridge cannot
carry what the broker never stored, so ``diode check`` measures it on the real broker: one
throw-away stream queue, one message per type, read back, compared, deleted.
"""

from __future__ import annotations

import datetime as dt
import decimal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions

from bridge.black.broker import connect
from bridge.config import BlackConfig

__all__ = ["FidelityReport", "probe_stream_fidelity", "PROBE_VALUES"]

PROBE_VALUES: dict[str, Any] = {
    "string": "é",
    "bytes": b"\x00\xff",
    "int32": -5,
    "int64": 2**40,
    "bool": True,
    "timestamp": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    "void": None,
    "table": {"a": 1},
    "array": [1, "x"],
}


@dataclass
class FidelityReport:
    """Header types kept exactly, dropped silently, or refused by the broker's streams."""

    kept: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.dropped and not self.refused


def probe_stream_fidelity(black: BlackConfig, *, timeout: float = 10.0) -> FidelityReport:
    """Publish one message per header type to a temporary stream and compare what comes back."""
    queue = f"diode.probe.{uuid.uuid4().hex[:12]}"
    report = FidelityReport()
    conn = connect(black, purpose="stream-probe")
    try:
        ch = conn.channel()
        ch.queue_declare(
            queue,
            durable=True,
            arguments={"x-queue-type": "stream", "x-max-length-bytes": 10_000_000},
        )
        ch.confirm_delivery()
        ch.basic_publish("", queue, b"probe", pika.BasicProperties(headers=dict(PROBE_VALUES)))
        ch.basic_qos(prefetch_count=10)
        got: list[dict[str, Any]] = []
        ch.basic_consume(
            queue,
            lambda _c, _m, p, _b: got.append(dict(p.headers or {})),
            arguments={"x-stream-offset": "first"},
        )
        deadline = time.monotonic() + timeout
        while not got and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.1)
        back = got[0] if got else {}
        for name, value in PROBE_VALUES.items():
            (report.kept if name in back and back[name] == value else report.dropped).append(name)
    finally:
        if conn.is_open:
            conn.close()
    # decimals close the publisher's connection on 3.10: probe them on a connection of their own
    conn = connect(black, purpose="stream-probe-decimal")
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        try:
            ch.basic_publish(
                "", queue, b"d", pika.BasicProperties(headers={"decimal": decimal.Decimal("1.5")})
            )
            report.kept.append("decimal")
        except pika.exceptions.AMQPError:
            report.refused.append("decimal")
    finally:
        if conn.is_open:
            conn.close()
    conn = connect(black, purpose="stream-probe-cleanup")
    try:
        conn.channel().queue_delete(queue)
    finally:
        if conn.is_open:
            conn.close()
    return report
