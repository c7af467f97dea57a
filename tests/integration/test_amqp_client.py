"""AMQP client against the real RabbitMQ: consume, acks, syncs, raw properties, confirms, faults.

Each test works in its own queues of a throw-away vhost. Broken connections are made by a
TCP relay between the client and the broker that the test can sever or freeze.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from pamqp.header import ContentHeader as PContentHeader

from bridge.amqp.client import Channel, Confirm, Connection, Delivery, Events, parse_url
from bridge.black.management import ManagementClient
from bridge.errors import (
    AmqpAccessRefused,
    AmqpClosed,
    AmqpConnectionError,
    AmqpInterrupted,
    ConfigError,
    ManagementApiError,
)

MGMT = os.environ.get("DIODE_TEST_MGMT", "http://127.0.0.1:15672")
HOST = os.environ.get("DIODE_TEST_AMQP_HOST", "127.0.0.1")
AUTH = ("guest", "guest")


# ---------------------------------------------------------------------------- fixtures
def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def vhost() -> Iterator[str]:
    """A throw-away vhost (management API; ``rabbitmqctl`` when the API is not enabled)."""
    name = f"diode-test-amqp-{uuid.uuid4().hex[:10]}"
    mgmt = ManagementClient(MGMT, *AUTH, timeout=30)
    try:
        mgmt.put_vhost(name)
        via_api = True
    except ManagementApiError:
        _rabbitmqctl("add_vhost", name)
        _rabbitmqctl("set_permissions", "-p", name, AUTH[0], ".*", ".*", ".*")
        via_api = False
    try:
        yield name
    finally:
        if via_api:
            ManagementClient(MGMT, *AUTH, timeout=60).delete_vhost(name)
        else:
            _rabbitmqctl("delete_vhost", name)


def url_of(vhost: str, host: str = HOST, port: int = 5672, password: str = "guest") -> str:
    return f"amqp://guest:{password}@{host}:{port}/{urllib.parse.quote(vhost, safe='')}"


@pytest.fixture
def url(vhost: str) -> str:
    return url_of(vhost)


@pytest.fixture
def conn(url: str) -> Iterator[Connection]:
    c = Connection.open(url, client_name="diode-test")
    yield c
    c.close()


def qname(what: str) -> str:
    return f"t.{what}.{uuid.uuid4().hex[:8]}"


class Relay:
    """A TCP relay to the broker: ``sever()`` kills every connection through it, ``freeze()``
    stops forwarding (a peer that hangs without closing)."""

    def __init__(self, target: tuple[str, int] = (HOST, 5672)) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.frozen = threading.Event()
        self.stopped = threading.Event()
        self._sever = threading.Event()  # asked of the relay thread, which owns the sockets
        self._severed = threading.Event()
        self.socks: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pairs: dict[socket.socket, socket.socket] = {}
        while not self.stopped.is_set():
            if self._sever.is_set():  # here, not in the caller's thread: select never sees a
                self._reset(pairs)  # socket closed under it
                pairs.clear()
                self._sever.clear()
                self._severed.set()
            ready, _, _ = select.select([self.listener, *pairs], [], [], 0.05)
            for s in ready:
                if s is self.listener:
                    a, _ = self.listener.accept()
                    b = socket.create_connection(self.target)
                    pairs[a], pairs[b] = b, a
                    self.socks += [a, b]
                elif s in pairs and not self.frozen.is_set():
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    if data:
                        try:
                            pairs[s].sendall(data)
                            continue
                        except OSError:
                            pass
                    other = pairs.pop(s)
                    pairs.pop(other, None)
                    s.close()
                    other.close()
            if self.frozen.is_set():
                time.sleep(0.05)

    def sever(self) -> None:
        """Reset every relayed connection at once (no AMQP close: like a crash); returns once
        they are reset."""
        if self.thread.is_alive():
            self._severed.clear()
            self._sever.set()
            if self._severed.wait(5):
                return
        self._reset(self.socks)

    @staticmethod
    def _reset(socks: Iterable[socket.socket]) -> None:
        for s in socks:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.sever()
        self.listener.close()


@pytest.fixture
def relay() -> Iterator[Relay]:
    r = Relay()
    yield r
    r.close()


def collect(
    conn: Connection, n: int, *, timeout: float = 30, what: str = "deliveries"
) -> list[Delivery]:
    """Poll until ``n`` deliveries arrived (fails after ``timeout`` s: a hang, not a timing)."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} {what} arrived"
        got += conn.poll(0.5).deliveries
    return got


