"""Integration: RabbitMQ (fanout/topic/headers/direct) -> black Spark job -> bundles, read back
with the plain gpg command line and pyarrow alone (no bridge code on the reading side)."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pika
import pyarrow.parquet as pq
import pytest
from pika.spec import BasicProperties

from bridge.black.job import BlackRun
from bridge.config import load_config
from bridge.crypto.keys import init_keys
from bridge.protocol.headers import decode_typed
from tests.support import AMQP_PROPERTIES, bundle_files, gpg_open_cli

pytestmark = [pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark]

EXCHANGES = [("fan", "fanout"), ("top", "topic"), ("hdr", "headers"), ("dir", "direct")]


def write_config(work: Path, amqp_url: str, black_fpr: str, red: list[str], **bundle: Any) -> Path:
    extra = "\n".join(f"{k} = {v}" for k, v in bundle.items())
    (work / "diode.toml").write_text(
        f"""
[link]
bridge_id = "it-black"
black_signers = ["{black_fpr}"]

[[channels]]
name = "main"
exchanges = ["*"]
recipients = [{", ".join(f'"{r}"' for r in red)}]
[channels.direct_routing_keys]
"dir" = ["k1", "k2"]

[black]
amqp_url = "{amqp_url}"
gnupg_home = "keys/black"
signing_key = "{black_fpr}"
trigger_seconds = 1.0
heartbeat_seconds = 2.0
max_messages_per_batch = 1500

[black.bundle]
{extra}
"""
    )
    return work / "diode.toml"


def declare(url: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    for name, kind in EXCHANGES:
        ch.exchange_declare(name, kind, durable=True)
    conn.close()


def publish(url: str, n: int) -> list[tuple[str, str, BasicProperties, bytes]]:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    sent = []
    for i in range(n):
        name, kind = EXCHANGES[i % 4]
        rk = {"fanout": "", "topic": f"a.b{i % 7}", "headers": "x", "direct": f"k{1 + i % 2}"}[kind]
        props = BasicProperties(
            content_type="application/octet-stream" if i % 3 else None,
            content_encoding="gzip" if i % 5 == 0 else None,
            delivery_mode=1 + i % 2,
            priority=i % 10 if i % 4 == 0 else None,
            correlation_id=f"c{i}" if i % 2 else None,
            reply_to="r" if i % 6 == 0 else None,
            expiration="60000" if i % 8 == 0 else None,
            message_id=f"m{i}",
            timestamp=1_700_000_000 + i if i % 3 == 0 else None,
            type="t" if i % 9 == 0 else None,
            user_id="guest" if i % 10 == 0 else None,
            app_id="it" if i % 11 == 0 else None,
            headers=None
            if i % 4 == 1
            else {
                "i": i,
                "big": 2**40 + i,
                "neg": -i,
                "s": f"é{i}",
                "b": bytes([i % 256, 0]),
                "t": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
                "ok": bool(i % 2),
                "v": None,
                "nest": {"arr": [1, "x", {"deep": b"\x00"}]},
            },
        )
        body = bytes([i % 256]) * (i % 2000) if i % 13 else b""
        ch.basic_publish(name, rk, body, props)
        sent.append((name, rk, props, body))
    # an unconfigured routing key on the direct exchange is not mirrored, by design
    ch.basic_publish("dir", "not-configured", b"x")
    conn.close()
    return sent


def broker_preserved(headers: dict | None) -> dict | None:
    """What a RabbitMQ 3.10 stream keeps of a header table: entries whose value is a table or
    an array are dropped by the broker itself (pinned by test_broker_streams.py)."""
    if headers is None:
        return None
    kept = {k: v for k, v in headers.items() if not isinstance(v, dict | list)}
    return kept or None


def read_bundles(outbox: Path, red_home: Path, black_fpr: str) -> list[tuple[dict, Any, str]]:
    out = []
    for f in bundle_files(outbox):
        plain = gpg_open_cli(red_home, f, black_fpr)
        pf = pq.ParquetFile(io.BytesIO(plain))
        manifest = json.loads(pf.metadata.metadata[b"diode.manifest"])
        out.append((manifest, pf.read(), hashlib.sha256(plain).hexdigest()))
    return out


def test_every_message_once_and_identical(black_vhost, short_tmp: Path, spark) -> None:  # type: ignore[no-untyped-def]
    inv = init_keys(short_tmp / "keys", red_names=("red", "audit"))
    cfg_path = write_config(
        short_tmp, black_vhost.amqp_url, inv.black_fpr, list(inv.red_fprs.values()), max_rows=700
    )
    cfg = load_config(cfg_path)
    declare(black_vhost.amqp_url)
    run = BlackRun(cfg)
    report = run.mirror.sync()
    assert "main" in str(report)
    n = 4000
    sent = publish(black_vhost.amqp_url, n)
    summary = run.run(spark, "available-now", timeout=300)
    assert summary.messages == n and summary.lost == 0

    bundles = read_bundles(cfg.black.outbox, inv.red_home, inv.black_fpr)
    assert [m["bundle_seq"] for m, _, _ in bundles] == list(range(1, len(bundles) + 1))
    assert len(bundles) >= n // 700
    prev = None
    rows: list[dict[str, Any]] = []
    for m, table, sha in bundles:
        assert m["format"] == 1 and m["schema_version"] == 1 and m["channel"] == "main"
        assert m["prev_sha256"] == prev, f"hash chain broken at bundle {m['bundle_seq']}"
        assert m["gaps"] == [] and m["rows"] == table.num_rows <= 700
        assert m["bridge_id"] == "it-black" and m["created_at"].endswith("Z")
        seqs = table.column("seq").to_pylist()
        assert seqs == sorted(seqs) and (m["first_seq"], m["last_seq"]) == (seqs[0], seqs[-1])
        counts: dict[str, int] = {}
        for x in table.column("exchange").to_pylist():
            counts[x] = counts.get(x, 0) + 1
        assert m["exchanges"] == counts
        prev = sha
        rows.extend(table.to_pylist())

    assert [r["seq"] for r in rows] == list(range(n)), "message seqs must be gapless, each once"
    types = dict(EXCHANGES)
    for r, (name, rk, props, body) in zip(rows, sent, strict=True):
        assert (r["exchange"], r["routing_key"], r["body"]) == (name, rk, body)
        assert r["exchange_type"] == types[name] and r["exchange_durable"] is True
        for f in AMQP_PROPERTIES:
            assert r[f] == getattr(props, f), (f, r["seq"])
        want = broker_preserved(props.headers)
        got = decode_typed(r["headers_typed"])
        assert got == want, r["seq"]
        if want:
            assert pika.data.encode_table([], got) == pika.data.encode_table([], want)
            assert dict(r["headers"])["s"] == want["s"]  # queryable rendering

    # heartbeats: signed, name the last bundle
    hbs = sorted(cfg.black.outbox.glob("*.dheartbeat"))
    assert hbs
    hb = json.loads(gpg_open_cli(inv.red_home, hbs[-1], inv.black_fpr))
    assert hb["last_bundle_seq"] == len(bundles) and hb["last_seq"] == n - 1

    # a second run with nothing new ships nothing, and the archive holds every bundle
    again = BlackRun(cfg).run(spark, "available-now", timeout=120)
    assert again.bundles == 0
    assert sorted(p.name for p in (cfg.black.archive / "main").iterdir()) == sorted(
        p.name for p in cfg.black.outbox.glob("*.dbundle")
    )
