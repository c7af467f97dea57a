"""Red, tables: Arrow schemas of the red Delta tables (messages, bundles, audit), row builders.

Pure: no I/O. Every timestamp is ``timestamp("us", tz="UTC")``: a zone-less timestamp
(``timestamp_ntz``) would raise a Delta table to reader 3 / writer 7, which older readers
refuse. ``messages`` repeats the wire row schema (``bridge.protocol.schema.row_schema(2)``)
and adds where and when red landed each row, and whether the row is byte-exact; ``bundles`` is
the ledger of every bundle file red judged; ``audit`` is the event log (one row per event, ids
deterministic so a re-applied landing writes the very same rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime
from typing import Any

import pyarrow as pa

from bridge.errors import DiodeError
from bridge.protocol.schema import row_schema

__all__ = [
    "ADDED_COLUMNS",
    "AUDIT_EVENTS",
    "AUDIT_PARTITIONS",
    "BUNDLE_STATUSES",
    "BUNDLES_PARTITIONS",
    "CHAIN_NOT_LANDED",
    "CHAIN_STATUSES",
    "MESSAGES_PARTITIONS",
    "MESSAGES_ROW_SCHEMA_VERSION",
    "TABLE_NAMES",
    "RedTableError",
    "audit_rows",
    "audit_schema",
    "bundles_rows",
    "bundles_schema",
    "messages_schema",
    "schema_for",
]


class RedTableError(DiodeError):
    """Data does not fit a red table (unknown or missing columns, nulls where none may be)."""


MESSAGES_ROW_SCHEMA_VERSION = 2
"""The wire row schema version whose columns open the ``messages`` table."""

TABLE_NAMES = ("messages", "bundles", "audit")
MESSAGES_PARTITIONS = ("exchange", "landed_date")
BUNDLES_PARTITIONS: tuple[str, ...] = ()
AUDIT_PARTITIONS = ("event_date",)
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {"messages": ("inexact",)}
"""Columns a later build added at the end of a table (nullable): ``RedTables.ensure`` adds them
to a table an earlier build created (its rows from before read as null) instead of refusing it."""

BUNDLE_STATUSES = ("landed", "duplicate", "conflict", "quarantined")
"""``bundles.status``: what red did with the file."""

CHAIN_STATUSES = ("first", "verified", "pending", "broken", "unverifiable")
"""``bundles.chain_status`` of a landed bundle: ``first`` (bundle 1, no predecessor),
``verified`` (prev_sha256 matches the landed predecessor), ``pending`` (predecessor not landed
yet), ``broken`` (mismatch), ``unverifiable`` (the predecessor was written off). Rows that did
not land carry ``CHAIN_NOT_LANDED``."""
CHAIN_NOT_LANDED = "n/a"
"""``bundles.chain_status`` of a row whose status is not ``landed`` (no chain to check)."""

AUDIT_EVENTS = (
    "received",  # a wire file was taken from the inbox (any kind, before any check)
    "landed",  # a bundle's rows were appended to messages
    "duplicate",  # a bundle already landed arrived again with the same plaintext: dropped
    "conflict",  # a bundle seq already landed arrived with another plaintext: quarantined
    "rejected",  # a file failed a check (name, signature, decryption, manifest, rows)
    "quarantined",  # a file was moved to quarantine/ (with a reason file)
    "gap_opened",  # bundle or message seqs are missing: red waits for them
    "gap_closed",  # a missing range arrived (late bundle or resend)
    "gap_declared",  # black declared a range lost (manifest gaps): accounted, never coming
    "gap_written_off",  # an operator declared missing bundles lost for good (diode red write-off)
    "channel_retired",  # an operator retired a channel removed from red's config (diode red retire)
    "channel_reinstated",  # a retired channel is configured again: watched from now on
    "request_refused",  # an operator request (write-off, retire) was refused when applied
    "chain_verified",  # prev_sha256 of a bundle matched its landed predecessor
    "chain_broken",  # prev_sha256 did not match: the bundle chain was forked or tampered with
    "chain_unverifiable",  # the predecessor of a landed bundle was written off: never checked
    "coverage_mismatch",  # a manifest's coverage disagrees with its rows and declared gaps
    "overlap_skipped",  # rows already landed by an earlier bundle were not appended again
    "heartbeat",  # a verified heartbeat arrived
    "heartbeat_replayed",  # a heartbeat not newer than the last one seen (stale or replayed)
    "missing_last_bundle",  # a heartbeat names a bundle seq red never received
    "link_silent",  # no heartbeat for longer than red.link_silent_seconds
    "link_resumed",  # a heartbeat after a silence
    "transport_gap",  # the UDP receiver gave up an object (expired, undecodable, disk error)
    "approved",  # an operator approved an exchange for replay
    "revoked",  # an operator revoked an approval
    "replayed",  # the replay publisher published a range of rows to the red broker
    "replay_failed",  # the replay publisher could not publish (broker refused, unroutable)
    "replay_gap_passed",  # the replay went past an open gap after holding it gap_hold_seconds
    "replayed_out_of_order",  # rows published below a seq of their channel already published
    "replay_rewound",  # an operator moved an exchange's replay progress back (diode red rewind)
)
"""Every ``audit.event`` the bridge writes; the comment says when."""

_S, _I64, _B = pa.string(), pa.int64(), pa.bool_()
_TS = pa.timestamp("us", tz="UTC")
_DATE = pa.date32()


def messages_schema() -> pa.Schema:
    """The wire row columns (v2, same order and nullability, no metadata), then red's columns."""
    wire = row_schema(MESSAGES_ROW_SCHEMA_VERSION).remove_metadata()
    red = [
        pa.field("bundle_seq", _I64, nullable=False),
        pa.field("bundle_id", _S, nullable=False),
        pa.field("land_seq", _I64, nullable=False),  # landing that wrote it; replay tails it
        pa.field("landed_at", _TS, nullable=False),
        pa.field("landed_date", _DATE, nullable=False),  # partition
        pa.field("inexact", _S),  # the manifest's inexact reason for the row's seq; null: exact
    ]
    return pa.schema(list(wire) + red)


