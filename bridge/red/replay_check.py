"""Red, replay (pure): can a landed row be published at all, before it is sent.

A row the broker cannot take must never reach the socket: a routing key over 255 bytes does
not fit the ``basic.publish`` frame (the client refuses to encode it), and the broker closes
the *whole connection* for property bytes that do not parse (541) or a content header larger
than the negotiated ``frame_max`` (501), taking every other exchange's unconfirmed publishes
with it. Black keeps names as UTF-8 text: a name whose wire bytes were not UTF-8 lands with
U+FFFD (3 bytes) per bad byte, so a legal 100-byte routing key can land as 300 bytes.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from bridge.amqp.frames import HEADER_FRAME_OVERHEAD, SHORT_MAX
from bridge.errors import ProtocolError
from bridge.protocol.properties import decode_table, headers_table

__all__ = ["TABLES_KEPT", "name_problem", "row_problem"]

TABLES_KEPT = 1024
"""Header tables already checked, remembered per lane (rows often share them)."""


def _wire(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def name_problem(exchange: str) -> str | None:
    """Why exchange name ``exchange`` cannot be published to, or None."""
    try:
        n = len(_wire(exchange))
    except UnicodeEncodeError as e:
        return f"exchange name does not encode ({e})"
    if n > SHORT_MAX:
        return f"exchange name is {n} bytes as landed (AMQP allows {SHORT_MAX})"
    return None


def row_problem(
    routing_key: str,
    properties_raw: bytes,
    frame_max: int,
    tables_ok: MutableMapping[bytes, None] | None = None,
) -> str | None:
    """Why a row with this routing key and these property bytes cannot be published on a
    connection with ``frame_max``, or None. ``tables_ok`` remembers header tables that decoded
    (bounded to ``TABLES_KEPT``), so rows sharing one are decoded once."""
    try:
        rk = len(routing_key) if routing_key.isascii() else len(_wire(routing_key))
    except UnicodeEncodeError as e:
        return f"routing key does not encode ({e})"
    if rk > SHORT_MAX:
        return (
            f"routing key is {rk} bytes as landed (AMQP allows {SHORT_MAX}; black lands bytes "
            "that are not UTF-8 as U+FFFD, 3 bytes each)"
        )
    size = len(properties_raw) + HEADER_FRAME_OVERHEAD
    if frame_max and size > frame_max:
        return (
            f"content header of {size} bytes (property bytes {len(properties_raw)}) exceeds the "
            f"red broker's frame_max {frame_max}"
        )
    try:
        table = headers_table(properties_raw)  # structure checked, values not decoded
        if table is not None and (tables_ok is None or table not in tables_ok):
            decode_table(table)
            if tables_ok is not None:
                if len(tables_ok) >= TABLES_KEPT:
                    tables_ok.clear()
                tables_ok[table] = None
    except ProtocolError as e:
        return f"property bytes do not parse: {e}"
    return None
