"""Protocol core (black builds, red reads): AMQP message <-> Arrow row of ``row_schema()``.

Black: ``RowBuilder(channel).append(seq, ...)`` per delivery, then ``to_batch()``.
Red:   ``table_to_messages(table)`` / ``row_to_message(row)`` give back what to publish.

Exactness rules (DESIGN.md 3.1), and the two places where the row cannot be exact:

* headers travel as typed JSON (``headers.encode_typed``) plus a queryable map;
* the broker-added header ``x-stream-offset`` (every stream delivery carries it) is
  stripped, and a headers table that is empty after that is stored as **null**: black
  cannot tell "no headers" from "empty table" once the broker has added its own;
* ``timestamp`` is an unsigned 64-bit AMQP field in a signed int64 column: values at or
  above 2**63 are stored as ``value - 2**64`` (negative) and restored on the way out;
* a short-string property (message id, type, ...) that is not UTF-8 (pika hands it over
  as bytes) cannot live in a string column: it is stored with U+FFFD replacements and
  counted in ``RowBuilder.lossy_rows`` so the caller can count and audit it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pika.spec import BasicProperties

from bridge.errors import ProtocolError
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.headers import decode_typed, encode_typed, typed_into
from bridge.protocol.naming import check_channel
from bridge.protocol.schema import ROW_SCHEMA_VERSION, row_schema

__all__ = [
    "RowBuilder",
    "Message",
    "row_to_message",
    "table_to_messages",
    "STREAM_OFFSET_HEADER",
    "UNKNOWN_EXCHANGE_TYPE",
]

STREAM_OFFSET_HEADER = "x-stream-offset"
UNKNOWN_EXCHANGE_TYPE = "unknown"

_U64 = 2**64
_I64_MAX = 2**63 - 1
_ROW_OVERHEAD = 96  # rough bytes per row besides body, routing key and headers

# short-string basic properties, in schema order, around the two int ones
_STR_PROPS = ("content_type", "content_encoding")
_STR_PROPS2 = ("correlation_id", "reply_to", "expiration", "message_id")
_STR_PROPS3 = ("type", "user_id", "app_id", "cluster_id")


@dataclass(frozen=True, slots=True)
class Message:
    """One AMQP message as red re-publishes it; ``(channel, seq)`` when it came from a row."""

    exchange: ExchangeDecl
    routing_key: str
    properties: BasicProperties
    body: bytes
    channel: str | None = None
    seq: int | None = None


class RowBuilder:
    """Columnar accumulator of message rows for one channel (not thread-safe).

    ``append`` only stores references (cheap); the columns are built in ``to_batch``.
    Do not mutate a ``properties`` object after appending it. ``seq`` must be strictly
    increasing across the builder's life (also across ``clear``).
    """

    __slots__ = (
        "channel",
        "schema_version",
        "lossy_rows",
        "_schema",
        "_seqs",
        "_offsets",
        "_xidx",
        "_rks",
        "_props",
        "_bodies",
        "_nbytes",
        "_last_seq",
        "_xcache",
        "_xdecls",
    )

    def __init__(self, channel: str, *, schema_version: int = ROW_SCHEMA_VERSION) -> None:
        self.channel = check_channel(channel)
        self.schema_version = schema_version
        self._schema = row_schema(schema_version)
        self.lossy_rows = 0
        """Rows whose string properties were not UTF-8 and were stored with replacements."""
        self._last_seq = -1
        self._xcache: dict[str, tuple[ExchangeDecl | None, int]] = {}
        self._xdecls: list[ExchangeDecl] = []
        self.clear()

    def clear(self) -> None:
        """Forget the appended rows (the last seq is kept: seqs are never reused)."""
        self._seqs: list[int] = []
        self._offsets: list[int] = []
        self._xidx: list[int] = []
        self._rks: list[str] = []
        self._props: list[BasicProperties] = []
        self._bodies: list[bytes] = []
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def last_seq(self) -> int | None:
        """The highest seq appended so far (kept across ``clear``), None before the first."""
        return None if self._last_seq < 0 else self._last_seq

    @property
    def nbytes_estimate(self) -> int:
        """Uncompressed size estimate of the appended rows: bodies, routing keys, overhead."""
        return self._nbytes

    def append(
        self,
        seq: int,
        exchange: ExchangeDecl | None,
        exchange_name: str,
        routing_key: str,
        properties: BasicProperties,
        body: bytes,
        stream_offset: int | None = None,
    ) -> None:
        """Add one delivery; ``exchange`` is the catalog entry, None when it is unknown.

        ``stream_offset`` is where black read it (defaults to ``seq``: black drains with
        seq = offset and renumbers seqs gaplessly when it seals).
        """
        if not seq > self._last_seq:
            raise ProtocolError(
                f"channel {self.channel!r}: seq {seq!r} does not follow seq {self._last_seq} "
                "(message seqs must be strictly increasing)"
            )
        if seq > _I64_MAX:
            raise ProtocolError(f"channel {self.channel!r}: seq {seq} does not fit in 64 bits")
        cached = self._xcache.get(exchange_name)
        if cached is not None and cached[0] is exchange:
            xi = cached[1]
        else:
            xi = self._exchange_index(seq, exchange, exchange_name)
        self._last_seq = seq
        self._seqs.append(seq)
        self._offsets.append(seq if stream_offset is None else stream_offset)
        self._xidx.append(xi)
        self._rks.append(routing_key)
        self._props.append(properties)
        self._bodies.append(body)
        self._nbytes += len(body) + len(routing_key) + _ROW_OVERHEAD

    def _exchange_index(self, seq: int, exchange: ExchangeDecl | None, name: str) -> int:
        if exchange is None:
            decl = ExchangeDecl(name=name, type=UNKNOWN_EXCHANGE_TYPE, durable=False)
        elif exchange.name != name:
            raise ProtocolError(
                f"channel {self.channel!r} seq {seq}: delivery from exchange {name!r} "
                f"was given the declaration of exchange {exchange.name!r}"
            )
        else:
            decl = exchange
        try:
            index = self._xdecls.index(decl)
        except ValueError:
            self._xdecls.append(decl)
            index = len(self._xdecls) - 1
        self._xcache[name] = (exchange, index)
        return index

    def to_batch(self) -> pa.RecordBatch:
        """The appended rows as a RecordBatch of exactly ``row_schema(schema_version)``."""
        n = len(self._seqs)
        props = self._props
        cols: list[pa.Array] = [
            pa.array([self.channel] * n, pa.string()),
            pa.array(self._seqs, pa.int64()),
            pa.array(self._offsets, pa.int64()),
        ]
        cols.extend(self._exchange_columns())
        cols.append(self._strings(self._rks, "routing_key"))
        for name in _STR_PROPS:
            cols.append(self._strings([getattr(p, name) for p in props], name))
        cols.append(pa.array([p.delivery_mode for p in props], pa.int32()))
        cols.append(pa.array([p.priority for p in props], pa.int32()))
        for name in _STR_PROPS2:
            cols.append(self._strings([getattr(p, name) for p in props], name))
        cols.append(_timestamps([p.timestamp for p in props]))
        for name in _STR_PROPS3:
            cols.append(self._strings([getattr(p, name) for p in props], name))
        cols.extend(self._header_columns(props))
        cols.append(pa.array(self._bodies, pa.binary()))
        return pa.RecordBatch.from_arrays(cols, schema=self._schema)

    def _header_columns(self, props: list[BasicProperties]) -> list[pa.Array]:
        typed: list[str | None] = []
        offsets = [0]
        keys: list[str] = []
        values: list[str | None] = []
        for p in props:
            h = p.headers
            if h and STREAM_OFFSET_HEADER in h:
                h = {k: v for k, v in h.items() if k != STREAM_OFFSET_HEADER}
            typed.append(typed_into(h, keys, values) if h else None)
            offsets.append(len(keys))
        typed_arr = pa.array(typed, pa.string())
        rendered = pa.MapArray.from_arrays(
            pa.array(offsets, pa.int32()),
            pa.array(keys, pa.string()),
            pa.array(values, pa.string()),
            type=self._schema.field("headers").type,
            mask=typed_arr.is_null(),
        )
        return [typed_arr, rendered]

    def to_table(self) -> pa.Table:
        """``to_batch()`` as a one-batch Table (what ``pack_bundle`` takes)."""
        return pa.Table.from_batches([self.to_batch()], schema=self._schema)

    def _exchange_columns(self) -> list[pa.Array]:
        decls = self._xdecls
        idx = pa.array(self._xidx, pa.int32())
        small = [
            pa.array([d.name for d in decls], pa.string()),
            pa.array([d.type for d in decls], pa.string()),
            pa.array([bool(d.durable) for d in decls], pa.bool_()),
            pa.array([bool(d.auto_delete) for d in decls], pa.bool_()),
            pa.array([bool(d.internal) for d in decls], pa.bool_()),
            pa.array([encode_typed(d.arguments or None) for d in decls], pa.string()),
        ]
        return [a.take(idx) for a in small]

    def _strings(self, values: list[Any], column: str) -> pa.Array:
        try:
            return pa.array(values, pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
            pass
        fixed: list[str | None] = []
        for v in values:
            if isinstance(v, bytes):
                try:
                    v = v.decode("utf-8")
                except UnicodeDecodeError:
                    v = v.decode("utf-8", "replace")
                    self.lossy_rows += 1
            elif v is not None and not isinstance(v, str):
                raise ProtocolError(
                    f"channel {self.channel!r}: column {column} got a {type(v).__name__}, not str"
                )
            fixed.append(v)
        return pa.array(fixed, pa.string())


def _timestamps(values: list[int | None]) -> pa.Array:
    try:
        return pa.array(values, pa.int64())
    except (OverflowError, pa.ArrowInvalid):
        wrapped = [v - _U64 if v is not None and v > _I64_MAX else v for v in values]
        return pa.array(wrapped, pa.int64())


def row_to_message(row: dict[str, Any]) -> Message:
    """The message a row describes (``row`` as from ``Table.to_pylist()``)."""
    try:
        ts = row["timestamp"]
        arguments = decode_typed(row["exchange_arguments"]) or {}
        exchange = ExchangeDecl(
            name=row["exchange"],
            type=row["exchange_type"],
            durable=row["exchange_durable"],
            auto_delete=row["exchange_auto_delete"],
            internal=row["exchange_internal"],
            arguments=arguments,
        )
        props = BasicProperties(
            content_type=row["content_type"],
            content_encoding=row["content_encoding"],
            headers=decode_typed(row["headers_typed"]),
            delivery_mode=row["delivery_mode"],
            priority=row["priority"],
            correlation_id=row["correlation_id"],
            reply_to=row["reply_to"],
            expiration=row["expiration"],
            message_id=row["message_id"],
            timestamp=ts + _U64 if ts is not None and ts < 0 else ts,
            type=row["type"],
            user_id=row["user_id"],
            app_id=row["app_id"],
            cluster_id=row["cluster_id"],
        )
        return Message(
            exchange=exchange,
            routing_key=row["routing_key"],
            properties=props,
            body=row["body"],
            channel=row["channel"],
            seq=row["seq"],
        )
    except KeyError as e:
        raise ProtocolError(
            f"row channel={row.get('channel')!r} seq={row.get('seq')!r} lacks column {e}"
        ) from None
    except ProtocolError as e:
        where = f"row channel={row.get('channel')!r} seq={row.get('seq')!r}"
        raise ProtocolError(f"{where}: {e}") from e


def table_to_messages(
    table: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch], *, chunk_rows: int = 8192
) -> Iterator[Message]:
    """Messages of every row, in row order, converting ``chunk_rows`` rows at a time.

    Columnar: same result as ``row_to_message`` per row, several times faster.
    """
    if isinstance(table, pa.Table):
        batches: Iterable[pa.RecordBatch] = table.to_batches(max_chunksize=chunk_rows)
    elif isinstance(table, pa.RecordBatch):
        batches = [table]
    else:
        batches = table
    exchanges: dict[tuple[Any, ...], ExchangeDecl] = {}
    for batch in batches:
        for off in range(0, batch.num_rows, chunk_rows):
            yield from _chunk_messages(batch.slice(off, chunk_rows), exchanges)


def _chunk_messages(
    batch: pa.RecordBatch, exchanges: dict[tuple[Any, ...], ExchangeDecl]
) -> Iterator[Message]:
    try:
        c = {name: batch.column(name).to_pylist() for name in _MESSAGE_COLUMNS}
    except KeyError as e:
        raise ProtocolError(f"rows lack a column: {e}") from None
    xkeys = zip(*(c[n] for n in _EXCHANGE_COLUMNS), strict=True)
    plists = zip(*(c[n] for n in _PROPERTY_COLUMNS), strict=True)
    for i, (xkey, p) in enumerate(zip(xkeys, plists, strict=True)):
        decl = exchanges.get(xkey)
        if decl is None:
            decl = exchanges[xkey] = row_to_message(_row_at(c, i)).exchange
        try:
            headers = decode_typed(c["headers_typed"][i])
        except ProtocolError as e:
            raise ProtocolError(f"row channel={c['channel'][i]!r} seq={c['seq'][i]!r}: {e}") from e
        ts = p[8]
        if ts is not None and ts < 0:
            ts += _U64
        # positional, in BasicProperties.__init__ order (headers third)
        props = BasicProperties(p[0], p[1], headers, *p[2:8], ts, *p[9:])
        yield Message(
            exchange=decl,
            routing_key=c["routing_key"][i],
            properties=props,
            body=c["body"][i],
            channel=c["channel"][i],
            seq=c["seq"][i],
        )


def _row_at(columns: dict[str, list[Any]], i: int) -> dict[str, Any]:
    return {name: col[i] for name, col in columns.items()}


_EXCHANGE_COLUMNS = (
    "exchange",
    "exchange_type",
    "exchange_durable",
    "exchange_auto_delete",
    "exchange_internal",
    "exchange_arguments",
)
# BasicProperties.__init__ order without headers (the third argument)
_PROPERTY_COLUMNS = (
    "content_type",
    "content_encoding",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
    "cluster_id",
)
_MESSAGE_COLUMNS = (
    "channel",
    "seq",
    *_EXCHANGE_COLUMNS,
    "routing_key",
    *_PROPERTY_COLUMNS,
    "headers_typed",
    "body",
)
