"""Black, drain: spool positions -> message rows (row schema v2) plus lost markers for the sealer.

A spool record's position is its message ``seq``. Records of kind *lost* (a message the
broker dropped from the mirror queue) become rows with ``lost_reason`` set and empty
properties and body: the sealer turns their seqs into gaps and never ships them as messages.
A message whose property bytes do not decode (protocol §5) is a row like any other, with
``undecodable`` set: the sealer counts it once its bundle ships.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from bridge.black.spool import SpoolReader
from bridge.logs import get_logger, log_event
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.properties import NO_PROPERTIES
from bridge.protocol.rows import build_rows
from bridge.protocol.schema import row_schema

__all__ = [
    "LOST_REASON",
    "INEXACT_REASON",
    "UNDECODABLE",
    "source_schema",
    "spool_batch_to_rows",
    "read_rows",
]

log = get_logger("bridge.black.spool_rows")

LOST_REASON = "lost_reason"
INEXACT_REASON = "inexact_reason"
UNDECODABLE = "undecodable"


def source_schema() -> pa.Schema:
    """Spool records as rows: row schema v2 + ``lost_reason`` (a lost marker),
    ``inexact_reason`` (a message carried, but not byte-exact as published) and
    ``undecodable`` (true: its property bytes do not decode; all null in a batch without)."""
    s = row_schema()
    s = s.append(pa.field(LOST_REASON, pa.string(), nullable=True))
    s = s.append(pa.field(INEXACT_REASON, pa.string(), nullable=True))
    return s.append(pa.field(UNDECODABLE, pa.bool_(), nullable=True))


def spool_batch_to_rows(
    channel: str, batch: pa.RecordBatch, catalog: Mapping[str, ExchangeDecl]
) -> pa.RecordBatch:
    """One spool record batch as source rows (same order, ``seq`` = position)."""
    lost = pc.equal(batch.column("kind"), 1)
    any_lost = bool(pc.any(lost).as_py())
    props = batch.column("properties_raw")
    if any_lost:
        props = pc.if_else(lost, pa.scalar(NO_PROPERTIES, pa.binary()), props)
    bad: list[int] = []
    rows = build_rows(
        channel,
        batch.column("pos"),
        batch.column("exchange"),
        batch.column("routing_key"),
        batch.column("redelivered"),
        props,
        batch.column("body"),
        catalog,
        undecodable=bad,
    )
    if bad:
        undecodable = pc.is_in(rows.column("seq"), value_set=pa.array(bad, pa.int64()))
    else:
        undecodable = pa.nulls(len(batch), pa.bool_())
    reason = batch.column("reason")
    none = pa.scalar(None, pa.string())
    if any_lost:  # a lost record is a gap whatever its reason says ("lost" if it says nothing)
        lost_reasons = pc.if_else(lost, pc.fill_null(reason, "lost"), none)
    else:
        lost_reasons = pa.nulls(len(batch), pa.string())
    if reason.null_count == len(batch):
        inexact = pa.nulls(len(batch), pa.string())
    else:
        inexact = pc.if_else(lost, none, reason)
    return pa.RecordBatch.from_arrays(
        [*rows.columns, lost_reasons, inexact, undecodable], schema=source_schema()
    )


def read_rows(
    spool_root: Path,
    channel: str,
    start: int,
    end: int,
    catalog: Mapping[str, ExchangeDecl],
    *,
    batch_rows: int = 8192,
) -> Iterator[pa.RecordBatch]:
    """Spool positions ``[start, end)`` of ``channel`` as source rows."""
    reader = SpoolReader(Path(spool_root), channel)
    n = 0
    for batch in reader.read(start, end, batch_rows=batch_rows):
        n += batch.num_rows
        yield spool_batch_to_rows(channel, batch, catalog)
    if n != end - start:
        # SpoolReader guarantees the range or raises; this would be a bug, never silent
        log_event(log, 50, "spool range read short", channel=channel, start=start, end=end, rows=n)
