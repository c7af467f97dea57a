"""Black, mirror plan: which bindings mirror a channel's exchanges into its queue (pure logic).

Catch-all bindings, verified on RabbitMQ 3.10: fanout "" ; topic "#" ; headers: an argument
table with ``x-match: all`` and no other key (matches every message, headers or not; ``any``
with no keys matches nothing) ; direct: one binding per configured routing key (AMQP has no
catch-all for direct exchanges, so one without keys is reported, never silently ignored).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from bridge.config import BlackConfig, ChannelConfig
from bridge.protocol.exchange import ExchangeDecl

__all__ = [
    "BUILTIN_DENY",
    "HEADERS_CATCH_ALL",
    "Binding",
    "ChannelPlan",
    "builtin_denied",
    "catch_all_bindings",
    "denied",
    "deny_pattern",
    "explicit_names",
    "plan_channel",
    "wanted",
    "mirror_queue_name",
    "dead_queue_name",
    "dead_letter_exchange",
    "without_own",
]

BUILTIN_DENY = ("", "amq.*")
"""Not mirrored unless named: the default exchange (never: it cannot be bound) and the broker's
own amq.* exchanges (mirrored only when a channel names one exactly, e.g. amq.topic, where the
MQTT and STOMP plugins publish; never amq.rabbitmq.*, the broker's internal ones)."""
_NEVER = ("", "amq.rabbitmq.*")

HEADERS_CATCH_ALL: dict[str, Any] = {"x-match": "all"}
"""Binding arguments that match every message of a headers exchange (no headers included)."""

_GLOB = frozenset("*?[")


@dataclass(frozen=True)
class Binding:
    """One binding of a channel's mirror queue to an exchange."""

    exchange: str
    routing_key: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple[str, str, str]:
        """Identity of the binding (RabbitMQ's: source, routing key, arguments)."""
        return (self.exchange, self.routing_key, json.dumps(self.arguments, sort_keys=True))


@dataclass(frozen=True)
class ChannelPlan:
    """What a channel's mirror queue should be bound to."""

    channel: str
    bindings: list[Binding]
    unbound_direct: list[str]
    """Direct exchanges the channel matches but has no `direct_routing_keys` for."""
    skipped: list[str]
    """"'name': reason" for matched or named exchanges that are not mirrored."""

    @property
    def exchanges(self) -> list[str]:
        return sorted({b.exchange for b in self.bindings})


def builtin_denied(name: str, *, named: bool = False) -> bool:
    """True for the default exchange and amq.*, which no pattern selects; ``named``: a channel
    names ``name`` exactly, which lets an amq.* exchange through (not amq.rabbitmq.*)."""
    if any(fnmatchcase(name, p) for p in _NEVER):
        return True
    return not named and any(fnmatchcase(name, p) for p in BUILTIN_DENY)


def deny_pattern(channel: ChannelConfig, name: str) -> str | None:
    """The first of ``channel``'s deny patterns matching exchange ``name`` (None: none does)."""
    return next((p for p in channel.deny if fnmatchcase(name, p)), None)


def denied(channel: ChannelConfig, name: str) -> bool:
    """True if ``channel`` never mirrors exchange ``name``: a built-in deny or a deny pattern.
    The tap drops deliveries from such an exchange (one bound into a mirrored exchange)."""
    named = name in explicit_names(channel)
    return builtin_denied(name, named=named) or deny_pattern(channel, name) is not None


def catch_all_bindings(channel: ChannelConfig, name: str) -> list[Binding]:
    """Every binding the mirror could have made from exchange ``name`` to ``channel``'s queue,
    whatever its type: the fanout, topic and headers catch-alls, and the channel's routing keys
    for it. Unbinding them is how a sync removes stale bindings it cannot list (unbinding a
    binding that does not exist is a no-op)."""
    keys = dict.fromkeys(channel.direct_routing_keys.get(name, []))
    return [
        Binding(name, ""),
        Binding(name, "#"),
        Binding(name, "", dict(HEADERS_CATCH_ALL)),
        *(Binding(name, k) for k in keys if k not in ("", "#")),
    ]


def explicit_names(channel: ChannelConfig) -> set[str]:
    """Exchange names a channel names exactly (no glob), including its direct exchanges."""
    exact = {p for p in channel.exchanges if not (_GLOB & set(p))}
    return exact | set(channel.direct_routing_keys)


def wanted(channel: ChannelConfig, name: str) -> bool:
    """True if ``channel`` selects exchange ``name`` (a pattern or its exact name) and does not
    deny it: whether it is bound then depends only on its type."""
    selected = name in explicit_names(channel) or any(
        fnmatchcase(name, p) for p in channel.exchanges
    )
    return selected and not denied(channel, name)


def plan_channel(channel: ChannelConfig, exchanges: Sequence[ExchangeDecl]) -> ChannelPlan:
    """Bindings mirroring every exchange of ``channel`` (fnmatch patterns minus deny lists).

    Exchanges named exactly (in `exchanges` or `direct_routing_keys`) are candidates even when
    no pattern matches; named ones that are absent or denied are reported in ``skipped``.
    """
    by_name = {d.name: d for d in exchanges}
    explicit = explicit_names(channel)
    where = f"channels[{channel.name}]"
    bindings: list[Binding] = []
    unbound: list[str] = []
    skipped: list[str] = []
    for name in sorted(by_name):
        decl = by_name[name]
        named = name in explicit
        if not named and not any(fnmatchcase(name, p) for p in channel.exchanges):
            continue
        if builtin_denied(name, named=named):
            if named:
                skipped.append(f"{name!r}: built-in deny (the default exchange, amq.rabbitmq.*)")
            continue
        deny = deny_pattern(channel, name)
        if deny is not None:
            skipped.append(f"{name!r}: denied by {where}.deny pattern {deny!r}")
            continue
        if decl.type == "fanout":
            bindings.append(Binding(name, ""))
        elif decl.type == "topic":
            bindings.append(Binding(name, "#"))
        elif decl.type == "headers":
            bindings.append(Binding(name, "", dict(HEADERS_CATCH_ALL)))
        elif decl.type == "direct":
            keys = list(dict.fromkeys(channel.direct_routing_keys.get(name, [])))
            if keys:
                bindings.extend(Binding(name, k) for k in keys)
            else:
                unbound.append(name)
        elif decl.type == "":
            skipped.append(
                f"{name!r}: type unknown (management API unavailable and not in the catalog): "
                f"make the management API reachable, or list it in {where}.direct_routing_keys "
                "if it is a direct exchange"
            )
        else:
            skipped.append(
                f"{name!r}: exchange type {decl.type!r} has no known catch-all binding; "
                f"its messages are not mirrored (add it to {where}.deny to silence this)"
            )
    for name in sorted(explicit - set(by_name)):
        if builtin_denied(name, named=True):
            skipped.append(f"{name!r}: built-in deny (the default exchange, amq.rabbitmq.*)")
        else:
            skipped.append(
                f"{name!r}: named in {where} but not found in the vhost: declare it or fix the name"
            )
    return ChannelPlan(channel.name, bindings, unbound, skipped)


def mirror_queue_name(black: BlackConfig, channel: str) -> str:
    """The queue mirroring ``channel``: ``<mirror_prefix><channel>``."""
    return f"{black.mirror_prefix}{channel}"


def dead_queue_name(black: BlackConfig, channel: str) -> str:
    """Where the broker dead-letters what the mirror queue drops (overflow, expiry)."""
    return f"{black.mirror_prefix}{channel}.dead"


def dead_letter_exchange(black: BlackConfig) -> str:
    """Black's own direct exchange for dead letters of the mirror queues (routing key: channel)."""
    return f"{black.mirror_prefix}dead-letter"


def without_own(black: BlackConfig, exchanges: Sequence[ExchangeDecl]) -> list[ExchangeDecl]:
    """``exchanges`` but black's own (its dead-letter exchange): never mirrored, never planned,
    never warned about."""
    own = dead_letter_exchange(black)
    return [d for d in exchanges if d.name != own]
