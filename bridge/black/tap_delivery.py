"""Black, tap: reading a delivery — a dead letter's x-death, the header a quorum queue adds or
re-sorts on redelivery, exchange and routing key names as storable text (pure)."""

from __future__ import annotations

import dataclasses
from typing import Any

from bridge.errors import ProtocolError
from bridge.protocol.properties import Properties, decode_properties, encode_properties

__all__ = [
    "DELIVERY_COUNT_HEADER", "as_text", "death_of", "field_of", "headers_of", "key_text",
    "order_free", "reordered", "strip_delivery_count", "text_names",
]  # fmt: skip

DELIVERY_COUNT_HEADER = "x-delivery-count"
"""Added by quorum queues to every redelivery: stripped so redelivered values stay unchanged."""


def headers_of(props_raw: bytes) -> Any:
    """The decoded header table (None if absent or undecodable)."""
    try:
        return decode_properties(props_raw).headers
    except ProtocolError:
        return None


def field_of(table: Any, name: str) -> Any:
    """Value of the first entry ``name`` of a decoded field table (None if absent)."""
    for key, (_tag, value) in table or ():
        if key_text(key) == name:
            return value
    return None


def death_of(headers: Any, queue: str) -> tuple[str, str, str] | None:
    """``(exchange, routing key, reason)`` the broker wrote into ``x-death`` when ``queue``
    dead-lettered the message: where it was published to, the routing key it was published
    with (the first of ``routing-keys``; the rest are CC keys), and why it was dropped. The
    entry of ``queue`` (the newest is first); else the first entry. None without ``x-death``;
    a missing field is ``""``."""
    deaths = field_of(headers, "x-death")
    if not isinstance(deaths, tuple):
        return None
    entries = [f[1] for f in deaths if isinstance(f, tuple) and len(f) == 2 and f[0] == "F"]
    if not entries:
        return None
    entry = next((e for e in entries if as_text(field_of(e, "queue")) == queue), entries[0])
    keys = field_of(entry, "routing-keys")
    first = keys[0] if isinstance(keys, tuple) and keys else None
    key = first[1] if isinstance(first, tuple) and len(first) == 2 else None
    return as_text(field_of(entry, "exchange")), as_text(key), as_text(field_of(entry, "reason"))


def as_text(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return "" if v is None else str(v)


def _utf8(name: str) -> tuple[str, bool]:
    """``name`` as storable text; True if its wire bytes were not UTF-8 (U+FFFD instead)."""
    try:
        name.encode("utf-8")
        return name, False
    except UnicodeEncodeError:  # the client hands non-UTF-8 bytes over as surrogate escapes
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace"), True


def text_names(exchange: str, routing_key: str) -> tuple[str, str, bool]:
    ex, a = _utf8(exchange)
    rk, b = _utf8(routing_key)
    return ex, rk, a or b


def key_text(k: bytes | str) -> str:
    return k.decode("utf-8", "replace") if isinstance(k, bytes) else k


def _with_headers(props_raw: bytes) -> Properties | None:
    """``props_raw`` decoded, if it decodes and has a header table; else None."""
    try:
        props = decode_properties(props_raw)
    except ProtocolError:
        return None
    return props if props.headers else None


def strip_delivery_count(props_raw: bytes) -> bytes:
    """``props_raw`` without the broker-added ``x-delivery-count`` header (quorum redeliveries)."""
    props = _with_headers(props_raw)
    if props is None or props.headers is None:
        return props_raw
    kept = tuple((k, v) for k, v in props.headers if key_text(k) != DELIVERY_COUNT_HEADER)
    if len(kept) == len(props.headers):
        return props_raw
    return encode_properties(dataclasses.replace(props, headers=kept or None))


def reordered(kept_raw: bytes) -> bool:
    """A quorum redelivery's kept property bytes (``strip_delivery_count``) may differ from the
    original's: the broker re-encoded the content header to add its count, sorting the header
    table by key (every other property and every value is re-encoded as it was). That changes
    bytes only if the table had two keys or more; with one or none the bytes are the original's."""
    props = _with_headers(kept_raw)
    return props is not None and props.headers is not None and len(props.headers) >= 2


def order_free(props_raw: bytes) -> bytes:
    """``props_raw`` with header keys sorted: how a quorum queue re-encodes a redelivery's table
    (when it adds x-delivery-count), so a first delivery and its redelivery compare equal."""
    props = _with_headers(props_raw)
    if props is None or props.headers is None:
        return props_raw
    table = tuple(sorted(props.headers, key=lambda kv: key_text(kv[0])))
    return encode_properties(dataclasses.replace(props, headers=table))
