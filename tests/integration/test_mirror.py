"""Black, mirror: exchanges -> durable mirror queue per channel on a real vhost (bindings,
catalog, dead-lettering, queue types)."""

from __future__ import annotations

import socket
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
import requests
from pika.adapters.blocking_connection import BlockingChannel
from pydantic import SecretStr

from bridge.black.catalog import load_catalog
from bridge.black.management import ManagementClient
from bridge.black.mirror import Mirror, MirrorLoop
from bridge.black.plan import dead_letter_exchange, dead_queue_name, mirror_queue_name
from bridge.config import BlackConfig, ChannelConfig, Config
from bridge.errors import BrokerError, ConfigError, ManagementApiError
from bridge.protocol.exchange import ExchangeDecl
from tests.conftest import Vhost

pytestmark = pytest.mark.broker

FPR = "A" * 40
AUTH = ("guest", "guest")
QUEUE = "diode.mirror.c1"
DEAD_QUEUE = "diode.mirror.c1.dead"
DLX = "diode.mirror.dead-letter"

Got = tuple[str, str, dict[str, Any], bytes]
"""(exchange, routing key, headers, body) of one message read back from a queue."""


def make_cfg(
    vhost: Vhost, state: Path, *, black: dict[str, Any] | None = None, **channel: Any
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


def api(vhost: Vhost, path: str) -> Any:
    """GET ``/api/<path>/<vhost>/...`` from the management API (``{v}`` is the vhost)."""
    v = urllib.parse.quote(vhost.name, safe="")
    r = requests.get(f"{vhost.management_url}/api/{path.format(v=v)}", auth=AUTH, timeout=10)
    r.raise_for_status()
    return r.json()


def drain(url: str, queue: str, expect: int, *, timeout: float = 10.0) -> list[Got]:
    """Consume ``queue`` until ``expect`` messages came and it stays quiet a moment; acks all."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    got: list[Got] = []
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=500)

        def on(c: BlockingChannel, m: Any, p: pika.BasicProperties, body: bytes) -> None:
            got.append((m.exchange, m.routing_key, dict(p.headers or {}), body))
            c.basic_ack(m.delivery_tag)

        ch.basic_consume(queue, on)
        deadline = time.monotonic() + timeout
        while len(got) < expect and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.1)
        conn.process_data_events(time_limit=0.5)  # anything beyond `expect` would show up here
    finally:
        conn.close()
    return got


def depth(ch: BlockingChannel, queue: str, want: int, timeout: float = 5.0) -> int:
    """Ready messages of ``queue`` once it reaches ``want`` (or ``timeout`` passes)."""
    deadline = time.monotonic() + timeout
    while True:
        n = int(ch.queue_declare(queue, passive=True).method.message_count)
        if n == want or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


@pytest.fixture
def amqp(black_vhost: Vhost) -> Iterator[BlockingChannel]:
    conn = pika.BlockingConnection(pika.URLParameters(black_vhost.amqp_url))
    ch = conn.channel()
    ch.confirm_delivery()
    yield ch
    conn.close()


def declare_world(ch: BlockingChannel) -> None:
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
    # a second route to the mirror queue for ev.fan messages: they must still arrive once
    ch.exchange_bind(destination="ev.topic", source="ev.fan")


def pub(
    ch: BlockingChannel,
    exchange: str,
    rk: str,
    body: bytes,
    headers: dict[str, Any] | None = None,
    **props: Any,
) -> None:
    ch.basic_publish(exchange, rk, body, pika.BasicProperties(headers=headers, **props))


def test_sync_mirrors_every_exchange_type_exactly_once(
    black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path
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
    assert r.queue == QUEUE == mirror_queue_name(cfg.black, "c1")
    assert r.bound == mirrored and r.newly_bound == mirrored
    assert r.unbound_direct == ["ev.nokeys"]
    assert r.skipped == ["'ev.denied': denied by channels[c1].deny pattern 'ev.denied'"]
    assert report.vhost == black_vhost.name

    # the bindings on the broker are the catch-all ones, one per direct routing key
    rows = api(black_vhost, f"queues/{{v}}/{QUEUE}/bindings")
    bindings = sorted(
        (b["source"], b["routing_key"], sorted((b.get("arguments") or {}).items()))
        for b in rows
        if b["source"]
    )
    assert bindings == [
        ("ev.ae", "#", []),
        ("ev.direct", "a", []),
        ("ev.direct", "b", []),
        ("ev.fan", "", []),
        ("ev.hdr", "", [("x-match", "all")]),
        ("ev.internal", "", []),
        ("ev.topic", "#", []),
    ]

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

    got = drain(black_vhost.amqp_url, r.queue, len(expected))
    assert [g[3] for g in got] == [e[2] for e in expected], "in publish order, each once"
    assert Counter((g[0], g[1], g[3]) for g in got) == Counter((e[0], e[1], e[2]) for e in expected)
    by_body = {g[3]: g for g in got}
    assert by_body[b"hdr-with"][2] == {"k": "v", "n": 1}
    assert by_body[b"hdr-without"][2] == {}
    # a message routed through an exchange-to-exchange binding carries the exchange it was
    # published to, which is why the catalog holds every exchange of the vhost
    assert by_body[b"via-internal"][0] == "ingress"
    # nothing was dropped on the way: the dead queue is empty
    assert depth(amqp, DEAD_QUEUE, 0) == 0


def test_dead_letter_exchange_and_queue_are_declared_and_not_mirrored(
    black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path
) -> None:
    """The mirror queue dead-letters into black's own direct exchange (routing key: the
    channel) and on into the channel's dead queue; black never mirrors that exchange itself,
    even under a channel that matches every exchange."""
    amqp.exchange_declare("ev.fan", "fanout", durable=True)
    cfg = make_cfg(black_vhost, tmp_path, exchanges=["*"])
    assert (dead_letter_exchange(cfg.black), dead_queue_name(cfg.black, "c1")) == (DLX, DEAD_QUEUE)
    report = Mirror(cfg, catalog_path=tmp_path / "exchanges.json").sync()
    r = report.channels["c1"]
    assert r.bound == ["ev.fan"]
    assert DLX not in r.unbound_direct and not any(DLX in s for s in r.skipped)
    assert DLX not in load_catalog(tmp_path / "exchanges.json")

    ex = api(black_vhost, f"exchanges/{{v}}/{DLX}")
    assert (ex["type"], ex["durable"], ex["auto_delete"]) == ("direct", True, False)
    q = api(black_vhost, f"queues/{{v}}/{QUEUE}")
    assert q["durable"] is True and q["type"] == "classic"
    assert q["arguments"] == {
        "x-queue-type": "classic",
        "x-dead-letter-exchange": DLX,
        "x-dead-letter-routing-key": "c1",
        "x-overflow": "drop-head",
    }
    dq = api(black_vhost, f"queues/{{v}}/{DEAD_QUEUE}")
    assert dq["durable"] is True and "x-dead-letter-exchange" not in dq["arguments"]
    dead_bindings = [
        (b["source"], b["routing_key"])
        for b in api(black_vhost, f"queues/{{v}}/{DEAD_QUEUE}/bindings")
        if b["source"]
    ]
    assert dead_bindings == [(DLX, "c1")]
    assert {b["source"] for b in api(black_vhost, f"queues/{{v}}/{QUEUE}/bindings")} == {
        "",
        "ev.fan",
    }

    # a message the broker drops from the mirror queue (here: it expires at once) lands in the
    # dead queue with its reason; nothing the dead-letter exchange carries reaches the mirror
    pub(amqp, "ev.fan", "rk", b"expires", {"h": 1}, expiration="0")
    pub(amqp, "ev.fan", "rk", b"stays")
    assert depth(amqp, DEAD_QUEUE, 1) == 1
    dead = drain(black_vhost.amqp_url, DEAD_QUEUE, 1)
    assert [(g[0], g[1], g[3]) for g in dead] == [(DLX, "c1", b"expires")]
    headers = dead[0][2]
    assert headers["x-first-death-reason"] == "expired"
    assert headers["x-first-death-queue"] == QUEUE
    assert headers["x-first-death-exchange"] == "ev.fan"
    assert headers["h"] == 1
    assert [g[3] for g in drain(black_vhost.amqp_url, QUEUE, 1)] == [b"stays"]

    # a second sync sees its own exchange again and still leaves it alone
    again = Mirror(cfg, catalog_path=tmp_path / "exchanges.json").sync().channels["c1"]
    assert again.bound == ["ev.fan"] and DLX not in again.unbound_direct


def test_quorum_mirror_queues(black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path) -> None:
    amqp.exchange_declare("ev.hdr", "headers", durable=True)
    cfg = make_cfg(black_vhost, tmp_path, black={"mirror_queue_type": "quorum"}, exchanges=["ev.*"])
    r = Mirror(cfg, catalog_path=tmp_path / "exchanges.json").sync().channels["c1"]
    assert r.bound == ["ev.hdr"]
    q = api(black_vhost, f"queues/{{v}}/{QUEUE}")
    assert q["type"] == "quorum" and q["durable"] is True
    assert q["arguments"]["x-dead-letter-exchange"] == DLX
    assert api(black_vhost, f"queues/{{v}}/{DEAD_QUEUE}")["type"] == "quorum"
    pub(amqp, "ev.hdr", "", b"q1", {"a": [1, "x"], "t": {"n": -2}})
    got = drain(black_vhost.amqp_url, QUEUE, 1)
    assert [(g[0], g[3]) for g in got] == [("ev.hdr", b"q1")]
    assert got[0][2] == {"a": [1, "x"], "t": {"n": -2}}, "a quorum queue keeps 0.9.1 tables"
    # idempotent with the same type
    assert not Mirror(cfg, catalog_path=tmp_path / "exchanges.json").sync().changed


@pytest.mark.parametrize("first", ["classic", "bare"], ids=["classic-then-quorum", "foreign"])
def test_mirror_queue_of_another_kind_is_a_config_error_with_the_fix(
    black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path, first: str
) -> None:
    """A queue already there under the mirror's name with other arguments: black refuses with
    a ConfigError saying how to fix it (never a silent re-use, never a broker error)."""
    if first == "classic":
        Mirror(make_cfg(black_vhost, tmp_path), catalog_path=tmp_path / "c.json").sync()
    else:  # someone else's queue under black's name (no dead-lettering)
        amqp.queue_declare(QUEUE, durable=True)
    other = make_cfg(black_vhost, tmp_path, black={"mirror_queue_type": "quorum"})
    with pytest.raises(ConfigError) as ei:
        Mirror(other, catalog_path=tmp_path / "c.json").sync()
    msg = str(ei.value)
    assert QUEUE in msg and black_vhost.name in msg and "'c1'" in msg
    assert "black.mirror_queue_type" in msg and "rabbitmqctl delete_queue --vhost" in msg
    assert "PRECONDITION_FAILED" in msg or "inequivalent" in msg
    assert "guest:guest" not in msg
    q = api(black_vhost, f"queues/{{v}}/{QUEUE}")
    assert q["type"] == "classic", "the existing queue is left as it was"


def test_new_exchange_picked_up_and_stale_bindings_removed(
    black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path
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
    pub(amqp, "ev.new", "any.key", b"new")
    assert [(g[0], g[3]) for g in drain(black_vhost.amqp_url, QUEUE, 1)] == [("ev.new", b"new")]

    # a deleted exchange stays in the catalog (rows may remain in the spool)
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
    rows = api(black_vhost, f"queues/{{v}}/{r3.queue}/bindings")
    assert sorted(b["source"] for b in rows) == ["", "ev.new"]
    pub(amqp, "ev.fan", "", b"denied now")
    pub(amqp, "ev.new", "", b"still mirrored")
    assert [g[3] for g in drain(black_vhost.amqp_url, QUEUE, 1)] == [b"still mirrored"]

    # allowed again: the binding comes back
    r4 = mirror.sync().channels["c1"]
    assert r4.bound == ["ev.fan", "ev.new"] and r4.newly_bound == ["ev.fan"]


def test_discovery_off_uses_named_exchanges_only(
    black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path
) -> None:
    amqp.exchange_declare("rpc", "direct")
    amqp.exchange_declare("named.fan", "fanout")
    amqp.exchange_declare("unnamed", "fanout")
    chan: dict[str, Any] = dict(
        exchanges=["named.fan", "missing"], direct_routing_keys={"rpc": ["k"]}
    )
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
    with pytest.raises(BrokerError) as ei:
        Mirror(cfg, catalog_path=tmp_path / "c.json").sync()
    msg = str(ei.value)
    assert f"127.0.0.1:{port}" in msg and "unreachable" in msg
    assert "s3cret" not in msg and "guest" not in msg


def test_management_errors_name_url_and_fix(black_vhost: Vhost) -> None:
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


def test_headers_catch_all_semantics_on_the_broker(amqp: BlockingChannel) -> None:
    """Why HEADERS_CATCH_ALL is {'x-match': 'all'}: 'any' with no keys matches nothing."""
    amqp.exchange_declare("h", "headers")
    variants: dict[str, dict[str, Any]] = {
        "empty": {},
        "all": {"x-match": "all"},
        "any": {"x-match": "any"},
    }
    for name, args in variants.items():
        amqp.queue_declare(name)
        amqp.queue_bind(name, "h", arguments=args)
    for headers in (None, {}, {"a": 1}, {"x-foo": "b"}):
        pub(amqp, "h", "rk", b"x", headers)
    counts = {name: depth(amqp, name, 0 if name == "any" else 4) for name in variants}
    assert counts == {"empty": 4, "all": 4, "any": 0}


def test_a_newly_denied_exchange_is_unbound_while_the_management_api_is_down(
    black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """discover = false and the management API unreachable: the bindings cannot be listed, yet
    an exchange the operator now denies must stop flowing. Every binding black could have made
    from it is unbound (a no-op where there is none), and the report says bindings were not
    listed; an exchange still wanted whose type is unknown keeps its binding."""
    amqp.exchange_declare("ev", "fanout", durable=True)
    amqp.exchange_declare("secret", "topic", durable=True)
    amqp.exchange_declare("gone", "fanout", durable=True)
    chan: dict[str, Any] = {"exchanges": ["ev", "secret", "gone"]}
    up = make_cfg(black_vhost, tmp_path, black={"discover": False}, **chan)
    catalog = tmp_path / "exchanges.json"
    assert Mirror(up, catalog_path=catalog).sync().channels["c1"].bound == ["ev", "gone", "secret"]

    # denied now, and the management API is down; "gone" is no longer named by the channel
    dead = ManagementClient(f"http://127.0.0.1:{free_port()}", "guest", "guest", timeout=2)
    now = make_cfg(black_vhost, tmp_path, black={"discover": False}, exchanges=["ev"],
                   deny=["secret*"])  # fmt: skip
    r = Mirror(now, catalog_path=catalog, management=dead).sync().channels["c1"]
    rows = api(black_vhost, f"queues/{{v}}/{QUEUE}/bindings")
    assert sorted(b["source"] for b in rows) == ["", "ev"]
    assert r.bound == ["ev"]
    assert not r.bindings_listed
    assert r.unbound_unlisted == ["gone", "secret"]
    assert "cannot be listed" in caplog.text
    pub(amqp, "secret", "x", b"classified")
    pub(amqp, "gone", "", b"not named")
    pub(amqp, "ev", "", b"mirrored")
    assert [g[3] for g in drain(black_vhost.amqp_url, QUEUE, 1)] == [b"mirrored"]


def test_a_limit_on_the_dead_queue_is_reported(
    black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's policy matching every mirror queue (``^diode\\.mirror\\.``) also limits
    the channel's dead queue: what it drops vanishes without a recorded gap (dead-lettering is
    at-most-once, refused or dropped alike). Each sync says so: an error log, a gauge and the
    report."""
    from bridge.metrics import REGISTRY

    amqp.exchange_declare("ev", "fanout", durable=True)
    cfg = make_cfg(black_vhost, tmp_path, exchanges=["ev"])
    mirror = Mirror(cfg, catalog_path=tmp_path / "exchanges.json")
    gauge = "bridge_black_dead_queue_limited"
    mirror.sync()
    assert REGISTRY.get_sample_value(gauge, {"channel": "c1"}) == 0
    v = urllib.parse.quote(black_vhost.name, safe="")
    put = requests.put(
        f"{black_vhost.management_url}/api/policies/{v}/limit-all-mirrors",
        json={"pattern": r"^diode\.mirror\.", "apply-to": "queues",
              "definition": {"max-length": 10, "message-ttl": 60000}},
        auth=AUTH, timeout=10,
    )  # fmt: skip
    assert put.status_code in (201, 204), put.text
    deadline = time.monotonic() + 20
    while True:  # the broker applies a new policy asynchronously
        r = mirror.sync().channels["c1"]
        if REGISTRY.get_sample_value(gauge, {"channel": "c1"}) == 1:
            break
        assert time.monotonic() < deadline, "the dead queue's limit was never reported"
        time.sleep(0.2)
    assert len(r.queue_problems) == 1
    assert DEAD_QUEUE in r.queue_problems[0]
    assert "max-length=10" in r.queue_problems[0] and "message-ttl=60000" in r.queue_problems[0]
    assert any(
        rec.levelname == "ERROR" and DEAD_QUEUE in rec.getMessage() for rec in caplog.records
    )
    requests.delete(
        f"{black_vhost.management_url}/api/policies/{v}/limit-all-mirrors", auth=AUTH, timeout=10
    ).raise_for_status()
    deadline = time.monotonic() + 20
    while mirror.sync().channels["c1"].queue_problems:
        assert time.monotonic() < deadline, "the lifted limit is still reported"
        time.sleep(0.2)
    assert REGISTRY.get_sample_value(gauge, {"channel": "c1"}) == 0


