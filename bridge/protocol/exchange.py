"""Protocol core: an exchange declaration, as it travels with every row to red."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bridge.errors import ConfigError

__all__ = ["ExchangeDecl", "EXCHANGE_TYPES", "check_exchange_name"]

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers")


@dataclass(frozen=True)
class ExchangeDecl:
    """What red needs to re-declare an exchange identically."""

    name: str
    type: str
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "durable": self.durable,
            "auto_delete": self.auto_delete,
            "internal": self.internal,
            "arguments": self.arguments,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ExchangeDecl:
        return cls(
            name=str(d["name"]),
            type=str(d["type"]),
            durable=bool(d.get("durable", True)),
            auto_delete=bool(d.get("auto_delete", False)),
            internal=bool(d.get("internal", False)),
            arguments=dict(d.get("arguments") or {}),
        )


def check_exchange_name(name: object) -> str:
    """``name`` if it can name an AMQP exchange (1..255 UTF-8 bytes), else ConfigError."""
    if not isinstance(name, str):
        raise ConfigError(f"exchange name {name!r} is not text")
    if not name:
        raise ConfigError(
            "the default exchange ('') cannot be approved: black never mirrors it; name an exchange"
        )
    size = len(name.encode("utf-8", "surrogateescape"))
    if size > 255:
        raise ConfigError(f"exchange name {name[:40]!r}... is {size} bytes (AMQP allows 255)")
    return name
