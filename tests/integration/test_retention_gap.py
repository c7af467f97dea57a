"""Integration: messages the stream's retention dropped before black read them are a gap —
listed in the manifest with reason "retention", counted, and every retained message still
crosses once. Real broker truncation (tiny stream segments), real Spark, read back with the
plain gpg CLI and pyarrow."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pika
import pytest

from bridge.black.job import BlackRun
from bridge.black.report import channel_status
from bridge.black.streams import stream_bounds
from bridge.config import load_config
from bridge.crypto.keys import init_keys
from tests.support import bundle_files, gpg_open_cli, read_plain_bundle

pytestmark = [pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark]

N = 4000


def test_retention_loss_is_a_reported_gap(black_vhost, short_tmp: Path, spark) -> None:  # type: ignore[no-untyped-def]
    inv = init_keys(short_tmp / "keys")
    p = short_tmp / "d.toml"
    p.write_text(
        f"""
[link]
black_signers = ["{inv.black_fpr}"]
[[channels]]
name = "ret"
exchanges = ["ret.*"]
recipients = {json.dumps(list(inv.red_fprs.values()))}
[black]
amqp_url = "{black_vhost.amqp_url}"
gnupg_home = "keys/black"
signing_key = "{inv.black_fpr}"
stream_max_bytes = 1048576
stream_max_segment_bytes = 65536
heartbeat_seconds = 30.0
"""
    )
    cfg = load_config(p, environ={})
    conn = pika.BlockingConnection(pika.URLParameters(black_vhost.amqp_url))
    ch = conn.channel()
    ch.exchange_declare("ret.x", "fanout", durable=True)
    BlackRun(cfg).mirror.sync()
    body = b"x" * 1000
    for i in range(N):  # ~4 MB into a 1 MB stream: the oldest segments go
        ch.basic_publish("ret.x", "", body, pika.BasicProperties(message_id=str(i)))
    conn.close()
    deadline = time.monotonic() + 30
    while stream_bounds(cfg, "ret")[0] == 0:
        assert time.monotonic() < deadline, "the broker never truncated the stream"
        time.sleep(0.5)

    summary = BlackRun(cfg).run(spark, "available-now", timeout=300)

    manifests, rows = [], []
    for f in bundle_files(cfg.black.outbox):
        m, r = read_plain_bundle(gpg_open_cli(inv.red_home, f, inv.black_fpr))
        manifests.append(m)
        rows += r
    gaps = [g for m in manifests for g in m["gaps"]]
    assert gaps and gaps[0]["first_seq"] == 0 and {g["reason"] for g in gaps} == {"retention"}
    lost = sum(g["last_seq"] - g["first_seq"] + 1 for g in gaps)
    ids = [int(r["message_id"]) for r in rows]
    assert ids == list(range(ids[0], N)), "every retained message crosses once, in order"
    actually_lost = ids[0]
    # the count is an upper bound: a lost range may hold segment holes (one per 64 KB segment)
    print(f"lost seqs {lost}, messages really lost {actually_lost}, crossed {len(rows)}")
    assert actually_lost <= lost <= actually_lost + (N * 1100) // 65536 + 2
    seqs = [r["seq"] for r in rows]
    assert seqs == list(range(lost, lost + len(rows))), "seqs stay gapless around the gap"
    assert summary.lost == lost and summary.messages == len(rows)
    st = channel_status(cfg)["channels"]["ret"]
    assert st["lost"] == {"retention": lost} and st["last_seq"] == lost + len(rows) - 1