def wait_events(conn: Connection, cond: Callable[[Events], bool], timeout: float = 30) -> Events:
    """Poll until an Events batch satisfies ``cond``; all batches merged into one."""
    seen = Events()
    deadline = time.monotonic() + timeout
    while True:
        ev = conn.poll(0.5)
        for name in ("deliveries", "confirms", "syncs", "returns", "cancels"):
            getattr(seen, name).extend(getattr(ev, name))
        if cond(seen):
            return seen
        assert time.monotonic() < deadline, f"timed out; got {seen}"


def publish_confirmed(
    ch: Channel, conn: Connection, exchange: str, key: str, items: list[tuple[bytes, bytes]]
) -> Events:
    """Publish (properties, body) pairs with confirms on and wait until every one is acked;
    returns what else arrived meanwhile (deliveries to a consumer on the same connection)."""
    if not ch.confirming:
        ch.confirm_select()
    last = 0
    for props, body in items:
        last = ch.publish(exchange, key, props, body)
    acked: set[int] = set()
    floor = 0

    def done(ev: Events) -> bool:
        nonlocal floor
        for c in ev.confirms:
            assert c.ack, f"broker nacked publish {c.delivery_tag}"
            if c.multiple:
                floor = max(floor, c.delivery_tag)
            else:
                acked.add(c.delivery_tag)
        ev.confirms.clear()
        return all(t <= floor or t in acked for t in range(last - len(items) + 1, last + 1))

    return wait_events(conn, done)


# ---------------------------------------------------------------------------- property bytes
def _ss(raw: bytes) -> bytes:
    return bytes([len(raw)]) + raw