def test_a_transient_mirror_failure_is_not_fatal_a_terminal_one_is(
    black_vhost: Vhost, tmp_path: Path
) -> None:
    """The continuous job stops on the mirror loop's ``fatal`` error only: a broker that is
    unreachable for a moment (a restart) is retried, and ended the whole job once the job
    polled the loop's last error every 0.2 s."""
    down = Vhost(black_vhost.name, black_vhost.amqp_url, f"http://127.0.0.1:{free_port()}")
    loop = MirrorLoop(Mirror(make_cfg(down, tmp_path), catalog_path=tmp_path / "c.json"), 0.1,
                      run_now=True).start()  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while loop.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loop.error is not None and loop.alive, "the transient fault did not fire"
        assert loop.fatal is None
    finally:
        loop.stop()
    cfg = make_cfg(black_vhost, tmp_path, black={"mirror_queue_type": "quorum"})
    Mirror(make_cfg(black_vhost, tmp_path), catalog_path=tmp_path / "c.json").sync()  # classic
    loop = MirrorLoop(Mirror(cfg, catalog_path=tmp_path / "c.json"), 0.1, run_now=True).start()
    deadline = time.monotonic() + 10
    while loop.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(loop.fatal, ConfigError) and loop.error is loop.fatal


# ------------------------------------------------------- one vhost reading, 404s, policy checks


