"""Integration: offsets Spark committed but black never delivered (a crash while the sink was
sealing in the background) are shipped at the next start, even when no new message arrives."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pika
import pytest

from bridge.black.job import BlackRun
from bridge.black.recovery import committed_offsets
from bridge.config import load_config
from bridge.crypto.keys import init_keys
from tests.support import bundle_files, gpg_open_cli, read_plain_bundle

pytestmark = [pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark]


def _config(work: Path, url: str, inv: Any) -> Path:
    p = work / "d.toml"
    p.write_text(
        f"""
[link]
black_signers = ["{inv.black_fpr}"]
[[channels]]
name = "rc"
exchanges = ["rc.*"]
recipients = {json.dumps(list(inv.red_fprs.values()))}
[black]
amqp_url = "{url}"
gnupg_home = "keys/black"
signing_key = "{inv.black_fpr}"
heartbeat_seconds = 30.0
[black.bundle]
max_rows = 300
"""
    )
    return p


def _publish(url: str, first: int, n: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.exchange_declare("rc.events", "fanout", durable=True)
    for i in range(first, first + n):
        ch.basic_publish("rc.events", "", b"m%d" % i, pika.BasicProperties(message_id=str(i)))
    conn.close()


def test_committed_but_undelivered_batches_ship_at_start(
    black_vhost, short_tmp: Path, spark
) -> None:  # type: ignore[no-untyped-def]
    inv = init_keys(short_tmp / "keys")
    cfg = load_config(_config(short_tmp, black_vhost.amqp_url, inv), environ={})
    state = Path(cfg.black.state_dir) / "channel-rc.json"
    _publish(black_vhost.amqp_url, 0, 0)  # declares the exchange before the mirror binds it
    BlackRun(cfg).mirror.sync()

    _publish(black_vhost.amqp_url, 0, 600)
    first = BlackRun(cfg).run(spark, "available-now", timeout=300)
    assert first.messages == 600
    journal_after_first = state.read_bytes()
    shipped_first = {p.name for p in bundle_files(cfg.black.outbox)}

    _publish(black_vhost.amqp_url, 600, 700)
    second = BlackRun(cfg).run(spark, "available-now", timeout=300)
    assert second.messages == 700
    assert committed_offsets(Path(cfg.black.checkpoint_dir)) == {"rc": 1300}

    # the crash: Spark committed the second run's batch, black's delivery never happened
    state.write_bytes(journal_after_first)
    for p in bundle_files(cfg.black.outbox):
        if p.name not in shipped_first:
            p.unlink()
            (cfg.black.archive / "rc" / p.name).unlink()

    third = BlackRun(cfg).run(spark, "available-now", timeout=300)  # nothing new published
    assert third.recovered_bundles >= 1 and third.messages == 700

    seqs: list[int] = []
    prev = None
    for i, p in enumerate(bundle_files(cfg.black.outbox), start=1):
        plain = gpg_open_cli(inv.red_home, p, inv.black_fpr)
        manifest, rows = read_plain_bundle(plain)
        assert manifest["bundle_seq"] == i and manifest["prev_sha256"] == prev
        prev = hashlib.sha256(plain).hexdigest()
        seqs += [r["seq"] for r in rows]
        assert [r["body"] for r in rows] == [b"m%d" % r["seq"] for r in rows]
    assert seqs == list(range(1300))
    shutil.rmtree(cfg.black.checkpoint_dir)  # a deleted checkpoint: the journal decides
    assert BlackRun(cfg).run(spark, "available-now", timeout=300).messages == 0