def _ls(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw


_FIXED = {"b": ">b", "B": ">B", "s": ">h", "u": ">H", "I": ">i", "i": ">I", "l": ">q",
          "f": ">f", "d": ">d", "T": ">Q"}  # fmt: skip


def field(tag: str, value: Any) -> bytes:
    """One tagged field value, encoded by hand from the AMQP 0-9-1 / RabbitMQ type table."""
    t = tag.encode()
    if tag == "t":
        return t + bytes([1 if value else 0])
    if tag in _FIXED:
        return t + struct.pack(_FIXED[tag], value)
    if tag == "D":
        return t + struct.pack(">Bi", *value)
    if tag in "Sx":
        return t + _ls(value)
    if tag == "V":
        return t
    if tag == "A":
        return t + _ls(b"".join(field(*v) for v in value))
    if tag == "F":
        return t + table(value)
    raise AssertionError(tag)


def table(items: list[tuple[bytes, tuple[str, Any]]]) -> bytes:
    return _ls(b"".join(_ss(k) + field(*v) for k, v in items))


EVERY_TYPE: list[tuple[bytes, tuple[str, Any]]] = [
    (b"zeta", ("t", True)),  # deliberately unsorted keys, and a duplicate key below
    (b"i8", ("b", -128)),
    (b"u8", ("B", 255)),
    (b"i16", ("s", -32768)),
    (b"u16", ("u", 65535)),
    (b"i32", ("I", -(2**31))),
    (b"u32", ("i", 2**32 - 1)),
    (b"i64", ("l", -(2**63))),
    (b"float", ("f", 1.5)),
    (b"double", ("d", -2.25)),
    (b"decimal", ("D", (2, 12345))),
    (b"text", ("S", "café".encode())),
    (b"array", ("A", [("b", 1), ("S", b"x"), ("A", [("V", None)]), ("F", [(b"k", ("d", 0.1))])])),
    (b"time", ("T", 1_700_000_000)),
    (b"table", ("F", [(b"nested", ("F", [(b"deep", ("x", b"\x00\xff")), (b"f", ("f", -0.5))]))])),
    (b"void", ("V", None)),
    (b"bytes", ("x", bytes(range(256)))),
    (b"dup", ("b", 1)),
    (b"dup", ("b", 2)),
]


def every_property(headers: list[tuple[bytes, tuple[str, Any]]] = EVERY_TYPE) -> bytes:
    """All 14 basic properties (flags 0xFFFC), headers of every field type."""
    return (
        struct.pack(">H", 0xFFFC)
        + _ss(b"application/json")
        + _ss(b"gzip")
        + table(headers)
        + bytes([2, 7])  # delivery mode, priority
        + _ss(b"corr-1")
        + _ss(b"reply.q")
        + _ss(b"60000")
        + _ss(b"msg-1")
        + struct.pack(">Q", 1_700_000_000)
        + _ss(b"type-x")
        + _ss(b"guest")  # user-id must be the publishing user
        + _ss(b"app-1")
        + _ss(b"cluster-1")
    )


def decoded(props_raw: bytes) -> Any:
    """pamqp's reading of property bytes (an independent decoder)."""
    h = PContentHeader()
    h.unmarshal(struct.pack(">HHQ", 60, 0, 0) + props_raw)
    return h.properties


PERSISTENT = b"\x10\x00\x02"  # delivery-mode 2 only


# ---------------------------------------------------------------------------- pure: URLs
def test_parse_url_decodes_the_vhost_and_defaults() -> None:
    p = parse_url("amqp://u%40x:p%3Aw@broker:5673/%2F")
    assert (p.host, p.port, p.user, p.password, p.vhost) == ("broker", 5673, "u@x", "p:w", "/")
    assert parse_url("amqp://h").vhost == "/" and parse_url("amqp://h").port == 5672
    assert parse_url("amqp://h/prod%2Fa").vhost == "prod/a"
    assert "p:w" not in repr(p) and "p:w" not in p.where


@pytest.mark.parametrize(
    "bad", ["amqps://h/v", "http://h/v", "amqp://h/v?heartbeat=5", "amqp://h:99999/v"]
)
def test_parse_url_refuses_what_it_cannot_honour(bad: str) -> None:
    with pytest.raises(ConfigError, match="amqp://user:pass@host:5672/vhost|remove them"):
        parse_url(bad)


# ---------------------------------------------------------------------------- broker tests
broker = pytest.mark.broker


@broker
def test_consume_with_manual_acks_and_prefetch(conn: Connection) -> None:
    q = qname("prefetch")
    ch = conn.channel()
    ch.queue_declare(q, durable=True)
    publish_confirmed(ch, conn, "", q, [(PERSISTENT, b"m%d" % i) for i in range(50)])
    cons = conn.channel()
    cons.basic_qos(10)
    tag = cons.basic_consume(q)
    first = collect(conn, 10)
    # the queue answers a passive declare after every delivery it made before: 40 still ready
    assert cons.queue_depth(q) == 40
    assert not conn.poll(0).deliveries  # nothing beyond the window
    cons.ack(first[4].delivery_tag, multiple=True)  # frees 5 slots
    more = collect(conn, 5)
    assert cons.queue_depth(q) == 35
    got = first + more
    while len(got) < 50:
        cons.ack(got[-1].delivery_tag, multiple=True)
        got += collect(conn, min(10, 50 - len(got)))
    cons.ack(got[-1].delivery_tag, multiple=True)
    assert [d.body for d in got] == [b"m%d" % i for i in range(50)]
    assert [d.delivery_tag for d in got] == list(range(1, 51))
    assert {d.consumer_tag for d in got} == {tag}
    assert {(d.channel, d.exchange, d.routing_key, d.redelivered) for d in got} == {
        (cons.number, "", q, False)
    }
    assert all(d.properties_raw == PERSISTENT for d in got)
    cons.basic_cancel(tag)
    assert tag not in cons.consumers


@broker
def test_multi_frame_bodies_and_zero_length_body(url: str) -> None:
    with Connection.open(url, frame_max=8192) as conn:
        assert conn.frame_max == 8192
        q = qname("frames")
        ch = conn.channel()
        ch.queue_declare(q)
        room = 8192 - 8
        bodies = [os.urandom(1 << 20), b"", os.urandom(room), os.urandom(room + 1), b"x"]
        publish_confirmed(ch, conn, "", q, [(PERSISTENT, b) for b in bodies])
        ch.basic_qos(100)
        ch.basic_consume(q)
        got = collect(conn, len(bodies))
        assert [d.body for d in got] == bodies
        assert all(type(d.body) is bytes for d in got)
        assert got[1].body == b"" and got[1].properties_raw == PERSISTENT


@broker
def test_ack_multiple_then_sync_proves_the_acks_applied_and_the_rest_come_back_redelivered(
    url: str, relay: Relay, vhost: str
) -> None:
    q = qname("sync")
    with Connection.open(url) as setup:
        ch = setup.channel()
        ch.queue_declare(q, durable=True)
        publish_confirmed(ch, setup, "", q, [(PERSISTENT, b"%d" % i) for i in range(20)])
    conn = Connection.open(url_of(vhost, "127.0.0.1", relay.port))
    cons = conn.channel()
    cons.basic_qos(100)
    cons.basic_consume(q)
    got = collect(conn, 20)
    cons.ack(got[11].delivery_tag, multiple=True)
    token = cons.request_sync()
    assert token in wait_events(conn, lambda ev: token in ev.syncs).syncs
    relay.sever()  # the tap dies: no close, no more acks
    with pytest.raises(AmqpConnectionError):
        wait_events(conn, lambda ev: False)
    assert not conn.is_open

    with Connection.open(url) as again:
        ch = again.channel()
        # the broker requeues the unacked ones in one step once it notices the dead socket
        deadline = time.monotonic() + 30
        while (depth := ch.queue_depth(q)) == 0:
            assert time.monotonic() < deadline, "the broker never requeued"
            time.sleep(0.1)
        assert depth == 8  # the 12 acked before the sync stayed acked
        ch.basic_qos(100)
        ch.basic_consume(q)
        back = collect(again, 8)
        assert [d.body for d in back] == [b"%d" % i for i in range(12, 20)]
        assert all(d.redelivered for d in back)
        ch.ack(back[-1].delivery_tag, multiple=True)
        token = ch.request_sync()
        wait_events(again, lambda ev: token in ev.syncs)
        assert ch.queue_depth(q) == 0


@broker
@pytest.mark.parametrize("exchange_type", ["fanout", "topic", "headers", "direct"])
def test_raw_properties_of_every_field_type_cross_a_classic_queue_unchanged(
    conn: Connection, exchange_type: str
) -> None:
    ex, q = qname(f"ex-{exchange_type}"), qname("classic")
    props = every_property()
    ch = conn.channel()
    ch.exchange_declare(ex, exchange_type, durable=True)
    ch.queue_declare(q, durable=True, arguments={"x-queue-type": "classic"})
    bind_args = table([(b"x-match", ("S", b"all")), (b"text", ("S", "café".encode()))])
    ch.queue_bind(q, ex, "a.b" if exchange_type != "fanout" else "", bind_args)
    # the decimal header must not close the producer's channel (it does for streams)
    publish_confirmed(ch, conn, ex, "a.b", [(props, b"body-1"), (props, b"")])
    assert ch.is_open and conn.is_open
    ch.basic_qos(10)
    ch.basic_consume(q)
    got = collect(conn, 2)
    assert [d.properties_raw for d in got] == [props, props]  # byte for byte
    assert [d.body for d in got] == [b"body-1", b""]
    assert (got[0].exchange, got[0].routing_key) == (ex, "a.b")
    p = decoded(got[0].properties_raw)
    assert p.headers["float"] == 1.5 and isinstance(p.headers["float"], float)
    assert p.headers["double"] == -2.25 and str(p.headers["decimal"]) == "123.45"
    assert p.headers["table"]["nested"]["deep"] == bytearray(b"\x00\xff")
    assert (p.priority, p.cluster_id, p.user_id) == (7, "cluster-1", "guest")
    # and the producer can go on publishing on the same channel
    ev = publish_confirmed(ch, conn, ex, "a.b", [(props, b"after")])
    assert (ev.deliveries or collect(conn, 1))[0].body == b"after"


@broker
def test_quorum_queue_keeps_first_delivery_and_re_sorts_headers_on_redelivery(
    conn: Connection,
) -> None:
    """RabbitMQ 3.10 quorum queues: the first delivery carries the publisher's property bytes;
    a redelivery re-encodes the headers table — keys sorted (stable for duplicates) and an
    ``x-delivery-count`` long-long added. Everything else stays byte-identical."""
    q = qname("quorum")
    props = every_property()
    ch = conn.channel()
    ch.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum"})
    publish_confirmed(ch, conn, "", q, [(props, b"q")])
    ch.basic_qos(10)
    ch.basic_consume(q)
    first = collect(conn, 1)[0]
    assert first.properties_raw == props and not first.redelivered
    ch.reject(first.delivery_tag, requeue=True)
    again = collect(conn, 1)[0]
    assert again.redelivered
    resorted = sorted([*EVERY_TYPE, (b"x-delivery-count", ("l", 1))], key=lambda kv: kv[0])
    assert again.properties_raw == every_property(resorted)
    assert again.properties_raw != props
    ch.ack(again.delivery_tag)


@broker
def test_publisher_confirms_and_returns(conn: Connection) -> None:
    q = qname("confirms")
    ch = conn.channel()
    ch.queue_declare(q)
    ch.confirm_select()
    seqs = [ch.publish("", q, PERSISTENT, b"%d" % i) for i in range(300)]
    assert seqs == list(range(1, 301))
    confirmed: set[int] = set()

    def all_confirmed(ev: Events) -> bool:
        for c in ev.confirms:
            assert c.ack and c.channel == ch.number
            confirmed.update(range(1, c.delivery_tag + 1) if c.multiple else [c.delivery_tag])
        ev.confirms.clear()
        return confirmed >= set(seqs)

    wait_events(conn, all_confirmed)
    assert ch.queue_depth(q) == 300
    # an unroutable mandatory message comes back, then is confirmed
    tag = ch.publish("", qname("nowhere"), PERSISTENT, b"lost?", mandatory=True)
    ev = wait_events(
        conn, lambda e: bool(e.returns) and any(c.delivery_tag == tag for c in e.confirms)
    )
    (ret,) = ev.returns
    assert (ret.reply_code, ret.reply_text, ret.body) == (312, "NO_ROUTE", b"lost?")
    assert ret.properties_raw == PERSISTENT


@broker
def test_broker_closing_a_channel_raises_404_and_the_connection_lives_on(
    conn: Connection, vhost: str
) -> None:
    ch = conn.channel()
    missing = qname("missing")
    with pytest.raises(AmqpClosed) as e:
        ch.basic_consume(missing)
    err = e.value
    assert (err.reply_code, err.class_id, err.method_id, err.channel) == (404, 60, 20, ch.number)
    assert missing in str(err) and vhost in str(err) and not err.retryable
    assert not ch.is_open
    with pytest.raises(AmqpClosed):
        ch.basic_qos(1)  # a closed channel keeps saying why
    other = conn.channel()
    assert other.queue_declare(qname("alive")).message_count == 0
    assert not conn.poll(0)  # the close was reported once (by basic_consume), not again


@broker
def test_channel_closed_during_poll_raises_once_and_other_channels_keep_their_deliveries(
    conn: Connection,
) -> None:
    q = qname("mixed")
    a, b = conn.channel(), conn.channel()
    a.queue_declare(q)
    publish_confirmed(a, conn, "", q, [(PERSISTENT, b"%d" % i) for i in range(5)])
    b.basic_qos(10)
    b.basic_consume(q)
    a.ack(999)  # unknown delivery tag: the broker closes channel a with 406
    seen: list[Delivery] = []
    with pytest.raises(AmqpClosed) as e:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen += conn.poll(0.5).deliveries
    assert (e.value.reply_code, e.value.channel) == (406, a.number)
    assert "999" in str(e.value)
    seen += collect(conn, 5 - len(seen)) if len(seen) < 5 else []
    assert [d.body for d in seen] == [b"%d" % i for i in range(5)]
    assert not a.is_open and b.is_open


@broker
def test_heartbeats_keep_an_idle_connection_and_a_frozen_peer_is_detected(
    url: str, relay: Relay, vhost: str
) -> None:
    conn = Connection.open(url_of(vhost, "127.0.0.1", relay.port), heartbeat=1)
    assert conn.heartbeat == 1
    ch = conn.channel()
    while conn.heartbeats_sent < 6:  # ~3 s idle: the broker drops a silent client after ~2 s
        assert not conn.poll(0.5)
    assert ch.queue_declare(qname("hb")).message_count == 0  # still served
    relay.freeze()
    with pytest.raises(AmqpConnectionError, match="heartbeat"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            conn.poll(0.5)
    assert not conn.is_open
    with pytest.raises(AmqpConnectionError):
        ch.ack(1)


@broker
def test_a_connection_limit_is_a_retryable_refusal_not_a_wrong_vhost(vhost: str) -> None:
    """RabbitMQ refuses a connection over a vhost's connection limit with 530, as it refuses a
    missing vhost: it was taken for a configuration error, and the tap stopped for good."""
    import requests

    limit = f"{MGMT}/api/vhost-limits/{urllib.parse.quote(vhost, safe='')}/max-connections"
    first = Connection.open(url_of(vhost))
    requests.put(limit, json={"value": 1}, auth=AUTH, timeout=10).raise_for_status()
    try:
        with pytest.raises(AmqpClosed) as e:
            Connection.open(url_of(vhost))
        assert not isinstance(e.value, AmqpAccessRefused)
        assert e.value.reply_code == 530 and "limit" in str(e.value) and e.value.retryable
    finally:
        requests.delete(limit, auth=AUTH, timeout=10)
        first.close()


@broker
def test_the_brokers_reason_survives_a_broken_pipe_on_close_ok(vhost: str) -> None:
    """A header frame over frame_max makes RabbitMQ close the connection (501) while 30 MB
    more are being written: the error raised is the broker's AmqpClosed with its reply code,
    not the broken pipe the close-ok met (replay tells a row the broker refuses by it)."""
    from bridge.protocol.properties import Properties, encode_properties, field_table

    conn = Connection.open(url_of(vhost))
    try:
        ch = conn.channel()
        ch.confirm_select()
        big = encode_properties(Properties(headers=field_table({"x": "a" * conn.frame_max})))
        with pytest.raises(AmqpClosed) as e:
            ch.publish("amq.direct", "k", big, b"x")
            for _ in range(30):
                ch.publish("amq.direct", "k", b"\x00\x00", b"y" * 1_000_000)
            conn.poll(5.0)
        assert e.value.reply_code == 501 and e.value.channel == 0, e.value
    finally:
        conn.close()


@broker
def test_connection_errors_name_host_and_vhost(vhost: str) -> None:
    with pytest.raises(AmqpAccessRefused) as e:
        Connection.open(url_of(vhost, password="wrong"))
    msg = str(e.value)
    assert "403" in msg and vhost in msg and HOST in msg and "wrong" not in msg
    assert not e.value.retryable
    missing = f"no-such-vhost-{uuid.uuid4().hex[:6]}"
    with pytest.raises(AmqpAccessRefused, match=missing) as e2:
        Connection.open(url_of(missing))
    assert "530" in str(e2.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        with pytest.raises(AmqpConnectionError, match=f"127.0.0.1:{port}") as e3:
            Connection.open(url_of(vhost, "127.0.0.1", port))
    assert e3.value.retryable


@broker
def test_graceful_close_requeues_unacked(url: str) -> None:
    q = qname("close")
    with Connection.open(url) as conn:
        ch = conn.channel()
        ch.queue_declare(q)
        publish_confirmed(ch, conn, "", q, [(PERSISTENT, b"a"), (PERSISTENT, b"b")])
        ch.basic_qos(10)
        ch.basic_consume(q)
        collect(conn, 2)
    assert not conn.is_open
    conn.close()  # idempotent
    with Connection.open(url) as again:
        ch = again.channel()
        ch.basic_qos(10)
        ch.basic_consume(q)
        back = collect(again, 2)
        assert [d.body for d in back] == [b"a", b"b"] and all(d.redelivered for d in back)


@broker
def test_broker_closing_the_connection_raises_amqp_closed_320(url: str, vhost: str) -> None:
    conn = Connection.open(url)
    out = subprocess.run(
        ["rabbitmqctl", "list_connections", "-q", "--no-table-headers", "pid", "vhost"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    (pid,) = [ln.split("\t")[0] for ln in out.splitlines() if ln.endswith("\t" + vhost)]
    _rabbitmqctl("close_connection", pid, "operator says bye")
    with pytest.raises(AmqpClosed) as e:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            conn.poll(0.5)
    assert (e.value.reply_code, e.value.channel) == (320, 0) and e.value.retryable
    assert "operator says bye" in str(e.value) and vhost in str(e.value)
    assert not conn.is_open
    with pytest.raises(AmqpClosed):
        conn.channel()


# ---------------------------------------------------------------------------- sends that wait
MB = b"y" * 1_000_000
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"


@broker
def test_a_send_the_broker_reads_nothing_of_is_abandoned_after_send_timeout(
    relay: Relay, vhost: str
) -> None:
    """A peer that stops reading (no heartbeats to notice it by) used to hold a publish in
    ``_send_rest`` for ever."""
    conn = Connection.open(url_of(vhost, "127.0.0.1", relay.port), heartbeat=0, send_timeout=1.0)
    ch = conn.channel()
    relay.freeze()
    t0 = time.monotonic()
    with pytest.raises(AmqpConnectionError, match="read nothing from it for") as e:
        for _ in range(200):  # 200 MB: far past every socket buffer between us and the relay
            ch.publish("amq.direct", "nobody", b"\x00\x00", MB)
    assert not isinstance(e.value, AmqpInterrupted) and "blocked" not in str(e.value)
    assert time.monotonic() - t0 >= 1.0  # it waited its send_timeout first
    assert not conn.is_open
    conn.close()


@broker
def test_a_send_blocked_by_a_broker_alarm_waits_until_interrupted_and_close_is_bounded(
    vhost: str, memory_alarm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real memory alarm: RabbitMQ blocks the publishing connection and reads nothing more
    while it keeps sending heartbeats. The send waits past ``send_timeout`` (the alarm is flow
    control, not a dead broker), knows it is blocked, and the ``interrupt`` hook ends it;
    closing a blocked connection gives up after CLOSE_SEND_LIMIT."""
    from bridge.amqp import client

    conn = Connection.open(url_of(vhost), heartbeat=2, send_timeout=0.5)
    ch = conn.channel()
    seen: list[str | None] = []
    t0 = time.monotonic()

    def interrupt() -> bool:
        seen.append(conn.blocked)
        return time.monotonic() - t0 > 5  # > send_timeout and > two heartbeat intervals

    conn.interrupt = interrupt
    with pytest.raises(AmqpInterrupted, match=r"blocked by the broker: low on memory") as e:
        for _ in range(200):
            ch.publish("amq.direct", "nobody", b"\x00\x00", MB)
    assert "low on memory" in seen and len(seen) >= 5, seen  # the hook ran while blocked
    assert isinstance(e.value, AmqpConnectionError) and not conn.is_open

    class HookFailed(Exception):
        pass

    def failing() -> bool:
        raise HookFailed

    other = Connection.open(url_of(vhost), heartbeat=2)
    och = other.channel()
    other.interrupt = failing
    with pytest.raises(HookFailed):  # a hook that raises mid-frame: the connection is gone
        for _ in range(200):
            och.publish("amq.direct", "nobody", b"\x00\x00", MB)
    assert not other.is_open and other.blocked == "low on memory"
    with pytest.raises(AmqpInterrupted, match="the interrupt hook raised"):
        other.channel()  # nothing is ever written after half a frame
    other.close()

    monkeypatch.setattr(client, "CLOSE_SEND_LIMIT", 1.0)
    third = Connection.open(url_of(vhost), heartbeat=0)
    tch = third.channel()
    tch.publish("amq.direct", "nobody", b"\x00\x00", b"x")  # blocked from its first publish
    deadline = time.monotonic() + 30
    while third.blocked is None:
        assert time.monotonic() < deadline, "the broker never blocked the connection"
        third.poll(0.2)
    filled = 0
    try:  # whole heartbeat frames into the socket the broker no longer reads, until it is full
        while True:
            filled += third._sock.send(HEARTBEAT_FRAME * 4096)
    except BlockingIOError:
        pass
    assert filled > 0
    t1 = time.monotonic()
    third.close()  # the close frame cannot be written while the alarm lasts: given up, not hung
    assert time.monotonic() - t1 >= 1.0 and not third.is_open


# ---------------------------------------------------------------------------- channel numbers
@broker
def test_a_new_channel_never_takes_the_number_whose_late_confirms_are_unread(url: str) -> None:
    """A channel the broker closes leaves its confirms unread in the connection; the next
    channel used to get the same (lowest free) number, so those confirms read as its own."""
    conn = Connection.open(url)
    try:
        old = conn.channel()
        old.confirm_select()
        for _ in range(50):
            old.publish("amq.direct", "nobody", b"\x00\x00", b"x")
        old.publish(f"no-such-{uuid.uuid4().hex[:6]}", "k", b"\x00\x00", b"x")  # 404 closes it
        seen = Events()
        with pytest.raises(AmqpClosed) as e:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                seen.confirms += conn.poll(0.5).confirms
        assert e.value.reply_code == 404 and e.value.channel == old.number
        new = conn.channel()
        assert new.number != old.number
        seen.confirms += conn.poll(0.5).confirms  # what the raise kept for the next call
        assert len(seen.confirms) > 0 and {c.channel for c in seen.confirms} == {old.number}
        new.confirm_select()
        assert new.publish("amq.direct", "nobody", b"\x00\x00", b"y") == 1
        got = wait_events(conn, lambda ev: any(c.channel == new.number for c in ev.confirms))
        assert [(c.channel, c.delivery_tag) for c in got.confirms] == [(new.number, 1)]
    finally:
        conn.close()


@broker
def test_channel_numbers_wrap_around_and_a_reused_number_starts_with_no_events(url: str) -> None:
    conn = Connection.open(url)
    try:
        conn.channel_max = 3
        numbers = []
        for _ in range(5):
            ch = conn.channel()
            numbers.append(ch.number)
            ch.close()
        assert numbers == [1, 2, 3, 1, 2]
        a, b = conn.channel(), conn.channel()  # 3, then 1 (2 is free too, but 1 comes first)
        assert (a.number, b.number) == (3, 1)
        conn._ev.confirms.append(Confirm(2, 7, False, True))  # a closed channel 2 left this
        assert conn.channel().number == 2 and not conn._ev.confirms
        with pytest.raises(AmqpConnectionError, match="all 3 channels"):
            conn.channel()
    finally:
        conn.close()


def test_frame_max_below_what_rabbitmq_4_1_takes_is_refused() -> None:
    with pytest.raises(ConfigError, match="8192"):
        Connection.open("amqp://guest:guest@127.0.0.1:1/%2F", frame_max=4096)


@broker
def test_the_brokers_consumer_ack_timeout_closes_the_channel_as_a_retryable_error(
    url: str,
) -> None:
    """RabbitMQ closes a consumer's channel with 406 when a delivery stays unacked past its
    consumer_timeout: a tap held by a slow disk that long must reconnect (the deliveries come
    again), not stop for good as for a real precondition failure."""
    from tests.conftest import rabbit_env

    q = qname("ack-timeout")
    with rabbit_env(consumer_timeout="1000", channel_tick_interval="200"):
        conn = Connection.open(url)
        try:
            ch = conn.channel()
            ch.queue_declare(q)
            publish_confirmed(ch, conn, "", q, [(PERSISTENT, b"a")])
            ch.basic_qos(10)
            ch.basic_consume(q)
            assert [d.body for d in collect(conn, 1)] == [b"a"]
            with pytest.raises(AmqpClosed) as e:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    conn.poll(0.5)
            assert e.value.reply_code == 406 and "timed out" in e.value.reply_text
            assert e.value.retryable and e.value.channel == ch.number
            again = conn.channel()  # the connection lives on; the delivery comes back
            again.basic_qos(10)
            again.basic_consume(q)
            back = collect(conn, 1)
            assert [d.body for d in back] == [b"a"] and back[0].redelivered
            again.ack(back[0].delivery_tag)
        finally:
            conn.close()
    with Connection.open(url) as c, pytest.raises(AmqpClosed) as e:
        c.channel().queue_declare(q, durable=True)  # not as declared: 406 inequivalent arg
    assert e.value.reply_code == 406 and not e.value.retryable  # a real one stays final
