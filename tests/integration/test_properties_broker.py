"""Integration: generated property blocks (every AMQP 0.9.1 field type, nested tables and
arrays, every int width, duplicate keys, odd text) published through the real broker come back
from a classic queue as the same bytes, and from a quorum queue as the same bytes up to the two
normalisations such a queue applies; the codec reads from the delivered bytes the values that
were published (issue 5: property-tested against real broker deliveries, not only against the
codec's own writer).

What RabbitMQ 3.10.8 does to header tables, measured here (docs/protocol.md §6.2):

* A NaN or infinite float / double, or the non-standard tag ``U``, anywhere in the headers: the
  broker closes the *producer's* connection (541 INTERNAL_ERROR) whatever the queue type, so
  nothing reaches a mirror queue. Such values are left out of the generated ones.
* Quorum queues decode and re-encode the header table even on the first delivery: ``L`` is
  delivered as ``l`` (same value) and a boolean byte other than 0/1 as 1. Classic queues (the
  default mirror queue type) deliver the bytes as published.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.amqp.client import Connection
from bridge.protocol.properties import (
    Float32Bits,
    Properties,
    decode_properties,
    encode_properties,
)
from tests.integration.test_amqp_client import (
    collect,
    publish_confirmed,
    qname,
    url_of,
    vhost,  # noqa: F401 - the fixture
)
from tests.unit.test_protocol_properties import canon, properties

pytestmark = [pytest.mark.broker]


def _broker_takes(value: Any) -> bool:
    """False if a field (at any depth) makes the broker close the producer's connection."""
    tag, v = value
    if tag == "U" or (tag in "fd" and (isinstance(v, Float32Bits) or not math.isfinite(v))):
        return False
    if tag == "A":
        return all(_broker_takes(x) for x in v)
    if tag == "F":
        return all(_broker_takes(x) for _, x in v)
    return True


def _quorum(value: Any) -> Any:
    """A field as a 3.10 quorum queue re-encodes it: ``L`` as ``l``, booleans as 0/1."""
    tag, v = value
    if tag == "L":
        return ("l", v)
    if tag == "t":
        return ("t", bool(v))
    if tag == "A":
        return ("A", tuple(_quorum(x) for x in v))
    if tag == "F":
        return ("F", tuple((k, _quorum(x)) for k, x in v))
    return value


# what the broker itself refuses (406, the producer's channel closed) or acts on: user-id must
# be the publishing user, delivery-mode 1 or 2, expiration a number of milliseconds (and the
# message would expire); the rest is the producer's business
publishable = properties.map(
    lambda p: dataclasses.replace(
        p,
        user_id=None if p.user_id is None else "guest",
        expiration=None,
        delivery_mode=None if p.delivery_mode is None else p.delivery_mode % 2 + 1,
    )
).filter(lambda p: p.headers is None or all(_broker_takes(v) for _, v in p.headers))


@pytest.fixture(scope="module")
def queues(vhost: str) -> dict[str, str]:  # noqa: F811
    with Connection.open(url_of(vhost)) as conn:
        ch = conn.channel()
        out = {kind: qname(kind) for kind in ("classic", "quorum")}
        for kind, q in out.items():
            ch.queue_declare(q, durable=True, arguments={"x-queue-type": kind})
    return out


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(p=publishable, body=st.binary(max_size=64))
def test_generated_properties_cross_classic_and_quorum_queues(
    vhost: str,  # noqa: F811
    queues: dict[str, str],
    p: Properties,
    body: bytes,
) -> None:
    raw = encode_properties(p)
    quorum = p if p.headers is None else dataclasses.replace(
        p, headers=tuple((k, _quorum(v)) for k, v in p.headers)
    )  # fmt: skip
    with Connection.open(url_of(vhost)) as conn:  # a connection per example: a refusal
        ch = conn.channel()  # closes only its own channel
        ch.basic_qos(10)
        for kind, want in (("classic", p), ("quorum", quorum)):
            tag = ch.basic_consume(queues[kind])
            early = publish_confirmed(ch, conn, "", queues[kind], [(raw, body)]).deliveries
            (d,) = early or collect(conn, 1, what=f"deliveries from the {kind} queue")
            ch.ack(d.delivery_tag)
            ch.basic_cancel(tag)
            assert not d.redelivered and d.body == body
            assert d.properties_raw == encode_properties(want), f"{kind}: unexpected bytes"
            assert canon(decode_properties(d.properties_raw)) == canon(want), kind
