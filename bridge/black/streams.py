"""Black, drain: a channel's RabbitMQ stream queue — its bounds and offset-range reads.

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
import pyarrow as pa
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import Basic, BasicProperties

from bridge.black.broker import connect, connect_url, connection_parameters
from bridge.black.plan import stream_queue_name
from bridge.config import Config
from bridge.errors import BrokerError
from bridge.logs import get_logger, log_event
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.rows import RowBuilder

__all__ = ["Delivery", "read_batches", "read_range", "stream_bounds", "stream_tail"]

log = get_logger("bridge.black.streams")


@dataclass(frozen=True, slots=True)
class Delivery:
    offset: int
    exchange: str
    routing_key: str
    properties: BasicProperties
    body: bytes


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
    conn = connect_url(url, purpose=f"read-{queue}")
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


def _offset(props: pika.BasicProperties) -> int:
    return int((props.headers or {})["x-stream-offset"])


def stream_bounds(
    cfg: Config,
    channel: str,
    *,
    empty_wait: float = 0.5,
    idle: float = 0.2,
    settle: float = 0.5,
    max_wait: float = 5.0,
) -> tuple[int, int]:
    """``(first retained offset, next offset)`` of a channel's stream; ``(0, 0)`` when empty.

    Read from deliveries, not from ``message_count`` (which lags and counts offsets): one
    consumer at ``first`` takes the first retained message, one at ``last`` drains the last
    chunk until ``idle`` seconds pass without a delivery (at most ``settle`` seconds after its
    first delivery: on a busy stream new chunks keep coming). ``next`` is the last *message*
    offset + 1, so ``next - 1`` is always a real message (offset holes sit between segments).
    On a busy stream ``next`` is a lower bound of the true tail, never beyond it. An empty
    stream costs ``empty_wait`` seconds.
    """
    cfg.channel(channel)
    queue = stream_queue_name(cfg.black, channel)
    vhost = connection_parameters(cfg.black, "stream-bounds").virtual_host
    conn = connect(cfg.black, purpose="stream-bounds")
    try:
        probe = conn.channel()
        try:
            count = probe.queue_declare(queue, passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code == 404:
                raise BrokerError(
                    f"stream queue {queue!r} of channel {channel!r} does not exist in vhost "
                    f"{vhost!r}: run the mirror (the black job) first"
                ) from None
            raise
        first: list[int] = []
        last: list[int] = []
        c1 = conn.channel()
        c1.basic_qos(prefetch_count=1)
        c1.basic_consume(
            queue,
            lambda c, m, p, b: first.append(_offset(p)),
            arguments={"x-stream-offset": "first"},
        )
        c2 = conn.channel()
        c2.basic_qos(prefetch_count=2000)

        def on_last(c: BlockingChannel, m: Any, p: pika.BasicProperties, b: bytes) -> None:
            last.append(_offset(p))
            c.basic_ack(m.delivery_tag)

        c2.basic_consume(queue, on_last, arguments={"x-stream-offset": "last"})
        start = seen_at = time.monotonic()
        began_at: float | None = None
        seen = 0
        while True:
            conn.process_data_events(time_limit=0.02)
            now = time.monotonic()
            if len(last) != seen:
                seen, seen_at = len(last), now
                began_at = began_at or now
            if first and began_at and (now - seen_at >= idle or now - began_at >= settle):
                break
            if not first and not last and now - start >= (empty_wait if count == 0 else max_wait):
                if count:
                    raise BrokerError(
                        f"stream queue {queue!r} reports {count} messages but delivered none "
                        f"in {max_wait}s; retrying may help"
                    )
                return (0, 0)
            if now - start >= max_wait:
                break
        if not first or not last:
            # never guess a bound: a made-up tail could look like a re-created stream
            raise BrokerError(
                f"stream queue {queue!r}: bounds incomplete after {max_wait}s (first offset "
                f"{'seen' if first else 'missing'}, tail {'seen' if last else 'missing'}); "
                "retrying may help"
            )
        return (first[0], max(last) + 1)
    except pika.exceptions.AMQPError as e:
        raise BrokerError(
            f"RabbitMQ failed while reading the bounds of stream {queue!r} ({type(e).__name__}); "
            "retrying may help"
        ) from None
    finally:
        if conn.is_open:
            try:
                conn.close()  # never stop_consuming(): streams refuse the rejects (NOTES.md)
            except pika.exceptions.AMQPError:
                pass


def stream_tail(cfg: Config, channel: str) -> int:
    """The next offset to be written in the channel's stream (see :func:`stream_bounds`)."""
    return stream_bounds(cfg, channel)[1]


def read_batches(
    url: str,
    queue: str,
    channel: str,
    start: int,
    end: int,
    catalog: Mapping[str, ExchangeDecl],
    *,
    batch_rows: int = 8192,
) -> Iterator[pa.RecordBatch]:
    """Offsets ``[start, end)`` of a stream as message-row batches (``seq`` = offset for now:
    the sealer numbers them). Lossy rows (non-UTF-8 short strings) are logged."""
    builder = RowBuilder(channel)
    for d in read_range(url, queue, start, end):
        builder.append(
            d.offset, catalog.get(d.exchange), d.exchange, d.routing_key, d.properties, d.body
        )
        if len(builder) >= batch_rows:
            yield builder.to_batch()
            builder.clear()
    if len(builder):
        yield builder.to_batch()
    if builder.lossy_rows:
        # short-string properties that were not UTF-8 had to be stored with U+FFFD
        log_event(
            log, 30, "messages with non-UTF-8 short-string properties stored lossily",
            channel=channel, start=start, end=end, lossy_rows=builder.lossy_rows,
        )  # fmt: skip
