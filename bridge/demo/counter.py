"""Demo, red consumer: a queue bound to every replayed demo exchange, counting what arrives."""

from __future__ import annotations

import time

from bridge.amqp.client import Connection
from bridge.demo.traffic import DEMO_DIRECT_KEYS, DEMO_EXCHANGES, declare_exchanges

__all__ = ["ReplayCounter", "COUNTER_QUEUE"]

COUNTER_QUEUE = "diode-demo-counter"


class ReplayCounter:
    """Declares the demo exchanges on red exactly as black has them (the replay publisher's
    own declarations must then agree, or the broker refuses them) and binds one queue to all."""

    def __init__(self, url: str, exchanges: list[str]) -> None:
        declare_exchanges(url)
        self.conn = Connection.open(url, client_name="diode-demo-counter")
        self.ch = self.conn.channel()
        self.ch.queue_declare(COUNTER_QUEUE, durable=True)
        types = {x.name: x.type for x in DEMO_EXCHANGES}
        for ex in exchanges:
            kind = types.get(ex)
            if kind == "direct":
                for key in DEMO_DIRECT_KEYS.get(ex, []):
                    self.ch.queue_bind(COUNTER_QUEUE, ex, key)
            elif kind == "topic":
                self.ch.queue_bind(COUNTER_QUEUE, ex, "#")
            elif kind is not None:  # fanout, headers (an empty binding matches everything)
                self.ch.queue_bind(COUNTER_QUEUE, ex, "")
        self.received = 0

    def drain(self, *, expected: int, timeout: float) -> int:
        """Consume until ``expected`` messages arrived or nothing came for ``timeout`` s."""
        self.ch.basic_qos(1000)
        self.ch.basic_consume(COUNTER_QUEUE)
        quiet_since = time.monotonic()
        while self.received < expected and time.monotonic() - quiet_since < timeout:
            ev = self.conn.poll(0.5)
            if ev.deliveries:
                self.received += len(ev.deliveries)
                self.ch.ack(ev.deliveries[-1].delivery_tag, multiple=True)
                quiet_since = time.monotonic()
        return self.received

    def close(self) -> None:
        self.conn.close()
