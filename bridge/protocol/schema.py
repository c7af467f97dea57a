"""Protocol core: the versioned Arrow schema of message rows (bundles and red `messages`)."""

from __future__ import annotations

import pyarrow as pa

from bridge.errors import SchemaVersionError

__all__ = [
    "ROW_SCHEMA_VERSION",
    "KNOWN_ROW_SCHEMA_VERSIONS",
    "row_schema",
    "check_row_schema_version",
]

ROW_SCHEMA_VERSION = 1
KNOWN_ROW_SCHEMA_VERSIONS = frozenset({1})


def _row_schema_v1() -> pa.Schema:
    s, i32, i64, b = pa.string(), pa.int32(), pa.int64(), pa.bool_()
    return pa.schema(
        [
            # identity of a message everywhere on red: (channel, seq)
            pa.field("channel", s, nullable=False),
            pa.field("seq", i64, nullable=False),
            # provenance: the message's offset in black's stream queue (not gapless)
            pa.field("stream_offset", i64, nullable=False),
            # the exchange as declared on black, so red can re-declare it identically
            pa.field("exchange", s, nullable=False),
            pa.field("exchange_type", s, nullable=False),
            pa.field("exchange_durable", b, nullable=False),
            pa.field("exchange_auto_delete", b, nullable=False),
            pa.field("exchange_internal", b, nullable=False),
            pa.field("exchange_arguments", s, nullable=True),  # typed JSON (see headers.py)
            pa.field("routing_key", s, nullable=False),
            # every AMQP basic property, null when absent
            pa.field("content_type", s, nullable=True),
            pa.field("content_encoding", s, nullable=True),
            pa.field("delivery_mode", i32, nullable=True),
            pa.field("priority", i32, nullable=True),
            pa.field("correlation_id", s, nullable=True),
            pa.field("reply_to", s, nullable=True),
            pa.field("expiration", s, nullable=True),
            pa.field("message_id", s, nullable=True),
            pa.field(
                "timestamp", i64, nullable=True
            ),  # AMQP timestamp: seconds since epoch, as sent
            pa.field("type", s, nullable=True),
            pa.field("user_id", s, nullable=True),
            pa.field("app_id", s, nullable=True),
            pa.field("cluster_id", s, nullable=True),
            # headers: exact AMQP types (typed JSON, used to re-publish) + a queryable rendering
            pa.field("headers_typed", s, nullable=True),
            pa.field("headers", pa.map_(s, s), nullable=True),
            # the body, bytes never decoded
            pa.field("body", pa.binary(), nullable=False),
        ],
        metadata={b"diode.schema_version": str(ROW_SCHEMA_VERSION).encode()},
    )


_SCHEMAS = {1: _row_schema_v1}


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
