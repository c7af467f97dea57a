"""AMQP client (both sides): one blocking-socket AMQP 0-9-1 connection, raw property bytes kept.

No threads: the caller drives the connection. ``conn.poll(timeout)`` reads what the socket
has (one ``recv_into`` of a large buffer, every complete frame parsed) and returns
:class:`Events` — deliveries, publisher confirms, completed sync tokens, returned messages,
consumer cancellations. Synchronous methods (declare, consume, qos ...) wait for their reply;
deliveries arriving meanwhile are kept for the next ``poll``. Heartbeats are sent while the
caller is inside any call of this module; a broker silent for two heartbeat intervals is
presumed dead (:class:`~bridge.errors.AmqpConnectionError`).

Content header property bytes are never decoded here: ``Delivery.properties_raw`` is exactly
what the broker sent, and ``Channel.publish`` sends the caller's property bytes unchanged.

    conn = Connection.open("amqp://user:pass@host:5672/%2F")
    ch = conn.channel()
    ch.basic_qos(1000)
    ch.basic_consume("queue")
    while True:
        ev = conn.poll(0.5)
        ...                                  # store ev.deliveries durably
        ch.ack(ev.deliveries[-1].delivery_tag, multiple=True)
        token = ch.request_sync()            # in a later poll: token in ev.syncs
"""

from __future__ import annotations

import select
import socket
import struct
import sys
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

from pamqp import commands

from bridge.amqp import frames as f
from bridge.errors import (
    AmqpAccessRefused,
    AmqpClosed,
    AmqpConnectionError,
    AmqpFrameError,
    AmqpInterrupted,
    BrokerError,
    ConfigError,
)

__all__ = [
    "Connection",
    "Channel",
    "Delivery",
    "Confirm",
    "Returned",
    "Cancelled",
    "Events",
    "QueueInfo",
    "AmqpParams",
    "parse_url",
]

DEFAULT_PORT = 5672
MIN_FRAME_MAX = 8192  # AMQP 0-9-1 allows 4096; RabbitMQ 4.1 and later refuse below 8192
READ_BUFFER = 1 << 20
SEND_WAKE = 0.5  # a send waiting for the broker to read checks the interrupt hook this often
CLOSE_SEND_LIMIT = 10.0  # connection.close never waits longer than this for the broker to read
_HEAD = struct.Struct(">BHI")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_QB = struct.Struct(">QB")
_monotonic = time.monotonic


# ---------------------------------------------------------------------------- events
@dataclass(slots=True)
class Delivery:
    """One message delivered to a consumer; ``properties_raw`` is verbatim from the broker.

    Names are UTF-8; bytes that are not (AMQP short strings are binary) are kept as surrogate
    escapes, so ``s.encode("utf-8", "surrogateescape")`` gives back the wire bytes.
    """

    channel: int
    consumer_tag: str
    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str
    properties_raw: bytes
    body: bytes


@dataclass(slots=True)
class Confirm:
    """A publisher confirm: ``ack`` False is a broker nack (the message may be lost)."""

    channel: int
    delivery_tag: int
    multiple: bool
    ack: bool


@dataclass(slots=True)
class Returned:
    """A mandatory message the broker could not route (``basic.return``)."""

    channel: int
    reply_code: int
    reply_text: str
    exchange: str
    routing_key: str
    properties_raw: bytes
    body: bytes


@dataclass(slots=True)
class Cancelled:
    """The broker cancelled a consumer (its queue was deleted, or a node went down)."""

    channel: int
    consumer_tag: str


@dataclass(slots=True)
class Events:
    """What one ``poll`` produced, in arrival order within each list."""

    deliveries: list[Delivery] = field(default_factory=list)
    confirms: list[Confirm] = field(default_factory=list)
    syncs: list[int] = field(default_factory=list)
    returns: list[Returned] = field(default_factory=list)
    cancels: list[Cancelled] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.deliveries or self.confirms or self.syncs or self.returns or self.cancels)

    def drop_channel(self, number: int) -> None:
        """Forget what channel ``number`` left unread (the number now names a new channel)."""
        for name in ("deliveries", "confirms", "returns", "cancels"):
            items = getattr(self, name)
            if any(x.channel == number for x in items):
                items[:] = [x for x in items if x.channel != number]


class QueueInfo(NamedTuple):
    """``queue.declare-ok``: the name (chosen by the broker for ``""``) and its counts."""

    queue: str
    message_count: int
    consumer_count: int


# ---------------------------------------------------------------------------- URL
@dataclass(frozen=True)
class AmqpParams:
    """Where to connect; ``repr`` and ``where`` never show the password."""

    host: str
    port: int
    user: str
    password: str = field(repr=False)
    vhost: str

    @property
    def where(self) -> str:
        """``amqp://host:port/vhost`` (vhost URL-encoded) for messages."""
        return f"amqp://{self.host}:{self.port}/{urllib.parse.quote(self.vhost, safe='')}"


