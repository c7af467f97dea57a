"""Protocol core (black builds, red reads): AMQP deliveries <-> Arrow rows of row schema v2.

Black: ``build_rows(channel, seqs, ...)`` turns a batch of spool records (Arrow arrays or
lists) into a RecordBatch of ``row_schema()``; ``RowBuilder`` does the same one delivery at a
time. Red: ``table_to_messages`` / ``row_to_message`` give back what to publish.

The row is exact because ``properties_raw`` holds the content header's property bytes as the
broker delivered them; red replays those bytes. Every other property column is derived from
them (``bridge.protocol.properties``) for queries:

* short-string properties are text, with U+FFFD where the wire bytes are not UTF-8;
* ``timestamp`` is AMQP's unsigned 64-bit field in an int64 column: values at or above 2**63
  are stored as ``value - 2**64`` (negative);
* ``headers_typed`` is typed JSON and ``headers`` its queryable text (``headers.py``); both are
  null exactly when the headers property is absent (an empty table is ``[]`` / an empty map);
* property bytes that do not decode (an unknown field type, a truncated table, ...) still
  travel in ``properties_raw``; their decoded columns are all null and they are counted
  (``RowBuilder.undecodable_rows``, ``build_rows(..., undecodable=[])``).

Decoding is columnar and cached: identical property blocks (common) are decoded once per
batch, and identical header tables once per batch even when other properties differ.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from bridge.errors import ProtocolError
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.headers import decode_typed, encode_typed, table_columns
from bridge.protocol.naming import check_channel
from bridge.protocol.properties import scan_properties
from bridge.protocol.schema import row_schema

__all__ = [
    "RowBuilder",
    "build_rows",
    "Message",
    "row_to_message",
    "table_to_messages",
    "UNKNOWN_EXCHANGE_TYPE",
]

UNKNOWN_EXCHANGE_TYPE = "unknown"

_U64 = 2**64
_I64_MAX = 2**63 - 1
_ROW_OVERHEAD = 96  # rough bytes per row besides body, routing key and property bytes
_SCHEMA = row_schema()
_HEADERS_TYPE = _SCHEMA.field("headers").type
_STRING_PROPS = (0, 1, 5, 6, 7, 8, 10, 11, 12, 13)  # indexes in properties.PROPERTY_NAMES
_NONE14: tuple[None, ...] = (None,) * 14
_MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class Message:
    """One AMQP message as red re-publishes it; ``(channel, seq)`` when it came from a row."""

    exchange: ExchangeDecl
    routing_key: str
    properties_raw: bytes
    body: bytes
    channel: str | None = None
    seq: int | None = None


# ---------------------------------------------------------------------------- black


def build_rows(
    channel: str,
    seqs: pa.Array | pa.ChunkedArray | Sequence[int],
    exchange_names: pa.Array | pa.ChunkedArray | Sequence[str],
    routing_keys: pa.Array | pa.ChunkedArray | Sequence[str],
    redelivered: pa.Array | pa.ChunkedArray | Sequence[bool],
    properties_raw: pa.Array | pa.ChunkedArray | Sequence[bytes],
    bodies: pa.Array | pa.ChunkedArray | Sequence[bytes],
    catalog: Mapping[str, ExchangeDecl],
    *,
    undecodable: list[int] | None = None,
) -> pa.RecordBatch:
    """Rows of ``row_schema()`` for one batch of deliveries, in the given order.

    ``catalog`` maps exchange names to their declarations (a name not in it gets type
    ``unknown``, not durable). ``seqs`` must be strictly increasing and >= 0; no input may
    hold nulls (ProtocolError naming the channel otherwise). Bodies are passed through
    without a copy when they are an Arrow binary array. The seqs of rows whose property
    bytes do not decode are appended to ``undecodable`` when it is given.
    """
    check_channel(channel)
    seq = _column(seqs, pa.int64(), "seq", channel)
    n = len(seq)
    names = _column(exchange_names, pa.string(), "exchange", channel)
    columns = (
        _column(routing_keys, pa.string(), "routing_key", channel),
        _column(redelivered, pa.bool_(), "redelivered", channel),
        _column(properties_raw, pa.binary(), "properties_raw", channel),
        _column(bodies, pa.binary(), "body", channel),
    )
    if any(len(c) != n for c in (names, *columns)):
        lengths = [len(c) for c in (seq, names, *columns)]
        raise ProtocolError(f"channel {channel!r}: build_rows got columns of lengths {lengths}")
    _check_seqs(channel, seq)
    encoded = pc.dictionary_encode(names)
    decls = []
    for name in encoded.dictionary.to_pylist():
        decls.append(_declaration(channel, name, catalog.get(name)))
    return _assemble(channel, seq, decls, encoded.indices, *columns, undecodable)


def _column(values: Any, type_: pa.DataType, name: str, channel: str) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        arr = values if values.type == type_ else values.cast(type_)
    else:
        try:
            arr = pa.array(values, type_)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
            raise ProtocolError(f"channel {channel!r}: column {name} is malformed: {e}") from None
    if arr.null_count:
        raise ProtocolError(f"channel {channel!r}: column {name} holds {arr.null_count} null(s)")
    return arr


def _check_seqs(channel: str, seq: pa.Array) -> None:
    if len(seq) == 0:
        return
    first = seq[0].as_py()
    if first < 0:
        raise ProtocolError(f"channel {channel!r}: seq {first} is negative")
    if len(seq) > 1 and not pc.all(pc.greater(seq[1:], seq[:-1])).as_py():
        bad = pc.index(pc.less_equal(seq[1:], seq[:-1]), True).as_py()
        raise ProtocolError(
            f"channel {channel!r}: seq {seq[bad + 1].as_py()} does not follow seq "
            f"{seq[bad].as_py()} (message seqs must be strictly increasing)"
        )


def _declaration(channel: str, name: str, decl: ExchangeDecl | None) -> ExchangeDecl:
    if decl is None:
        return ExchangeDecl(name=name, type=UNKNOWN_EXCHANGE_TYPE, durable=False)
    if decl.name != name:
        raise ProtocolError(
            f"channel {channel!r}: delivery from exchange {name!r} "
            f"was given the declaration of exchange {decl.name!r}"
        )
    return decl


def _assemble(
    channel: str,
    seq: pa.Array,
    decls: list[ExchangeDecl],
    xidx: pa.Array,
    routing_keys: pa.Array,
    redelivered: pa.Array,
    properties_raw: pa.Array,
    bodies: pa.Array,
    undecodable: list[int] | None,
) -> pa.RecordBatch:
    n = len(seq)
    encoded = pc.dictionary_encode(properties_raw)
    unique = encoded.dictionary
    prop_cols, bad = _property_columns(unique.to_pylist())
    if len(unique) != n:  # repeated blocks: expand the per-block columns
        prop_cols = [c.take(encoded.indices) for c in prop_cols]
        if bad and undecodable is not None:
            undecodable.extend(seq.filter(pa.array(bad).take(encoded.indices)).to_pylist())
    elif bad and undecodable is not None:
        undecodable.extend(seq.filter(pa.array(bad)).to_pylist())
    cols = [pa.repeat(pa.scalar(channel, pa.string()), n), seq]
    cols.extend(_exchange_columns(channel, decls, xidx))
    cols.extend((routing_keys, redelivered, properties_raw))
    cols.extend(prop_cols)
    cols.append(bodies)
    return pa.RecordBatch.from_arrays(cols, schema=_SCHEMA)


def _exchange_columns(channel: str, decls: list[ExchangeDecl], xidx: pa.Array) -> list[pa.Array]:
    arguments = []
    for d in decls:
        try:
            arguments.append(encode_typed(d.arguments))
        except ProtocolError as e:
            raise ProtocolError(f"channel {channel!r}: exchange {d.name!r} arguments: {e}") from e
    small = [
        pa.array([d.name for d in decls], pa.string()),
        pa.array([d.type for d in decls], pa.string()),
        pa.array([bool(d.durable) for d in decls], pa.bool_()),
        pa.array([bool(d.auto_delete) for d in decls], pa.bool_()),
        pa.array([bool(d.internal) for d in decls], pa.bool_()),
        pa.array(arguments, pa.string()),
    ]
    if len(decls) == 1:
        n = len(xidx)
        return [pa.repeat(a[0], n) for a in small]
    return [a.take(xidx) for a in small]


def _property_columns(blocks: list[bytes]) -> tuple[list[pa.Array], list[bool] | None]:
    """The 15 derived columns (13 properties, headers_typed, headers) for each block, and a
    per-block undecodable flag list (None when every block decoded)."""
    # the loop allocates many small acyclic objects: cyclic GC passes would cost a third
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _property_columns_nogc(blocks)
    finally:
        if enabled:
            gc.enable()


def _property_columns_nogc(blocks: list[bytes]) -> tuple[list[pa.Array], list[bool] | None]:
    rows: list[Any] = []
    typed: list[str | None] = []
    offsets = [0]
    keys: list[str] = []
    values: list[str | None] = []
    bad: list[bool] | None = None
    tables: dict[bytes, Any] = {}
    for i, raw in enumerate(blocks):
        try:
            vals = scan_properties(raw)
            table = vals[2]
            if table is not None:
                entry = tables.get(table, _MISSING)
                if entry is _MISSING:
                    entry = tables[table] = _headers_entry(table)
                if entry is None:
                    raise ProtocolError("headers table does not decode")
        except ProtocolError:
            if bad is None:
                bad = [False] * len(blocks)
            bad[i] = True
            rows.append(_NONE14)
            typed.append(None)
            offsets.append(len(keys))
            continue
        rows.append(vals)
        if table is None:
            typed.append(None)
        else:
            typed.append(entry[0])
            keys.extend(entry[1])
            values.extend(entry[2])
        offsets.append(len(keys))
    per_prop = list(zip(*rows, strict=True)) if rows else [()] * 14
    cols: list[pa.Array] = []
    for i in range(14):
        if i in _STRING_PROPS:
            cols.append(_strings(per_prop[i]))
        elif i == 3 or i == 4:
            cols.append(pa.array(per_prop[i], pa.int32()))
        elif i == 9:
            cols.append(_timestamps(per_prop[i]))
    typed_arr = pa.array(typed, pa.string())
    cols.append(typed_arr)
    cols.append(
        pa.MapArray.from_arrays(
            pa.array(offsets, pa.int32()),
            pa.array(keys, pa.string()),
            pa.array(values, pa.string()),
            type=_HEADERS_TYPE,
            mask=typed_arr.is_null(),
        )
    )
    return cols, bad


def _headers_entry(table_bytes: bytes) -> tuple[str, list[str], list[str | None]] | None:
    try:
        return table_columns(table_bytes)
    except ProtocolError:
        return None


def _strings(values: Sequence[Any]) -> pa.Array:
    try:
        return pa.array(values, pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # bytes that are not UTF-8
        return pa.array(
            [v.decode("utf-8", "replace") if type(v) is bytes else v for v in values],
            pa.string(),
        )


def _timestamps(values: Sequence[int | None]) -> pa.Array:
    try:
        return pa.array(values, pa.int64())
    except (OverflowError, pa.ArrowInvalid):
        wrapped = [v - _U64 if v is not None and v > _I64_MAX else v for v in values]
        return pa.array(wrapped, pa.int64())


class RowBuilder:
    """Accumulates deliveries of one channel and builds them into rows (not thread-safe).

    ``append`` only stores references; ``to_batch`` does the columnar work of
    ``build_rows``. ``seq`` must be strictly increasing across the builder's life (also
    across ``clear``). Unlike ``build_rows``, each row keeps the declaration it was appended
    with, so a re-declared exchange is described per row.
    """

    __slots__ = (
        "channel",
        "undecodable_rows",
        "_seqs",
        "_xidx",
        "_rks",
        "_redelivered",
        "_props",
        "_bodies",
        "_nbytes",
        "_last_seq",
        "_counted_through",
        "_xcache",
        "_xdecls",
    )

    def __init__(self, channel: str) -> None:
        self.channel = check_channel(channel)
        self.undecodable_rows = 0
        """Rows (counted once, by ``to_batch``) whose property bytes did not decode."""
        self._last_seq = -1
        self._counted_through = -1
        self._xcache: dict[str, tuple[ExchangeDecl | None, int]] = {}
        self._xdecls: list[ExchangeDecl] = []
        self.clear()

    def clear(self) -> None:
        """Forget the appended rows (the last seq is kept: seqs are never reused)."""
        self._seqs: list[int] = []
        self._xidx: list[int] = []
        self._rks: list[str] = []
        self._redelivered: list[bool] = []
        self._props: list[bytes] = []
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
        """Uncompressed size estimate of the appended rows."""
        return self._nbytes

    def append(
        self,
        seq: int,
        exchange: ExchangeDecl | None,
        exchange_name: str,
        routing_key: str,
        redelivered: bool,
        properties_raw: bytes,
        body: bytes,
    ) -> None:
        """Add one delivery; ``exchange`` is the catalog entry, None when it is unknown."""
        if not seq > self._last_seq:
            raise ProtocolError(
                f"channel {self.channel!r}: seq {seq!r} does not follow seq {self._last_seq} "
                "(message seqs must be strictly increasing)"
            )
        if seq > _I64_MAX:
            raise ProtocolError(f"channel {self.channel!r}: seq {seq} does not fit in 64 bits")
        if type(properties_raw) is not bytes or type(body) is not bytes:
            properties_raw, body = self._as_bytes(seq, properties_raw, body)
        cached = self._xcache.get(exchange_name)
        if cached is not None and cached[0] is exchange:
            xi = cached[1]
        else:
            xi = self._exchange_index(exchange, exchange_name)
        self._last_seq = seq
        self._seqs.append(seq)
        self._xidx.append(xi)
        self._rks.append(routing_key)
        self._redelivered.append(bool(redelivered))
        self._props.append(properties_raw)
        self._bodies.append(body)
        self._nbytes += len(body) + len(routing_key) + len(properties_raw) + _ROW_OVERHEAD

    def _as_bytes(self, seq: int, props: Any, body: Any) -> tuple[bytes, bytes]:
        for what, v in (("properties_raw", props), ("body", body)):
            if not isinstance(v, bytes | bytearray | memoryview):
                raise ProtocolError(
                    f"channel {self.channel!r} seq {seq}: {what} must be bytes, "
                    f"not {type(v).__name__}"
                )
        return bytes(props), bytes(body)

    def _exchange_index(self, exchange: ExchangeDecl | None, name: str) -> int:
        decl = _declaration(self.channel, name, exchange)
        try:
            index = self._xdecls.index(decl)
        except ValueError:
            self._xdecls.append(decl)
            index = len(self._xdecls) - 1
        self._xcache[name] = (exchange, index)
        return index

    def to_batch(self) -> pa.RecordBatch:
        """The appended rows as a RecordBatch of exactly ``row_schema()``."""
        bad: list[int] = []
        batch = _assemble(
            self.channel,
            pa.array(self._seqs, pa.int64()),
            self._xdecls,
            pa.array(self._xidx, pa.int32()),
            pa.array(self._rks, pa.string()),
            pa.array(self._redelivered, pa.bool_()),
            pa.array(self._props, pa.binary()),
            pa.array(self._bodies, pa.binary()),
            bad,
        )
        fresh = [s for s in bad if s > self._counted_through]
        self.undecodable_rows += len(fresh)
        if self._seqs:
            self._counted_through = max(self._counted_through, self._seqs[-1])
        return batch

    def to_table(self) -> pa.Table:
        """``to_batch()`` as a one-batch Table (what ``pack_bundle`` takes)."""
        return pa.Table.from_batches([self.to_batch()], schema=_SCHEMA)


# ---------------------------------------------------------------------------- red


def row_to_message(row: Mapping[str, Any]) -> Message:
    """The message a row describes (``row`` as from ``Table.to_pylist()``).

    Red publishes ``properties_raw`` byte for byte: it never re-encodes from the decoded
    columns, so rows whose property bytes did not decode on black replay unchanged too.
    """
    try:
        exchange = ExchangeDecl(
            name=row["exchange"],
            type=row["exchange_type"],
            durable=row["exchange_durable"],
            auto_delete=row["exchange_auto_delete"],
            internal=row["exchange_internal"],
            arguments=decode_typed(row["exchange_arguments"]) or {},
        )
        return _message(
            exchange,
            row["routing_key"],
            row["properties_raw"],
            row["body"],
            row["channel"],
            row["seq"],
        )
    except KeyError as e:
        raise ProtocolError(
            f"row channel={row.get('channel')!r} seq={row.get('seq')!r} lacks column {e}"
        ) from None
    except ProtocolError as e:
        where = f"row channel={row.get('channel')!r} seq={row.get('seq')!r}"
        raise ProtocolError(f"{where}: {e}") from e


def _message(
    exchange: ExchangeDecl, routing_key: Any, props: Any, body: Any, channel: Any, seq: Any
) -> Message:
    if type(props) is not bytes or type(body) is not bytes or type(routing_key) is not str:
        raise ProtocolError("properties_raw and body must be bytes and routing_key text")
    return Message(exchange, routing_key, props, body, channel, seq)


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
    rest = zip(
        c["routing_key"], c["properties_raw"], c["body"], c["channel"], c["seq"], strict=True
    )
    for i, (xkey, (rk, props, body, channel, seq)) in enumerate(zip(xkeys, rest, strict=True)):
        decl = exchanges.get(xkey)
        if decl is None:
            decl = exchanges[xkey] = row_to_message({n: col[i] for n, col in c.items()}).exchange
        try:
            yield _message(decl, rk, props, body, channel, seq)
        except ProtocolError as e:
            raise ProtocolError(f"row channel={channel!r} seq={seq!r}: {e}") from e


_EXCHANGE_COLUMNS = (
    "exchange",
    "exchange_type",
    "exchange_durable",
    "exchange_auto_delete",
    "exchange_internal",
    "exchange_arguments",
)
_MESSAGE_COLUMNS = (
    "channel",
    "seq",
    *_EXCHANGE_COLUMNS,
    "routing_key",
    "properties_raw",
    "body",
)