@pytest.mark.parametrize("tail", ["//", "/", "", "/%2F", "/a%2Fb", "/a/b", "/a%20b", "/p%25c"])
def test_the_mirror_reads_the_vhost_as_the_tap_does(tmp_path: Path, tail: str) -> None:
    """pika reads ``amqp://host:5672//`` as vhost '' and ``/a/b`` as 'a'; the tap's parser
    (bridge.amqp.client.parse_url) as '/' and 'a/b'. The mirror must bind the queues the tap
    drains: one reading, the tap's."""
    from bridge.amqp.client import parse_url
    from bridge.black.broker import connection_parameters

    url = f"amqp://guest:guest@127.0.0.1:5672{tail}"
    cfg = make_cfg(Vhost("unused", url), tmp_path)
    want = parse_url(url).vhost
    assert want, "the tap never reads an empty vhost"
    assert Mirror(cfg, catalog_path=tmp_path / "c.json").vhost == want
    assert connection_parameters(url, "test").virtual_host == want


def test_a_vhost_whose_name_pika_misreads_is_mirrored_where_the_tap_reads(
    tmp_path: Path,
) -> None:
    """A vhost with a '/' in its name, written unencoded in black.amqp_url: pika alone would
    connect to the vhost before the '/', the tap to the whole name."""
    import uuid

    name = f"mend-black-{uuid.uuid4().hex[:8]}/sub"
    mc = ManagementClient("http://127.0.0.1:15672", *AUTH, timeout=60)
    mc.put_vhost(name)
    try:
        url = f"amqp://guest:guest@127.0.0.1:5672/{name}"  # not %2F-encoded
        vh = Vhost(name, url)
        conn = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", 5672, name, pika.PlainCredentials(*AUTH))
        )
        conn.channel().exchange_declare("ev", "fanout", durable=True)
        conn.close()
        report = Mirror(make_cfg(vh, tmp_path, exchanges=["ev"]),
                        catalog_path=tmp_path / "c.json").sync()  # fmt: skip
        assert report.vhost == name and report.channels["c1"].bound == ["ev"]
        rows = api(vh, f"queues/{{v}}/{QUEUE}/bindings")
        assert sorted(b["source"] for b in rows) == ["", "ev"]
    finally:
        mc.delete_vhost(name)
        mc.close()


