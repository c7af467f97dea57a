"""AMQP client (both sides): a lean AMQP 0-9-1 client that keeps content-header property bytes."""

from bridge.amqp.client import (
    Cancelled,
    Channel,
    Confirm,
    Connection,
    Delivery,
    Events,
    QueueInfo,
    Returned,
)

__all__ = [
    "Cancelled",
    "Channel",
    "Confirm",
    "Connection",
    "Delivery",
    "Events",
    "QueueInfo",
    "Returned",
]