def parse_url(url: str) -> AmqpParams:
    """``amqp://user:pass@host:port/vhost``; the vhost is URL-decoded (``%2F`` is ``/``; an
    empty path is ``/``). Anything this client cannot honour is a :class:`ConfigError`."""
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port or DEFAULT_PORT
    except ValueError as e:
        raise ConfigError(
            f"AMQP URL is malformed ({e}): use amqp://user:pass@host:5672/vhost"
        ) from None
    if u.scheme != "amqp":
        raise ConfigError(
            f"AMQP URL scheme {u.scheme!r} is not supported: use amqp://user:pass@host:5672/vhost "
            "(TLS is not implemented by bridge.amqp; terminate it in front of the broker)"
        )
    if u.query or u.fragment:
        raise ConfigError(
            "AMQP URL has query parameters or a fragment, which bridge.amqp does not read: remove "
            "them (heartbeat and timeouts come from the bridge configuration)"
        )
    path = u.path
    vhost = "/" if path in ("", "/") else urllib.parse.unquote(path[1:])
    return AmqpParams(
        host=u.hostname or "localhost",
        port=port,
        user=urllib.parse.unquote(u.username) if u.username is not None else "guest",
        password=urllib.parse.unquote(u.password) if u.password is not None else "guest",
        vhost=vhost,
    )


def _method_name(class_id: int, method_id: int) -> str:
    cls = commands.INDEX_MAPPING.get((class_id << 16) | method_id)
    return str(getattr(cls, "name", f"{class_id}.{method_id}"))