def test_the_management_client_refuses_an_empty_vhost(black_vhost: Vhost) -> None:
    """``/api/exchanges/`` (an empty vhost) lists the exchanges of every vhost."""
    mc = ManagementClient(black_vhost.management_url, *AUTH)
    for call in (
        lambda: mc.list_exchanges(""),
        lambda: mc.queue_info("", QUEUE),
        lambda: mc.list_queue_bindings("", QUEUE),
        lambda: mc.vhost_tags(""),
        lambda: mc.delete_vhost(""),
    ):
        with pytest.raises(ConfigError, match=r"vhost '' \(empty\).*black\.amqp_url.*%2F"):
            call()
    mc.close()


def test_a_404_tells_a_wrong_management_url_from_a_missing_vhost_or_queue(
    black_vhost: Vhost,
) -> None:
    missing_vh = "no-such-vhost-" + black_vhost.name
    wrong = ManagementClient(black_vhost.management_url + "/rabbitmq", *AUTH)
    for call in (
        lambda: wrong.list_exchanges(black_vhost.name),
        lambda: wrong.queue_info(black_vhost.name, QUEUE),
        lambda: wrong.vhost_tags(black_vhost.name),  # not "no such vhost": None
    ):
        with pytest.raises(ManagementApiError) as ei:
            call()
        msg = str(ei.value)
        assert "is not the management API" in msg and "/rabbitmq/api/overview" in msg, msg
        assert "does not exist" not in msg, msg
    ok = ManagementClient(black_vhost.management_url, *AUTH)
    with pytest.raises(ManagementApiError, match=rf"vhost '{missing_vh}' does not exist"):
        ok.list_exchanges(missing_vh)
    with pytest.raises(ManagementApiError) as ei:
        ok.queue_info(black_vhost.name, "no-such-queue")
    msg = str(ei.value)
    assert f"queue 'no-such-queue' does not exist in vhost '{black_vhost.name}'" in msg, msg
    assert f"vhost '{black_vhost.name}' does not exist" not in msg
    assert ok.vhost_tags(missing_vh) is None
    ok.delete_vhost(missing_vh)  # already gone: fine


