"""diode-bridge: RabbitMQ traffic carried one way across a data diode (black -> diode -> red)."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
