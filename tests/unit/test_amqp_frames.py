"""AMQP client frames: splitting, content headers and methods round-trip; pamqp is the oracle.

pamqp (an independent AMQP 0-9-1 codec) marshals the methods we build by hand and decodes the
ones we parse by hand. The client's frame reader is fed the same byte streams through a real
socket pair, cut at arbitrary points, and must rebuild every message exactly.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands
from pamqp import frame as pframe
from pamqp.header import ContentHeader as PContentHeader

from bridge.amqp import frames as f
from bridge.amqp.client import AmqpParams, Channel, Connection, Delivery, Events, Returned
from bridge.errors import AmqpConnectionError, AmqpFrameError

# names pamqp's validators accept (RabbitMQ accepts any UTF-8; the hand-made cases cover it)
NAME = st.text(
    alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789-_.:@#,/+ "), max_size=60
)
ANY_NAME = st.text(max_size=40).filter(lambda s: len(s.encode()) <= 255)
TAG = st.integers(min_value=0, max_value=2**63 - 1)  # pamqp encodes longlong as signed
CHANNEL = st.integers(min_value=0, max_value=65535)


def props_strategy() -> st.SearchStrategy[bytes]:
    """Property bytes as pamqp encodes them (flag word + values), floats included."""
    values = st.one_of(
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.floats(allow_nan=False, width=32),
        st.text(max_size=20),
    )
    headers = st.none() | st.dictionaries(st.text(min_size=1, max_size=10), values, max_size=6)
    return st.builds(
        lambda ct, dm, hd, mid: commands.Basic.Properties(
            content_type=ct, delivery_mode=dm, headers=hd, message_id=mid
        ).marshal(),
        st.none() | NAME.filter(bool),
        st.none() | st.sampled_from([1, 2]),
        headers,
        st.none() | NAME.filter(bool),
    )


# ---------------------------------------------------------------------------- splitting
FRAMES = st.lists(
    st.tuples(st.sampled_from([1, 2, 3, 8]), CHANNEL, st.binary(max_size=300)), max_size=12
)


@settings(max_examples=300, deadline=None)
@given(FRAMES, st.data())
def test_split_frames_round_trips_at_any_cut(
    frames: list[tuple[int, int, bytes]], data: Any
) -> None:
    stream = b"".join(f.frame(t, c, p) for t, c, p in frames)
    cut = data.draw(st.integers(min_value=0, max_value=len(stream)))
    first, used = f.split_frames(stream[:cut])
    assert used <= cut
    rest, used2 = f.split_frames(stream[used:])
    assert used + used2 == len(stream)
    got = [(s.type, s.channel, stream[s.start : s.end]) for s in first]
    got += [(s.type, s.channel, stream[used + s.start : used + s.end]) for s in rest]
    assert got == frames
    for s in first:
        assert stream[s.end] == f.FRAME_END


@given(FRAMES.filter(bool), st.data())
def test_split_frames_rejects_a_bad_frame_end(
    frames: list[tuple[int, int, bytes]], data: Any
) -> None:
    stream = bytearray(b"".join(f.frame(t, c, p) for t, c, p in frames))
    ends = []
    pos = 0
    for _t, _c, p in frames:
        pos += 7 + len(p)
        ends.append(pos)
        pos += 1
    at = data.draw(st.sampled_from(ends))
    stream[at] = data.draw(st.integers(min_value=0, max_value=255).filter(lambda b: b != 0xCE))
    with pytest.raises(AmqpFrameError, match="0xCE"):
        f.split_frames(bytes(stream))


def test_split_frames_rejects_a_frame_larger_than_frame_max_before_it_is_complete() -> None:
    head = struct.pack(">BHI", 3, 1, 10_000_000)
    with pytest.raises(AmqpFrameError, match="frame_max"):
        f.split_frames(head + b"x" * 100, max_payload=131072 - 8)
    assert f.split_frames(head + b"x" * 100) == ([], 0)  # no limit: waits for the rest


# ---------------------------------------------------------------------------- content header
@given(st.integers(min_value=0, max_value=2**64 - 1), props_strategy())
def test_content_header_round_trip_and_matches_pamqp(size: int, props: bytes) -> None:
    payload = f.content_header_payload(size, props)
    ch = f.parse_content_header(payload)
    assert ch == f.ContentHeader(60, 0, size, props)
    ours = f.frame(f.FRAME_HEADER, 5, payload)
    decoded = PContentHeader()
    decoded.unmarshal(payload)
    assert decoded.body_size == size
    assert pframe.marshal(PContentHeader(0, size, decoded.properties), 5) == ours


@given(st.binary(max_size=13))
def test_content_header_too_short_is_refused(payload: bytes) -> None:
    with pytest.raises(AmqpFrameError):
        f.parse_content_header(payload)


# ---------------------------------------------------------------------------- incoming methods
@given(NAME, TAG, st.booleans(), NAME, NAME)
def test_parse_deliver_matches_pamqp(
    ctag: str, dtag: int, redelivered: bool, ex: str, rk: str
) -> None:
    method = commands.Basic.Deliver(ctag, dtag, redelivered, ex, rk)
    wire = pframe.marshal(method, 3)
    spans, _ = f.split_frames(wire)
    (span,) = spans
    assert f.method_id(wire, span.start) == f.DELIVER
    assert f.parse_deliver(wire, span.start) == f.DeliverArgs(ctag, dtag, redelivered, ex, rk)


@given(ANY_NAME, TAG, st.booleans(), ANY_NAME, ANY_NAME)
def test_parse_deliver_any_utf8(ctag: str, dtag: int, redelivered: bool, ex: str, rk: str) -> None:
    args = (
        f.shortstr(ctag) + struct.pack(">QB", dtag, redelivered) + f.shortstr(ex) + f.shortstr(rk)
    )
    wire = f.method_frame(1, f.DELIVER, args)
    assert f.parse_deliver(wire, 7) == (ctag, dtag, redelivered, ex, rk)
    decoded = f.unmarshal_method(wire[7:-1])  # pamqp decodes it too (no validation on read)
    assert (decoded.consumer_tag, decoded.delivery_tag, decoded.exchange) == (ctag, dtag, ex)  # type: ignore[attr-defined]


def test_undecodable_short_strings_are_kept_as_surrogate_escapes() -> None:
    args = f.shortstr(b"t") + struct.pack(">QB", 1, 0) + f.shortstr(b"\xff") + f.shortstr(b"k\xfe")
    got = f.parse_deliver(f.method_frame(1, f.DELIVER, args), 7)
    assert got.exchange.encode("utf-8", "surrogateescape") == b"\xff"
    assert got.routing_key.encode("utf-8", "surrogateescape") == b"k\xfe"


@given(st.integers(min_value=0, max_value=65535), NAME, NAME, NAME)
def test_parse_return_matches_pamqp(code: int, text: str, ex: str, rk: str) -> None:
    wire = pframe.marshal(commands.Basic.Return(code, text, ex, rk), 1)
    assert f.parse_return(wire, 7) == f.ReturnArgs(code, text, ex, rk)


@given(TAG, st.booleans(), st.booleans())
def test_confirms_and_acks_match_pamqp(dtag: int, multiple: bool, requeue: bool) -> None:
    ack = pframe.marshal(commands.Basic.Ack(dtag, multiple), 9)
    nack = pframe.marshal(commands.Basic.Nack(dtag, multiple, requeue), 9)
    reject = pframe.marshal(commands.Basic.Reject(dtag, requeue), 9)
    assert f.ack_frame(9, dtag, multiple) == ack
    assert f.nack_frame(9, dtag, multiple, requeue) == nack
    assert f.reject_frame(9, dtag, requeue) == reject
    assert f.parse_confirm(ack, 7) == (dtag, multiple)
    assert f.parse_confirm(nack, 7) == (dtag, multiple)


# ---------------------------------------------------------------------------- outgoing methods
ARGS = st.none() | st.dictionaries(
    st.text(min_size=1, max_size=8), st.integers(min_value=0, max_value=10**6) | NAME, max_size=3
)


@settings(max_examples=200, deadline=None)
@given(
    CHANNEL.filter(bool), NAME, NAME, NAME, st.lists(st.booleans(), min_size=4, max_size=4), ARGS
)
def test_methods_match_pamqp(
    ch: int, a: str, b: str, c: str, flags: list[bool], args: dict[str, Any] | None
) -> None:
    p, d, x, ad = flags
    pairs = [
        (
            f.queue_declare_frame(ch, a, passive=p, durable=d, exclusive=x, auto_delete=ad,
                                  arguments=args),
            commands.Queue.Declare(0, a, p, d, x, ad, False, args),
        ),
        (
            f.exchange_declare_frame(ch, a, b or "direct", passive=p, durable=d, auto_delete=x,
                                     internal=ad, arguments=args),
            commands.Exchange.Declare(0, a, b or "direct", p, d, x, ad, False, args),
        ),
        (f.queue_bind_frame(ch, a, b, c, args), commands.Queue.Bind(0, a, b, c, False, args)),
        (
            f.consume_frame(ch, a, b, no_ack=p, exclusive=x, arguments=args),
            commands.Basic.Consume(0, a, b, False, p, x, False, args),
        ),
        (f.cancel_frame(ch, a), commands.Basic.Cancel(a, False)),
        (f.cancel_ok_frame(ch, a), commands.Basic.CancelOk(a)),
        (f.qos_frame(ch, 1000), commands.Basic.Qos(0, 1000, False)),
        (f.confirm_select_frame(ch), commands.Confirm.Select(False)),
        (f.flow_ok_frame(ch, p), commands.Channel.FlowOk(p)),
        (f.close_frame(ch, 200, a, 0x003C0014), commands.Channel.Close(200, a, 60, 20)),
        (f.close_ok_frame(ch), commands.Channel.CloseOk()),
    ]  # fmt: skip
    for ours, theirs in pairs:
        assert ours == pframe.marshal(theirs, ch), theirs.name
        _used, number, back = pframe.unmarshal(ours)
        assert number == ch and back.name == theirs.name
    # channel.open's reserved short string is empty (as pika sends it; pamqp insists on "0")
    assert f.channel_open_frame(ch) == f.frame(f.FRAME_METHOD, ch, b"\x00\x14\x00\x0a\x00")


@given(NAME, st.text(max_size=20), st.text(max_size=20), NAME.filter(bool))
def test_connection_methods_match_pamqp(client: str, user: str, password: str, vhost: str) -> None:
    props: dict[str, Any] = {"connection_name": client, "capabilities": {"basic.nack": True}}
    start_ok = commands.Connection.StartOk(
        props, "PLAIN", "\x00" + user + "\x00" + password, "en_US"
    )
    assert f.start_ok_frame(props, user, password) == pframe.marshal(start_ok, 0)
    assert f.tune_ok_frame(2047, 131072, 30) == pframe.marshal(
        commands.Connection.TuneOk(2047, 131072, 30), 0
    )
    assert f.connection_open_frame(vhost) == pframe.marshal(commands.Connection.Open(vhost), 0)
    assert f.close_frame(0, 320, "bye") == pframe.marshal(
        commands.Connection.Close(320, "bye", 0, 0), 0
    )
    assert f.close_ok_frame(0) == pframe.marshal(commands.Connection.CloseOk(), 0)


def test_pre_encoded_tables_pass_unchanged_and_are_checked() -> None:
    raw = struct.pack(">I", 11) + b"\x01kd" + struct.pack(">d", 1.5)
    assert f.table(raw) == raw
    assert f.queue_declare_frame(1, "q", arguments=raw).endswith(raw + b"\xce")
    for bad in (b"", b"\x00\x00\x00\x05abc", b"\x00\x00"):
        with pytest.raises(ValueError, match="32-bit length"):
            f.table(bad)
    with pytest.raises(ValueError, match="255"):
        f.shortstr("q" * 256)


@settings(max_examples=200, deadline=None)
@given(
    CHANNEL.filter(bool), NAME, NAME, props_strategy(), st.binary(max_size=20_000),
    st.sampled_from([4096, 4097, 5000, 131072]), st.booleans(),
)  # fmt: skip
def test_publish_frames_split_bodies_and_match_pamqp(
    ch: int, ex: str, rk: str, props: bytes, body: bytes, frame_max: int, mandatory: bool
) -> None:
    wire = f.publish_frames(ch, ex.encode(), rk.encode(), props, body, frame_max, mandatory)
    spans, used = f.split_frames(wire, max_payload=frame_max - 8)
    assert used == len(wire)
    method, header, *bodies = spans
    assert wire[: method.end + 1] == pframe.marshal(
        commands.Basic.Publish(0, ex, rk, mandatory, False), ch
    )
    assert f.parse_content_header(wire[header.start : header.end]) == (60, 0, len(body), props)
    room = frame_max - 8
    assert len(bodies) == -(-len(body) // room)
    assert all(s.type == f.FRAME_BODY and s.channel == ch for s in bodies)
    assert all(s.end - s.start <= room for s in bodies)
    assert b"".join(wire[s.start : s.end] for s in bodies) == body


# ---------------------------------------------------------------------------- the client's reader
MESSAGE = st.tuples(
    st.integers(min_value=1, max_value=3),  # channel
    st.booleans(),  # a delivery (True) or a returned message
    NAME,
    ANY_NAME,
    props_strategy(),
    st.binary(max_size=64)
    | st.builds(  # bodies over several 4 KB frames, sizes around the frame boundaries
        lambda n, seed: (seed * (n // len(seed) + 1))[:n],
        st.integers(min_value=4080, max_value=13000),
        st.binary(min_size=1, max_size=16),
    ),
)


def _message_frames(i: int, m: tuple[int, bool, str, str, bytes, bytes], frame_max: int) -> bytes:
    ch, deliver, ex, rk, props, body = m
    if deliver:
        args = f.shortstr(f"ctag-{ch}") + struct.pack(">QB", i, i % 2)
        method = f.method_frame(ch, f.DELIVER, args + f.shortstr(ex) + f.shortstr(rk))
    else:
        args = struct.pack(">H", 312) + f.shortstr("NO_ROUTE") + f.shortstr(ex) + f.shortstr(rk)
        method = f.method_frame(ch, f.RETURN, args)
    content = f.publish_frames(ch, b"", b"", props, body, frame_max)
    return method + content[content.index(b"\xce") + 1 :]  # drop basic.publish, keep content


@pytest.fixture
def reader() -> Iterator[tuple[Connection, socket.socket]]:
    """A Connection on one end of a real socket pair, past its handshake, channels 1-3 open."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    conn = Connection(
        ours, AmqpParams("test", 1, "u", "p", "/"), heartbeat=0, frame_max=4096, rpc_timeout=5
    )
    conn._handshake = False
    for n in (1, 2, 3):
        ch = Channel(conn, n)
        ch._tags[f"ctag-{n}".encode()] = f"ctag-{n}"
        conn._channels[n] = ch
    yield conn, theirs
    conn._drop()
    theirs.close()


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(MESSAGE, max_size=8), st.lists(st.integers(min_value=1, max_value=5000), max_size=6)
)
def test_reader_rebuilds_messages_from_any_cut(
    reader: tuple[Connection, socket.socket],
    msgs: list[tuple[int, bool, str, str, bytes, bytes]],
    cuts: list[int],
) -> None:
    conn, theirs = reader
    stream = f.HEARTBEAT + b"".join(_message_frames(i, m, 4096) for i, m in enumerate(msgs, 1))
    expected: list[Delivery | Returned] = []
    for i, (ch, deliver, ex, rk, props, body) in enumerate(msgs, 1):
        if deliver:
            expected.append(Delivery(ch, f"ctag-{ch}", i, i % 2 == 1, ex, rk, props, body))
        else:
            expected.append(Returned(ch, 312, "NO_ROUTE", ex, rk, props, body))
    got: list[Delivery | Returned] = []
    reads = 0
    pos = 0
    for size in [*cuts, len(stream)]:
        chunk = stream[pos : pos + size]
        pos += len(chunk)
        if chunk:
            theirs.sendall(chunk)
            ev = conn.poll(0.0)  # the bytes are already in the socket: one read
            reads += 1
            got += [*ev.deliveries, *ev.returns]
    while len(got) < len(expected):
        ev = conn.poll(5.0)
        assert ev, "the reader lost data"
        got += [*ev.deliveries, *ev.returns]
    assert [g for g in got if isinstance(g, Delivery)] == [
        e for e in expected if isinstance(e, Delivery)
    ]
    assert [g for g in got if isinstance(g, Returned)] == [
        e for e in expected if isinstance(e, Returned)
    ]
    assert conn._rlen == 0 and reads >= 1


