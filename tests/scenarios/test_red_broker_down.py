"""Scenario: the red broker is stopped (``rabbitmqctl stop_app`` on the shared node) while the
replay publisher runs and bundles keep arriving: landing goes on without it, and once the broker
is back the publisher completes the replay, none skipped."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pika
import pytest
from deltalake import DeltaTable

from bridge.amqp.client import Connection
from bridge.config import load_config
from bridge.red.approvals import Approvals
from bridge.red.job import RedRun
from bridge.red.replay import Replayer, ReplaySummary
from tests.red_factory import RedKeys, kill_agents, make_chain, write_red_toml
from tests.scenarios.test_broker_restart import rabbitmqctl, restartable_broker  # noqa: F401

pytestmark = [pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark, pytest.mark.slow]


def test_landing_goes_on_while_red_broker_is_down(
    restartable_broker: None,  # noqa: F811
    red_vhost: Any,
    spark: Any,
    tmp_path: Path,
) -> None:
    root = Path("/tmp") / f"rb{os.getpid()}"
    root.mkdir(exist_ok=True)
    keys = RedKeys.create(root)
    try:
        cfg = load_config(
            write_red_toml(
                tmp_path, keys, {"orders": True}, replay_url=red_vhost.amqp_url,
                replay_extra="poll_seconds = 0.3\n",
            )
        )  # fmt: skip
        made = tmp_path / "made"
        made.mkdir()
        chain = make_chain(made, keys, "orders", 6, 200)
        inbox = Path(cfg.red.inbox)
        inbox.mkdir(parents=True)
        for b in chain[:3]:
            os.replace(b.path, inbox / b.name)
        assert RedRun(cfg).run(spark, "available-now").to_json()["messages_landed"] == 600

        # a durable queue on red, bound before anything is replayed
        conn = pika.BlockingConnection(pika.URLParameters(red_vhost.amqp_url))
        ch = conn.channel()
        ch.exchange_declare(
            "orders", "topic", durable=True, arguments={"alternate-exchange": "unrouted"}
        )
        ch.queue_declare("seen", durable=True)
        ch.queue_bind("seen", "orders", "#")
        conn.close()
        Approvals.load(Path(cfg.red.state_dir)).approve("orders", "test")

        rabbitmqctl("stop_app")
        out: dict[str, ReplaySummary] = {}
        t = threading.Thread(
            target=lambda: out.setdefault(
                "s", Replayer(cfg).run(until_caught_up=True, timeout=240)
            ),
            daemon=True,
        )
        t.start()
        # the broker is down: the second half still lands, and quickly
        for b in chain[3:]:
            os.replace(b.path, inbox / b.name)
        t0 = time.monotonic()
        second = RedRun(cfg).run(spark, "available-now").to_json()
        assert second["messages_landed"] == 600 and second["bundles_landed"] == 3, second
        assert time.monotonic() - t0 < 120
        assert t.is_alive(), "the publisher waits for the broker, it does not give up or crash"
        rabbitmqctl("start_app")
        rabbitmqctl("await_startup")
        t.join(240)
        assert not t.is_alive()

        seqs: set[int] = set()
        c = Connection.open(red_vhost.amqp_url)
        cch = c.channel()
        cch.basic_consume("seen", no_ack=True)
        idle = 0
        while len(seqs) < 1200 and idle < 20:
            ev = c.poll(0.5)
            idle = 0 if ev.deliveries else idle + 1
            for d in ev.deliveries:
                seqs.add(json.loads(d.body)["seq"])
        c.close()
        assert seqs == set(range(1200)), "every landed message replayed, none skipped"
        assert out["s"].to_json()["confirmed"] >= 1200, out
        msgs = DeltaTable(str(Path(cfg.red.tables_dir) / "messages")).to_pyarrow_table(
            columns=["seq"]
        )
        assert sorted(msgs["seq"].to_pylist()) == list(range(1200))
    finally:
        kill_agents(root)
