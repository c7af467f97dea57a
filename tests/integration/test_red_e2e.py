"""Integration, whole chain: black RabbitMQ (fanout/topic/headers/direct, every field type) ->
black job -> bundles -> (file diode) -> red job -> Delta -> replay publisher -> red RabbitMQ.
What a red consumer receives is what the black producer published: property bytes, body,
routing key, exchange type/flags/arguments; `messages` holds each (channel, seq) once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pika
import pytest
from deltalake import DeltaTable

from bridge.amqp.client import Connection
from bridge.black.job import BlackRun
from bridge.config import load_config
from bridge.crypto.keys import init_keys
from bridge.demo.diode import move_outbox
from bridge.red.approvals import Approvals
from bridge.red.job import RedRun
from bridge.red.replay import Replayer, audit_sink
from tests.integration.test_black_pipeline import EXCHANGES, publish, write_config
from tests.red_factory import RED_DIRS_TOML

pytestmark = [pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark, pytest.mark.slow]

ARGS: dict[str, dict[str, Any]] = {
    "fan": {"alternate-exchange": "ae"},
    "top": {},
    "hdr": {"x-note": "kept"},
    "dir": {},
}
BINDINGS = {"fan": [""], "top": ["#"], "hdr": [""], "dir": ["k1", "k2"]}


def declare(url: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    for name, kind in EXCHANGES:
        ch.exchange_declare(name, kind, durable=True, arguments=ARGS[name] or None)
    conn.close()


def red_section(red_url: str) -> str:
    return f"""
[red]
gnupg_home = "keys/red"
{RED_DIRS_TOML}settle_seconds = 0.2

[red.replay]
amqp_url = "{red_url}"
"""


def consume_all(url: str, expected: int) -> dict[str, list[tuple[str, bytes, bytes]]]:
    conn = Connection.open(url)
    ch = conn.channel()
    ch.basic_qos(500)
    for name, _ in EXCHANGES:
        ch.basic_consume(f"q-{name}")
    got: dict[str, list[tuple[str, bytes, bytes]]] = {n: [] for n, _ in EXCHANGES}
    n, idle = 0, 0
    while n < expected and idle < 20:
        ev = conn.poll(0.5)
        idle = 0 if ev.deliveries else idle + 1
        for d in ev.deliveries:
            got[d.exchange].append((d.routing_key, d.properties_raw, d.body))
            ch.ack(d.delivery_tag)
            n += 1
    conn.close()
    return got


def test_black_to_red_broker_identical(
    black_vhost: Any, red_vhost: Any, short_tmp: Path, spark: Any
) -> None:
    inv = init_keys(short_tmp / "keys", red_names=("red",))
    cfg_path = write_config(
        short_tmp, black_vhost.amqp_url, inv.black_fpr, [*inv.red_fprs.values()]
    )
    cfg_path.write_text(cfg_path.read_text() + red_section(red_vhost.amqp_url))
    cfg = load_config(cfg_path)
    declare(black_vhost.amqp_url)
    run = BlackRun(cfg)
    run.mirror.sync()
    n = 1200
    sent = publish(black_vhost.amqp_url, n)
    black = run.run(spark, "available-now", timeout=300)
    assert black.messages == n and black.lost == 0
    move_outbox(Path(cfg.black.outbox), Path(cfg.red.inbox))
    red = RedRun(cfg).run(spark, "available-now").to_json()
    assert red["messages_landed"] == n and red["rejected"] == 0, red

    # red consumers: the same exchanges (replay must agree with these or the broker refuses
    # its declaration: type, durable, auto-delete, internal and arguments are all compared)
    declare(red_vhost.amqp_url)
    conn = pika.BlockingConnection(pika.URLParameters(red_vhost.amqp_url))
    pch = conn.channel()
    for name, _ in EXCHANGES:
        pch.queue_declare(f"q-{name}")
        for key in BINDINGS[name]:
            pch.queue_bind(f"q-{name}", name, key)
    conn.close()
    # nothing is replayed before approval (DMZ rule)
    idle = Replayer(cfg).run(until_caught_up=True, timeout=30)
    assert idle.to_json()["confirmed"] == 0
    ap = Approvals.load(Path(cfg.red.state_dir))
    for name, _ in EXCHANGES:
        ap.approve(name, "test")
    summary = Replayer(cfg, sink=audit_sink(cfg)).run(until_caught_up=True, timeout=120)
    assert summary.to_json()["confirmed"] == n, summary.to_json()

    got = consume_all(red_vhost.amqp_url, n)
    for name, _ in EXCHANGES:
        want = [(rk, raw, body) for ex, rk, raw, body in sent if ex == name]
        assert got[name] == want, f"exchange {name}: what red received differs (in order)"

    msgs = DeltaTable(str(Path(cfg.red.tables_dir) / "messages")).to_pyarrow_table(
        columns=["channel", "seq"]
    )
    ids = list(zip(msgs["channel"].to_pylist(), msgs["seq"].to_pylist(), strict=True))
    assert len(set(ids)) == len(ids) == n
    audit = DeltaTable(str(Path(cfg.red.tables_dir) / "audit")).to_pyarrow_table(columns=["event"])
    assert "replayed" in set(audit["event"].to_pylist())