def test_reader_refuses_garbage(reader: tuple[Connection, socket.socket]) -> None:
    conn, theirs = reader
    theirs.sendall(b"\x01\x00\x01\x00\x00\x00\x04abcdX")
    with pytest.raises(AmqpFrameError, match="0xCE"):
        conn.poll(5.0)
    assert not conn.is_open


def test_reader_refuses_frames_for_unopened_channels(
    reader: tuple[Connection, socket.socket],
) -> None:
    conn, theirs = reader
    theirs.sendall(f.frame(f.FRAME_BODY, 9, b"x"))
    with pytest.raises(AmqpFrameError, match="channel 9"):
        conn.poll(5.0)


def test_events_are_falsy_when_empty() -> None:
    assert not Events()
    assert Events(syncs=[1])


def test_a_caller_away_longer_than_two_heartbeats_reads_before_declaring_the_peer_dead(
    reader: tuple[Connection, socket.socket],
) -> None:
    conn, theirs = reader
    conn.heartbeat = 1
    conn._last_recv -= 5.0  # the caller did not poll for 5 s ...
    conn._last_send -= 5.0
    theirs.sendall(f.HEARTBEAT)  # ... while the broker's heartbeats waited in the socket
    assert not conn.poll(0.0)
    assert conn.is_open and conn.heartbeats_sent == 1
    assert theirs.recv(64) == f.HEARTBEAT  # ours went out
    conn._last_recv -= 5.0  # and this time nothing came
    with pytest.raises(AmqpConnectionError, match="two heartbeat intervals"):
        conn.poll(0.0)
    assert not conn.is_open


def test_a_send_the_peer_keeps_reading_is_never_cut_by_the_interrupt_hook(
    reader: tuple[Connection, socket.socket],
) -> None:
    """The hook is asked only once a send has stalled (or the broker blocked it): a stop during
    a send that moves lets it finish, so the caller stops gracefully between frames."""
    import threading

    conn, theirs = reader
    asked: list[float] = []
    conn.interrupt = lambda: asked.append(1.0) or True
    data = b"\x08\x00\x00\x00\x00\x00\x00\xce" * (1 << 20)  # 8 MB of heartbeat frames
    got = 0

    def drain() -> None:
        nonlocal got
        while got < len(data):
            got += len(theirs.recv(1 << 20))

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    conn._send(data)
    t.join(30)
    assert got == len(data) and conn.is_open and not asked
