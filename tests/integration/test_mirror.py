"""Black, mirror: exchanges -> stream queue on a real vhost (bindings, catalog, offsets)."""

from __future__ import annotations

import socket
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
import requests
from pydantic import SecretStr

from bridge.black.catalog import load_catalog
from bridge.black.management import ManagementClient
from bridge.black.mirror import Mirror, MirrorLoop
from bridge.black.plan import stream_queue_name
from bridge.black.streams import stream_bounds, stream_tail
from bridge.config import BlackConfig, ChannelConfig, Config
from bridge.errors import BrokerError, ConfigError, ManagementApiError
from bridge.protocol.exchange import ExchangeDecl

pytestmark = pytest.mark.broker

FPR = "A" * 40


def make_cfg(
    vhost: Any, state: Path, *, black: dict[str, Any] | None = None, **channel: Any
) -> Config:
    ch = ChannelConfig(name="c1", recipients=[FPR], **channel)
    b = BlackConfig(
        amqp_url=SecretStr(vhost.amqp_url),
        management_url=vhost.management_url,
        state_dir=state,
        **(black or {}),
    )
    return Config(channels=[ch], black=b)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def consume_all(url: str, queue: str, expect: int, *, timeout: float = 10.0) -> list[tuple]:
    """(offset, exchange, routing key, headers, body) from offset 'first', until idle."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    got: list[tuple] = []
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=500)

        def on(c: Any, m: Any, p: pika.BasicProperties, body: bytes) -> None:
            h = dict(p.headers or {})
            got.append((h.pop("x-stream-offset"), m.exchange, m.routing_key, h, body))
            c.basic_ack(m.delivery_tag)

        ch.basic_consume(queue, on, arguments={"x-stream-offset": "first"})
        deadline = time.monotonic() + timeout
        while len(got) < expect and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.1)
        conn.process_data_events(time_limit=0.5)  # anything beyond `expect` would show up here
    finally:
        conn.close()  # not stop_consuming(): streams refuse its rejects
    return got


@pytest.fixture
def amqp(black_vhost: Any):
    conn = pika.BlockingConnection(pika.URLParameters(black_vhost.amqp_url))
    ch = conn.channel()
    ch.confirm_delivery()
    yield ch
    conn.close()


def declare_world(ch: Any) -> None:
    ch.exchange_declare("ev.fan", "fanout", durable=True)
    ch.exchange_declare("ev.topic", "topic", durable=True)
    ch.exchange_declare("ev.hdr", "headers", durable=False, auto_delete=True)
    ch.exchange_declare("ev.direct", "direct", durable=True)
    ch.exchange_declare("ev.nokeys", "direct", durable=True)
    ch.exchange_declare("ev.denied", "fanout", durable=True)
    ch.exchange_declare("ev.internal", "fanout", durable=True, internal=True)
    ch.exchange_declare("ev.ae", "topic", durable=True, arguments={"alternate-exchange": "ev.fan"})
    ch.exchange_declare("ingress", "fanout", durable=True)  # not matched by the channel
    ch.exchange_bind(destination="ev.internal", source="ingress")
    # a second route to the stream for ev.fan messages: they must still arrive once
    ch.exchange_bind(destination="ev.topic", source="ev.fan")


def pub(ch: Any, exchange: str, rk: str, body: bytes, headers: dict | None = None) -> None:
    ch.basic_publish(exchange, rk, body, pika.BasicProperties(headers=headers))


def test_sync_mirrors_every_exchange_type_exactly_once(
    black_vhost: Any, amqp: Any, tmp_path: Path
) -> None:
    declare_world(amqp)
    cfg = make_cfg(
        black_vhost,
        tmp_path,
        exchanges=["ev.*"],
        deny=["ev.denied"],
        direct_routing_keys={"ev.direct": ["a", "b"]},
    )
    catalog_path = tmp_path / "exchanges.json"
    mirror = Mirror(cfg, catalog_path=catalog_path)
    report = mirror.sync()
    r = report.channels["c1"]
    mirrored = ["ev.ae", "ev.direct", "ev.fan", "ev.hdr", "ev.internal", "ev.topic"]
    assert r.queue == "diode.mirror.c1"
    assert r.bound == mirrored and r.newly_bound == mirrored
    assert r.unbound_direct == ["ev.nokeys"]
    assert r.skipped == ["'ev.denied': denied by channels[c1].deny pattern 'ev.denied'"]
    assert report.vhost == black_vhost.name

    # the catalog holds every declaration of the vhost, flags and arguments included
    cat = load_catalog(catalog_path)
    assert cat["ev.hdr"] == ExchangeDecl("ev.hdr", "headers", durable=False, auto_delete=True)
    assert cat["ev.internal"] == ExchangeDecl("ev.internal", "fanout", internal=True)
    assert cat["ev.ae"].arguments == {"alternate-exchange": "ev.fan"}
    assert cat["ingress"].type == "fanout" and cat["ev.nokeys"].type == "direct"
    assert set(report.catalog_changed) >= set(mirrored) | {"ingress", "ev.nokeys"}

    # idempotent and quiet the second time
    again = mirror.sync()
    assert again.channels["c1"].newly_bound == [] and again.catalog_changed == []
    assert again.channels["c1"].bound == mirrored and not again.changed

    expected = [
        ("ev.fan", "any", b"fan", None),
        ("ev.topic", "a.b.c", b"topic", None),
        ("ev.topic", "", b"topic-empty-key", None),
        ("ev.hdr", "", b"hdr-with", {"k": "v", "n": 1}),
        ("ev.hdr", "ignored", b"hdr-without", None),
        ("ev.direct", "a", b"direct-a", None),
        ("ev.direct", "b", b"direct-b", None),
        ("ev.ae", "x.y", b"ae", None),
        ("ingress", "r", b"via-internal", None),
    ]
    not_mirrored = [
        ("ev.direct", "c", b"direct-c"),
        ("ev.nokeys", "a", b"nokeys"),
        ("ev.denied", "", b"denied"),
    ]
    for ex, rk, body, headers in expected:
        pub(amqp, ex, rk, body, headers)
    for ex, rk, body in not_mirrored:
        pub(amqp, ex, rk, body)

    got = consume_all(black_vhost.amqp_url, r.queue, len(expected))
    assert [g[0] for g in got] == list(range(len(expected)))  # contiguous 0..N-1
    seen = Counter((g[1], g[2], g[4]) for g in got)
    assert seen == Counter((e[0], e[1], e[2]) for e in expected)  # each exactly once
    by_body = {g[4]: g for g in got}
    assert by_body[b"hdr-with"][3] == {"k": "v", "n": 1}
    assert by_body[b"hdr-without"][3] == {}
    # a message routed through an exchange-to-exchange binding carries the exchange it was
    # published to, which is why the catalog holds every exchange of the vhost
    assert by_body[b"via-internal"][1] == "ingress"

    assert stream_bounds(cfg, "c1") == (0, len(expected))
    assert stream_tail(cfg, "c1") == len(expected)


def test_new_exchange_picked_up_and_stale_bindings_removed(
    black_vhost: Any, amqp: Any, tmp_path: Path
) -> None:
    amqp.exchange_declare("ev.fan", "fanout")
    cfg = make_cfg(black_vhost, tmp_path, exchanges=["ev.*"])
    mirror = Mirror(cfg, catalog_path=tmp_path / "exchanges.json")
    assert mirror.sync().channels["c1"].bound == ["ev.fan"]

    amqp.exchange_declare("ev.new", "topic")
    loop = MirrorLoop(mirror, 0.2, run_now=True).start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and loop.last_report is None:
            time.sleep(0.05)
    finally:
        loop.stop()
    assert loop.last_report is not None and loop.error is None
    r = loop.last_report.channels["c1"]
    assert r.bound == ["ev.fan", "ev.new"] and r.newly_bound == ["ev.new"]
    assert load_catalog(tmp_path / "exchanges.json")["ev.new"].type == "topic"

    # a deleted exchange stays in the catalog (rows may remain in the stream)
    amqp.exchange_delete("ev.new")
    r2 = mirror.sync().channels["c1"]
    assert r2.bound == ["ev.fan"]
    assert "ev.new" in load_catalog(tmp_path / "exchanges.json")

    # re-declared with another type: the entry is replaced
    amqp.exchange_declare("ev.new", "headers")
    mirror.sync()
    assert load_catalog(tmp_path / "exchanges.json")["ev.new"].type == "headers"

    # the config now denies ev.fan: its binding is removed
    denied = make_cfg(black_vhost, tmp_path, exchanges=["ev.*"], deny=["ev.fan"])
    r3 = Mirror(denied, catalog_path=tmp_path / "exchanges.json").sync().channels["c1"]
    assert r3.removed == ["ev.fan"] and r3.bound == ["ev.new"]
    q = urllib.parse.quote(black_vhost.name, safe="")
    rows = requests.get(
        f"{black_vhost.management_url}/api/queues/{q}/{r3.queue}/bindings",
        auth=("guest", "guest"),
        timeout=10,
    ).json()
    assert sorted(b["source"] for b in rows) == ["", "ev.new"]


def test_stream_with_other_retention_is_a_config_error(black_vhost: Any, tmp_path: Path) -> None:
    Mirror(make_cfg(black_vhost, tmp_path), catalog_path=tmp_path / "c.json").sync()
    other = make_cfg(black_vhost, tmp_path, black={"stream_max_bytes": 2 * 1024**2})
    with pytest.raises(ConfigError) as ei:
        Mirror(other, catalog_path=tmp_path / "c.json").sync()
    msg = str(ei.value)
    assert "PRECONDITION_FAILED" in msg and "diode.mirror.c1" in msg
    assert black_vhost.name in msg and "stream_max_bytes" in msg and "guest:guest" not in msg


def test_discovery_off_uses_named_exchanges_only(
    black_vhost: Any, amqp: Any, tmp_path: Path
) -> None:
    amqp.exchange_declare("rpc", "direct")
    amqp.exchange_declare("named.fan", "fanout")
    amqp.exchange_declare("unnamed", "fanout")
    chan = dict(exchanges=["named.fan", "missing"], direct_routing_keys={"rpc": ["k"]})
    # management reachable: types come from it
    cfg = make_cfg(black_vhost, tmp_path, black={"discover": False}, **chan)
    r = Mirror(cfg, catalog_path=tmp_path / "a.json").sync().channels["c1"]
    assert r.bound == ["named.fan", "rpc"]
    assert any("'missing': named in channels[c1] but not found" in s for s in r.skipped)
    assert set(load_catalog(tmp_path / "a.json")) == {"named.fan", "rpc"}

    # management unreachable: passive declares; rpc assumed direct, named.fan type unknown
    dead = ManagementClient(f"http://127.0.0.1:{free_port()}", "guest", "guest", timeout=2)
    m = Mirror(cfg, catalog_path=tmp_path / "b.json", management=dead)
    r = m.sync().channels["c1"]
    assert r.bound == ["rpc"]
    assert any("'named.fan': type unknown" in s for s in r.skipped)
    assert any("'missing': named" in s for s in r.skipped)
    # ...but the catalog written while the API was up knows its type
    m2 = Mirror(cfg, catalog_path=tmp_path / "a.json", management=dead)
    assert m2.sync().channels["c1"].bound == ["named.fan", "rpc"]


def test_broker_unreachable_fails_fast_without_secrets(tmp_path: Path) -> None:
    port = free_port()
    cfg = Config(
        channels=[ChannelConfig(name="c1", recipients=[FPR])],
        black=BlackConfig(
            amqp_url=SecretStr(f"amqp://guest:s3cret-pw@127.0.0.1:{port}/%2F"),
            management_password=SecretStr("m-s3cret"),
            state_dir=tmp_path,
        ),
    )
    t0 = time.monotonic()
    with pytest.raises(BrokerError) as ei:
        Mirror(cfg, catalog_path=tmp_path / "c.json").sync()
    assert time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert f"127.0.0.1:{port}" in msg and "unreachable" in msg
    assert "s3cret" not in msg and "guest" not in msg
    with pytest.raises(BrokerError):
        stream_tail(cfg, "c1")


def test_management_errors_name_url_and_fix(black_vhost: Any) -> None:
    port = free_port()
    dead = ManagementClient(f"http://127.0.0.1:{port}", "guest", "pw-s3cret", timeout=2)
    with pytest.raises(ManagementApiError) as ei:
        dead.list_exchanges("/")
    msg = str(ei.value)
    assert f"127.0.0.1:{port}" in msg and "rabbitmq-plugins enable rabbitmq_management" in msg
    assert "pw-s3cret" not in msg

    bad = ManagementClient(black_vhost.management_url, "guest", "wrong")
    with pytest.raises(ManagementApiError, match="401"):
        bad.overview()
    ok = ManagementClient(black_vhost.management_url, "guest", "guest")
    assert ok.overview()["rabbitmq_version"]
    with pytest.raises(ManagementApiError, match="does not exist"):
        ok.list_exchanges("no-such-vhost-" + black_vhost.name)
    names = [d.name for d in ok.list_exchanges(black_vhost.name)]
    assert "" in names and "amq.topic" in names


def test_headers_catch_all_semantics_on_the_broker(amqp: Any) -> None:
    """Why HEADERS_CATCH_ALL is {'x-match': 'all'}: 'any' with no keys matches nothing."""
    amqp.exchange_declare("h", "headers")
    variants = {"empty": {}, "all": {"x-match": "all"}, "any": {"x-match": "any"}}
    for name, args in variants.items():
        amqp.queue_declare(name)
        amqp.queue_bind(name, "h", arguments=args)
    for headers in (None, {}, {"a": 1}, {"x-foo": "b"}):
        pub(amqp, "h", "rk", b"x", headers)
    counts = {}
    for name in variants:
        deadline = time.monotonic() + 5
        while True:
            counts[name] = amqp.queue_declare(name, passive=True).method.message_count
            if counts[name] == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert counts == {"empty": 4, "all": 4, "any": 0}


def test_stream_bounds_after_retention_truncation(
    black_vhost: Any, amqp: Any, tmp_path: Path
) -> None:
    """Offsets: holes at segment boundaries; retention moves `first`; `next` stays last+1."""
    cfg = make_cfg(black_vhost, tmp_path)
    queue = stream_queue_name(cfg.black, "c1")
    amqp.queue_declare(
        queue,
        durable=True,
        arguments={
            "x-queue-type": "stream",
            "x-max-length-bytes": 200_000,
            "x-stream-max-segment-size-bytes": 20_000,
        },
    )
    for _ in range(2000):
        amqp.basic_publish("", queue, b"x" * 1000)
    got = consume_all(black_vhost.amqp_url, queue, 10_000, timeout=3)
    offsets = [g[0] for g in got]
    assert offsets == sorted(offsets) and 0 < len(offsets) < 2000  # retention dropped most
    first, nxt = stream_bounds(cfg, "c1")
    assert first == offsets[0] > 0
    assert nxt == offsets[-1] + 1
    # each new segment begins with a tracking chunk that takes an offset: offsets are not
    # message counts (2000 messages end well past offset 1999)
    assert offsets[-1] > 1999
    assert any(b - a > 1 for a, b in zip(offsets, offsets[1:], strict=False))