def bundles_schema() -> pa.Schema:
    """The ledger: one row per bundle file red judged (landed, duplicate, conflict, quarantined)."""
    f = pa.field
    return pa.schema(
        [
            f("channel", _S, nullable=False),
            f("bundle_seq", _I64, nullable=False),
            f("bundle_id", _S),
            f("file_name", _S, nullable=False),
            f("status", _S, nullable=False),  # BUNDLE_STATUSES
            f("reason", _S),
            f("signer_fpr", _S),
            f("encrypted", _B),
            f("rows", _I64),
            f("first_seq", _I64),
            f("last_seq", _I64),
            f("coverage_first", _I64),
            f("coverage_last", _I64),
            f("gaps", _S),  # JSON list of {first_seq, last_seq, reason}
            f("inexact", _S),  # JSON
            f("plaintext_sha256", _S),
            f("prev_sha256", _S),
            f("chain_status", _S, nullable=False),  # CHAIN_STATUSES
            f("bridge_id", _S),
            f("created_at", _TS),
            f("received_at", _TS, nullable=False),
            f("landed_at", _TS),
            f("land_seq", _I64, nullable=False),
            f("file_bytes", _I64),
        ]
    )


def audit_schema() -> pa.Schema:
    """The event log; ``event_id`` is ``f"{app_id}:{version}:{i}"`` (i = index in the commit)."""
    f = pa.field
    return pa.schema(
        [
            f("event_id", _S, nullable=False),
            f("at", _TS, nullable=False),
            f("event", _S, nullable=False),  # AUDIT_EVENTS
            f("channel", _S),
            f("bundle_seq", _I64),
            f("file_name", _S),
            f("seq_first", _I64),
            f("seq_last", _I64),
            f("exchange", _S),
            f("reason", _S),
            f("detail", _S),  # JSON
            f("app_id", _S, nullable=False),
            f("version", _I64, nullable=False),
            f("event_date", _DATE, nullable=False),  # partition
        ]
    )


