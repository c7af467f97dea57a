"""Protocol core: the versioned Arrow schema of message rows (bundles and red `messages`)."""

from __future__ import annotations

import pyarrow as pa

from bridge.errors import SchemaVersionError
from bridge.protocol.properties import PROPERTY_NAMES

__all__ = [
    "ROW_SCHEMA_VERSION",
    "KNOWN_ROW_SCHEMA_VERSIONS",
    "PROPERTY_COLUMNS",
    "row_schema",
    "check_row_schema_version",
]

ROW_SCHEMA_VERSION = 2
KNOWN_ROW_SCHEMA_VERSIONS = frozenset({2})

PROPERTY_COLUMNS = tuple(n for n in PROPERTY_NAMES if n != "headers")
"""The decoded basic properties besides headers, in column (and AMQP flag) order."""


def _row_schema_v2() -> pa.Schema:
    s, i32, i64, b = pa.string(), pa.int32(), pa.int64(), pa.bool_()
    props = [pa.field(name, s, nullable=True) for name in PROPERTY_COLUMNS]
    props[2] = pa.field("delivery_mode", i32, nullable=True)
    props[3] = pa.field("priority", i32, nullable=True)
    props[8] = pa.field("timestamp", i64, nullable=True)  # seconds as sent; >= 2**63 wraps
    return pa.schema(
        [
            # identity of a message everywhere on red: (channel, seq)
            pa.field("channel", s, nullable=False),
            pa.field("seq", i64, nullable=False),
            # the exchange as declared on black, so red can re-declare it identically
            pa.field("exchange", s, nullable=False),
            pa.field("exchange_type", s, nullable=False),
            pa.field("exchange_durable", b, nullable=False),
            pa.field("exchange_auto_delete", b, nullable=False),
            pa.field("exchange_internal", b, nullable=False),
            pa.field("exchange_arguments", s, nullable=True),  # typed JSON (headers.py)
            pa.field("routing_key", s, nullable=False),
            # provenance: the broker had delivered the message to black before
            pa.field("redelivered", b, nullable=False),
            # the content header's property bytes as delivered: the source of truth for replay
            pa.field("properties_raw", pa.binary(), nullable=False),
            # derived from properties_raw, for queries; null when absent (or undecodable)
            *props,
            pa.field("headers_typed", s, nullable=True),  # typed JSON (headers.py)
            pa.field("headers", pa.map_(s, s), nullable=True),  # queryable text
            # the body, bytes never decoded
            pa.field("body", pa.binary(), nullable=False),
        ],
        metadata={b"diode.schema_version": b"2"},
    )


_SCHEMAS = {2: _row_schema_v2}


def row_schema(version: int = ROW_SCHEMA_VERSION) -> pa.Schema:
    """The Arrow schema of message rows for ``version``."""
    check_row_schema_version(version)
    return _SCHEMAS[version]()


def check_row_schema_version(version: object) -> int:
    """Return ``version`` if this reader knows it, else raise SchemaVersionError."""
    if not isinstance(version, int) or isinstance(version, bool) or version not in _SCHEMAS:
        raise SchemaVersionError(
            f"row schema version {version!r} is unknown to this reader "
            f"(known: {sorted(KNOWN_ROW_SCHEMA_VERSIONS)}); upgrade diode-bridge on this side"
        )
    return version
