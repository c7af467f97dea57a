"""Red, replay (pure): can a landed row be published at all, before it is sent.

A row the broker cannot take must never reach the socket: a routing key over 255 bytes does
not fit the ``basic.publish`` frame (the client refuses to encode it), and the broker closes
the *whole connection* for property bytes that do not parse (541) or a content header larger
than the negotiated ``frame_max`` (501), taking every other exchange's unconfirmed publishes
with it. Black keeps names as UTF-8 text: a name whose wire bytes were not UTF-8 lands with
U+FFFD (3 bytes) per bad byte, so a legal 100-byte routing key can land as 300 bytes.

A ``user-id`` property other than the replay user's name closes the *channel* (406) unless
that user has RabbitMQ's ``impersonator`` tag (read at login: a running publisher keeps what
it had): :func:`user_id_problem` names such a row when the publisher's connection may not
impersonate, so it is skipped and audited instead of stopping its exchange at every retry.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from bridge.amqp.frames import HEADER_FRAME_OVERHEAD, SHORT_MAX
from bridge.errors import ProtocolError
from bridge.protocol.properties import decode_table, headers_table, scan_properties

__all__ = [
    "TABLES_KEPT",
    "USER_ID_FLAG",
    "impersonation_fix",
    "name_problem",
    "row_problem",
    "user_id_of",
    "user_id_problem",
]

TABLES_KEPT = 1024
"""Header tables already checked, remembered per lane (rows often share them)."""
USER_ID_FLAG = 0x0010
"""The ``user-id`` bit of the property flags (bit 4; in the second byte of the block)."""
_USER_ID = 11  # index of user-id in scan_properties' flag order


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


def user_id_of(properties_raw: bytes) -> bytes | None:
    """Red, replay check: the ``user-id`` bytes of property block ``properties_raw``, or None
    when it has none (or does not parse: :func:`row_problem` names that)."""
    if len(properties_raw) < 2 or not properties_raw[1] & USER_ID_FLAG:
        return None  # the common case: one byte test, nothing decoded
    try:
        value = scan_properties(properties_raw)[_USER_ID]
    except ProtocolError:
        return None
    if value is None:
        return None
    return value if isinstance(value, bytes) else value.encode()


def impersonation_fix(user: str) -> str:
    """Red, replay check: how an operator lets replay user ``user`` publish other users'
    user-ids (one sentence, for logs, audit reasons and errors)."""
    return (
        f"give the replay user {user!r} RabbitMQ's impersonator tag on the red broker "
        f"(`rabbitmqctl set_user_tags {user} impersonator`, listing its other tags too: the "
        "command replaces them; or the management UI, Admin > Users > the user > Tags), then "
        "restart the replay publisher (the broker reads tags at login)"
    )


def user_id_problem(properties_raw: bytes, user: str) -> str | None:
    """Red, replay check: why a row whose property bytes carry another user's ``user-id``
    cannot be published by replay user ``user`` without the impersonator tag, or None (no
    user-id, or ``user``'s own)."""
    claimed = user_id_of(properties_raw)
    if claimed is None or claimed == user.encode("utf-8", "surrogateescape"):
        return None
    shown = claimed.decode("utf-8", "backslashreplace")
    return (
        f"its user-id property is '{shown}' but the replay user {user!r} may not publish "
        "another user's user-id (the red broker refuses it, 406 PRECONDITION_FAILED; replay "
        f"keeps properties byte for byte, so it is not changed): {impersonation_fix(user)}; "
        "then publish the skipped rows again: diode red rewind --exchange <exchange> --skipped "
        "(runbook §15.4)"
    )
