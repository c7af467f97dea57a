"""Red, replay: declare exchanges on the red broker as black had them, publishing nothing.

The replay publisher declares an exchange just before its first publish, so a queue cannot be
bound to it before messages go out, and what no binding routes is returned (``unroutable``).
``diode red declare`` closes that window: declare first, bind the red queues, then approve.
The declaration is the one of the exchange's last landed row (type, durable, auto-delete,
internal, arguments); the broker's own exchanges (``amq.*``) and the default exchange are
never declared, only checked to exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.dataset as pads

from bridge.amqp.client import Connection
from bridge.errors import AmqpClosed, ProtocolError
from bridge.protocol.headers import typed_json_to_headers
from bridge.protocol.properties import encode_table
from bridge.protocol.rows import UNKNOWN_EXCHANGE_TYPE

__all__ = ["Decl", "Declared", "declare_as_landed", "declare_exchanges", "landed_declarations"]

Decl = tuple[str, bool, bool, bool, str | None]
"""``(type, durable, auto_delete, internal, arguments typed JSON)`` as a landed row has them."""
_COLUMNS = [
    "land_seq", "channel", "seq", "exchange", "exchange_type", "exchange_durable",
    "exchange_auto_delete", "exchange_internal", "exchange_arguments",
]  # fmt: skip


@dataclass(frozen=True)
class Declared:
    """What became of one exchange: ``declared``, ``exists`` (the broker's own, checked),
    ``skipped`` (the default exchange), ``not_landed`` or ``refused`` (``why``)."""

    exchange: str
    outcome: str
    why: str = ""
    decl: Decl | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"exchange": self.exchange, "outcome": self.outcome}
        if self.why:
            out["why"] = self.why
        if self.decl is not None:
            xtype, durable, auto_delete, internal, arguments = self.decl
            out.update(type=xtype, durable=durable, auto_delete=auto_delete, internal=internal,
                       arguments=arguments)  # fmt: skip
        return out


def landed_declarations(messages: Path, names: Sequence[str] = ()) -> dict[str, Decl]:
    """Per exchange (those named, or every landed one), the declaration of its last landed
    row (highest ``land_seq``, then channel and seq); {} when nothing has landed yet."""
    from deltalake import DeltaTable

    if not DeltaTable.is_deltatable(str(messages)):
        return {}
    ds = DeltaTable(str(messages)).to_pyarrow_dataset()
    where = pads.field("exchange").isin(list(names)) if names else None
    table = ds.to_table(columns=_COLUMNS, filter=where)
    if table.num_rows == 0:
        return {}
    order = pc.sort_indices(
        table, sort_keys=[("land_seq", "ascending"), ("channel", "ascending"), ("seq", "ascending")]
    )
    table = table.take(order)
    out: dict[str, Decl] = {}
    for row in table.to_pylist():  # the last one of each exchange wins
        out[row["exchange"]] = (
            row["exchange_type"], bool(row["exchange_durable"]),
            bool(row["exchange_auto_delete"]), bool(row["exchange_internal"]),
            row["exchange_arguments"],
        )  # fmt: skip
    return out


def declare_as_landed(ch: Any, name: str, decl: Decl) -> None:
    """Declare ``name`` on ``ch`` with the type, flags and arguments of ``decl`` (the replay
    publisher's declaration too): ProtocolError when the arguments do not decode, AmqpClosed
    when the broker refuses."""
    xtype, durable, auto_delete, internal, arguments = decl
    table = encode_table(typed_json_to_headers(arguments)) if arguments else None
    ch.exchange_declare(name, xtype, durable=durable, auto_delete=auto_delete, internal=internal,
                        arguments=table)  # fmt: skip


def _declare_one(conn: Connection, name: str, decl: Decl) -> Declared:
    """Declare ``name`` as ``decl`` on a channel of its own (a refusal closes only that)."""
    if name == "":
        return Declared(name, "skipped", "the default exchange: always there", decl)
    ch = conn.channel()
    try:
        return _declare_on(ch, name, decl)
    finally:
        ch.close()  # a no-op on a channel the broker closed


def _declare_on(ch: Any, name: str, decl: Decl) -> Declared:
    xtype, internal = decl[0], decl[3]
    builtin, unknown = name.startswith("amq."), xtype == UNKNOWN_EXCHANGE_TYPE
    try:
        if builtin or unknown:
            ch.exchange_declare(name, "direct" if unknown else xtype, passive=True)
            why = (
                "the broker's own: checked, never declared"
                if builtin
                else "black did not know its type: it exists on red, used as it is"
            )
            return Declared(name, "exists", why, decl)
        declare_as_landed(ch, name, decl)
    except AmqpClosed as e:
        if not e.channel:
            raise
        if unknown:
            why = "black did not know its type and it does not exist on red: declare it by hand"
        elif builtin:
            why = "amq.* names are the broker's own and are never declared: it does not exist"
        else:
            why = "the red broker refused it (an exchange of that name with another type or flags?)"
        return Declared(name, "refused", f"{why} ({e.reply_code} {e.reply_text})", decl)
    except ProtocolError as e:
        return Declared(name, "refused", f"its arguments do not decode: {e}", decl)
    note = "internal: clients cannot publish to it, the replay stops at it" if internal else ""
    return Declared(name, "declared", note, decl)


def declare_exchanges(
    messages: Path, url: str, names: Sequence[str] = (), *, client_name: str = "diode-declare"
) -> list[Declared]:
    """Declare each exchange (``names``, or every landed one) on the red broker at ``url``
    as its last landed row says; one :class:`Declared` per exchange, in name order."""
    found = landed_declarations(messages, names)
    out: list[Declared] = []
    conn = Connection.open(url, client_name=client_name)
    try:
        for n in sorted(set(names) | set(found)):
            if n not in found:
                why = "no row of it has landed yet: nothing to declare from"
                out.append(Declared(n, "not_landed", why))
                continue
            try:
                out.append(_declare_one(conn, n, found[n]))
            except AmqpClosed as e:  # e.g. 503 for an unknown type closes the connection
                why = f"the red broker refused it and closed the connection ({e})"
                out.append(Declared(n, "refused", why, found[n]))
                conn.close()
                conn = Connection.open(url, client_name=client_name)
        return out
    finally:
        conn.close()