def _policy_warnings(records: list[Any]) -> list[str]:
    return [
        r.getMessage()
        for r in records
        if r.levelname == "WARNING" and "queue policies not checked" in r.getMessage()
    ]


def test_unchecked_queue_policies_are_warned_once_per_failure(
    black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path
) -> None:
    """The management API answers the exchange listing but fails the queue lookups (a proxy
    in front of the real API breaks them): the overflow and dead-queue limit checks cannot run.
    One warning says so and why, not one per sync; it is re-armed once a check succeeds."""
    from tests.mgmt_proxy import management_proxy
    from tests.support import captured_logs

    amqp.exchange_declare("ev", "fanout", durable=True)
    with management_proxy(black_vhost.management_url) as proxy:
        cfg = make_cfg(Vhost(black_vhost.name, black_vhost.amqp_url, proxy.url), tmp_path,
                       exchanges=["ev"])  # fmt: skip
        mirror = Mirror(cfg, catalog_path=tmp_path / "c.json")
        proxy.fail = lambda path: 503 if path.startswith("/api/queues/") else None
        with captured_logs("bridge.black.mirror") as logs:
            for _ in range(3):
                assert mirror.sync().channels["c1"].bound == ["ev"]
            warned = _policy_warnings(logs)
            assert len(warned) == 1, warned
            assert "HTTP 503" in warned[0] and proxy.url in warned[0]

            proxy.fail = None  # the API heals: checked again, said once
            mirror.sync()
            assert len(_policy_warnings(logs)) == 1
            assert any("queue policies are checked again" in r.getMessage() for r in logs)

            proxy.fail = lambda path: 503  # now the whole API fails (discover = true: fatal)
            cfg2 = make_cfg(Vhost(black_vhost.name, black_vhost.amqp_url, proxy.url), tmp_path,
                            black={"discover": False}, exchanges=["ev"])  # fmt: skip
            quiet = Mirror(cfg2, catalog_path=tmp_path / "c.json")
            for _ in range(2):
                assert quiet.sync().channels["c1"].bound == ["ev"]
            warned = _policy_warnings(logs)
            assert len(warned) == 2 and "HTTP 503" in warned[1], warned