# ---------------------------------------------------------------------------- channel
class Channel:
    """One AMQP channel of a :class:`Connection` (``number`` is its id on the wire)."""

    def __init__(self, conn: Connection, number: int) -> None:
        self._conn = conn
        self.number = number
        self.prefetch = 0
        self.is_open = True
        self.flow_active = True
        self.consumers: set[str] = set()
        self._tags: dict[bytes, str] = {}  # consumer tags as sent on the wire
        self._error: AmqpClosed | None = None
        # synchronous replies
        self._expect = 0
        self._reply: Any = None
        self._doing = ""
        self._qos: deque[int] = deque()  # 0 = a basic_qos call waiting; >0 = a sync token
        # content being assembled: (is_delivery, method args) + properties + remaining bytes
        self._deliver = True
        self._msg: Any = None
        self._props = b""
        self._need = 0
        self._parts: list[Any] | None = None
        # publishing
        self._confirming = False
        self._seq = 0

    def __repr__(self) -> str:
        return f"Channel({self.number}, open={self.is_open})"

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if not self.is_open:
            raise AmqpConnectionError(f"channel {self.number} of {self._conn.where} is closed")

    def _rpc(self, frame: bytes, expect: int, doing: str) -> Any:
        self._check()
        self._expect, self._reply, self._doing = expect, None, doing
        try:
            self._conn._send(frame)
            self._conn._wait_reply(self)
            return self._reply
        finally:
            self._expect, self._reply, self._doing = 0, None, ""

    # -- consuming ---------------------------------------------------------------------------
    def basic_qos(self, prefetch_count: int) -> None:
        """Per-consumer prefetch window for the consumers started after this call."""
        if not 0 <= prefetch_count <= 65535:
            raise ValueError(f"prefetch_count {prefetch_count} is outside 0..65535")
        self._check()
        self._qos.append(0)
        self._rpc(f.qos_frame(self.number, prefetch_count), f.BASIC_QOS_OK, "basic.qos")
        self.prefetch = prefetch_count

    def basic_consume(
        self,
        queue: str,
        *,
        consumer_tag: str | None = None,
        exclusive: bool = False,
        no_ack: bool = False,
        arguments: bytes | Mapping[str, Any] | None = None,
    ) -> str:
        """Start a consumer on ``queue`` (manual acks unless ``no_ack``); returns its tag."""
        frame = f.consume_frame(
            self.number, queue, consumer_tag or "", no_ack=no_ack, exclusive=exclusive,
            arguments=arguments,
        )  # fmt: skip
        ok = self._rpc(frame, f.BASIC_CONSUME_OK, f"consuming from queue {queue!r}")
        tag = str(ok.consumer_tag)
        self.consumers.add(tag)
        self._tags[tag.encode()] = tag
        return tag

    def basic_cancel(self, consumer_tag: str) -> None:
        """Stop a consumer; deliveries already sent still arrive through ``poll``."""
        self._rpc(
            f.cancel_frame(self.number, consumer_tag),
            f.BASIC_CANCEL_OK,
            f"cancelling consumer {consumer_tag!r}",
        )
        self.consumers.discard(consumer_tag)
        self._tags.pop(consumer_tag.encode(), None)

    def ack(self, delivery_tag: int, multiple: bool = False) -> None:
        """Acknowledge one delivery (or, with ``multiple``, every one up to it)."""
        self._check()
        self._conn._send(f.ack_frame(self.number, delivery_tag, multiple))

    def nack(self, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> None:
        """Refuse deliveries (requeued unless ``requeue`` is False)."""
        self._check()
        self._conn._send(f.nack_frame(self.number, delivery_tag, multiple, requeue))

    def reject(self, delivery_tag: int, requeue: bool = True) -> None:
        """Refuse one delivery (requeued unless ``requeue`` is False)."""
        self._check()
        self._conn._send(f.reject_frame(self.number, delivery_tag, requeue))

    def request_sync(self) -> int:
        """Send a ``basic.qos`` with the current prefetch and return a token; the token shows
        up in ``Events.syncs`` once the broker answered, which proves it processed every
        earlier frame of this channel (e.g. acks). Does not change existing consumers."""
        self._check()
        token = self._conn._next_token()
        self._qos.append(token)
        self._conn._send(f.qos_frame(self.number, self.prefetch))
        return token

    # -- publishing --------------------------------------------------------------------------
    @property
    def confirming(self) -> bool:
        """Whether ``confirm_select`` was called (publishes are confirmed)."""
        return self._confirming

    def confirm_select(self) -> None:
        """Publisher confirms from now on: ``publish`` returns the tag the broker confirms."""
        self._rpc(f.confirm_select_frame(self.number), f.CONFIRM_SELECT_OK, "confirm.select")
        self._confirming = True
        self._seq = 0

    def publish(
        self,
        exchange: str,
        routing_key: str,
        properties_raw: bytes,
        body: bytes | bytearray | memoryview,
        *,
        mandatory: bool = False,
    ) -> int:
        """Publish with the content header's property bytes exactly as given (flag words
        first, as in a content header frame); returns the publish sequence number (the
        confirm delivery tag after ``confirm_select``, counted from 1)."""
        self._check()
        conn = self._conn
        conn._send(
            f.publish_frames(
                self.number, exchange.encode("utf-8", "surrogateescape"),
                routing_key.encode("utf-8", "surrogateescape"), properties_raw, body,
                conn.frame_max, mandatory,
            )
        )  # fmt: skip
        self._seq += 1
        return self._seq

    def publish_many(
        self,
        exchange: str,
        messages: Sequence[tuple[str, bytes, bytes | bytearray | memoryview]],
        *,
        mandatory: bool = False,
    ) -> int:
        """Publish ``(routing_key, properties_raw, body)`` messages to ``exchange`` in one
        socket write (properties sent byte for byte, as ``publish``); returns the publish
        sequence number of the last one (the first is ``last - len(messages) + 1``)."""
        self._check()
        if not messages:
            return self._seq
        conn = self._conn
        number, frame_max = self.number, conn.frame_max
        x = exchange.encode("utf-8", "surrogateescape")
        frames = f.publish_frames
        conn._send(
            b"".join(
                [
                    frames(number, x, rk.encode("utf-8", "surrogateescape"), props, body,
                           frame_max, mandatory)
                    for rk, props, body in messages
                ]
            )
        )  # fmt: skip
        self._seq += len(messages)
        return self._seq

    # -- topology ----------------------------------------------------------------------------
    def exchange_declare(
        self,
        exchange: str,
        exchange_type: str = "direct",
        *,
        passive: bool = False,
        durable: bool = False,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: bytes | Mapping[str, Any] | None = None,
    ) -> None:
        """Declare (or with ``passive`` check) an exchange."""
        frame = f.exchange_declare_frame(
            self.number, exchange, exchange_type, passive=passive, durable=durable,
            auto_delete=auto_delete, internal=internal, arguments=arguments,
        )  # fmt: skip
        self._rpc(frame, f.EXCHANGE_DECLARE_OK, f"declaring exchange {exchange!r}")

    def queue_declare(
        self,
        queue: str = "",
        *,
        passive: bool = False,
        durable: bool = False,
        exclusive: bool = False,
        auto_delete: bool = False,
        arguments: bytes | Mapping[str, Any] | None = None,
    ) -> QueueInfo:
        """Declare (or with ``passive`` check) a queue; returns its name and counts."""
        frame = f.queue_declare_frame(
            self.number, queue, passive=passive, durable=durable, exclusive=exclusive,
            auto_delete=auto_delete, arguments=arguments,
        )  # fmt: skip
        ok = self._rpc(frame, f.QUEUE_DECLARE_OK, f"declaring queue {queue!r}")
        return QueueInfo(str(ok.queue), int(ok.message_count), int(ok.consumer_count))

    def queue_depth(self, queue: str) -> int:
        """Messages ready in ``queue`` (a passive declare; unacked deliveries not counted)."""
        return self.queue_declare(queue, passive=True).message_count

    def queue_bind(
        self,
        queue: str,
        exchange: str,
        routing_key: str = "",
        arguments: bytes | Mapping[str, Any] | None = None,
    ) -> None:
        """Bind ``queue`` to ``exchange``."""
        self._rpc(
            f.queue_bind_frame(self.number, queue, exchange, routing_key, arguments),
            f.QUEUE_BIND_OK,
            f"binding queue {queue!r} to exchange {exchange!r}",
        )

    def close(self) -> None:
        """Close the channel (unacked deliveries go back to their queues); idempotent."""
        if not self.is_open or self._error is not None or not self._conn.is_open:
            self.is_open = False
            return
        try:
            self._rpc(f.close_frame(self.number, 200, "bye"), f.CHANNEL_CLOSE_OK, "closing")
        finally:
            self.is_open = False
            # deliveries that arrived while closing can no longer be acked: the broker
            # requeues them, so they are not handed out
            ev = self._conn._ev
            ev.deliveries[:] = [d for d in ev.deliveries if d.channel != self.number]


# ---------------------------------------------------------------------------- connection
class Connection:
    """One AMQP 0-9-1 connection over a TCP socket; open with :meth:`Connection.open`."""

    def __init__(
        self,
        sock: socket.socket,
        params: AmqpParams,
        *,
        heartbeat: int,
        frame_max: int,
        rpc_timeout: float,
        send_timeout: float = 60,
    ) -> None:
        self._sock = sock
        self.params = params
        self.vhost = params.vhost
        self.where = params.where
        self.heartbeat = heartbeat
        self.frame_max = frame_max
        self.channel_max = 2047
        self.rpc_timeout = rpc_timeout
        self.send_timeout = send_timeout
        self.server_properties: dict[str, Any] = {}
        self.blocked: str | None = None
        #: asked at least every SEND_WAKE seconds while a send waits for the broker to read;
        #: True abandons the connection (:class:`~bridge.errors.AmqpInterrupted`)
        self.interrupt: Callable[[], bool] | None = None
        self.heartbeats_sent = 0
        self._fatal: BrokerError | None = None
        self._handshake = True
        self._closing = False
        self._losing = False
        self._parsing = False
        self._errors: list[AmqpClosed] = []
        self._ch0 = Channel(self, 0)
        self._channels: dict[int, Channel] = {0: self._ch0}
        self._last_number = 0  # channel numbers go round: a closed one's late events stay its own
        self._peeked = 0  # bytes of the read buffer _peek_flow has looked at since the last parse
        self._tokens = 0
        self._ev = Events()
        self._rsize = max(READ_BUFFER, 4 * frame_max)
        self._rbuf = bytearray(self._rsize)
        self._rlen = 0
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        now = _monotonic()
        self._last_recv = now
        self._last_send = now

    def __repr__(self) -> str:
        return f"Connection({self.where!r}, open={self.is_open})"

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return self._fatal is None

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        url: str,
        *,
        heartbeat: int = 30,
        connect_timeout: float = 10,
        client_name: str = "diode-bridge",
        frame_max: int = 131072,
        rpc_timeout: float = 60,
        send_timeout: float = 60,
    ) -> Connection:
        """Connect, authenticate (PLAIN) and open the URL's vhost.

        ``heartbeat`` seconds (0: none), ``frame_max`` and the channel count are negotiated
        down to what the broker allows. Refused or unreachable: :class:`AmqpConnectionError`;
        bad login or vhost: :class:`AmqpAccessRefused`; both name host and vhost.

        A send the broker reads nothing of for ``send_timeout`` seconds abandons the
        connection, unless the broker said it blocked the connection (``connection.blocked``:
        a memory or disk alarm), which lasts as long as the alarm; the :attr:`interrupt` hook
        bounds that wait.
        """
        params = parse_url(url)
        if frame_max < MIN_FRAME_MAX:
            raise ConfigError(
                f"frame_max {frame_max} is below {MIN_FRAME_MAX} (RabbitMQ 4.1 and later refuse "
                "smaller frames)"
            )
        if not 0 <= heartbeat <= 65535:
            raise ConfigError(f"heartbeat {heartbeat} s is outside 0..65535")
        try:
            sock = socket.create_connection((params.host, params.port), timeout=connect_timeout)
        except OSError as e:
            raise AmqpConnectionError(
                f"RabbitMQ unreachable at {params.where} ({e.strerror or type(e).__name__}): "
                "is the broker running, and are host and port right?"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        conn = cls(
            sock,
            params,
            heartbeat=heartbeat,
            frame_max=frame_max,
            rpc_timeout=connect_timeout,
            send_timeout=send_timeout,
        )
        try:
            conn._open(client_name)
        except BaseException:
            conn._drop()
            raise
        conn.rpc_timeout = rpc_timeout
        return conn

    def _open(self, client_name: str) -> None:
        c0 = self._ch0
        c0._expect, c0._doing = f.CONNECTION_START, "waiting for connection.start"
        self._send(f.PROTOCOL_HEADER)
        self._wait_reply(c0)
        start = c0._reply
        mechanisms = start.mechanisms
        if isinstance(mechanisms, bytes):
            mechanisms = mechanisms.decode("latin-1")
        if "PLAIN" not in str(mechanisms).split():
            raise AmqpAccessRefused(
                f"RabbitMQ at {self.where} does not offer PLAIN authentication "
                f"(offers {mechanisms!r}): enable it on the broker"
            )
        self.server_properties = dict(start.server_properties or {})
        props = {
            "product": "diode-bridge",
            "platform": f"Python {sys.version.split()[0]}",
            "connection_name": client_name,
            "capabilities": {
                "authentication_failure_close": True,
                "basic.nack": True,
                "connection.blocked": True,
                "consumer_cancel_notify": True,
                "publisher_confirms": True,
            },
        }
        c0._expect, c0._reply = f.CONNECTION_TUNE, None
        c0._doing = f"logging in as {self.params.user!r}"
        self._send(f.start_ok_frame(props, self.params.user, self.params.password))
        self._wait_reply(c0)
        tune = c0._reply
        smax = int(tune.channel_max or 0)
        self.channel_max = min(smax, 2047) if smax else 2047
        if tune.frame_max:
            self.frame_max = min(self.frame_max, int(tune.frame_max))
        sbeat = int(tune.heartbeat or 0)
        if self.heartbeat and sbeat:
            self.heartbeat = min(self.heartbeat, sbeat)
        c0._expect, c0._reply = f.CONNECTION_OPEN_OK, None
        c0._doing = f"opening vhost {self.vhost!r}"
        self._send(
            f.tune_ok_frame(self.channel_max, self.frame_max, self.heartbeat)
            + f.connection_open_frame(self.vhost)
        )
        self._wait_reply(c0)
        c0._expect, c0._reply, c0._doing = 0, None, ""
        self._handshake = False

    def channel(self) -> Channel:
        """Open a new channel.

        Numbers are taken in turn (after the last one given, wrapping around), never the
        lowest free one: confirms, returns or deliveries a closed channel left unread would
        otherwise be read as the new channel's."""
        self._check()
        chans = self._channels
        top, last = self.channel_max, self._last_number
        number = next(
            (
                n
                for n in (*range(last + 1, top + 1), *range(1, min(last, top) + 1))
                if n not in chans or not chans[n].is_open
            ),
            0,
        )
        if not number:
            raise AmqpConnectionError(
                f"all {self.channel_max} channels of {self.where} are in use: close some first"
            )
        ch = Channel(self, number)
        chans[number] = ch
        self._last_number = number
        self._ev.drop_channel(number)  # wrapped around onto a number with events still unread
        try:
            ch._rpc(f.channel_open_frame(number), f.CHANNEL_OPEN_OK, "opening the channel")
        except BaseException:
            ch.is_open = False
            raise
        return ch

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close gracefully (unacked deliveries go back to their queues); idempotent."""
        if self._fatal is not None:
            self._drop()
            return
        c0 = self._ch0
        self._closing = True
        try:
            c0._expect, c0._reply, c0._doing = f.CONNECTION_CLOSE_OK, None, "closing"
            self._send(f.close_frame(0, 200, "closed by the client"))
            deadline = _monotonic() + min(self.rpc_timeout, 10.0)
            while c0._reply is None and self._fatal is None and _monotonic() < deadline:
                if self._fill(max(0.0, deadline - _monotonic())):
                    self._parse()
                    self._ev = Events()  # nothing is acked any more: drop what arrived
        except BrokerError:
            pass
        finally:
            self._fatal = self._fatal or AmqpConnectionError(
                f"the connection to {self.where} was closed by this client"
            )
            self._drop()

    def _drop(self) -> None:
        if self._fatal is None:
            self._fatal = AmqpConnectionError(f"the connection to {self.where} is closed")
        for ch in self._channels.values():
            ch.is_open = False
        try:
            self._poller.unregister(self._sock.fileno())
        except (KeyError, ValueError, OSError):
            pass
        try:
            self._sock.close()
        except OSError:
            pass

    def _die(self, err: BrokerError) -> NoReturn:
        """The connection is unusable: remember why, close the socket, raise."""
        if self._fatal is None:
            self._fatal = err
        self._drop()
        raise self._fatal

    def _check(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    # -- polling ---------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> Events:
        """Wait up to ``timeout`` seconds for something to happen; return what did.

        Returns as soon as one read produced any event (possibly with nothing if the time
        ran out). A channel the broker closed raises its :class:`AmqpClosed` once (the other
        channels' events are kept for the next call); a lost connection raises
        :class:`AmqpConnectionError`.
        """
        self._check()
        if self._errors:
            raise self._errors.pop(0)
        ev = self._ev
        now = _monotonic()
        deadline = now + timeout
        while True:
            wait = self._tick(now)
            if self._errors:
                raise self._errors.pop(0)
            if self._fill(0.0 if ev else min(deadline - now, wait)):
                self._parse()
                if self._errors:
                    raise self._errors.pop(0)
            now = _monotonic()
            if ev or now >= deadline:
                break
        self._ev = Events()
        return ev

    def _next_token(self) -> int:
        self._tokens += 1
        return self._tokens

    def _wait_reply(self, c: Channel) -> None:
        """Read until channel ``c`` got its reply; its closing raises (once)."""
        deadline = _monotonic() + self.rpc_timeout
        while True:
            if c._error is not None:
                if c._error in self._errors:
                    self._errors.remove(c._error)
                raise c._error
            self._check()
            if c._reply is not None:
                return
            now = _monotonic()
            if now >= deadline:
                self._die(
                    AmqpConnectionError(
                        f"no answer from {self.where} within {self.rpc_timeout:g}s on channel "
                        f"{c.number} while {c._doing or 'waiting'}: the connection is abandoned"
                    )
                )
            wait = self._tick(now)  # may read (and answer) too: check again before waiting
            if c._reply is None and c._error is None and self._fill(min(deadline - now, wait)):
                self._parse()

    def _tick(self, now: float) -> float:
        """Heartbeat duties; returns how long the caller may wait before the next one."""
        hb = self.heartbeat
        if not hb or self._handshake:
            return 3600.0
        silent = now - self._last_recv
        if silent >= 2 * hb and self._fill(0.0):  # the caller was away: the socket may hold data
            self._parse()
            silent = 0.0
        if silent >= 2 * hb:
            self._die(
                AmqpConnectionError(
                    f"no data from {self.where} for {silent:.1f}s (two heartbeat intervals of "
                    f"{hb}s): the broker or the network is gone"
                )
            )
        half = hb / 2
        if now - self._last_send >= half:
            self._send(f.HEARTBEAT)
            self.heartbeats_sent += 1
        return max(0.001, min(self._last_send + half, self._last_recv + 2 * hb) - now)

    # -- socket ----------------------------------------------------------------------------
    def _fill(self, timeout: float) -> bool:
        """One ``recv_into`` behind the unparsed bytes; waits up to ``timeout`` for data."""
        buf = self._rbuf
        if len(buf) - self._rlen < self.frame_max + 8:
            buf.extend(bytes(len(buf)))
        sock = self._sock
        try:
            with memoryview(buf) as mv:
                try:
                    n = sock.recv_into(mv[self._rlen :])
                except BlockingIOError:
                    if timeout <= 0 or not self._poller.poll(timeout * 1000.0):
                        return False
                    try:
                        n = sock.recv_into(mv[self._rlen :])
                    except BlockingIOError:
                        return False
        except OSError as e:
            self._lost(e)
        if n == 0:
            self._lost(None)
        self._rlen += n
        self._last_recv = _monotonic()
        return True

    def _lost(self, e: OSError | None) -> NoReturn:
        """The socket failed or the broker closed it: parse what it sent first (a close
        method explains why), then give up."""
        if self._fatal is None and not self._losing and not self._parsing:
            self._losing = True
            self._drain_socket()
            try:
                self._parse()
            except BrokerError:
                pass
        if self._fatal is not None:
            self._die(self._fatal)
        why = "closed the connection" if e is None else f"connection failed ({e.strerror or e})"
        if self._handshake:
            self._die(
                AmqpConnectionError(
                    f"RabbitMQ at {self.where} {why} while {self._ch0._doing or 'connecting'}: "
                    "is this RabbitMQ's AMQP port, and are the user, password and vhost right?"
                )
            )
        self._die(AmqpConnectionError(f"RabbitMQ at {self.where} {why}"))

    def _drain_socket(self) -> None:
        """Read whatever the broker sent before the socket failed (best effort)."""
        for _ in range(64):
            buf = self._rbuf
            if len(buf) - self._rlen < self.frame_max + 8:
                buf.extend(bytes(len(buf)))
            try:
                with memoryview(buf) as mv:
                    n = self._sock.recv_into(mv[self._rlen :])
            except OSError:  # BlockingIOError included
                return
            if not n:
                return
            self._rlen += n

    def _send(self, data: bytes) -> None:
        if self._fatal is not None:
            raise self._fatal
        try:
            n = self._sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError as e:
            self._lost(e)
        if n != len(data):
            self._send_rest(data, n)
        self._last_send = _monotonic()

    def _send_rest(self, data: bytes, sent: int) -> None:
        """The socket is full: wait until it drains, reading meanwhile so that a broker busy
        sending to us cannot deadlock against us.

        Bounded: the broker's silence (two heartbeat intervals), a broker that reads nothing
        for ``send_timeout`` seconds without having blocked the connection (CLOSE_SEND_LIMIT
        while closing, blocked or not) and the :attr:`interrupt` hook each abandon it."""
        fd = self._sock.fileno()
        view = memoryview(data)[sent:]
        self._poller.modify(fd, select.POLLIN | select.POLLOUT)
        moved = _monotonic()
        try:
            while len(view):
                now = _monotonic()
                hb = self.heartbeat
                wait = 2 * hb - (now - self._last_recv) if hb and not self._handshake else 3600.0
                if wait <= 0:
                    self._die(
                        AmqpConnectionError(
                            f"no data from {self.where} for two heartbeat intervals of {hb}s "
                            "while sending: the broker or the network is gone"
                        )
                    )
                if now - moved >= SEND_WAKE or self.blocked is not None:
                    self._stalled(now - moved)
                for _fd, event in self._poller.poll(min(wait, SEND_WAKE) * 1000.0):
                    if event & select.POLLIN:
                        if self._fill(0.0):
                            self._peek_flow()
                    if event & (select.POLLOUT | select.POLLERR | select.POLLHUP):
                        try:
                            n = self._sock.send(view)
                        except BlockingIOError:
                            n = 0
                        except OSError as e:
                            self._lost(e)
                        if n:
                            view = view[n:]
                            moved = _monotonic()
        finally:
            view.release()
            if self._fatal is None:
                self._poller.modify(fd, select.POLLIN)

    def _stalled(self, for_s: float) -> None:
        """A send has moved nothing for ``for_s`` seconds (at least SEND_WAKE, or the broker
        blocked the connection): give up if the hook or a limit says so (a frame is half
        sent, so the connection cannot be kept). A send that moves is never cut short."""
        if self.interrupt is not None and self._ask_interrupt():
            why = f" (blocked by the broker: {self.blocked})" if self.blocked is not None else ""
            self._die(
                AmqpInterrupted(
                    f"sending to {self.where} was interrupted after {for_s:.1f}s of waiting for "
                    f"the broker to read{why}: the connection is abandoned"
                )
            )
        limit = CLOSE_SEND_LIMIT if self._closing else self.send_timeout
        if for_s < limit or (self.blocked is not None and not self._closing):
            return
        if self.blocked is not None:
            why = f"blocked this connection ({self.blocked}) and "
        else:
            why = ""
        self._die(
            AmqpConnectionError(
                f"RabbitMQ at {self.where} {why}read nothing from it for {for_s:.0f}s while "
                f"{'closing' if self._closing else 'sending'}: the connection is abandoned "
                "(a memory or disk alarm blocks publishers: `rabbitmqctl status` lists alarms)"
            )
        )

    def _ask_interrupt(self) -> bool:
        """The interrupt hook's answer; if the hook raises, the half-sent frame makes the
        connection unusable: it is abandoned, then the hook's exception goes on."""
        assert self.interrupt is not None
        try:
            return self.interrupt()
        except BaseException:
            self._fatal = self._fatal or AmqpInterrupted(
                f"sending to {self.where} was interrupted (the interrupt hook raised) with a "
                "frame half sent: the connection is abandoned"
            )
            self._drop()
            raise

    def _peek_flow(self) -> None:
        """Track connection.blocked / unblocked among the complete frames read so far without
        dispatching anything (a send is half done: no other frame may be written now); the
        frames are dispatched as usual by the next parse."""
        buf, end, pos = self._rbuf, self._rlen, self._peeked
        while pos + 7 <= end:
            ftype, channel, size = _HEAD.unpack_from(buf, pos)
            if pos + 8 + size > end:
                break
            if ftype == 1 and channel == 0 and size >= 4:
                index = _U32.unpack_from(buf, pos + 7)[0]
                payload = bytes(buf[pos + 7 : pos + 7 + size])
                if index == f.CONNECTION_BLOCKED:
                    self.blocked = str(f.unmarshal_method(payload).reason or "blocked")  # type: ignore[attr-defined]
                elif index == f.CONNECTION_UNBLOCKED:
                    self.blocked = None
            pos += 8 + size
        self._peeked = pos  # complete frames looked at already (reset by each parse)

    # -- parsing ---------------------------------------------------------------------------
    def _parse(self) -> None:
        """Dispatch every complete frame in the read buffer; keep a trailing partial frame.

        The common case — ``basic.deliver``, content header and a single body frame, all in
        this buffer — is handled in one step; anything else goes frame by frame.
        """
        n = self._rlen
        if not n:
            return
        buf = self._rbuf
        with memoryview(buf) as mv:
            data = bytes(mv[:n])  # the one copy: bodies and properties are slices of it
        if self._handshake and data[:4] == b"AMQP":
            self._die(
                AmqpConnectionError(
                    f"RabbitMQ at {self.where} refused AMQP 0-9-1 (it answered with protocol "
                    f"header {data[:8]!r})"
                )
            )
        self._parsing = True
        try:
            pos = self._dispatch(data, n)
        finally:
            self._parsing = False
        # keep the partial frame (and anything read while answering the broker meanwhile)
        end = self._rlen
        if pos:
            if end > pos:
                buf[: end - pos] = data[pos:] if end == n else buf[pos:end]
            self._rlen = end - pos
        self._peeked = 0  # the buffer moved: _peek_flow starts over (from a frame's start)
        if len(buf) > self._rsize and self._rlen < self._rsize // 2:
            del buf[self._rsize :]

    def _dispatch(self, data: bytes, n: int) -> int:
        """Handle the complete frames in ``data[:n]``; returns the offset after the last one."""
        chans = self._channels
        ev = self._ev
        deliveries = ev.deliveries
        head = _HEAD.unpack_from
        u32 = _U32.unpack_from
        qb = _QB.unpack_from
        u64 = _U64.unpack_from
        pos = 0
        while n - pos >= 8:
            ftype, number, size = head(data, pos)
            stop = pos + 7 + size  # the frame-end octet
            if stop >= n:
                if size > self.frame_max - 8:
                    self._bad_frame(f"a frame of {size} bytes exceeds frame_max", number, pos)
                break
            if data[stop] != 206:
                self._bad_frame("a frame does not end with 0xCE", number, pos)
            start = pos + 7
            pos = stop + 1
            c = chans.get(number)
            if c is None:
                self._bad_frame(f"a frame of type {ftype} for a channel never opened", number, pos)
            if ftype == 1:  # method
                index = u32(data, start)[0]
                if index == 0x003C003C:  # basic.deliver
                    p = start + 5
                    e = p + data[p - 1]
                    raw_tag = data[p:e]
                    tag = c._tags.get(raw_tag) or raw_tag.decode("utf-8", "surrogateescape")
                    dtag, bits = qb(data, e)
                    p = e + 10
                    e = p + data[p - 1]
                    exchange = data[p:e].decode("utf-8", "surrogateescape")
                    p = e + 1
                    e = p + data[e]
                    rkey = data[p:e].decode("utf-8", "surrogateescape")
                    redelivered = bits & 1 == 1
                    # fast path: the content header and the whole body follow in this buffer
                    if n - pos >= 8:
                        t2, n2, s2 = head(data, pos)
                        h_end = pos + 7 + s2
                        if (
                            t2 == 2
                            and n2 == number
                            and s2 >= 14
                            and h_end < n
                            and data[h_end] == 206
                        ):
                            bsize = u64(data, pos + 11)[0]
                            props = data[pos + 19 : h_end]
                            p = h_end + 1
                            if not bsize:
                                if c.is_open:
                                    deliveries.append(
                                        Delivery(
                                            number, tag, dtag, redelivered, exchange, rkey, props,
                                            b"",
                                        )
                                    )  # fmt: skip
                                pos = p
                                continue
                            if n - p >= 8:
                                t3, n3, s3 = head(data, p)
                                b_end = p + 7 + s3
                                if (
                                    t3 == 3 and n3 == number and s3 == bsize and b_end < n
                                    and data[b_end] == 206
                                ):  # fmt: skip
                                    if c.is_open:
                                        deliveries.append(
                                            Delivery(
                                                number, tag, dtag, redelivered, exchange, rkey,
                                                props, data[p + 7 : b_end],
                                            )
                                        )  # fmt: skip
                                    pos = b_end + 1
                                    continue
                    c._msg = (tag, dtag, redelivered, exchange, rkey)
                    c._deliver = True
                elif index == 0x003C0050 or index == 0x003C0078:  # basic.ack / basic.nack
                    dtag, bits = qb(data, start + 4)
                    ev.confirms.append(Confirm(number, dtag, bits & 1 == 1, index == 0x003C0050))
                elif index == f.RETURN:
                    c._msg = f.parse_return(data, start)
                    c._deliver = False
                else:
                    self._method(c, index, data[start:stop])
            elif ftype == 2:  # content header (not followed by its whole body in this buffer)
                if size < 14:
                    self._bad_frame(f"a content header of {size} bytes", number, start - 7)
                c._props = data[start + 12 : stop]
                c._need = u64(data, start + 4)[0]
                if not c._need:
                    self._content(c, b"")
            elif ftype == 3:  # body frame, general case
                if c._parts is None and size == c._need:
                    self._content(c, data[start:stop])
                    continue
                if c._parts is None:
                    c._parts = []
                c._parts.append(memoryview(data)[start:stop])
                c._need -= size
                if c._need > 0:
                    continue
                if c._need < 0:
                    self._bad_frame(
                        "more body bytes than the content header announced", number, start - 7
                    )
                body = b"".join(c._parts)
                c._parts = None
                self._content(c, body)
            elif ftype != 8:  # 8: heartbeat, nothing to do: every read counts as life
                self._bad_frame(f"unknown frame type {ftype}", number, start - 7)
        return pos

    def _content(self, c: Channel, body: bytes) -> None:
        """A message's content is complete: a delivery or a returned message."""
        c._need = 0
        m = c._msg
        if c._deliver:
            if c.is_open:
                self._ev.deliveries.append(
                    Delivery(c.number, m[0], m[1], m[2], m[3], m[4], c._props, body)
                )
        else:
            self._ev.returns.append(Returned(c.number, m[0], m[1], m[2], m[3], c._props, body))

    def _bad_frame(self, what: str, channel: int, offset: int) -> NoReturn:
        self._die(
            AmqpFrameError(
                f"{self.where} sent bytes that are not AMQP 0-9-1: {what} (channel {channel}, "
                f"offset {offset} of a read)"
            )
        )

    def _method(self, c: Channel, index: int, payload: bytes) -> None:
        """Methods off the hot path (decoded by pamqp)."""
        if not c.is_open and c.number:
            return  # frames in flight for a channel already closed
        if index == f.BASIC_QOS_OK and c._qos:
            token = c._qos.popleft()
            if token:
                self._ev.syncs.append(token)
            else:
                c._reply = True
            return
        if index == c._expect:
            c._reply = f.unmarshal_method(payload)
            return
        if index == f.CONNECTION_CLOSE or index == f.CHANNEL_CLOSE:
            self._closed_by_broker(c, f.unmarshal_method(payload))
        elif index == f.CONNECTION_BLOCKED:
            self.blocked = str(f.unmarshal_method(payload).reason or "blocked")  # type: ignore[attr-defined]
        elif index == f.CONNECTION_UNBLOCKED:
            self.blocked = None
        elif index == f.CHANNEL_FLOW:
            active = bool(f.unmarshal_method(payload).active)  # type: ignore[attr-defined]
            c.flow_active = active
            self._send(f.flow_ok_frame(c.number, active))
        elif index == f.BASIC_CANCEL:
            m = f.unmarshal_method(payload)
            tag = str(m.consumer_tag)  # type: ignore[attr-defined]
            c.consumers.discard(tag)
            self._ev.cancels.append(Cancelled(c.number, tag))
            if not m.nowait:  # type: ignore[attr-defined]
                self._send(f.cancel_ok_frame(c.number, tag))
        elif index == f.CONNECTION_CLOSE_OK and self._closing:
            c._reply = True
        else:
            m = f.unmarshal_method(payload)
            self._die(
                AmqpFrameError(
                    f"{self.where} sent an unexpected {m.name} on channel {c.number}"
                    + (f" while {c._doing}" if c._doing else "")
                )
            )

    def _closed_by_broker(self, c: Channel, m: Any) -> None:
        code, text = int(m.reply_code), str(m.reply_text)
        class_id, method_id = int(m.class_id or 0), int(m.method_id or 0)
        failed = f" (refusing {_method_name(class_id, method_id)})" if class_id else ""
        doing = f" while {c._doing}" if c._doing else ""
        if c.number == 0:
            if self._handshake and code in (403, 530) and not _a_limit(text):
                hint = (
                    "create the vhost or fix the URL's vhost (URL-encode '/' as %2F)"
                    if code == 530
                    else "check the user and password in the AMQP URL and the user's "
                    "permissions on the vhost"
                )
                err: BrokerError = AmqpAccessRefused(
                    f"RabbitMQ at {self.params.host}:{self.params.port} refused user "
                    f"{self.params.user!r} on vhost {self.vhost!r}: {code} {text}{doing}: {hint}"
                )
            else:
                err = AmqpClosed(
                    f"RabbitMQ closed the connection to {self.where} (vhost {self.vhost!r}): "
                    f"{code} {text}{failed}{doing}",
                    reply_code=code, reply_text=text, class_id=class_id, method_id=method_id,
                    channel=0,
                )  # fmt: skip
                if code == 530:  # a connection limit: it may be lifted, or a slot free up
                    err.retryable = True
            try:
                self._send(f.close_ok_frame(0))
            except BrokerError:
                pass
            self._fatal = err  # the broker's reason, not the broken pipe close-ok may have hit
            self._die(err)
        c.is_open = False
        self._send(f.close_ok_frame(c.number))
        closed = AmqpClosed(
            f"RabbitMQ closed channel {c.number} of {self.where} (vhost {self.vhost!r}): "
            f"{code} {text}{failed}{doing}",
            reply_code=code, reply_text=text, class_id=class_id, method_id=method_id,
            channel=c.number,
        )  # fmt: skip
        if code == 406 and "timed out" in text:  # the broker's consumer (ack) timeout
            closed.retryable = True  # a new channel gets the unacked deliveries again
        c._error = closed
        self._errors.append(closed)


def _a_limit(reply_text: str) -> bool:
    """A 530 that refuses a connection because a vhost's or user's connection limit is
    reached: transient (a slot frees up), never a wrong vhost or password."""
    return "limit" in reply_text.lower()