_SCHEMAS = {"messages": messages_schema, "bundles": bundles_schema, "audit": audit_schema}


def schema_for(name: str) -> pa.Schema:
    """The schema of red table ``name`` (one of TABLE_NAMES)."""
    try:
        return _SCHEMAS[name]()
    except KeyError:
        raise RedTableError(f"no red table named {name!r} (known: {list(TABLE_NAMES)})") from None


# -- row builders ----------------------------------------------------------------------------


def _row_id(table: str, i: int, row: Mapping[str, Any]) -> str:
    ids = [f"{k}={row[k]!r}" for k in ("channel", "bundle_seq", "file_name", "event") if k in row]
    return f"{table} row {i}" + (f" ({', '.join(ids)})" if ids else "")


def _check_time(table: str, i: int, row: Mapping[str, Any], key: str, value: Any) -> None:
    if isinstance(value, datetime) and value.tzinfo is None:
        raise RedTableError(
            f"{_row_id(table, i, row)}: {key} is a naive datetime; give it a time zone (UTC)"
        )


def _build(table: str, schema: pa.Schema, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Columns from plain dicts: unknown keys and nulls in required columns are errors."""
    names = set(schema.names)
    for i, row in enumerate(rows):
        unknown = sorted(set(row) - names)
        if unknown:
            raise RedTableError(f"{_row_id(table, i, row)}: unknown columns {unknown}")
        for fld in schema:
            value = row.get(fld.name)
            if value is None and not fld.nullable:
                raise RedTableError(f"{_row_id(table, i, row)}: {fld.name} is required")
            if pa.types.is_timestamp(fld.type):
                _check_time(table, i, row, fld.name, value)
    arrays = []
    for fld in schema:
        values = [row.get(fld.name) for row in rows]
        try:
            arrays.append(pa.array(values, type=fld.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
            raise RedTableError(f"{table}.{fld.name}: a value does not fit {fld.type}: {e}") from e
    return pa.Table.from_arrays(arrays, schema=schema)


_AUDIT_COMPUTED = ("event_id", "app_id", "version", "event_date")


def audit_rows(
    events: Sequence[Mapping[str, Any]], app_id: str, version: int, at: datetime
) -> pa.Table:
    """The audit rows of one commit ``(app_id, version)``.

    Each event is a dict keyed by audit column names (missing -> null); ``at`` defaults to the
    commit's ``at``; ``event_id`` (``f"{app_id}:{version}:{i}"``), ``app_id``, ``version`` and
    ``event_date`` (the UTC date of the row's ``at``) are filled in here and may not be given.
    Event names are not checked against AUDIT_EVENTS (a new one must not stop a landing).
    """
    if at.tzinfo is None:
        raise RedTableError(f"audit commit {app_id}:{version}: at is a naive datetime")
    rows: list[dict[str, Any]] = []
    for i, ev in enumerate(events):
        given = sorted(k for k in _AUDIT_COMPUTED if k in ev)
        if given:
            raise RedTableError(
                f"{_row_id('audit', i, ev)} of {app_id}:{version}: {given} are computed, not given"
            )
        row = dict(ev)
        when = row.get("at") or at
        if not isinstance(when, datetime):
            raise RedTableError(f"{_row_id('audit', i, ev)}: at is {type(when).__name__}")
        _check_time("audit", i, row, "at", when)
        row["at"] = when
        row["event_id"] = f"{app_id}:{version}:{i}"
        row["app_id"] = app_id
        row["version"] = version
        row["event_date"] = _utc_date(when)
        rows.append(row)
    return _build("audit", audit_schema(), rows)


def bundles_rows(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Ledger rows from dicts keyed by bundles column names (missing -> null)."""
    return _build("bundles", bundles_schema(), rows)


def _utc_date(when: datetime) -> date:
    return when.astimezone(UTC).date()