def test_amq_topic_named_exactly_is_mirrored_and_unbound_when_no_longer_named(
    black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path
) -> None:
    """amq.topic is where RabbitMQ's MQTT and STOMP plugins publish: a channel that names it
    gets its traffic (a pattern never does); named no more, the next sync unbinds it."""
    cfg = make_cfg(black_vhost, tmp_path, exchanges=["amq.topic", "*"])
    r = Mirror(cfg, catalog_path=tmp_path / "exchanges.json").sync().channels["c1"]
    assert r.bound == ["amq.topic"] and r.skipped == [], r
    amqp.basic_publish("amq.topic", "sensors.room1.temp", b"21.5")
    amqp.basic_publish("amq.fanout", "", b"not named: not mirrored")
    got = drain(black_vhost.amqp_url, QUEUE, 1)
    assert [(g[0], g[1], g[3]) for g in got] == [("amq.topic", "sensors.room1.temp", b"21.5")]

    cfg = make_cfg(black_vhost, tmp_path, exchanges=["*"])
    r = Mirror(cfg, catalog_path=tmp_path / "exchanges.json").sync().channels["c1"]
    assert r.bound == []
    sources = {b["source"] for b in api(black_vhost, f"queues/{{v}}/{QUEUE}/bindings")}
    assert sources == {""}, sources  # only the default exchange's implicit binding is left


def test_each_sync_reads_the_mirror_and_dead_queue_depths_into_the_report_and_gauges(
    black_vhost: Vhost, amqp: BlockingChannel, tmp_path: Path
) -> None:
    """The mirror queue's depth is the tap's backlog (a stopped or slow tap shows as growth):
    each sync reads it, and the dead queue's, into the report and into the gauge an operator
    alarms on."""
    from bridge.metrics import BLACK

    declare_world(amqp)
    cfg = make_cfg(black_vhost, tmp_path, exchanges=["ev.fan"])
    mirror = Mirror(cfg, catalog_path=tmp_path / "exchanges.json")
    r = mirror.sync().channels["c1"]
    assert (r.messages, r.dead_messages) == (0, 0)
    for i in range(7):
        amqp.basic_publish("ev.fan", "", f"m{i}".encode())
    gauge = BLACK.mirror_queue_messages
    for _ in range(50):  # the broker counts what it routed a moment later
        r = mirror.sync().channels["c1"]
        if r.messages == 7:
            break
        time.sleep(0.1)
    assert (r.messages, r.dead_messages) == (7, 0), r
    assert gauge.labels("c1", "mirror")._value.get() == 7
    assert gauge.labels("c1", "dead")._value.get() == 0
