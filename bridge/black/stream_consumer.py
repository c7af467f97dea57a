"""Black, drain: read one offset range of a RabbitMQ stream queue with pika.

Streams are read, not drained: nothing is removed, so a replayed range yields the same
messages (as long as retention keeps them). Deliveries are acked only to keep the broker's
credit flowing. Messages before ``start`` (a stream starts delivery at a chunk boundary) are
skipped; the read stops at ``end`` (exclusive). If retention removed part of the range, the
first offset delivered is beyond ``start``: the missing seqs become gaps downstream. A read
that stalls raises BrokerError rather than returning short (which would lose offsets).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pika
import pika.exceptions
from pika.spec import Basic, BasicProperties

from bridge.errors import BrokerError
from bridge.logs import get_logger, log_event

__all__ = ["Delivery", "read_range", "connect"]

log = get_logger("bridge.black.stream_consumer")


@dataclass(frozen=True, slots=True)
class Delivery:
    offset: int
    exchange: str
    routing_key: str
    properties: BasicProperties
    body: bytes


def connect(url: str, *, what: str) -> pika.BlockingConnection:
    """Open a blocking connection; failures become BrokerError naming ``what`` (never the URL)."""
    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = 5
    params.blocked_connection_timeout = 30
    params.heartbeat = 60
    try:
        return pika.BlockingConnection(params)
    except pika.exceptions.AMQPError as e:
        raise BrokerError(
            f"cannot connect to RabbitMQ at {params.host}:{params.port} vhost "
            f"{params.virtual_host!r} for {what}: {type(e).__name__} {e}; check that the broker "
            "runs and black.amqp_url (host, port, vhost, credentials) is right"
        ) from None
    except OSError as e:
        raise BrokerError(
            f"cannot reach RabbitMQ at {params.host}:{params.port} for {what}: {e}"
        ) from None


def read_range(
    url: str,
    queue: str,
    start: int,
    end: int,
    *,
    prefetch: int = 2000,
    idle_timeout: float = 15.0,
) -> Iterator[Delivery]:
    """Yield the messages of ``queue`` with offsets in ``[start, end)``, in offset order."""
    if end <= start:
        return
    conn = connect(url, what=f"stream {queue!r} offsets {start}..{end - 1}")
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=prefetch)
        buf: collections.deque[tuple[Basic.Deliver, BasicProperties, bytes]] = collections.deque()

        def on_message(_ch, method, props, body):  # type: ignore[no-untyped-def]
            buf.append((method, props, body))

        ch.basic_consume(queue, on_message, auto_ack=False, arguments={"x-stream-offset": start})
        ack_every = max(1, prefetch // 2)
        unacked = 0
        idle_since = time.monotonic()
        while True:
            if not buf:
                conn.process_data_events(time_limit=0.25)
                if not buf:
                    if time.monotonic() - idle_since > idle_timeout:
                        # a short read would let Spark commit offsets never read: fail the
                        # task instead, so the micro-batch is retried from the same offsets
                        log_event(
                            log,
                            40,
                            "stream read stalled",
                            queue=queue,
                            start=start,
                            end=end,
                            idle_timeout=idle_timeout,
                        )
                        raise BrokerError(
                            f"stream {queue!r} stalled: no message for {idle_timeout:.0f}s while "
                            f"reading offsets {start}..{end - 1}; the micro-batch will be retried"
                        )
                    continue
            idle_since = time.monotonic()
            while buf:
                method, props, body = buf.popleft()
                unacked += 1
                if unacked >= ack_every:
                    ch.basic_ack(method.delivery_tag, multiple=True)
                    unacked = 0
                headers = props.headers or {}
                off = headers.get("x-stream-offset")
                if not isinstance(off, int):
                    raise BrokerError(
                        f"queue {queue!r} delivered a message without x-stream-offset: "
                        "is it really a stream queue (x-queue-type=stream)?"
                    )
                if off < start:
                    continue
                if off >= end:
                    return
                yield Delivery(off, method.exchange, method.routing_key, props, body)
                if off == end - 1:
                    return
    finally:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - closing a broken connection must not mask the cause
            pass
